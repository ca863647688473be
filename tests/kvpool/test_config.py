"""kvpool.config: file < KVPOOL_* environment < flags, and readable errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.config import Settings, load_settings, parse_size
from kvpool.errors import InvalidArgument


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No KVPOOL_* setting from the calling shell leaks into these tests (where the user's keyring
    lives is not a setting: tests/conftest.py chose it for the session)."""
    import os

    from kvpool.security.local import ENV_VARS

    for name in list(os.environ):
        if name.startswith("KVPOOL_") and name not in ENV_VARS:
            monkeypatch.delenv(name)


def test_defaults():
    s = load_settings()
    assert s.port == 7600 and s.host == "127.0.0.1" and s.dram_capacity == 1 << 30
    assert s.transports == ["shm", "tcp"] and s.admin_token is None


@pytest.mark.parametrize("text,expected", [
    ("4GiB", 4 << 30), ("512m", 512 << 20), ("1048576", 1 << 20), (" 2 KiB ", 2048), ("1.5GiB", 3 << 29),
    ("10GB", 10 * 10**9), (123, 123), (0, 0),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "4 parsecs", "-1", "1e9", -5, True])
def test_parse_size_rejects(bad):
    with pytest.raises(InvalidArgument):
        parse_size(bad)


def test_precedence_file_env_flags(tmp_path, monkeypatch):
    cfg = tmp_path / "kvpool.toml"
    cfg.write_text('port = 7001\nadmin_port = 7002\ndram_capacity = "2GiB"\nreplicas = 2\n')
    # the file alone
    s = load_settings(cfg)
    assert (s.port, s.admin_port, s.dram_capacity, s.replicas) == (7001, 7002, 2 << 30, 2)
    # the environment beats the file, field by field
    monkeypatch.setenv("KVPOOL_PORT", "7101")
    monkeypatch.setenv("KVPOOL_DRAM_CAPACITY", "3GiB")
    s = load_settings(cfg)
    assert (s.port, s.admin_port, s.dram_capacity, s.replicas) == (7101, 7002, 3 << 30, 2)
    # flags beat both; None flags (options not given) change nothing
    s = load_settings(cfg, port=7201, admin_port=None, replicas=3)
    assert (s.port, s.admin_port, s.dram_capacity, s.replicas) == (7201, 7002, 3 << 30, 3)


def test_config_file_from_env_json(tmp_path, monkeypatch):
    cfg = tmp_path / "kvpool.json"
    cfg.write_text(json.dumps({"host": "127.0.0.1", "port": 7301, "transports": ["tcp"]}))
    monkeypatch.setenv("KVPOOL_CONFIG", str(cfg))
    s = load_settings()
    assert s.port == 7301 and s.transports == ["tcp"]
    # an explicit file beats KVPOOL_CONFIG
    other = tmp_path / "other.json"
    other.write_text('{"port": 7302}')
    assert load_settings(other).port == 7302


def test_env_list_forms(monkeypatch):
    monkeypatch.setenv("KVPOOL_TRANSPORTS", "tcp, shm")
    assert load_settings().transports == ["tcp", "shm"]
    monkeypatch.setenv("KVPOOL_TRANSPORTS", '["shm"]')
    assert load_settings().transports == ["shm"]


def test_env_is_case_insensitive_for_values_where_documented(monkeypatch):
    monkeypatch.setenv("KVPOOL_LOG_LEVEL", "debug")
    assert load_settings().log_level == "DEBUG"


def test_empty_admin_token_means_none(monkeypatch):
    monkeypatch.setenv("KVPOOL_ADMIN_TOKEN", "")
    assert load_settings().admin_token is None
    monkeypatch.setenv("KVPOOL_ADMIN_TOKEN", "s3cret")
    assert load_settings().admin_token == "s3cret"


@pytest.mark.parametrize("name,value,field", [
    ("KVPOOL_PORT", "abc", "port"),
    ("KVPOOL_PORT", "70000", "port"),
    ("KVPOOL_DRAM_CAPACITY", "lots", "dram_capacity"),
    ("KVPOOL_TRANSPORTS", "carrier-pigeon", "transports"),
    ("KVPOOL_REPLICAS", "0", "replicas"),
    ("KVPOOL_LOG_LEVEL", "LOUD", "log_level"),
])
def test_bad_env_is_a_typed_error_naming_the_field(monkeypatch, name, value, field):
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidArgument) as info:
        load_settings()
    assert "environment" in str(info.value) and field in str(info.value)


def test_bad_flag_is_a_typed_error():
    with pytest.raises(InvalidArgument, match="chunk_tokens"):
        load_settings(chunk_tokens=0)
    with pytest.raises(InvalidArgument, match="admin_port"):
        load_settings(admin_port=-1)


@pytest.mark.parametrize("name,text,match", [
    ("bad.json", "{not json", "not valid JSON"),
    ("bad.toml", "port = = 3", "not valid TOML"),
    ("list.json", "[1, 2]", "one object"),
    ("typo.toml", 'dram_capacty = "4GiB"', "unknown setting"),
    ("conf.yaml", "port: 1", ".toml or .json"),
    ("value.toml", 'port = "seventy"', "port"),
])
def test_bad_file_is_a_typed_error(tmp_path, name, text, match):
    cfg = tmp_path / name
    cfg.write_text(text)
    with pytest.raises(InvalidArgument, match=match):
        load_settings(cfg)


def test_tables_of_other_tools_are_skipped(tmp_path):
    # deploy/local.toml shape: `kvpool up` reads [pool] and [[workers]]; settings ignore them
    cfg = tmp_path / "local.toml"
    cfg.write_text('port = 7401\n[pool]\ndram_capacity = "2GiB"\n[[workers]]\nrole = "prefill"\n')
    s = load_settings(cfg)
    assert s.port == 7401 and s.dram_capacity == 1 << 30  # the default, not [pool]'s value
    repo_file = Path(__file__).resolve().parents[2] / "deploy" / "local.toml"
    if repo_file.exists():
        load_settings(repo_file)


def test_missing_file(tmp_path, monkeypatch):
    with pytest.raises(InvalidArgument, match="does not exist"):
        load_settings(tmp_path / "nope.toml")
    monkeypatch.setenv("KVPOOL_CONFIG", str(tmp_path / "nope.json"))
    with pytest.raises(InvalidArgument, match="does not exist"):
        load_settings()


def test_settings_is_the_one_model():
    # every service reads the same fields; the admin token is among them
    assert "admin_token" in Settings.model_fields and "admin_port" in Settings.model_fields
