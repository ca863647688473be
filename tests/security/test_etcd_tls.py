"""etcd with TLS and client-certificate authentication, as deploy/k8s/etcd.yaml runs it (issue 13):
a real etcd, certificates made with openssl. Without the CA a client refuses etcd; without a
client certificate etcd refuses the client; with both, kvpool's etcd client works."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kvpool.cluster.etcd import EtcdClient
from kvpool.errors import InvalidArgument, Unavailable

from tls_etcd_support import tls_etcd

pytestmark = pytest.mark.skipif(not (shutil.which("etcd") and shutil.which("openssl")),
                                reason="needs etcd and openssl")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _certs(d: Path) -> None:
    """ca.crt; server.crt for 127.0.0.1; client.crt (CN node) and, from another CA, rogue.crt."""
    for ca in ("ca", "rogue-ca"):
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={ca}",
                 "-keyout", f"{ca}.key", "-out", f"{ca}.crt", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    for name, ca in (("server", "ca"), ("client", "ca"), ("rogue", "rogue-ca")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
                 "-days", "1", "-extfile", "san.ext", "-out", f"{name}.crt", cwd=d)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    d = tmp_path_factory.mktemp("etcd-tls")
    _certs(d)
    with tls_etcd(d, cert=d / "server.crt", key=d / "server.key", ca=d / "ca.crt") as client:
        yield d, f"etcds://127.0.0.1:{client}"


def _env(monkeypatch, d: Path, ca: str | None, cert: str | None) -> None:
    for name, value in (("KVPOOL_ETCD_CA_FILE", ca and d / f"{ca}.crt"), ("KVPOOL_ETCD_CERT_FILE", cert and d / f"{cert}.crt"),
                        ("KVPOOL_ETCD_KEY_FILE", cert and d / f"{cert}.key")):
        if value:
            monkeypatch.setenv(name, str(value))
        else:
            monkeypatch.delenv(name, raising=False)


def test_a_client_with_the_ca_and_a_certificate_is_served(etcd, monkeypatch):
    d, meta = etcd
    _env(monkeypatch, d, "ca", "client")
    c = EtcdClient(meta)
    c.put("/kvpool/t", "v")
    assert c.get("/kvpool/t") == b"v"
    c.close()


@pytest.mark.parametrize("ca,cert", [("ca", None), ("ca", "rogue"), (None, "client")],
                         ids=["no-client-cert", "cert-from-another-ca", "etcd-not-trusted"])
def test_without_the_right_certificates_nothing_is_read_or_written(etcd, monkeypatch, ca, cert):
    d, meta = etcd
    _env(monkeypatch, d, ca, cert)
    c = EtcdClient(meta, timeout=5)
    with pytest.raises(Unavailable):
        c.put("/kvpool/t", "evil")
    with pytest.raises(Unavailable):
        c.get("/kvpool/t")
    c.close()


def test_plain_http_to_a_tls_etcd_fails_and_half_a_client_certificate_is_a_clear_error(etcd, monkeypatch):
    d, meta = etcd
    _env(monkeypatch, d, "ca", "client")
    with pytest.raises(Unavailable):
        EtcdClient(meta.replace("etcds://", "etcd://"), timeout=5).get("/kvpool/t")
    monkeypatch.delenv("KVPOOL_ETCD_KEY_FILE")
    with pytest.raises(InvalidArgument, match="KVPOOL_ETCD_KEY_FILE"):
        EtcdClient(meta)
