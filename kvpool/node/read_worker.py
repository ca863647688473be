"""A node's read worker: a process of its own that serves `NodeGet` for DRAM-resident objects on
the node's read port (`kvpool.node.readers` starts it: `python -m kvpool.node.read_worker`).

Why a process: the node is one Python process, one GIL, one serve loop; over TCP it can never
use more than one core, however many clients ask (issue 29). A worker maps the node's arena
and its shm DRAM index read-only, exactly as a same-host client does (`ShmPath`), and answers
gets from them with no lock and no word with the node.

What it answers: each key's bytes, copied out of the arena and then validated by the index's
seqlock (`ShmIndexReader.read`). What the index cannot serve (absent, on SSD, just written or
changed, changed during the copy) it asks of the node, the authority, over the node's unix socket
(one request for all such keys of a get, on the connection's own thread: the loop answers a get
only when every key is in the index, so a slow SSD read holds up no other connection), and
answers the node's bytes or `ABSENT`: a client pays one network round trip either way. Only if
the node cannot be asked does it answer -1, "not here", which a client takes to the node's RPC
itself.

Copy then validate, not send then validate with a trailer: the reply's header names every size
before the bytes, so a value found torn after its bytes left could only be disowned by a trailer
every client must check, and the copy of a 64 KiB value costs a few microseconds against the tens
a request costs here; a value that leaves this process has been proved the key's own. The index
is keyed by the stored key, so a tenant's keys are scoped (`kvpool.security.authz`) before the
lookup, exactly as at the node.

Who may ask: its `RpcServer` is the node's kind, with the node's keyring (handed over on
stdin, never in argv), handshake, authorization, tenant scoping and connection caps; it
serves `NodeGet` (a request that also names pins to release is refused: pins live at the node)
and `NodeStats` (who answers on this port), nothing else.

What it owes the node: the keys it served from the index, as `NodeUnpin.touched` (one-way, as
the node's principal, every `TOUCH_S`), so hit counts and eviction recency stay right, as a
same-host reader's do (what it asked the node for, the node counted itself).

Lifetime: the node holds the write end of this process's stdin; when the node ends, however it
ends (SIGKILL too), the kernel closes it and this process exits at the end of file, at once. The
node's `stop` closes it too (and kills a worker that does not go). Standard output carries one
line, "ready", once the port is served.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from typing import Any

from kvpool.config import Settings, use_settings
from kvpool.errors import InvalidArgument, KVPoolError
from kvpool.messages import ABSENT, Info, NodeData, NodeGet, NodeStats, NodeUnpin
from kvpool.rpc import Payload, RpcClient, RpcServer, ServerConn
from kvpool.security.keyring import Keyring
from kvpool.shm.arena import map_read_only, populate
from kvpool.shm.index import ShmIndexReader

log = logging.getLogger("kvpool.node.reader")

TOUCH_S = 0.5  # how often the keys served are reported to the node
TOUCH_BATCH = 1024  # keys per report


class ReadWorker:
    """One worker, from the node's `spec` (`kvpool.node.readers.ReadWorkers.spec`)."""

    def __init__(self, spec: dict[str, Any]):
        settings = Settings(**spec["settings"])
        use_settings(settings)  # the node's tree: what the keyring and the limits are read from
        keyring = None
        if spec["keyring"] is not None:
            import tomllib

            keyring = Keyring.from_dict(tomllib.loads(spec["keyring"]), spec["keyring_source"])
            keyring.local = spec["keyring_local"]
        self.node_id = spec["node_id"]
        self._mmap = map_read_only(spec["arena"], spec["arena_size"])
        if self._mmap is None:
            raise InvalidArgument(f"cannot map the node's arena {spec['arena']} read-only")
        self.arena = memoryview(self._mmap)
        populate(self._mmap, spec["arena_size"], write=False)
        self.index = ShmIndexReader(spec["index"])
        self.touched: list[str] = []
        self._node_lock = threading.Lock()  # one request at a time on `self.node` (gets and touch reports)
        credential = keyring.node_credential() if keyring is not None else None
        self.node = RpcClient(spec["node"], settings=settings, credential=credential)
        self.node.use_unix(spec["node_unix"])
        self.rpc = RpcServer({NodeGet: self._on_get, NodeStats: self._on_stats}, spec["host"], spec["port"],
                             name=f"node-reader-{os.getpid()}", unix=False, settings=settings,
                             keyring=keyring, inline={NodeGet: self._here, NodeStats: None}, reuse_port=True)
        self._touch_thread = threading.Thread(target=self._report_touches, name="reader-touch", daemon=True)

    def start(self) -> "ReadWorker":
        self.rpc.start()
        self._touch_thread.start()
        log.debug("read worker %d of node %s serving at %s", os.getpid(), self.node_id, self.rpc.address)
        return self

    def _here(self, msg: NodeGet, scope: str) -> bool:
        """Whether the loop may answer `msg` itself: every key is in the index (else a connection
        thread does, so that asking the node holds up no other connection)."""
        find = self.index.find
        return all(find(scope + key if scope else key) is not None for key in msg.keys)

    def _on_get(self, msg: NodeGet, payload: Payload, conn: ServerConn) -> tuple:
        if msg.unpin:
            raise InvalidArgument("a read port holds no pins: release them at the node")
        read, arena, keys = self.index.read, self.arena, msg.keys
        values = [read(key, arena) for key in keys]
        sizes = [-1 if value is None else len(value) for value in values]
        missing = [j for j, n in enumerate(sizes) if n < 0]
        if not missing:  # the loop's case: every key was in the index
            self.touched.extend(keys)  # not a local: `_report_touches` swaps the list
            return NodeData(sizes), values
        served = [keys[j] for j, n in enumerate(sizes) if n >= 0]  # before the node's answers join them
        ssd = self._ask_node(keys, missing, values, sizes)  # the node counts what it serves itself
        self.touched.extend(served)
        return NodeData(sizes, ssd), [value for value in values if value is not None]

    def _ask_node(self, keys: list[str], missing: list[int], values: list, sizes: list[int]) -> list[int]:
        """The keys at `missing` (absent from the index, on SSD, being changed) from the node over
        its unix socket, in place: their bytes, or `ABSENT` as the node says; the positions it read
        from SSD. On a failure they stay -1, and the client asks the node itself."""
        try:
            with self._node_lock:
                data = self.node.call(NodeGet([keys[j] for j in missing]))
                got = [self.node.read_payload(n) if n >= 0 else None for n in data.sizes]
        except KVPoolError as exc:
            log.info("read worker %d: asking the node failed (%s); the client will", os.getpid(), exc)
            return []
        for j, value in zip(missing, got):
            values[j] = value
            sizes[j] = ABSENT if value is None else len(value)
        return sorted(missing[p] for p in data.ssd)

    def _on_stats(self, msg: NodeStats, payload: Payload, conn: ServerConn) -> Info:
        return Info({"node_id": self.node_id, "read_worker": os.getpid()})

    def _report_touches(self) -> None:
        while True:  # until the process ends (`main`)
            time.sleep(TOUCH_S)
            self.touched, served = [], self.touched  # swapped under the GIL: the loop appends to the new list
            for i in range(0, len(served), TOUCH_BATCH):
                try:
                    with self._node_lock:
                        self.node.send_oneway(NodeUnpin([], served[i:i + TOUCH_BATCH]))
                except KVPoolError as exc:  # the node is gone or restarting: only recency is lost
                    log.debug("read worker %d: reporting reads to the node failed: %s", os.getpid(), exc)
                    break


def main() -> None:
    spec = json.loads(sys.stdin.buffer.readline() or b"null")
    if spec is None:
        return  # the node went away before it told us anything
    logging.basicConfig(level=spec["settings"].get("log_level", "INFO"), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s[reader {os.getpid()}]: %(message)s")
    try:
        worker = ReadWorker(spec).start()
    except (KVPoolError, OSError) as exc:
        if not _node_gone():  # else it stopped while we started: nothing to say
            log.error("read worker of node %s could not start: %s", spec.get("node_id"), exc)
        os._exit(1)
    try:
        print("ready", flush=True)
        while sys.stdin.buffer.read(4096):  # the node writes nothing more; end of file: it is gone
            pass
    except (OSError, KeyboardInterrupt):  # BrokenPipeError: the node stopped as we started
        pass
    # The node is stopping or gone: its clients' connections end with this process, and reads
    # served since the last report only lose their recency.
    os._exit(0)


def _node_gone() -> bool:
    """Whether the node closed our stdin (it stopped, or died)."""
    import select

    try:
        return bool(select.select([sys.stdin], [], [], 0)[0]) and not sys.stdin.buffer.read(1)
    except OSError:
        return True


if __name__ == "__main__":
    main()
