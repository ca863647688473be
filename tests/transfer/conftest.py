"""Fixtures for the transfer tests: peer engines in their own processes, cleaned up always."""

from __future__ import annotations

import pytest

from transfer_peer import Peer


@pytest.fixture
def make_peer():
    peers: list[Peer] = []

    def start(size: int = 8 << 20, seed: int = 1, transports: str = "shm,tcp") -> Peer:
        peer = Peer(size, seed, transports)
        peers.append(peer)
        return peer

    yield start
    for peer in peers:
        peer.stop()
