"""`kvpool serve | master | node`: help, one configuration model (file < env < flags), errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

import kvpool
from kvpool.cli import cli
from etcd_testing import spawn


@pytest.mark.parametrize("command", ["serve", "master", "node"])
def test_help(command):
    result = CliRunner().invoke(cli, [command, "--help"])
    assert result.exit_code == 0
    assert "--config" in result.output and "--port" in result.output


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-c", "from kvpool.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=60, env=env)


def test_readable_errors_for_bad_configuration(tmp_path):
    bad = run_cli("serve", "--dram-capacity", "lots")
    assert bad.returncode == 2 and "error:" in bad.stderr and "dram_capacity" in bad.stderr
    assert "Traceback" not in bad.stderr
    missing = run_cli("serve", "--config", str(tmp_path / "nope.json"))
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    node = run_cli("node", "--master", "not-an-address", "--port", "0")
    assert node.returncode == 2 and "host:port" in node.stderr and "Traceback" not in node.stderr


def test_file_env_and_flags_compose(tmp_path, monkeypatch):
    config = tmp_path / "pool.json"
    config.write_text(json.dumps({"dram_capacity": "8MiB", "replicas": 1, "admin_port": 0}))
    monkeypatch.setenv("KVPOOL_DRAM_CAPACITY", "12MiB")  # env beats the file
    proc = spawn(["serve", "--config", str(config), "--port", "0"])
    try:
        with kvpool.connect(proc.address) as c:
            assert c.admin("nodes")[0]["capacity"]["dram"] == 12 << 20
            assert c.admin("config")["pool"]["admin_port"] == 0  # from the file
    finally:
        proc.stop()
    proc = spawn(["serve", "--config", str(config), "--port", "0", "--dram-capacity", "16MiB"])  # flag beats env
    try:
        with kvpool.connect(proc.address) as c:
            assert c.admin("nodes")[0]["capacity"]["dram"] == 16 << 20
            c.put("k", b"v")
            assert c.get("k") == b"v"
    finally:
        proc.stop()
