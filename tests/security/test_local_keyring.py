"""The per-user keyring's files (`kvpool.security.local`): where they are made, their modes, what
is refused, and that processes starting at once agree on one secret (first use is atomic)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kvpool.errors import InvalidArgument
from kvpool.security import local

# Says it is ready, waits for the go file, then in each of ROUNDS empty folders makes (or finds)
# the keyring and both tokens, and prints what it got.
ROUNDS = 25
FIRST_USE = r"""
import json, os, sys, time
from kvpool.security import local
home, go, ready, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.001)
got = []
for r in range(rounds):
    os.environ[local.DIR_ENV] = os.path.join(home, f"round-{r}")
    got.append([local.local_keyring().node_credential().secret.decode(), local.local_token("admin"),
                local.local_token("metrics")])
print(json.dumps(got))
"""


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A home of its own and nothing of the session's keyring directory (tests/conftest.py)."""
    for name in local.ENV_VARS + ("XDG_CONFIG_HOME",):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_made_on_first_use_in_the_home_private(home):
    ring = local.local_keyring()
    folder = home / ".config" / "kvpool"
    assert local.local_dir() == folder
    assert ring.local and ring.node_credential().principal == "node"
    token = local.local_token("admin")
    assert (folder / "admin.token").read_text().strip() == token and len(token) >= 32
    assert folder.stat().st_mode & 0o777 == 0o700
    for name in ("keyring.toml", "admin.token"):
        assert (folder / name).stat().st_mode & 0o777 == 0o600, name
    assert local.local_token("admin") == token  # found again, never overwritten
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_xdg_config_home_and_kvpool_local_dir_move_it(home, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / "xdg"))
    assert local.local_dir() == home / "xdg" / "kvpool"
    monkeypatch.setenv(local.DIR_ENV, str(home / "mine"))
    local.local_keyring()
    assert (home / "mine" / "keyring.toml").exists() and not (home / "xdg").exists()


def test_a_folder_or_file_others_may_read_is_refused_with_the_fix(home):
    folder = home / ".config" / "kvpool"
    folder.mkdir(parents=True, mode=0o755)
    folder.chmod(0o755)
    with pytest.raises(InvalidArgument, match=f"chmod 700 {folder}"):
        local.local_keyring()
    folder.chmod(0o700)
    (folder / "admin.token").write_text("readable by all\n")
    (folder / "admin.token").chmod(0o644)
    with pytest.raises(InvalidArgument, match="chmod 600"):
        local.local_token("admin")


def test_turned_off_it_makes_nothing(home, monkeypatch):
    monkeypatch.setenv(local.LOCAL_ENV, "off")
    assert local.local_keyring() is None and local.local_token("admin") is None
    assert local.resolve(None) is None
    assert not (home / ".config").exists()


def test_processes_starting_at_once_agree_on_one_keyring(home):
    """Twelve processes make the keyring and tokens of the same empty folders at the same moment,
    25 folders in turn: in each, every process reads back one complete file, the same secret and
    tokens as the others (a plain write-then-read lets one read another's half-written file, or
    two each keep their own secret), and no temporary file is left."""
    go, waiting = home / "go", home / "ready"
    waiting.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", FIRST_USE, str(home), str(go), str(waiting / str(i)),
                               str(ROUNDS)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(12)]
    while len(list(waiting.iterdir())) < len(procs):  # every one imported and waiting: then all go at once
        assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs if p.poll()]
        time.sleep(0.01)
    go.touch()
    got = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        got.append(json.loads(out))
    for r in range(ROUNDS):
        assert len({tuple(g[r]) for g in got}) == 1, (r, [g[r] for g in got])
        folder = home / f"round-{r}"
        assert sorted(p.name for p in folder.iterdir()) == ["admin.token", "keyring.toml", "metrics.token"]
