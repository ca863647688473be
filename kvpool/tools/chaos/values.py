"""Self-describing values: a key's bytes are derived from the key alone, so any reader can tell
whether a get returned that key's own bytes.

In kvpool a chunk key names its content (a prefix-hash chain), so one key has one value: the
campaign never writes two different values under one key, and "wrong bytes" means anything but
`value_of(key)`.
"""

from __future__ import annotations

import random

import xxhash

MAGIC = b"KVCHAOS1"
MIN_SIZE, MAX_SIZE = 512, 48 * 1024


def value_of(key: str) -> bytes:
    """The only bytes a get of `key` may ever return: a header naming the key, then bytes
    seeded by the key's hash, 512 B to 48 KiB long (also derived from the key)."""
    seed = xxhash.xxh3_64_intdigest(key.encode())
    size = MIN_SIZE + seed % (MAX_SIZE - MIN_SIZE)
    head = MAGIC + key.encode() + b"\0"
    return head + random.Random(seed).randbytes(max(0, size - len(head)))


def whose(data: bytes) -> str | None:
    """The key a value names in its header (for reporting a wrong read), or None."""
    if not data.startswith(MAGIC):
        return None
    end = data.find(b"\0", len(MAGIC))
    return data[len(MAGIC):end].decode(errors="replace") if end > 0 else None
