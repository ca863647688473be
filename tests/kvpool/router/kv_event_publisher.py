"""A KV event publisher in vLLM 0.32's wire format, for tests without vLLM: a ZMQ PUB socket
sending `[topic, seq (8 bytes big-endian), msgpack [ts, events, dp rank]]`, events as maps
tagged by "type", and a ROUTER socket replaying kept batches from a requested seq, then
`[b"", -1]` (vllm/distributed/kv_events.py). The vLLM suite checks the router against vLLM's own
publisher class (tests/engine_adapters/vllm_real/test_vllm_kv_events.py).

Block hashes are sha256 over (parent hash, tokens), as vLLM's default chains them; the router must
not depend on how they are made.
"""

from __future__ import annotations

import hashlib
import threading
import time

import msgspec
import zmq

END = (-1).to_bytes(8, "big", signed=True)


def block_hashes(ids: list[int], block_size: int, salt: str | None = None) -> list[bytes]:
    out, parent = [], (salt or "").encode()
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + repr(ids[start:start + block_size]).encode()).digest()
        out.append(parent)
    return out


def stored(ids: list[int], block_size: int, first: int, last: int, *, salt: str | None = None,
           lora: str | None = None) -> dict:
    """BlockStored for blocks [first, last) of the sequence `ids` (as vLLM caches a request's new
    full blocks: the parent is the block before `first`)."""
    hashes = block_hashes(ids, block_size, salt)
    event = {"type": "BlockStored", "block_hashes": hashes[first:last],
             "parent_block_hash": hashes[first - 1] if first else None,
             "token_ids": ids[first * block_size:last * block_size], "block_size": block_size,
             "lora_id": 1 if lora else None, "medium": "GPU", "lora_name": lora, "group_idx": 0}
    if salt is not None and first == 0:
        event["extra_keys"] = [[salt]] + [None] * (last - first - 1)
    return event


def removed(ids: list[int], block_size: int, blocks: list[int], salt: str | None = None) -> dict:
    hashes = block_hashes(ids, block_size, salt)
    return {"type": "BlockRemoved", "block_hashes": [hashes[i] for i in blocks], "medium": "GPU", "group_idx": 0}


CLEARED = {"type": "AllBlocksCleared"}


class Publisher:
    """PUB on a loopback TCP port (`endpoint`), ROUTER for replay (`replay_endpoint`) served by a
    thread, as vLLM's ZmqEventPublisher serves it; `publish(..., send=False)` numbers and keeps a
    batch without sending it (a batch the subscriber missed)."""

    def __init__(self, replay: bool = True, start_seq: int = 0):
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)  # a PUB that sees subscriptions: wait_subscribed()
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not only the first
        self.pub.bind("tcp://127.0.0.1:0")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.seq = start_seq
        self.kept: list[tuple[int, bytes]] = []
        self.replay_endpoint = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = None
        self.replay_requests = 0
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind("tcp://127.0.0.1:0")
            self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    def publish(self, events: list[dict], *, send: bool = True, ts: float | None = None) -> int:
        payload = msgspec.msgpack.encode([time.time() if ts is None else ts, events, 0])
        with self._lock:
            seq, self.seq = self.seq, self.seq + 1
            self.kept.append((seq, payload))
            if send:
                self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        return seq

    def wait_subscribed(self, timeout_s: float = 30.0) -> None:
        """Until a subscriber's subscription arrived (PUB drops what is sent before it)."""
        if not self.pub.poll(int(timeout_s * 1000)):
            raise AssertionError("no subscriber connected")
        self.pub.recv()

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            client, _, start = self.router.recv_multipart()
            self.replay_requests += 1
            first = int.from_bytes(start, "big")
            with self._lock:
                kept = list(self.kept)
            for seq, payload in kept:
                if seq >= first:
                    self.router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([client, b"", b"", END, b""])

    def forget_before(self, seq: int) -> None:
        """Keep only the batches from `seq` on (a replay buffer that rolled over)."""
        with self._lock:
            self.kept = [(s, p) for s, p in self.kept if s >= seq]

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
            self.router.close(0)
        self.pub.close(0)
        self.ctx.term()
