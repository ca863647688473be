"""The keyring and the connection handshake (transfer.auth), over real socket pairs."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from kvpool.security.keyring import Keyring, check_bind, chunk_mac_key, tenant_salt
from kvpool.errors import InvalidArgument
from transfer.auth import AuthError, client_handshake, looks_like_hello, serve_handshake

SECRET = "s" * 40


def keyring() -> Keyring:
    return Keyring.from_dict({"principals": {
        "node": {"role": "node", "secret": "n" * 40},
        "acme": {"role": "tenant:acme", "secret": SECRET, "api_keys": ["sk-acme-0123456789"], "quota_bytes": "1MiB"},
    }})


def run_pair(client_name: str, client_secret: bytes, lookup, channel_c="rpc", channel_s="rpc"):
    a, b = socket.socketpair()
    out: dict = {}

    def server():
        try:
            first = b.recv(4)
            assert looks_like_hello(first)
            out["server"] = serve_handshake(b, first, lookup, channel_s)
        except AuthError as exc:
            out["server_err"] = str(exc)

    t = threading.Thread(target=server)
    t.start()
    try:
        client_handshake(a, client_name, client_secret, channel_c)
        out["client"] = "ok"
    except AuthError as exc:
        out["client_err"] = str(exc)
    t.join(10)
    a.close(), b.close()
    return out


def test_handshake_proves_both_sides():
    ring = keyring()
    out = run_pair("acme", SECRET.encode(), ring.secret)
    assert out == {"server": "acme", "client": "ok"}


@pytest.mark.parametrize("name,secret", [("acme", b"x" * 40), ("nobody", SECRET.encode())])
def test_wrong_secret_or_unknown_principal_is_refused_the_same_way(name, secret):
    out = run_pair(name, secret, keyring().secret)
    assert "server" not in out and "client" not in out
    assert out["client_err"] == "the server's proof is wrong: it does not hold this principal's secret " \
                                "(wrong server, or the keyrings differ)"


def test_proof_for_one_channel_is_not_one_for_another():
    out = run_pair("acme", SECRET.encode(), keyring().secret, channel_c="rpc", channel_s="transfer")
    assert "server" not in out and "client_err" in out


def test_server_without_keyring_says_so():
    out = run_pair("acme", SECRET.encode(), None)
    assert "not configured" in out["client_err"] or "no authentication configured" in out["client_err"]


def test_keyring_file_must_be_private(tmp_path):
    path = tmp_path / "keyring.toml"
    path.write_text('[principals.node]\nrole = "node"\nsecret = "' + "n" * 40 + '"\n')
    os.chmod(path, 0o644)
    with pytest.raises(InvalidArgument, match="chmod 600"):
        Keyring.load(path)
    os.chmod(path, 0o600)
    assert Keyring.load(path).credential().principal == "node"


@pytest.mark.parametrize("doc,match", [
    ({"principals": {"a": {"role": "root", "secret": SECRET}}}, "role must be"),
    ({"principals": {"a": {"role": "node", "secret": "short"}}}, "at least 32"),
    ({"principals": {"a": {"role": "node", "secret": SECRET, "api_keys": ["sk-0123456789abcdef"]}}}, "only a tenant"),
    ({"principals": {}}, "needs a"),
])
def test_bad_keyrings_name_the_problem(doc, match):
    with pytest.raises(InvalidArgument, match=match):
        Keyring.from_dict(doc)


def test_derived_keys_differ_per_tenant_and_need_the_secret():
    ring = keyring()
    assert ring.tenant_of_api_key("sk-acme-0123456789").principal.tenant == "acme"
    assert ring.tenant_of_api_key("sk-acme-0123456780") is None
    assert chunk_mac_key(b"a" * 32) != chunk_mac_key(b"b" * 32)
    assert tenant_salt("acme", b"a" * 32) != tenant_salt("acme", b"b" * 32)


def test_protected_mode():
    check_bind("127.0.0.1", False, "pool")
    check_bind("::1", False, "pool")
    check_bind("0.0.0.0", True, "pool")
    with pytest.raises(InvalidArgument, match="protected mode"):
        check_bind("0.0.0.0", False, "pool")
