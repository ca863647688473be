"""The default mode on a shared host (issue 27): with no configuration at all, `kvpool serve` and
the SDK work for their owner (a per-user keyring made on first use in ~/.config/kvpool, 0600), and
another local user (a uid made here with useradd) is refused: it cannot list, read, overwrite or
remove the owner's objects over TCP on loopback, the data port, the unix socket or the admin API,
nor read the keyring. Before, with no configuration, it could do all of that."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import kvpool

KVPOOL = str(Path(sys.executable).with_name("kvpool"))
SECRET = b"the owner's KV " * 1000

# Runs as root long enough to import what it needs (the interpreter lives under /root, which
# another user may not enter), then becomes the other user for good and attacks.
OTHER = r"""
import json, os, socket, sys
import httpx, msgspec, tomllib
import kvpool, kvpool.client, kvpool.client.sync, kvpool.client.nodes, kvpool.client.where
import kvpool.client.datapath, kvpool.client.engine_path, kvpool.rpc.client
try:
    import kvpool.security.local
except ImportError:  # a kvpool before the per-user keyring: it has nothing to import here
    pass
from kvpool import messages as m
from kvpool.errors import KVPoolError
from kvpool.rpc.frame import HEADER, encoder
from transfer import SegmentDescriptor, TransferEngine
import transfer.tcp, transfer.engine
args = json.loads(sys.argv[1])
httpx.get(args["admin"] + "/health")  # warm httpx's lazy imports while still root
os.setgroups([]); os.setgid(args["gid"]); os.setuid(args["uid"])
os.environ["HOME"] = args["home"]
assert os.getuid() == args["uid"]
out = {}

def attempt(name, fn):
    try:
        out[name] = ["ok", repr(fn())]
    except Exception as exc:
        out[name] = [type(exc).__name__, str(exc)]

def sdk():  # the SDK with no configuration: it proves this user's own keyring
    with kvpool.connect(args["address"], use_shm=False, timeout=5) as c:
        return c.get("secret")
attempt("sdk_get", sdk)
def sdk_put():
    with kvpool.connect(args["address"], use_shm=False, timeout=5) as c:
        c.put("planted", b"x")
attempt("sdk_put", sdk_put)

def raw(msg):  # a frame without any handshake
    host, port = args["address"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        body = encoder.encode(msg)
        s.sendall(HEADER.pack(m.PROTOCOL_VERSION, 0, len(body), 0) + body)
        _, _, n, _ = HEADER.unpack(s.recv(HEADER.size, socket.MSG_WAITALL))
        return msgspec.msgpack.decode(s.recv(n, socket.MSG_WAITALL), type=m.Err).code
attempt("raw_exists", lambda: raw(m.Exists(["secret"])))
attempt("raw_remove", lambda: raw(m.Remove(["secret"])))
attempt("raw_keys", lambda: raw(m.Admin("keys", {"prefix": "", "limit": 10})))

def unix():
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect("\0" + args["unix"][1:])
        data = b""
        while part := s.recv(65536):
            data += part
        return data
attempt("unix", unix)

def data_port():
    eng = TransferEngine(transports=["tcp"], timeout=5).start()
    try:
        buf = bytearray(4096)
        eng.read(SegmentDescriptor.from_bytes(bytes.fromhex(args["segment"])), 0, buf)
        return bytes(buf).count(0)
    finally:
        eng.close()
attempt("data_port", data_port)
attempt("keyring_file", lambda: open(args["keyring"]).read())
attempt("admin_keys", lambda: httpx.get(args["admin"] + "/v1/keys", timeout=5).status_code)
attempt("admin_evict", lambda: httpx.post(args["admin"] + "/v1/evict", json={"keys": ["secret"]}, timeout=5).status_code)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def other_user(tmp_path_factory):
    if os.getuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to make a second local user")
    name = f"kvpt{os.getpid()}"
    home = tmp_path_factory.mktemp("other-home")
    r = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    try:
        import pwd

        entry = pwd.getpwnam(name)
        os.chown(home, entry.pw_uid, entry.pw_gid)
        for parent in home.parents:  # pytest's temp directories are 0700: let the user reach its home
            if str(parent) in ("/", "/tmp"):
                break
            os.chmod(parent, os.stat(parent).st_mode | 0o011)
        yield entry.pw_uid, entry.pw_gid, home
    finally:
        subprocess.run(["userdel", name], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def owner_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("owner-home")
    os.chmod(home, 0o755)  # a home others may enter: only the keyring's own modes protect it
    return home


def _owner_env(home: Path) -> dict[str, str]:
    """The owner's environment: nothing of kvpool configured (only its home)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_") and k != "XDG_CONFIG_HOME"}
    return {**env, "HOME": str(home)}


@pytest.fixture(scope="module")
def served(owner_home, tmp_path_factory):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        admin_port = probe.getsockname()[1]
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    proc = subprocess.Popen([KVPOOL, "serve", "--port", "0", "--admin-port", str(admin_port), "--dram-capacity",
                             "32MiB"], stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,
                            env=_owner_env(owner_home))
    line = proc.stdout.readline().strip()
    assert line.startswith("kvpool serving at "), (line, log.read_text()[-2000:])
    yield line.rsplit(" ", 1)[1], f"http://127.0.0.1:{admin_port}"
    proc.terminate()
    proc.wait(15)


@pytest.fixture
def as_owner(owner_home, monkeypatch):
    for name in [k for k in os.environ if k.startswith("KVPOOL_")] + ["XDG_CONFIG_HOME"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(owner_home))


def test_the_owner_needs_no_setup(served, owner_home, as_owner):
    address, admin = served
    with kvpool.connect(address) as client:  # same host: unix socket and shm, as the owner
        client.put("secret", SECRET)
        assert client.get("secret") == SECRET
    with kvpool.connect(address, use_shm=False, data_path="engine", transports=["tcp"]) as client:
        assert client.get("secret") == SECRET  # loopback TCP and the data port too
    folder = owner_home / ".config" / "kvpool"
    assert folder.stat().st_mode & 0o777 == 0o700
    assert (folder / "keyring.toml").stat().st_mode & 0o777 == 0o600
    assert (folder / "admin.token").stat().st_mode & 0o777 == 0o600
    r = subprocess.run([KVPOOL, "admin", "--url", admin, "--json", "keys"], capture_output=True, text=True,
                       timeout=60, env=_owner_env(owner_home))
    assert r.returncode == 0 and "secret" in r.stdout, r.stderr  # the admin CLI finds the owner's token


def test_another_local_user_is_refused_everywhere(served, other_user, owner_home, as_owner):
    address, admin = served
    with kvpool.connect(address) as client:
        client.put("secret", SECRET)
        hello = client._master.call(__import__("kvpool.messages", fromlist=["Hello"]).Hello(1, "probe"))
    uid, gid, home = other_user
    args = {"uid": uid, "gid": gid, "home": str(home), "address": address, "admin": admin, "unix": hello.unix,
            "segment": bytes(hello.node.transfer_segment).hex(),
            "keyring": str(owner_home / ".config" / "kvpool" / "keyring.toml")}
    r = subprocess.run([sys.executable, "-c", OTHER, json.dumps(args)], capture_output=True, text=True, timeout=120,
                       env={**_owner_env(home), "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["sdk_get"][0] == "Unauthorized" and "its user's own keyring" in out["sdk_get"][1], out["sdk_get"]
    assert out["sdk_put"][0] == "Unauthorized", out["sdk_put"]
    for name in ("raw_exists", "raw_remove", "raw_keys"):
        assert out[name] == ["ok", repr("unauthorized")], (name, out[name])
    assert out["unix"][0] == "ok" and "uid" in out["unix"][1], out["unix"]  # refused for its uid
    assert out["data_port"][0] == "AccessDenied", out["data_port"]
    assert out["keyring_file"][0] == "PermissionError", out["keyring_file"]
    assert out["admin_keys"] == ["ok", "401"] and out["admin_evict"] == ["ok", "401"], out
    with kvpool.connect(address) as client:  # nothing was removed, overwritten or planted
        assert client.get("secret") == SECRET and client.get("planted") is None
    assert (home / ".config" / "kvpool" / "keyring.toml").exists()  # the other user got a keyring of its own


def test_authentication_off_is_a_choice_and_says_so(served, as_owner, monkeypatch):
    address, _ = served
    monkeypatch.setenv("KVPOOL_LOCAL_AUTH", "off")  # a client without any keyring
    with pytest.raises(kvpool.errors.Unauthorized, match="KVPOOL_AUTH_FILE"):
        with kvpool.connect(address, use_shm=False, timeout=5) as client:
            client.get("secret")
