"""kvpool.config: one tree (sections), filled from file < KVPOOL_* environment < flags < --set,
with readable errors naming the bad key and where its value came from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.config import SECTIONS, Settings, current_settings, default, describe, load_settings, parse_size
from kvpool.errors import InvalidArgument

KVPOOL = [sys.executable, "-c", "from kvpool.cli import main; main()"]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No KVPOOL_* setting from the calling shell leaks into these tests (but where the user's
    keyring lives: tests/conftest.py chose it for the session)."""
    import os

    from kvpool.security.local import ENV_VARS

    for name in list(os.environ):
        if name.startswith("KVPOOL_") and name not in ENV_VARS:
            monkeypatch.delenv(name)


def _clean_env() -> dict[str, str]:
    from kvpool.tools.launch.processes import clean_env

    return clean_env()


def test_defaults():
    s = load_settings()
    assert s.pool.port == 7600 and s.pool.host == "127.0.0.1" and s.node.dram_capacity == 1 << 30
    assert s.node.transports == ["shm", "tcp"] and s.security.admin_token is None
    assert s.pool.master == f"127.0.0.1:{s.pool.port}"  # the two defaults agree
    assert [w.role for w in s.workers] == ["prefill", "decode"] and s.router.port == 8000


def test_library_defaults_are_the_trees():
    """The library configs take their defaults from the tree, not from copies of the numbers."""
    from kvpool.router.service import RouterConfig
    from reference_worker.config import WorkerConfig

    w, r = WorkerConfig(), RouterConfig()
    assert (w.pool, w.chunk_tokens, w.local_cache_bytes, w.max_batch, w.max_kv_tokens, w.kv_codec) == (
        default("pool.master"), default("pool.chunk_tokens"), default("worker.local_cache"),
        default("worker.max_batch"), default("worker.max_kv_tokens"), default("pool.kv_codec"))
    assert (r.policy, r.local_prefill_tokens, r.default_max_tokens) == (
        default("router.policy"), default("router.local_prefill_tokens"), default("router.default_max_tokens"))


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


def test_precedence_flag_over_env_over_file(tmp_path, monkeypatch):
    cfg = tmp_path / "kvpool.toml"
    cfg.write_text('[pool]\nport = 7001\nadmin_port = 7002\nreplicas = 2\n[node]\ndram_capacity = "2GiB"\n'
                   '[router]\nport = 8101\npolicy = "round_robin"\n')
    s = load_settings(cfg)  # the file alone
    assert (s.pool.port, s.pool.admin_port, s.node.dram_capacity, s.pool.replicas) == (7001, 7002, 2 << 30, 2)
    assert (s.router.port, s.router.policy) == (8101, "round_robin")
    assert s.source("pool.port") == f"file {cfg}" and s.source("pool.lease_s") == "default"
    # the environment beats the file, field by field, by short name or by section
    monkeypatch.setenv("KVPOOL_PORT", "7101")
    monkeypatch.setenv("KVPOOL_DRAM_CAPACITY", "3GiB")
    monkeypatch.setenv("KVPOOL_ROUTER__PORT", "8201")
    s = load_settings(cfg)
    assert (s.pool.port, s.pool.admin_port, s.node.dram_capacity, s.pool.replicas) == (7101, 7002, 3 << 30, 2)
    assert (s.router.port, s.router.policy) == (8201, "round_robin")
    assert s.source("pool.port") == "environment KVPOOL_PORT"
    assert s.source("router.port") == "environment KVPOOL_ROUTER__PORT"
    # flags beat both; None flags (options not given) change nothing; --set beats the named flags
    s = load_settings(cfg, port=7201, admin_port=None, replicas=3, router={"port": 8301, "policy": None})
    assert (s.pool.port, s.pool.admin_port, s.node.dram_capacity, s.pool.replicas) == (7201, 7002, 3 << 30, 3)
    assert (s.router.port, s.router.policy) == (8301, "round_robin") and s.source("pool.port") == "flag"
    s = load_settings(cfg, sets=["pool.port=7301", "router.policy=least_loaded"], port=7201)
    assert (s.pool.port, s.router.policy) == (7301, "least_loaded") and s.source("pool.port") == "flag --set"


def test_section_env_name_beats_short_name(monkeypatch):
    monkeypatch.setenv("KVPOOL_DRAM_CAPACITY", "2GiB")
    monkeypatch.setenv("KVPOOL_NODE__DRAM_CAPACITY", "3GiB")
    assert load_settings().node.dram_capacity == 3 << 30


def test_environment_names_the_outside_world_uses(monkeypatch, tmp_path):
    salt = tmp_path / "salt"
    salt.write_text("pepper\n")
    salt.chmod(0o600)
    for name, value in {"KVPOOL_MASTER": "10.0.0.1:7600", "KVPOOL_MODEL_CACHE": str(tmp_path),
                        "KVPOOL_ALLOW_UNTESTED": "1", "KVPOOL_SHM_INDEX": "0", "KVPOOL_RDMA_DEVICE": "mlx5_0",
                        "KVPOOL_ETCD_CA_FILE": "/ca.crt", "KVPOOL_HTTP_MAX_BODY": "4KiB",
                        "KVPOOL_TENANT_SALT_FILE": str(salt)}.items():
        monkeypatch.setenv(name, value)
    s = load_settings()
    assert s.pool.master == "10.0.0.1:7600" and s.worker.model_cache == str(tmp_path)
    assert s.connector.allow_untested and not s.rpc.shm_index and s.rpc.rdma_device == "mlx5_0"
    assert s.pool.etcd_ca_file == "/ca.crt" and s.security.http_max_body == 4096
    assert s.security.tenant_salt == "pepper"


def test_current_settings_follow_the_environment(monkeypatch):
    monkeypatch.setenv("KVPOOL_PRINCIPAL", "alice")
    assert current_settings().security.principal == "alice"
    monkeypatch.setenv("KVPOOL_PRINCIPAL", "bob")
    assert current_settings().security.principal == "bob"


def test_config_file_from_env_json(tmp_path, monkeypatch):
    cfg = tmp_path / "kvpool.json"
    cfg.write_text(json.dumps({"pool": {"host": "127.0.0.1", "port": 7301}, "node": {"transports": ["tcp"]}}))
    monkeypatch.setenv("KVPOOL_CONFIG", str(cfg))
    s = load_settings()
    assert s.pool.port == 7301 and s.node.transports == ["tcp"]
    other = tmp_path / "other.json"  # an explicit file beats KVPOOL_CONFIG
    other.write_text('{"pool": {"port": 7302}}')
    assert load_settings(other).pool.port == 7302


def test_flat_files_of_before_the_tree_still_load(tmp_path):
    cfg = tmp_path / "old.toml"
    cfg.write_text('port = 7401\ndram_capacity = "2GiB"\nauth_file = "/k.toml"\nserver_spin = 0\n')
    s = load_settings(cfg)
    assert (s.pool.port, s.node.dram_capacity, s.security.auth_file, s.rpc.server_spin) == (7401, 2 << 30, "/k.toml", 0)


def test_env_list_forms(monkeypatch):
    monkeypatch.setenv("KVPOOL_TRANSPORTS", "tcp, shm")
    assert load_settings().node.transports == ["tcp", "shm"]
    monkeypatch.setenv("KVPOOL_TRANSPORTS", '["shm"]')
    assert load_settings().node.transports == ["shm"]
    monkeypatch.setenv("KVPOOL_WORKERS", '[{"role": "both", "max_batch": 4}]')
    (w,) = load_settings().workers
    assert w.role == "both" and w.settings == {"max_batch": 4}


def test_env_is_case_insensitive_for_values_where_documented(monkeypatch):
    monkeypatch.setenv("KVPOOL_LOG_LEVEL", "debug")
    assert load_settings().log_level == "DEBUG"


def test_empty_admin_token_means_none(monkeypatch):
    monkeypatch.setenv("KVPOOL_ADMIN_TOKEN", "")
    assert load_settings().security.admin_token is None
    monkeypatch.setenv("KVPOOL_ADMIN_TOKEN", "s3cret")
    assert load_settings().security.admin_token == "s3cret"


@pytest.mark.parametrize("name,value,field", [
    ("KVPOOL_PORT", "abc", "pool.port"),
    ("KVPOOL_PORT", "70000", "pool.port"),
    ("KVPOOL_DRAM_CAPACITY", "lots", "node.dram_capacity"),
    ("KVPOOL_TRANSPORTS", "carrier-pigeon", "node.transports"),
    ("KVPOOL_REPLICAS", "0", "pool.replicas"),
    ("KVPOOL_LOG_LEVEL", "LOUD", "log_level"),
    ("KVPOOL_WORKER__MAX_BATCH", "many", "worker.max_batch"),
])
def test_bad_env_is_a_typed_error_naming_the_field_and_variable(monkeypatch, name, value, field):
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidArgument) as info:
        load_settings()
    assert field in str(info.value) and f"environment {name}" in str(info.value)


def test_bad_flag_is_a_typed_error():
    with pytest.raises(InvalidArgument, match="pool.chunk_tokens"):
        load_settings(chunk_tokens=0)
    with pytest.raises(InvalidArgument, match="pool.admin_port"):
        load_settings(admin_port=-1)
    with pytest.raises(InvalidArgument, match=r"\[worker\] has no setting 'max_bach' \(did you mean 'max_batch'\?\)"):
        load_settings(sets=["worker.max_bach=3"])
    with pytest.raises(InvalidArgument, match="SECTION.FIELD=VALUE"):
        load_settings(sets=["nothing"])


@pytest.mark.parametrize("name,text,match", [
    ("bad.json", "{not json", "not valid JSON"),
    ("bad.toml", "port = = 3", "not valid TOML"),
    ("list.json", "[1, 2]", "one object"),
    ("typo.toml", 'dram_capacty = "4GiB"', r"unknown setting 'dram_capacty' \(did you mean 'dram_capacity'\?\)"),
    ("typo2.toml", '[node]\ndram_capacty = "4GiB"', r"unknown setting 'dram_capacty' in \[node\]"),
    ("section.toml", '[nodes]\ndram_capacity = "4GiB"', "unknown setting 'nodes'"),
    ("conf.yaml", "port: 1", ".toml or .json"),
    ("value.toml", '[pool]\nport = "seventy"', "pool.port"),
    ("worker.toml", '[[workers]]\nrole = "prefill"\nmax_bach = 3', r"unknown worker setting\(s\) \['max_bach'\]"),
    ("role.toml", '[[workers]]\nrole = "cook"', "workers.0.role"),
])
def test_bad_file_is_a_typed_error(tmp_path, name, text, match):
    cfg = tmp_path / name
    cfg.write_text(text)
    with pytest.raises(InvalidArgument, match=match) as info:
        load_settings(cfg)
    assert str(cfg) in str(info.value)


def test_a_file_of_before_the_tree_says_how_to_convert(tmp_path):
    # `kvpool up`'s old file: the pool's tiers under [pool] ("flags of kvpool serve")
    cfg = tmp_path / "local.toml"
    cfg.write_text('[pool]\ndram_capacity = "2GiB"\n[[workers]]\nrole = "prefill"\n')
    with pytest.raises(InvalidArgument, match=r"unknown setting 'dram_capacity' in \[pool\] \(it belongs in \[node\]\)"):
        load_settings(cfg)


def test_the_repository_file_is_the_tree():
    s = load_settings(REPO / "deploy" / "local.toml")
    assert [w.role for w in s.workers] == ["prefill", "decode"] and s.node.eviction == "arc"
    assert s.workers[1].settings["max_batch"] == 32


def test_settings_keyword_short_names_and_sections():
    s = Settings(port=0, dram_capacity="64MiB", router={"port": 0})
    assert (s.pool.port, s.node.dram_capacity, s.router.port) == (0, 64 << 20, 0)
    with pytest.raises(ValueError, match="dram_capacty"):
        Settings(dram_capacty="1GiB")
    assert set(SECTIONS) == {"pool", "node", "rpc", "security", "router", "worker", "connector", "up"}


def test_show_names_origins_and_never_prints_a_secret(tmp_path, monkeypatch):
    token = tmp_path / "admin.token"
    token.write_text("tok-from-file-1234\n")
    token.chmod(0o600)
    monkeypatch.setenv("KVPOOL_ADMIN_TOKEN_FILE", str(token))
    monkeypatch.setenv("KVPOOL_METRICS_TOKEN", "metrics-secret-5678")
    cfg = tmp_path / "c.toml"
    cfg.write_text('[node]\ndram_capacity = "2GiB"\n')
    text = describe(load_settings(cfg, sets=["worker.max_batch=7"]))
    assert "tok-from-file-1234" not in text and "metrics-secret-5678" not in text
    lines = {line.split("=")[0].strip("# ").strip(): line for line in text.splitlines() if "=" in line}
    assert lines["dram_capacity"].endswith(f"# file {cfg}") and "2147483648" in lines["dram_capacity"]
    assert lines["max_batch"].endswith("# flag --set") and "= 7" in lines["max_batch"]
    assert lines["metrics_token"].endswith("# environment KVPOOL_METRICS_TOKEN") and "<redacted>" in lines["metrics_token"]
    assert lines["admin_token"].endswith("# read from admin_token_file")
    assert lines["lease_s"].endswith("# default")


def test_show_is_a_config_file(tmp_path):
    """What `describe` prints loads back as the same tree (secrets left out)."""
    s = load_settings(sets=["router.policy=round_robin", "router.kv_connector_config={\"chunk_tokens\": 64}",
                            "node.transports=tcp"])
    out = tmp_path / "shown.toml"
    out.write_text(describe(s))
    back = load_settings(out)
    assert back.redacted() == s.redacted()


def test_cli_unknown_key_is_a_clear_error_not_a_traceback(tmp_path):
    cfg = tmp_path / "typo.toml"
    cfg.write_text('[node]\ndram_capacty = "4GiB"\n')
    for command in (["config", "show"], ["node", "--port", "0"], ["serve", "--port", "0"], ["up"], ["worker", "--role", "both"]):
        r = subprocess.run([*KVPOOL, *command, "--config", str(cfg)], capture_output=True, text=True, timeout=60,
                           env=_clean_env())
        assert r.returncode == 2, (command, r.stdout, r.stderr)
        assert "unknown setting 'dram_capacty' in [node]" in r.stderr and "dram_capacity" in r.stderr
        assert "Traceback" not in r.stderr + r.stdout


def test_cli_config_show(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[router]\npolicy = "least_loaded"\n')
    r = subprocess.run([*KVPOOL, "config", "show", "--config", str(cfg), "--set", "worker.max_batch=5"],
                       capture_output=True, text=True, timeout=60, env={**_clean_env(), "KVPOOL_REPLICAS": "2"})
    assert r.returncode == 0, r.stderr
    assert 'policy = "least_loaded"' in r.stdout and "max_batch = 5" in r.stdout
    assert "replicas = 2" in r.stdout and "environment KVPOOL_REPLICAS" in r.stdout


def test_the_documented_tree_is_the_tree(tmp_path):
    """docs/configuration.md shows every field of every section, with the defaults in force."""
    import re

    doc = (REPO / "docs" / "configuration.md").read_text()
    block = re.search(r"## The tree\n\n```toml\n(.*?)```", doc, re.S).group(1)
    shown = tmp_path / "tree.toml"
    shown.write_text(block)
    assert load_settings(shown).redacted() == load_settings().redacted()
    section = None
    named: dict[str, set[str]] = {}
    for line in block.splitlines():
        if m := re.match(r"\[\[?(\w+)\]", line):
            section = m.group(1)
        elif section and (m := re.match(r"#? ?(\w+) =", line)):
            named.setdefault(section, set()).add(m.group(1))
    for name, cls in SECTIONS.items():
        assert named.get(name) == set(cls.model_fields), name


def test_the_sdk_finds_the_pool_where_the_tree_says(monkeypatch):
    import kvpool
    from kvpool.embedded import EmbeddedPool

    with EmbeddedPool(load_settings(port=0, admin_port=0, dram_capacity="16MiB")) as ep:
        monkeypatch.setenv("KVPOOL_MASTER", ep.address)
        with kvpool.connect() as client:
            client.put("k", b"v")
            assert client.get("k") == b"v"


def test_the_per_user_keyring_is_configured_by_the_tree(tmp_path, monkeypatch):
    """`[security] local_auth` and `local_dir` from a file reach kvpool.security.local as its
    variables (KVPOOL_LOCAL_AUTH, KVPOOL_LOCAL_DIR) do."""
    from kvpool.config import use_settings
    from kvpool.security import local

    for name in local.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[security]\nlocal_dir = "{tmp_path / "mine"}"\n')
    use_settings(load_settings(cfg))
    assert local.local_dir() == tmp_path / "mine" and local.local_keyring() is not None
    assert (tmp_path / "mine" / "keyring.toml").stat().st_mode & 0o777 == 0o600
    use_settings(load_settings(cfg, sets=["security.local_auth=false"]))
    assert local.local_keyring() is None and local.local_token("admin") is None
    use_settings(None)
    monkeypatch.setenv("KVPOOL_LOCAL_AUTH", "off")
    assert not local.enabled()
