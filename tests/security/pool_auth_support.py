"""Shared by the pool RPC attack tests: a keyring file and a real `kvpool serve` using it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvpool.auth import Credential

SECRETS = {"node": "n" * 40, "ops": "o" * 40, "acme": "a" * 40, "beta": "b" * 40}
ROLES = {"node": "node", "ops": "admin", "acme": "tenant:acme", "beta": "tenant:beta"}


def write_keyring(path: Path, quotas: dict[str, dict] | None = None) -> Path:
    lines = []
    for name, secret in SECRETS.items():
        lines += [f"[principals.{name}]", f'role = "{ROLES[name]}"', f'secret = "{secret}"']
        for field, value in (quotas or {}).get(name, {}).items():
            lines.append(f"{field} = {value!r}" if isinstance(value, int) else f'{field} = "{value}"')
    path.write_text("\n".join(lines) + "\n")
    os.chmod(path, 0o600)
    return path


def cred(name: str, secret: str | None = None) -> Credential:
    return Credential(name, (secret or SECRETS[name]).encode())


def clean_env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}, **extra}


class Served:
    """`kvpool serve` with a keyring, in its own process."""

    def __init__(self, keyring: Path, log: Path, *args: str):
        self.log = log
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("kvpool")), "--log-level", "INFO", "serve", "--port", "0",
             "--admin-port", "0", *args],
            stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,
            env=clean_env(KVPOOL_AUTH_FILE=str(keyring)))
        line = self.proc.stdout.readline().strip()
        if not line.startswith("kvpool serving at "):
            self.stop()
            raise AssertionError(f"kvpool serve did not start: {line!r}\n{log.read_text()[-3000:]}")
        self.address = line.rsplit(" ", 1)[1]
        host, _, port = self.address.rpartition(":")
        self.host, self.port = host, int(port)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
