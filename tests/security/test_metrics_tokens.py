"""Tokens of the HTTP side with a keyring (issue 27), against real processes: the admin API
refuses to start without its token (before, on loopback it answered anyone: every tenant's keys,
evictions), a node's `/metrics` needs the metrics token (before, it was open, on 0.0.0.0 too, with
per-node traffic the RPC hides from tenants), and the metrics token opens `/metrics` and nothing
else, on the master's admin API and the router too. `kvpool auth init` writes it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from kvpool.tools.launch.processes import clean_env, free_port

KVPOOL = str(Path(sys.executable).with_name("kvpool"))


def _env(**extra: str) -> dict[str, str]:
    return clean_env(**extra)


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("auth") / "secrets"
    r = subprocess.run([KVPOOL, "auth", "init", "--out", str(out), "--tenant", "acme"],
                       capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == 0, r.stderr
    return out


def _token(secrets_dir: Path, name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {(secrets_dir / name).read_text().strip()}"}


class Proc:
    """A kvpool service; `line` is its first line on stdout (what it prints once it serves)."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path):
        self.log = log
        self.proc = subprocess.Popen([KVPOOL, "--log-level", "WARNING", *args], stdout=subprocess.PIPE,
                                     stderr=open(log, "w"), text=True, env=_env(**env))
        self.line = self.proc.stdout.readline().strip()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def test_auth_init_writes_a_private_metrics_token(secrets_dir):
    path = secrets_dir / "metrics.token"
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.read_text().strip() not in {(secrets_dir / n).read_text().strip() for n in ("admin.token",
                                                                                              "internal.token")}


@pytest.mark.parametrize("service", ["serve", "master"])
def test_an_admin_api_with_a_keyring_but_no_token_is_refused(service, secrets_dir, tmp_path):
    proc = Proc([service, "--port", "0", "--admin-port", str(free_port())],
                {"KVPOOL_AUTH_FILE": str(secrets_dir / "keyring.toml")}, tmp_path / "out.log")
    try:
        assert not proc.line, f"it started: {proc.line!r}"
        assert proc.proc.wait(30) != 0
        err = proc.log.read_text()
        assert "no admin token" in err and "KVPOOL_ADMIN_TOKEN_FILE" in err and "Traceback" not in err
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def master(secrets_dir, tmp_path_factory):
    proc = Proc(["master", "--port", "0", "--admin-port", "0", "--heartbeat-s", "0.2"],
                {"KVPOOL_AUTH_FILE": str(secrets_dir / "keyring.toml")}, tmp_path_factory.mktemp("m") / "master.log")
    assert proc.line.startswith("kvpool master at "), (proc.line, proc.log.read_text()[-2000:])
    yield proc.line.rsplit(" ", 1)[1]
    proc.stop()


def test_a_node_with_a_keyring_serves_metrics_only_with_the_metrics_token(master, secrets_dir, tmp_path):
    ring = {"KVPOOL_AUTH_FILE": str(secrets_dir / "keyring.toml")}
    port = free_port()
    refused = Proc(["node", "--port", "0", "--master", master, "--admin-port", str(port), "--dram-capacity", "16MiB"],
                   ring, tmp_path / "refused.log")
    try:
        assert not refused.line, f"it started: {refused.line!r}"
        assert refused.proc.wait(30) != 0
        err = refused.log.read_text()
        assert "KVPOOL_METRICS_TOKEN_FILE" in err and "--admin-port 0" in err and "Traceback" not in err
    finally:
        refused.stop()
    node = Proc(["node", "--port", "0", "--master", master, "--admin-port", str(port), "--dram-capacity", "16MiB"],
                {**ring, "KVPOOL_METRICS_TOKEN_FILE": str(secrets_dir / "metrics.token")}, tmp_path / "node.log")
    try:
        assert node.line.startswith("kvpool node "), (node.line, node.log.read_text()[-2000:])
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            for headers in ({}, {"Authorization": "Bearer wrong"}, _token(secrets_dir, "admin.token"),
                            _token(secrets_dir, "internal.token")):
                r = http.get("/metrics", headers=headers)
                assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (headers, r.text)
                assert "kvpool_" not in r.text and r.json()["code"] == "unauthorized"
            r = http.get("/metrics", headers=_token(secrets_dir, "metrics.token"))
            assert r.status_code == 200 and "kvpool_tier_" in r.text
    finally:
        node.stop()


@pytest.fixture(scope="module")
def serve(secrets_dir, tmp_path_factory):
    port = free_port()
    proc = Proc(["serve", "--port", "0", "--admin-port", str(port), "--dram-capacity", "16MiB"],
                {"KVPOOL_AUTH_FILE": str(secrets_dir / "keyring.toml"),
                 "KVPOOL_ADMIN_TOKEN_FILE": str(secrets_dir / "admin.token"),
                 "KVPOOL_METRICS_TOKEN_FILE": str(secrets_dir / "metrics.token")},
                tmp_path_factory.mktemp("serve") / "serve.log")
    assert proc.line.startswith("kvpool serving at "), (proc.line, proc.log.read_text()[-2000:])
    yield f"http://127.0.0.1:{port}"
    proc.stop()


def test_the_metrics_token_opens_the_masters_metrics_and_nothing_else(serve, secrets_dir):
    scraper = _token(secrets_dir, "metrics.token")
    with httpx.Client(base_url=serve, timeout=10) as http:
        r = http.get("/metrics", headers=scraper)
        assert r.status_code == 200 and "kvpool_pool_" in r.text
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers=_token(secrets_dir, "admin.token")).status_code == 200
        for method, path in (("GET", "/v1/keys"), ("GET", "/v1/config"), ("GET", "/v1/nodes"),
                             ("POST", "/v1/evict")):
            r = http.request(method, path, headers=scraper, json={"target_bytes": 1} if method == "POST" else None)
            assert r.status_code == 401, (path, r.text)


def test_the_metrics_token_opens_the_routers_metrics_and_nothing_else(secrets_dir, tmp_path):
    router = Proc(["router", "--port", "0"], {"KVPOOL_AUTH_FILE": str(secrets_dir / "keyring.toml"),
                                               "KVPOOL_METRICS_TOKEN_FILE": str(secrets_dir / "metrics.token")},
                  tmp_path / "router.log")
    try:
        assert router.line.startswith("kvpool router serving at "), (router.line, router.log.read_text()[-2000:])
        url = router.line.rsplit(" ", 1)[1]
        scraper = _token(secrets_dir, "metrics.token")
        with httpx.Client(base_url=url, timeout=10) as http:
            deadline = time.monotonic() + 10
            while (r := http.get("/metrics", headers=scraper)).status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert r.status_code == 200 and "kvpool_router_" in r.text
            assert http.get("/metrics").status_code == 401
            assert http.get("/admin/workers", headers=scraper).status_code == 401
            assert http.get("/admin/workers", headers=_token(secrets_dir, "internal.token")).status_code == 200
    finally:
        router.stop()
