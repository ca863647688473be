"""`kvpool admin ...` against a live admin API: output, --json, token from --token-file / env / file,
and one readable line (no traceback) for each kind of error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvpool.cli import cli
from kvpool.security.local import ENV_VARS
from kvpool.tools.launch.processes import clean_env

TOKEN = "test-token-7f3a"
KVPOOL = str(Path(sys.executable).with_name("kvpool"))


@pytest.fixture(autouse=True)
def _no_kvpool_settings(monkeypatch):  # but the session's own keyring directory (tests/conftest.py)
    for name in list(os.environ):
        if name.startswith("KVPOOL_") and name not in ENV_VARS:
            monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def token_file(tmp_path):
    """TOKEN in a 0600 file: the API needs it for every call (reads included)."""
    global TOKEN_FILE, WRONG_FILE
    TOKEN_FILE, WRONG_FILE = tmp_path / "admin.token", tmp_path / "wrong.token"
    for path, text in ((TOKEN_FILE, TOKEN), (WRONG_FILE, "wrong")):
        path.write_text(text + "\n")
        path.chmod(0o600)


TOKEN_FILE = WRONG_FILE = None


def run(url, *args, token=True):
    base = ["admin", "--url", url, "--json"] + (["--token-file", str(TOKEN_FILE)] if token else [])
    result = CliRunner().invoke(cli, base + list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def shell(*args, env=None):
    """The real `kvpool` executable in a new process (for what only a fresh process shows)."""
    full_env = clean_env()
    full_env.update(env or {})
    return subprocess.run([KVPOOL, "admin", *args], capture_output=True, text=True, timeout=60, env=full_env)


def main_in_process(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """Run `kvpool admin ARGS` through the real entry point (`kvpool.cli.main`, which turns
    typed errors into one line and an exit code) without paying for a new interpreter."""
    from kvpool.cli import main

    monkeypatch.setattr(sys, "argv", ["kvpool", "admin", *args])
    with pytest.raises(SystemExit) as info:
        main()
        raise SystemExit(0)
    out = capsys.readouterr()
    return info.value.code, out.out, out.err


def test_help_lists_the_commands():
    result = CliRunner().invoke(cli, ["admin", "--help"])
    assert result.exit_code == 0
    for name in ("nodes", "stats", "key", "keys", "evict", "drain", "undrain", "config", "remove-node"):
        assert name in result.output


def test_nodes_stats_key_json(admin):
    handle, _ = admin
    nodes = run(handle.url, "nodes")
    assert [n["node_id"] for n in nodes] == ["node-a"]
    assert run(handle.url, "stats")["objects"] == 3
    assert run(handle.url, "key", "key-2")["size"] == 3000
    assert run(handle.url, "node", "node-a")["objects"] == 3
    assert sorted(run(handle.url, "keys", "--prefix", "key-")) == ["key-0", "key-1", "key-2"]


def test_tables_render(admin):
    handle, _ = admin
    for args in (["nodes"], ["stats"]):
        result = CliRunner().invoke(cli, ["admin", "--url", handle.url, "--token-file", str(TOKEN_FILE), *args],
                                   catch_exceptions=False)
        assert result.exit_code == 0 and "node-a" in result.output or "dram" in result.output


def test_mutations_with_token(master, admin):
    handle, _ = admin
    assert run(handle.url, "evict", "--key", "key-0")["evicted"] == 1
    assert run(handle.url, "evict", "--bytes", "1KiB")["evicted"] >= 1
    assert run(handle.url, "config", "--set", "lease_s=2.5")["lease_s"] == 2.5
    assert run(handle.url, "drain", "node-a")["state"] == "draining"
    assert master.admin.node("node-a")["state"] == "draining"


def test_token_from_env_and_config_file(master, admin, tmp_path, monkeypatch, capsys):
    handle, _ = admin
    monkeypatch.setenv("KVPOOL_ADMIN_TOKEN", TOKEN)
    code, _, err = main_in_process(monkeypatch, capsys, "--url", handle.url, "drain", "node-a")
    assert code == 0, err
    monkeypatch.delenv("KVPOOL_ADMIN_TOKEN")
    cfg = tmp_path / "kvpool.toml"
    cfg.write_text(f'admin_token = "{TOKEN}"\n')
    code, out, err = main_in_process(monkeypatch, capsys, "--url", handle.url, "--config", str(cfg), "--json",
                                     "config", "--set", "replicas=2")
    assert code == 0, err
    assert json.loads(out)["replicas"] == 2
    # a flag beats the file: a wrong --token-file is refused even though the file has the right one
    code, _, err = main_in_process(monkeypatch, capsys, "--url", handle.url, "--config", str(cfg),
                                   "--token-file", str(WRONG_FILE), "drain", "node-a")
    assert code == 2 and "wrong bearer token" in err
    monkeypatch.setenv("KVPOOL_ADMIN_TOKEN_FILE", str(TOKEN_FILE))  # the file named in the environment
    code, _, err = main_in_process(monkeypatch, capsys, "--url", handle.url, "--json", "nodes")
    assert code == 0, err
    TOKEN_FILE.chmod(0o644)  # a token file others can read is refused, as a readable keyring is
    code, _, err = main_in_process(monkeypatch, capsys, "--url", handle.url, "--json", "nodes")
    assert code == 2 and "readable by others" in err


def test_url_from_settings(admin, tmp_path, monkeypatch, capsys):
    handle, _ = admin
    cfg = tmp_path / "kvpool.json"
    cfg.write_text(json.dumps({"host": "127.0.0.1", "admin_port": handle.port, "admin_token": TOKEN}))
    code, out, err = main_in_process(monkeypatch, capsys, "--config", str(cfg), "--json", "nodes")
    assert code == 0, err
    assert json.loads(out)[0]["node_id"] == "node-a"
    monkeypatch.setenv("KVPOOL_ADMIN_PORT", str(handle.port))  # the environment works the same way
    monkeypatch.setenv("KVPOOL_ADMIN_TOKEN", TOKEN)
    code, out, err = main_in_process(monkeypatch, capsys, "--json", "nodes")
    assert code == 0, err


@pytest.mark.parametrize("args,needle", [
    (["drain", "node-a"], "no bearer token"),
    (["nodes"], "no bearer token"),
    (["keys"], "no bearer token"),
    (["config"], "no bearer token"),
    (["--token-file", "WRONG", "drain", "node-a"], "wrong bearer token"),
    (["--token-file", "TOKEN", "node", "ghost"], "not found"),
    (["--token-file", "TOKEN", "key", "tail/ghost"], "not found"),
    (["evict"], "--bytes"),
    (["evict", "--bytes", "many"], "not a size"),
    (["config", "--set", "lease_s"], "FIELD=VALUE"),
    (["--token-file", "TOKEN", "config", "--set", "port=1"], "cannot be changed"),
])
def test_errors_are_one_readable_line(master, admin, args, needle, monkeypatch, capsys):
    handle, _ = admin
    monkeypatch.setenv("KVPOOL_LOCAL_AUTH", "off")  # else a CLI given no token presents its user's own (a wrong one)
    args = [{"WRONG": str(WRONG_FILE), "TOKEN": str(TOKEN_FILE)}.get(a, a) for a in args]
    code, _, err = main_in_process(monkeypatch, capsys, "--url", handle.url, *args)
    assert code == 2
    assert needle in err and err.startswith("error: ") and err.count("\n") == 1
    assert "Traceback" not in err
    assert master.admin.node("node-a")["state"] == "up"


def test_unreachable_server_is_a_readable_error():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = shell("--url", f"http://127.0.0.1:{port}", "nodes")
    assert r.returncode == 2 and "cannot reach the admin API" in r.stderr and "Traceback" not in r.stderr


def test_bad_config_file_is_a_readable_error(tmp_path, monkeypatch, capsys):
    cfg = tmp_path / "kvpool.toml"
    cfg.write_text("admin_port = 'x'\n")
    code, _, err = main_in_process(monkeypatch, capsys, "--config", str(cfg), "nodes")
    assert code == 2 and "admin_port" in err and "Traceback" not in err
