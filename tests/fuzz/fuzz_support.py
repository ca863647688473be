"""Helpers of the fuzz tests (issue 14): how many inputs each target gets, a count of the inputs
each target really tried (printed at the end of the run), and byte-mutation strategies.

Budgets: the default suite gives each target `KVPOOL_FUZZ_EXAMPLES` inputs (default 300, a few
seconds per target); the `slow` variants give `KVPOOL_FUZZ_LONG_EXAMPLES` (default 20000).
Hypothesis keeps failing inputs in .hypothesis/ and replays them first.
"""

from __future__ import annotations

import os
import socket
import threading
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("KVPOOL_FUZZ_EXAMPLES", "300"))
LONG_EXAMPLES = int(os.environ.get("KVPOOL_FUZZ_LONG_EXAMPLES", "20000"))

TRIED: Counter[str] = Counter()


def fuzz_settings(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])


@st.composite
def mutated(draw, seeds: list[bytes]) -> bytes:
    """A valid encoding from `seeds` with a few random edits: flipped or replaced bytes, bytes
    inserted or deleted, a cut, or a little-endian length field overwritten with a huge value."""
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "big"]))
        n = len(data)
        if op == "truncate":
            data = data[:draw(st.integers(0, n))]
        elif op == "insert":
            at = draw(st.integers(0, n))
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif not n:
            continue
        elif op == "flip":
            at = draw(st.integers(0, n - 1))
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            data[draw(st.integers(0, n - 1))] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xC0, 0xCF, 0xDD, 0xDF, 0xFF]))
        elif op == "delete":
            at = draw(st.integers(0, n - 1))
            del data[at:at + draw(st.integers(1, 8))]
        else:  # "big": a length or count field claims far more than there is
            at = draw(st.integers(0, n - 1))
            data[at:at + 4] = draw(st.sampled_from([b"\xff\xff\xff\x7f", b"\xff\xff\xff\xff", b"\xdd\xff\xff\xff"]))
    return bytes(data)


def fuzz_bytes(seeds: list[bytes], max_size: int = 512):
    """Arbitrary bytes or a mutation of a valid encoding."""
    return st.one_of(st.binary(max_size=max_size), mutated(seeds))


class LyingServer:
    """A fake pool server on loopback: answers each connection's first request with `reply`
    (which may lie in its header), then closes the connection, or with `hold` keeps it open
    (a peer that announced more than it sends)."""

    def __init__(self, reply: bytes = b"", *, hold: bool = False):
        self.reply, self.hold = reply, hold
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            try:
                conn.recv(1 << 16)
                conn.sendall(self.reply)
            except OSError:
                pass
            if self.hold:
                self.held.append(conn)
            else:
                conn.close()

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()
