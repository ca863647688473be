"""Engine plug-ins (vLLM, SGLang) take their tenant salt from the keyring, a file or the
environment, so it need not sit in the engine's JSON config on argv."""

from __future__ import annotations

import logging

import pytest

from engine_adapters.chunk_store import plugin_tenant_salt
from kvpool.security.keyring import Keyring, tenant_salt
from kvpool.errors import InvalidArgument

SECRET = "t" * 40


def test_a_tenant_plugin_uses_the_tenants_derived_salt(monkeypatch):
    ring = Keyring.from_dict({"principals": {"acme": {"role": "tenant:acme", "secret": SECRET}}})
    monkeypatch.setenv("KVPOOL_TENANT_SALT", "ignored")
    assert plugin_tenant_salt({"tenant_salt": "ignored"}, ring) == tenant_salt("acme", SECRET.encode())


def test_salt_file_then_env_then_inline_with_a_warning(tmp_path, monkeypatch, caplog):
    ring = Keyring.from_dict({"principals": {"node": {"role": "node", "secret": SECRET}}})
    path = tmp_path / "salt"
    path.write_text("from-file\n")
    path.chmod(0o600)
    monkeypatch.setenv("KVPOOL_TENANT_SALT", "from-env")
    assert plugin_tenant_salt({"tenant_salt_file": str(path), "tenant_salt": "inline"}, ring) == "from-file"
    assert plugin_tenant_salt({"tenant_salt": "inline"}, ring) == "from-env"
    monkeypatch.delenv("KVPOOL_TENANT_SALT")
    with caplog.at_level(logging.WARNING):
        assert plugin_tenant_salt({"tenant_salt": "inline"}, ring) == "inline"
    assert "ps" in caplog.text
    path.chmod(0o644)
    with pytest.raises(InvalidArgument, match="chmod 600"):
        plugin_tenant_salt({"tenant_salt_file": str(path)}, ring)
