"""A tenant's view of the REST admin API (issue 13), on a real `kvpool serve` over real HTTP: with
its own derived token (`kvpool.security.keyring.admin_api_token`) a tenant lists and inspects only its own
keys, named as it names them (another tenant's key is answered exactly as a missing key), sees
its own use and quota, and gets 403 from everything else; the admin token keeps the whole view;
the tenant's raw secret is no credential. `kvpool admin --principal` speaks as the tenant."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

import kvpool
from kvpool.security.keyring import admin_api_token
from pool_auth_support import SECRETS, clean_env, cred, write_keyring

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kvpool"))
from etcd_testing import serve_process  # noqa: E402

ADMIN_TOKEN = "t" * 40


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def as_tenant(name: str) -> dict[str, str]:
    return bearer(admin_api_token(SECRETS[name].encode()))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("admin-tenants")
    keyring = write_keyring(tmp / "keyring.toml", {"acme": {"quota_bytes": "4MiB", "quota_keys": 100}})
    token_file = tmp / "admin.token"
    token_file.write_text(ADMIN_TOKEN)
    os.chmod(token_file, 0o600)
    env = {"KVPOOL_AUTH_FILE": str(keyring), "KVPOOL_ADMIN_TOKEN_FILE": str(token_file)}
    with serve_process(tmp / "serve.log", "32MiB", env) as (address, url):
        with kvpool.connect(address, credential=cred("acme")) as acme, \
                kvpool.connect(address, credential=cred("beta")) as beta:
            acme.put("acme/one", b"a" * 1000)
            acme.put("shared/name", b"a" * 2000)
            beta.put("beta/one", b"b" * 10)
            beta.put("shared/name", b"b" * 20)
            yield address, url, keyring, beta


def test_a_tenant_lists_and_reads_only_its_own_keys(served):
    _, url, _, _ = served
    r = httpx.get(f"{url}/v1/keys", headers=as_tenant("acme"))
    assert r.status_code == 200 and sorted(r.json()["keys"]) == ["acme/one", "shared/name"], r.text
    assert httpx.get(f"{url}/v1/keys", params={"prefix": "shared/"}, headers=as_tenant("beta")).json()["keys"] \
        == ["shared/name"]
    assert httpx.get(f"{url}/v1/keys", params={"prefix": "beta/"}, headers=as_tenant("acme")).json()["keys"] == []
    r = httpx.get(f"{url}/v1/keys", params={"prefix": "beta\x00"}, headers=as_tenant("acme"))
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_argument"
    # one key: its own object (acme's 2000 bytes, not beta's 20), named as acme names it
    r = httpx.get(f"{url}/v1/keys/shared/name", headers=as_tenant("acme"))
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["key"] == "shared/name" and doc["info"]["key"] == "shared/name" and doc["info"]["size"] == 2000
    # the stored form of another tenant's key is no key name for a tenant
    r = httpx.get(f"{url}/v1/keys/{quote('beta' + chr(0) + 'beta/one')}", headers=as_tenant("acme"))
    assert r.status_code == 400


def test_another_tenants_key_answers_exactly_as_a_missing_key(served):
    address, url, _, beta = served
    beta.put("beta/secret", b"s" * 100)
    present = httpx.get(f"{url}/v1/keys/beta/secret", headers=as_tenant("acme"))
    assert beta.remove("beta/secret")
    missing = httpx.get(f"{url}/v1/keys/beta/secret", headers=as_tenant("acme"))
    assert present.status_code == missing.status_code == 404
    assert present.content == missing.content and present.headers["content-type"] == missing.headers["content-type"]
    assert present.json()["error"] == {"code": "not_found", "message": "key 'beta/secret' not found"}


def test_a_tenants_stats_are_its_own_use_and_quota(served):
    _, url, _, _ = served
    r = httpx.get(f"{url}/v1/stats", headers=as_tenant("acme"))
    assert r.status_code == 200, r.text
    assert r.json()["stats"] == {"tenant": "acme", "bytes": 3000, "keys": 2, "quota_bytes": 4 << 20,
                                 "quota_keys": 100}
    beta = httpx.get(f"{url}/v1/stats", headers=as_tenant("beta")).json()["stats"]
    assert beta["tenant"] == "beta" and beta["quota_bytes"] == 0 and beta["keys"] >= 2
    assert "tiers" not in beta and "nodes" not in beta


@pytest.mark.parametrize("method,path,body", [
    ("GET", "/v1/nodes", None), ("GET", "/v1/nodes/x", None), ("POST", "/v1/nodes/x/drain", None),
    ("POST", "/v1/nodes/x/undrain", None), ("DELETE", "/v1/nodes/x", None),
    ("POST", "/v1/evict", {"keys": ["acme/one"]}), ("POST", "/v1/evict", {"target_bytes": 1 << 30}),
    ("GET", "/v1/config", None), ("PATCH", "/v1/config", {"lease_s": 1.0}), ("GET", "/metrics", None),
    ("GET", "/v1/no-such-endpoint", None)])
def test_a_tenant_is_forbidden_everything_else(served, method, path, body):
    _, url, _, _ = served
    r = httpx.request(method, f"{url}{path}", json=body, headers=as_tenant("acme"))
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "forbidden" and r.json()["version"] == 1
    # nothing happened: the object is still there, the config unchanged
    assert httpx.get(f"{url}/v1/keys/acme/one", headers=as_tenant("acme")).status_code == 200
    assert httpx.get(f"{url}/v1/config", headers=bearer(ADMIN_TOKEN)).json()["config"]["lease_s"] != 1.0


def test_the_admin_token_keeps_the_whole_view(served):
    _, url, _, _ = served
    keys = httpx.get(f"{url}/v1/keys", headers=bearer(ADMIN_TOKEN)).json()["keys"]
    assert {"acme\x00acme/one", "acme\x00shared/name", "beta\x00beta/one", "beta\x00shared/name"} <= set(keys)
    r = httpx.get(f"{url}/v1/keys/{quote('beta' + chr(0) + 'shared/name')}", headers=bearer(ADMIN_TOKEN))
    assert r.status_code == 200 and r.json()["info"]["size"] == 20, r.text
    assert "tiers" in httpx.get(f"{url}/v1/stats", headers=bearer(ADMIN_TOKEN)).json()["stats"]
    assert httpx.get(f"{url}/v1/nodes", headers=bearer(ADMIN_TOKEN)).status_code == 200


@pytest.mark.parametrize("headers", [{}, bearer("wrong" * 10), bearer(SECRETS["acme"]),
                                     bearer(admin_api_token(b"x" * 40)), {"Authorization": SECRETS["acme"]}])
def test_no_token_a_wrong_one_or_the_raw_secret_is_refused(served, headers):
    _, url, _, _ = served
    r = httpx.get(f"{url}/v1/keys", headers=headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    assert httpx.get(f"{url}/health", headers=headers).status_code == 200


def _cli(url: str, keyring: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).with_name("kvpool")), "admin", "--url", url, *args],
                          capture_output=True, text=True, timeout=60, env=clean_env(KVPOOL_AUTH_FILE=str(keyring)))


def test_the_admin_cli_speaks_as_a_tenant(served):
    _, url, keyring, _ = served
    out = _cli(url, keyring, "--principal", "acme", "--json", "keys")
    assert out.returncode == 0, out.stderr
    assert sorted(json.loads(out.stdout)) == ["acme/one", "shared/name"]
    out = _cli(url, keyring, "--principal", "acme", "--json", "stats")
    assert out.returncode == 0 and '"tenant": "acme"' in out.stdout, out.stderr
    out = _cli(url, keyring, "--principal", "acme", "nodes")
    assert out.returncode != 0 and "may read only its own keys" in out.stderr and "Traceback" not in out.stderr
    out = _cli(url, keyring, "--principal", "ops", "keys")  # the admin principal has no derived token
    assert out.returncode != 0 and "no tenant principal 'ops'" in out.stderr and "Traceback" not in out.stderr


def test_with_a_keyring_the_admin_api_does_not_start_without_its_token(tmp_path):
    """Issue 27: a keyring without an admin token left the admin API on loopback open to anyone
    (every tenant's keys, evictions); now it refuses to start and says how to give it one
    (tests/security/test_metrics_tokens.py runs `kvpool serve` and `kvpool master` the same way)."""
    keyring = write_keyring(tmp_path / "keyring.toml")
    with pytest.raises(AssertionError, match="no admin token.*KVPOOL_ADMIN_TOKEN_FILE"):
        with serve_process(tmp_path / "serve.log", "16MiB", {"KVPOOL_AUTH_FILE": str(keyring)}):
            pass
