"""What each vLLM instance holds in its own prefix cache, from the KV events it publishes.

vLLM (`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`) publishes,
after every engine step that changed its prefix cache, one batch on a ZMQ PUB socket:

    frames   [topic, seq (8 bytes, big-endian, from 0), payload]
    payload  msgpack array [ts, events, data_parallel_rank?]
    events   maps tagged by "type": BlockStored {block_hashes, parent_block_hash, token_ids,
             block_size, lora_id, medium, lora_name, extra_keys?, group_idx?, ...},
             BlockRemoved {block_hashes, medium, group_idx?}, AllBlocksCleared {}

and keeps its last batches for replay on a ROUTER socket (`replay_endpoint`): a request
`[b"", start seq (8 bytes)]` is answered with every kept batch from `start` on, each as
`[b"", topic, seq, payload]`, then `[b"", b"", -1 (8 bytes, signed), b""]`.

vLLM's block hashes are its own (sha256 over its own chaining), so `BlockIndex` keys what it
learns by token ids: each block's tokens and parent place it in its sequence, and a block that
ends at a multiple of `chunk_tokens` completes a kvpool chunk whose key is the router's own
(`kvpool.keys`: `key[i] = xxh3_128(key[i-1] || tokens of chunk i)`, from the namespace the
instance's connector uses, salted by the request's `cache_salt` as the connector salts it). An
instance holds a chunk while it holds every block of it. The held keys land in the worker's
`local_keys` (workers.py), where the reference workers' own local-cache events land: the policy
reads both the same way (`WorkerView.local_prefix_chunks`).

Invariants of `BlockIndex`:
- a key is in `held` only if the instance stored every block of that chunk and has removed
  none of them since (a block stored N times is held until removed N times); when in doubt it is
  left out: a miss costs a pool fetch, a wrong guess a recomputation;
- a block whose place is unknown (its parent was never seen or is gone), a LoRA block, a block of
  another medium (an offloading tier) or KV-cache group, and one whose hash has extra inputs the
  router cannot key (multimodal, prompt embeddings) are not indexed, nor are their descendants;
- a chunk key is completed by exactly one block record (same key: same tokens and salt, so the
  same vLLM block hash), so a removed member drops its chunks without counting;
- a member block stored again after its removal does not bring its chunk back until the chunk's
  last block is stored again (rare: vLLM evicts a sequence's tail first).

Invariants of `KVEventSubscriber`: batches are applied once each, in sequence order; a gap is
filled from the replay endpoint, and where it cannot be (no replay endpoint, the batches are no
longer kept, no answer in time) the index is cleared, since removals may have been lost; a seq
that goes back with a later timestamp is a new publisher (the instance restarted): cleared too.
Everything runs on the router's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
import xxhash

from kvpool.errors import InvalidArgument, Unavailable
from kvpool.keys import parse_namespace_hex
from kvpool.router.tenants import cache_salted_namespace
from kvpool.router.tokenizer import u32_bytes

log = logging.getLogger(__name__)

BlockHash = bytes | int  # vLLM's ExternalBlockHash (int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
END_SEQ = -1  # the replay answer's last message
PRIMARY_MEDIA = (None, "GPU")  # vLLM's own paged KV cache ("GPU" on every device, CPU included)


# -- vLLM's wire format (vllm/distributed/kv_events.py, 0.32), as far as the router reads it ------


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


_batch = msgspec.msgpack.Decoder(EventBatch)
_event = msgspec.msgpack.Decoder(BlockStored | BlockRemoved | AllBlocksCleared)


@dataclass(frozen=True)
class KVEventsSource:
    """Where one instance publishes: its PUB endpoint and, optionally, its replay endpoint."""

    endpoint: str
    replay_endpoint: str | None = None

    @classmethod
    def parse(cls, text: str) -> "KVEventsSource":
        """`ENDPOINT[,REPLAY_ENDPOINT]`, each a ZMQ address (tcp://HOST:PORT, ipc://PATH)."""
        endpoint, _, replay = (part.strip() for part in text.partition(","))
        for addr in (endpoint, replay):
            if addr and not addr.startswith(("tcp://", "ipc://")):
                raise InvalidArgument(f"a KV events endpoint is tcp://HOST:PORT or ipc://PATH, got {addr!r}")
        if not endpoint or "*" in endpoint:
            raise InvalidArgument(f"KV events: give the address to connect to (not a wildcard), got {text!r}")
        return cls(endpoint, replay or None)


def parse_kv_events(specs: list[str]) -> dict[str, KVEventsSource]:
    """`--kv-events URL=ENDPOINT[,REPLAY]` entries, by worker URL (normalized as workers.py does)."""
    out = {}
    for spec in specs:
        url, sep, rest = spec.partition("=")
        if not sep or not url.startswith(("http://", "https://")):
            raise InvalidArgument(f"--kv-events takes WORKER_URL=ENDPOINT[,REPLAY_ENDPOINT], got {spec!r}")
        out[url.strip().rstrip("/")] = KVEventsSource.parse(rest)
    return out


# -- the index ------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Block:
    parent: BlockHash | None
    end: int  # tokens from the sequence's start to this block's end
    prev: bytes  # the chain key before this block's chunk (the namespace for chunk 0)
    tokens: bytes  # this block's token ids, little-endian u32
    key: bytes | None = None  # the chunk key this block completes (end % chunk_tokens == 0)
    count: int = 1  # stores minus removals (vLLM may hold one content in several blocks)
    covers: set[str] = field(default_factory=set)  # held chunk keys this block is a member of


class BlockIndex:
    """One instance's prefix cache as chunk keys (hex), in `held`."""

    def __init__(self, chunk_tokens: int, namespace_of: Callable[[str | None], bytes | None],
                 held: set[str] | None = None):
        if chunk_tokens <= 0:
            raise InvalidArgument(f"chunk_tokens must be positive, got {chunk_tokens}")
        self.chunk_tokens = chunk_tokens
        self.namespace_of = namespace_of  # a request's cache_salt (None: none) -> its chain's namespace
        self.held = held if held is not None else set()
        self.blocks: dict[BlockHash, _Block] = {}
        self.skipped = 0  # blocks not indexed (see the invariants)

    def apply(self, event: Any) -> None:
        if isinstance(event, BlockStored):
            self.stored(event)
        elif isinstance(event, BlockRemoved):
            self.removed(event)
        elif isinstance(event, AllBlocksCleared):
            self.clear()

    def clear(self) -> None:
        self.blocks.clear()
        self.held.clear()

    def stored(self, ev: BlockStored) -> None:
        bs, n = ev.block_size, len(ev.block_hashes)
        if (ev.lora_name is not None or ev.lora_id is not None or ev.medium not in PRIMARY_MEDIA
                or ev.group_idx not in (None, 0) or bs <= 0 or self.chunk_tokens % bs
                or len(ev.token_ids) != bs * n or (ev.extra_keys is not None and len(ev.extra_keys) != n)):
            self.skipped += n
            return
        parent = None
        if ev.parent_block_hash is not None:
            parent = self.blocks.get(ev.parent_block_hash)
            if parent is None:  # placed after a block we do not know: nowhere
                self.skipped += n
                return
        parent_hash = ev.parent_block_hash
        for i, block_hash in enumerate(ev.block_hashes):
            known = self.blocks.get(block_hash)
            if known is not None:  # the same content again, in another block
                known.count += 1
                parent, parent_hash = known, block_hash
                continue
            extra = ev.extra_keys[i] if ev.extra_keys is not None else None
            if parent is None:
                prev = self._root(extra)
                end = 0
            else:
                prev = None if extra else (parent.key if parent.end % self.chunk_tokens == 0 else parent.prev)
                end = parent.end
            if prev is None:
                self.skipped += n - i
                return
            try:
                toks = u32_bytes(ev.token_ids[i * bs:(i + 1) * bs])
            except (OverflowError, TypeError):  # not token ids
                self.skipped += n - i
                return
            block = _Block(parent_hash, end + bs, prev, toks)
            self.blocks[block_hash] = block
            if block.end % self.chunk_tokens == 0:
                self._complete(block)
            parent, parent_hash = block, block_hash

    def removed(self, ev: BlockRemoved) -> None:
        if ev.medium not in PRIMARY_MEDIA or ev.group_idx not in (None, 0):
            return
        for block_hash in ev.block_hashes:
            block = self.blocks.get(block_hash)
            if block is None:
                continue
            block.count -= 1
            if block.count <= 0:
                del self.blocks[block_hash]
                self.held.difference_update(block.covers)

    def _root(self, extra: list[Any] | None) -> bytes | None:
        """The namespace of a sequence's first block: its only extra key may be the request's
        cache_salt (a string; a LoRA name too, but LoRA blocks were skipped already)."""
        if not extra:
            return self.namespace_of(None)
        if len(extra) == 1 and isinstance(extra[0], str):
            return self.namespace_of(extra[0])
        return None

    def _complete(self, last: _Block) -> None:
        """`last` ends a chunk: key it from its chunk's blocks, held if all are still here."""
        start = last.end - self.chunk_tokens
        members, block = [last], last
        while block.end - len(block.tokens) // 4 > start:
            block = self.blocks.get(block.parent) if block.parent is not None else None
            if block is None:
                return
            members.append(block)
        if block.end - len(block.tokens) // 4 != start:  # blocks of mixed sizes straddle the chunk's start
            return
        tokens = b"".join(b.tokens for b in reversed(members))
        last.key = xxhash.xxh3_128_digest(last.prev + tokens)
        key = last.key.hex()
        for member in members:
            member.covers.add(key)
        self.held.add(key)


def namespace_resolver(namespace_hex: str, namespace_doc: str) -> Callable[[str | None], bytes | None]:
    """The chain root of a request with `cache_salt` (None: none) on servers of this namespace:
    the connector's namespace salted with `request_salt(configured salt, cache_salt)`, as the
    router keys a tenant's prompts (tenants.py). Unknown (None) without the namespace's document."""
    base = parse_namespace_hex(namespace_hex)
    doc = json.loads(namespace_doc) if namespace_doc else None

    @functools.cache
    def of(cache_salt: str | None) -> bytes | None:
        if cache_salt is None:
            return base
        return None if doc is None else cache_salted_namespace(doc, cache_salt)

    return of


# -- the subscriber -------------------------------------------------------------------------------


class KVEventSubscriber:
    """Follows one instance's event stream into its `BlockIndex` (asyncio, pyzmq)."""

    def __init__(self, name: str, source: KVEventsSource, index: BlockIndex, *, replay_timeout_s: float = 2.0):
        self.name = name
        self.source = source
        self.index = index
        self.replay_timeout_s = replay_timeout_s
        self.last_seq = -1  # the last batch applied
        self.last_ts = -math.inf
        self.batches = 0
        self.replays = 0
        self.resets = 0  # the index was cleared: events lost, or a new publisher
        self.undecodable = 0
        self._task: asyncio.Task | None = None
        self._ctx: Any = None

    def summary(self) -> dict[str, Any]:
        return {"endpoint": self.source.endpoint, "replay_endpoint": self.source.replay_endpoint,
                "last_seq": self.last_seq, "batches": self.batches, "blocks": len(self.index.blocks),
                "replays": self.replays, "resets": self.resets, "undecodable": self.undecodable,
                "skipped_blocks": self.index.skipped}

    def start(self) -> "KVEventSubscriber":
        try:
            import zmq.asyncio
        except ImportError:
            raise Unavailable("KV events need pyzmq (`pip install pyzmq`)") from None
        self._ctx = zmq.asyncio.Context.instance()
        self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.name}")
        return self

    def close(self) -> None:
        """Stop following (the socket closes as the task ends, on the event loop)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    def reset(self, why: str) -> None:
        """Forget everything: what the instance holds is unknown (a miss, not a wrong guess)."""
        if self.index.blocks or self.index.held:
            log.warning("KV events of %s: %s; forgetting its %d cached chunks", self.name, why, len(self.index.held))
        self.index.clear()
        self.resets += 1

    async def _run(self) -> None:
        import zmq

        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.source.endpoint)
        log.info("following the KV events of %s at %s", self.name, self.source.endpoint)
        try:
            if self.source.replay_endpoint:  # what it published before we connected (a router restart)
                await self._catch_up()
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    self.undecodable += 1
                    continue
                await self._receive(int.from_bytes(frames[1], "big", signed=True), frames[2])
        except asyncio.CancelledError:
            raise
        except Exception:  # the index must not outlive its stream silently
            log.exception("KV events of %s stopped", self.name)
            self.reset("the event stream failed")
        finally:
            sub.close(0)

    async def _receive(self, seq: int, payload: bytes) -> None:
        batch = self._decode(payload)
        if batch is None:
            self.reset(f"batch {seq} could not be decoded")
            self.last_seq = max(self.last_seq, seq)
            return
        if seq <= self.last_seq:
            if batch.ts <= self.last_ts:
                return  # a batch the replay already gave
            self.reset(f"sequence went back from {self.last_seq} to {seq} (the instance restarted)")
            self.last_seq, self.last_ts = -1, -math.inf
        if seq > self.last_seq + 1:
            await self._catch_up()
        if seq > self.last_seq:
            if seq > self.last_seq + 1 and self.last_seq >= 0:  # not filled: removals may be lost
                self.reset(f"batches {self.last_seq + 1}..{seq - 1} were lost")
            self._apply(seq, batch)

    def _decode(self, payload: bytes) -> EventBatch | None:
        try:
            return _batch.decode(payload)
        except msgspec.DecodeError as exc:
            self.undecodable += 1
            log.warning("KV events of %s: undecodable batch (%s)", self.name, exc)
            return None

    def _apply(self, seq: int, batch: EventBatch) -> None:
        for raw in batch.events:
            try:
                event = _event.decode(raw)
            except msgspec.DecodeError as exc:  # an event kind this router does not know
                self.undecodable += 1
                log.warning("KV events of %s: unknown event skipped (%s)", self.name, exc)
                continue
            self.index.apply(event)
        self.last_seq, self.last_ts = seq, batch.ts
        self.batches += 1

    async def _catch_up(self) -> None:
        """Ask the replay endpoint for the batches after `last_seq` (it sends every one it kept
        from there on) and apply them in order."""
        if not self.source.replay_endpoint:
            return
        import zmq

        self.replays += 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.source.replay_endpoint)
        start = self.last_seq + 1
        deadline = time.monotonic() + self.replay_timeout_s
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise asyncio.TimeoutError
                frames = await asyncio.wait_for(dealer.recv_multipart(), left)
                if len(frames) != 4:
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    return
                if seq <= self.last_seq:
                    continue
                batch = self._decode(frames[3])
                if batch is None:
                    continue
                if seq > self.last_seq + 1 and self.last_seq >= 0:
                    self.reset(f"batches {self.last_seq + 1}..{seq - 1} are no longer kept by the instance")
                self._apply(seq, batch)
        except asyncio.TimeoutError:
            log.warning("KV events of %s: no replay from %s within %.1f s", self.name,
                        self.source.replay_endpoint, self.replay_timeout_s)
        finally:
            dealer.close(0)


__all__ = ["BlockIndex", "KVEventSubscriber", "KVEventsSource", "parse_kv_events", "namespace_resolver",
           "EventBatch", "BlockStored", "BlockRemoved", "AllBlocksCleared"]
