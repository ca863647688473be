"""Shared by the pool RPC attack tests: a keyring file, credentials from it, a clean environment
(the real `kvpool serve` using them is `served_support.Serve`)."""

from __future__ import annotations

import os
from pathlib import Path

from kvpool import messages as m
from kvpool.security.keyring import Credential
from kvpool.tools.launch.processes import clean_env

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




def reserve(rpc, key: str, size: int):
    """Start a put at the (embedded) pool and reserve it for a one-sided write: the `Slot`, or
    the `Err` of the reservation (a node takes no write under no put)."""
    plan = rpc.call(m.PutStart([key], [size])).plans[0]
    assert isinstance(plan, m.PutPlan), plan
    return rpc.call(m.NodeReserve([key], [size], [plan.put_id])).results[0]
