"""`kvpool/tools/scripts/instr_per_op.py`: its auth-off processes have no keyring at all (the
per-user one is on by default, and a launcher passes on where it is), its auth-on ones the
bench keyring; each side's own check tells them apart."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.tools.scripts import instr_per_op

ROOT = Path(__file__).resolve().parents[3]
ASK = "from kvpool.tools.scripts.instr_per_op import _keyring_in_use; print(_keyring_in_use())"


def _keyring_of(env: dict[str, str]) -> str:
    env["PYTHONPATH"] = str(ROOT)  # this tree's tool, whichever is installed
    done = subprocess.run([sys.executable, "-c", ASK], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("auth, expected", [(False, "none"), (True, "configured")])
def test_each_mode_runs_with_the_keyring_it_names(tmp_path, auth, expected):
    env, secret = instr_per_op._child_env(str(tmp_path), auth)
    assert bool(secret) == auth
    assert _keyring_of(env) == expected


def test_the_per_user_keyring_is_told_apart(tmp_path):
    """Without the tool's setting a child with no keyring configured takes this user's own."""
    env, _ = instr_per_op._child_env(str(tmp_path), False)
    local = tmp_path / "local"
    local.mkdir(mode=0o700)
    env.pop("KVPOOL_LOCAL_AUTH")
    env["KVPOOL_LOCAL_DIR"] = str(local)
    assert _keyring_of(env) == "per-user"
