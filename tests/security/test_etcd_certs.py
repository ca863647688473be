"""`kvpool auth etcd-certs` (issue 13): the CA, server and client certificates that etcd's
--client-cert-auth needs, as deploy/docker-compose.yml uses them. Checked with real TLS handshakes
on loopback (the server's name, the client's certificate), and, where etcd is installed, against a
real etcd with --client-cert-auth through kvpool's own etcd client."""

from __future__ import annotations

import shutil
import socket
import ssl
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvpool.cluster.etcd import EtcdClient
from kvpool.errors import Unavailable

from tls_etcd_support import tls_etcd

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")

KVPOOL = str(Path(sys.executable).with_name("kvpool"))
FILES = ("etcd-ca.crt", "etcd-ca.key", "etcd-server.crt", "etcd-server.key", "etcd-client.crt", "etcd-client.key")


def _certs(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([KVPOOL, "auth", "etcd-certs", "--out", str(out), *args], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("etcd-certs") / "tls"
    r = _certs(out, "--san", "etcd", "--san", "10.1.2.3", "--days", "2")
    assert r.returncode == 0, r.stderr
    assert "etcds://etcd:2379" in r.stdout
    return out


def test_files_and_modes(certs: Path):
    assert sorted(p.name for p in certs.iterdir()) == sorted(FILES)  # no csr, ext or serial left behind
    assert stat.S_IMODE(certs.stat().st_mode) == 0o700
    for name in FILES:
        assert stat.S_IMODE((certs / name).stat().st_mode) == (0o600 if name.endswith(".key") else 0o644), name
    text = subprocess.run(["openssl", "x509", "-noout", "-text", "-in", str(certs / "etcd-server.crt")],
                          capture_output=True, text=True, check=True).stdout
    assert "DNS:etcd, IP Address:10.1.2.3, DNS:localhost, IP Address:127.0.0.1" in text
    assert "TLS Web Server Authentication, TLS Web Client Authentication" in text  # the gateway dials itself
    for leaf in ("etcd-server.crt", "etcd-client.crt"):
        r = subprocess.run(["openssl", "verify", "-x509_strict", "-CAfile", str(certs / "etcd-ca.crt"),
                            str(certs / leaf)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


def test_existing_files_are_kept_without_force(certs: Path):
    before = (certs / "etcd-ca.crt").read_bytes()
    r = _certs(certs, "--san", "etcd")
    assert r.returncode == 2 and "exists; pass --force" in r.stderr and "Traceback" not in r.stderr
    assert (certs / "etcd-ca.crt").read_bytes() == before


@pytest.mark.parametrize("bad", ["", "etcd:2379", "a b", "-x", "https://etcd"])
def test_bad_san_is_refused(tmp_path: Path, bad: str):
    r = _certs(tmp_path / "out", "--san", bad)
    assert r.returncode == 2 and "--san" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def _handshake(certs: Path, server_name: str, client_cert: bool) -> str:
    """A TLS server with etcd's certificate that requires a client certificate from the CA (as
    --client-cert-auth does); a client that checks the server's name. 'ok' or the client's error."""
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    sctx.load_cert_chain(certs / "etcd-server.crt", certs / "etcd-server.key")
    sctx.load_verify_locations(certs / "etcd-ca.crt")
    sctx.verify_mode = ssl.CERT_REQUIRED
    cctx = ssl.create_default_context(cafile=str(certs / "etcd-ca.crt"))
    if client_cert:
        cctx.load_cert_chain(certs / "etcd-client.crt", certs / "etcd-client.key")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def serve() -> None:
            conn, _ = listener.accept()
            try:
                with sctx.wrap_socket(conn, server_side=True) as tls:
                    tls.sendall(b"x")
            except (ssl.SSLError, OSError):
                pass

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        try:
            with socket.create_connection(("127.0.0.1", port), 5) as raw:
                with cctx.wrap_socket(raw, server_hostname=server_name) as tls:
                    return "ok" if tls.recv(1) == b"x" else "no data"
        except (ssl.SSLError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            t.join(5)


def test_tls_handshakes(certs: Path):
    assert _handshake(certs, "etcd", client_cert=True) == "ok"
    assert _handshake(certs, "localhost", client_cert=True) == "ok"
    assert "match" in _handshake(certs, "other", client_cert=True)  # not a name in the certificate
    assert _handshake(certs, "etcd", client_cert=False) != "ok"  # the server wants a client certificate


@pytest.mark.skipif(shutil.which("etcd") is None, reason="needs etcd")
def test_real_etcd_with_client_cert_auth(certs: Path, tmp_path: Path, monkeypatch):
    """etcd as deploy/docker-compose.yml runs it (listening on every address, client certificates
    required); kvpool reaches it by the name in the certificate (localhost here) with the client
    certificate, and not without one."""
    with tls_etcd(tmp_path, cert=certs / "etcd-server.crt", key=certs / "etcd-server.key", ca=certs / "etcd-ca.crt",
                  listen="0.0.0.0", advertise="localhost") as client:
        monkeypatch.setenv("KVPOOL_ETCD_CA_FILE", str(certs / "etcd-ca.crt"))
        monkeypatch.setenv("KVPOOL_ETCD_CERT_FILE", str(certs / "etcd-client.crt"))
        monkeypatch.setenv("KVPOOL_ETCD_KEY_FILE", str(certs / "etcd-client.key"))
        etcd = EtcdClient(f"etcds://localhost:{client}")
        deadline = time.monotonic() + 30
        while True:
            try:
                etcd.put("/kvpool-test/k", "v")
                break
            except Unavailable:
                assert time.monotonic() < deadline, (tmp_path / "etcd.log").read_text()[-3000:]
                time.sleep(0.2)
        assert etcd.get("/kvpool-test/k") == b"v"
        etcd.close()
        monkeypatch.delenv("KVPOOL_ETCD_CERT_FILE")
        monkeypatch.delenv("KVPOOL_ETCD_KEY_FILE")
        anonymous = EtcdClient(f"etcds://localhost:{client}")
        with pytest.raises(Unavailable):
            anonymous.get("/kvpool-test/k")
        anonymous.close()
