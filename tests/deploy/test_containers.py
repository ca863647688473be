"""deploy/ for real (issue 14): the image is built from this repository (deploy/build-image.sh,
podman, no registry), deploy/docker-compose.yml runs under podman-compose (etcd, two masters, two
nodes, a prefill and a decode worker, the router; etcd with TLS and client certificates, issue
13), and the stack is used through its published 127.0.0.1 ports only: the router's OpenAI API
with the official `openai` client, the masters' admin API. Then the leading master's process is
SIGKILLed (the restart policy must bring the container back, one master lead again, the router
serve again) and a node's container is killed for good (the router must still serve, the master
must see the node gone).

Skipped, with the reason, where podman, podman-compose or a working container runtime is missing.
Everything it starts belongs to one compose project named kvpool-test-<pid>; teardown removes
exactly that project's containers, volumes, network and secrets, by name.

Slow (a few minutes: the image build is incremental, the workers load the model).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest

from kvpool.tools.launch.processes import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
BASE_IMAGE = os.environ.get("KVPOOL_BASE_IMAGE", "localhost/kvpool-base:bookworm")
UID = 10001  # the image's user: the secret files must be readable by it


def _podman_compose() -> str | None:
    exe = Path(sys.executable).with_name("podman-compose")
    return str(exe) if exe.exists() else shutil.which("podman-compose")


def _run(cmd: list[str], timeout: float, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def _credentials(workdir: Path) -> tuple[Path, Path, Path, str, str]:
    """`kvpool auth init` (a node, an admin and the tenant acme with one API key) and `kvpool auth
    etcd-certs --san etcd` (etcd's CA, server and client certificates), as docs/deploy.md says:
    the keyring, the admin token and the etcd certificate directory (the secret files handed to uid
    10001, the containers' user; they stay 0600), the tenant's API key and the admin token."""
    out = workdir / "secrets"
    kvpool = Path(sys.executable).with_name("kvpool")
    _run([str(kvpool), "auth", "init", "--out", str(out), "--tenant", "acme"], 60)
    tls = out / "etcd-tls"
    _run([str(kvpool), "auth", "etcd-certs", "--out", str(tls), "--san", "etcd"], 60)
    keyring, token = out / "keyring.toml", out / "admin.token"
    api_key = tomllib.loads(keyring.read_text())["principals"]["acme"]["api_keys"][0]
    admin_token = token.read_text().strip()
    if os.getuid() == 0:
        for path in (keyring, token, out / "metrics.token", out / "tenants.keyring.toml", out / "internal.token",
                     tls / "etcd-server.key", tls / "etcd-client.key"):
            os.chown(path, UID, UID)
    return keyring, token, tls, api_key, admin_token


class Stack:
    """One compose project: up, the containers' names, logs, down."""

    def __init__(self, workdir: Path):
        self.project = f"kvpool-test-{os.getpid()}"
        self.pc = _podman_compose()
        self.router_port, self.admin_a, self.admin_b = free_port(), free_port(), free_port()
        keyring, token, tls, self.api_key, self.admin_token = _credentials(workdir)
        self.env = dict(os.environ, KVPOOL_KEYRING=str(keyring), KVPOOL_ADMIN_TOKEN_SECRET=str(token),
                        KVPOOL_METRICS_TOKEN_SECRET=str(token.with_name("metrics.token")),
                        KVPOOL_TENANTS_KEYRING=str(token.with_name("tenants.keyring.toml")),
                        KVPOOL_INTERNAL_TOKEN_SECRET=str(token.with_name("internal.token")),
                        KVPOOL_ETCD_TLS=str(tls),
                        KVPOOL_ETCD_IMAGE=BASE_IMAGE, KVPOOL_ROUTER_PORT=str(self.router_port),
                        KVPOOL_ADMIN_PORT_A=str(self.admin_a), KVPOOL_ADMIN_PORT_B=str(self.admin_b))

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        return _run([self.pc, "-p", self.project, "-f", str(COMPOSE), *args], timeout, env=self.env, check=check)

    def containers(self) -> list[str]:
        r = _run(["podman", "ps", "-a", "--filter", f"label=io.podman.compose.project={self.project}",
                  "--format", "{{.Names}}"], 60, check=False)
        return [n for n in r.stdout.split() if n]

    def name(self, service: str) -> str:
        found = [n for n in self.containers() if n.startswith(f"{self.project}_{service}_")]
        assert found, (service, self.containers())
        return found[0]

    def logs(self) -> str:
        out = []
        for name in self.containers():
            r = _run(["podman", "logs", "--tail", "25", name], 60, check=False)
            out.append(f"---- {name}\n{r.stdout[-2500:]}{r.stderr[-2500:]}")
        return "\n".join(out)

    def down(self) -> None:
        self.compose("down", "-v", "-t", "5", timeout=300, check=False)
        for name in self.containers():  # whatever down left, by name
            _run(["podman", "rm", "-f", "-t", "2", name], 120, check=False)
        for kind in ("volume", "network"):
            r = _run(["podman", kind, "ls", "--format", "{{.Name}}"], 60, check=False)
            for name in r.stdout.split():
                if name.startswith(self.project + "_") or name.startswith(self.project.replace("-", "") + "_"):
                    _run(["podman", kind, "rm", "-f", name], 60, check=False)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (apt-get install podman runc debootstrap)")
    if _podman_compose() is None:
        pytest.skip("podman-compose is not installed (pip install -e '.[dev]')")
    setup = subprocess.run([str(DEPLOY / "podman-setup.sh")], capture_output=True, text=True, timeout=300)
    if setup.returncode == 3:
        pytest.skip(f"podman cannot start containers here: {setup.stderr.strip()[-800:]}")
    if not podman_image_exists(BASE_IMAGE) and (os.getuid() != 0 or shutil.which("debootstrap") is None):
        pytest.skip(f"{BASE_IMAGE} is missing and debootstrap (as root) is not available to make it")
    t0 = time.monotonic()
    build = subprocess.run([str(DEPLOY / "build-image.sh")], capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    print(f"image built in {time.monotonic() - t0:.0f} s")
    s = Stack(tmp_path_factory.mktemp("deploy"))
    s.down()  # a previous run of this pid's project, if any
    try:
        t0 = time.monotonic()
        s.compose("up", "-d", "--no-build", timeout=600)
        s.up_s = time.monotonic() - t0
        yield s
    finally:
        if os.environ.get("KVPOOL_KEEP_STACK") != "1":
            s.down()


def podman_image_exists(image: str) -> bool:
    return subprocess.run(["podman", "image", "exists", image], timeout=60).returncode == 0


def _openai(stack: Stack):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.router_port}/v1", api_key=stack.api_key, max_retries=0,
                         timeout=120)


def _complete(stack: Stack, deadline_s: float, what: str) -> tuple[str, float]:
    """A chat completion through the router, retried until `deadline_s`; (text, seconds taken)."""
    client = _openai(stack)
    t0 = time.monotonic()
    last: Exception | None = None
    while time.monotonic() - t0 < deadline_s:
        try:
            model = client.models.list().data[0].id
            resp = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Name three colours."}], max_tokens=12,
                temperature=0)
            text = resp.choices[0].message.content or ""
            assert resp.usage.completion_tokens > 0, resp
            return text, time.monotonic() - t0
        except Exception as exc:  # not served yet: retry until the deadline, then report the last error
            last = exc
            time.sleep(2)
    raise AssertionError(f"{what}: no completion within {deadline_s:.0f} s: {last!r}\n{stack.logs()}")


def _admin(stack: Stack, port: int, path: str) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=10,
                     headers={"Authorization": f"Bearer {stack.admin_token}"})


def _leader_port(stack: Stack, deadline_s: float) -> int:
    """The published admin port of the master that leads: its /ready answers 200 (a standby's 503
    names the leader)."""
    t0 = time.monotonic()
    seen = {}
    while time.monotonic() - t0 < deadline_s:
        for port in (stack.admin_a, stack.admin_b):
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5)
                seen[port] = (r.status_code, r.text[:200])
                if r.status_code == 200:
                    return port
            except httpx.HTTPError as exc:
                seen[port] = repr(exc)
        time.sleep(1)
    raise AssertionError(f"no leading master within {deadline_s:.0f} s: {seen}\n{stack.logs()}")


STANDBY = -1
SETTLE_S = 5.0  # longer than a master's lease TTL (3 s at the default 1 s heartbeat)


def _ready(port: int) -> int | None:
    """/ready's status code, STANDBY for a standby master's 503, None when nothing answers."""
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1)
    except httpx.HTTPError:
        return None
    return STANDBY if r.status_code == 503 and "standby" in r.text else r.status_code


def _failover(stack: Stack, killed: int, standby: int, deadline_s: float) -> tuple[float, int, str]:
    """After the leader's process was killed: seconds until exactly one master leads (answers
    /ready 200) and the other stands by (503 naming the leader), for SETTLE_S in a row; the leader's
    port; and when the restarted master (same container, same address) first answered 200.

    Either may lead in the end: once the dead process's lease expires, whichever campaigns first
    wins. Before that, the restarted master may claim to lead on the strength of its
    predecessor's leader key, which names its own address (kvpool/cluster/membership.py compares
    addresses, not leases): a split-brain window of up to one lease TTL, which this reports."""
    t0 = time.monotonic()
    seen_down, claimed, settled, states, leader = False, 0.0, 0.0, [], None
    while time.monotonic() - t0 < deadline_s:
        k, sb = _ready(killed), _ready(standby)
        states.append((round(time.monotonic() - t0, 1), k, sb))
        seen_down = seen_down or k != 200
        if seen_down and k == 200:
            claimed = claimed or time.monotonic() - t0
        single = seen_down and sorted((k or 0, sb or 0)) == [STANDBY, 200]
        settled = (settled if leader == (k == 200) else 0.0) or time.monotonic() if single else 0.0
        leader = k == 200  # which one leads: a change starts the wait again
        if settled and time.monotonic() - settled >= SETTLE_S:
            return (settled - t0, killed if k == 200 else standby,
                    f"at {claimed:.1f} s" if claimed else "never")
        time.sleep(0.2)
    raise AssertionError(f"no single leader within {deadline_s:.0f} s: {states[-20:]}\n{stack.logs()}")


def _nodes_up(stack: Stack, port: int) -> set[str]:
    r = _admin(stack, port, "/v1/nodes")
    assert r.status_code == 200, r.text
    return {n["node_id"] for n in r.json()["nodes"] if n.get("state") == "up"}


def test_stack_serves_and_survives_killed_containers(stack: Stack):
    services = {n.split("_")[1] for n in stack.containers()}
    assert services == {"etcd", "master-a", "master-b", "node-a", "node-b", "prefill", "decode", "router"}, services
    # the router's OpenAI API through its published port, with an API key from the keyring
    text, first_s = _complete(stack, 300, "fresh stack")
    print(f"up -d {stack.up_s:.0f} s; first completion after {first_s:.0f} s more: {text!r}")
    # etcd (issue 13): its healthcheck passes over TLS with a client certificate; without a client
    # certificate, or in plain HTTP, etcd answers nobody
    etcd = stack.name("etcd")
    r = _run(["podman", "healthcheck", "run", etcd], 60, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    ctl = ["podman", "exec", etcd, "etcdctl", "--dial-timeout=2s", "--command-timeout=3s"]
    for refused in (["--endpoints", "https://127.0.0.1:2379", "--cacert", "/run/secrets/etcd_ca"],
                    ["--endpoints", "http://127.0.0.1:2379"]):
        r = _run([*ctl, *refused, "get", "--prefix", "/"], 60, check=False)
        assert r.returncode != 0 and not r.stdout.strip(), (refused, r.stdout, r.stderr)
    # without the key: refused
    r = httpx.post(f"http://127.0.0.1:{stack.router_port}/v1/chat/completions", timeout=10,
                   json={"model": "x", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401, r.text
    # the admin API: one leader, both nodes registered; the standby refuses or redirects
    leader = _leader_port(stack, 60)
    t0 = time.monotonic()
    while _nodes_up(stack, leader) != {"node-a", "node-b"} and time.monotonic() - t0 < 60:
        time.sleep(1)
    assert _nodes_up(stack, leader) == {"node-a", "node-b"}, _admin(stack, leader, "/v1/nodes").text
    assert httpx.get(f"http://127.0.0.1:{leader}/v1/nodes", timeout=10).status_code == 401

    # the leading master crashes (SIGKILL to its process, as the kernel's OOM killer would): the
    # restart policy brings the container back, one master leads again, the router still serves.
    # (`podman kill` would count as a stop by the user: podman would restart nothing.)
    dead = "master-a" if leader == stack.admin_a else "master-b"
    name = stack.name(dead)
    pid = int(_run(["podman", "inspect", "--format", "{{.State.Pid}}", name], 60).stdout)
    assert pid > 1
    os.kill(pid, signal.SIGKILL)  # the container's own process, which this test started
    other = stack.admin_b if leader == stack.admin_a else stack.admin_a
    failover_s, leader, claimed = _failover(stack, killed=leader, standby=other, deadline_s=90)
    text, served_s = _complete(stack, 180, f"after killing {dead}")
    state = _run(["podman", "inspect", "--format", "{{.State.Status}} {{.RestartCount}}", name], 60).stdout.split()
    assert state[0] == "running" and int(state[1]) >= 1, (name, state)  # the restart policy brought it back
    print(f"killed {dead}'s process: one leader ({'the standby' if leader == other else 'the restarted ' + dead}) "
          f"after {failover_s:.1f} s, served after {served_s:.1f} s more: {text!r}; {dead} restarted "
          f"({state[1]} restart), answered as the leader first {claimed}")

    # a node's container is killed (and stays down): the pool keeps serving with the other node
    _run(["podman", "kill", stack.name("node-a")], 60)
    t0 = time.monotonic()
    text, served_s = _complete(stack, 180, "after killing node-a")
    print(f"killed node-a's container: served after {served_s:.1f} s: {text!r}")
    while _nodes_up(stack, leader) != {"node-b"} and time.monotonic() - t0 < 60:
        time.sleep(1)
    assert _nodes_up(stack, leader) == {"node-b"}, _admin(stack, leader, "/v1/nodes").text
    print(f"node-a no longer up at the master after {time.monotonic() - t0:.1f} s")
    text, _ = _complete(stack, 60, "with node-a gone")
