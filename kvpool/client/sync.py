"""`Client`: the synchronous pool SDK (satisfies `kvpool.api.PoolClient`). Thread-safe (one lock).

Round trips (loopback, embedded mode: the server is master and node at once):
- get / get_into / get_batch / get_batch_into: 0 on the same host when the node's shm index
  has the key (copy from the mapping, validated after), else 1 (`NodePin` + shm copy on the
  same host, `NodeGet` from another);
- put / put_from / put_batch: 1 (`NodeWrite` with put_id 0: the server plans and publishes).
Cluster mode: a get is `Lookup` at the master (replicas + a lease; the previous leases are
released on the same message) then one read from a node; a put is `PutStart`, one `NodeWrite`
per replica node (all sent before any reply is awaited, so replica writes overlap), `PutEnd`.
Batch forms cost one master round trip for all keys plus one per node.

Data path (`data_path`, see `kvpool.client.engine_path`): "rpc" moves the bytes as above;
"engine" through a `transfer.TransferEngine` (reserve / one-sided WRITE / commit, pin /
one-sided READ); "auto" (default) uses the engine for nodes that share rdma with it, else rpc.

Misses: `get` returns None, `get_into` raises `KeyNotFound`. Errors are `kvpool.errors` types.
Master failover (address `etcd://...`): calls that fail with `Unavailable` / `NotLeader` find
the new leader in etcd and retry until `timeout`; a put restarts from `PutStart`.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any, Callable, Sequence, TypeVar

from kvpool.api import check_key
from kvpool.client.engine_path import EnginePath
from kvpool.client.nodes import TOO_SMALL, NodeConn
from kvpool.errors import (InvalidArgument, KeyNotFound, KVPoolError, NotLeader, ObjectTooLarge, Unavailable,
                           error_from_code)
from kvpool.messages import (PROTOCOL_VERSION, Admin, Err, Exists, Hello, Lookup, MatchPrefix, Placed, PutEnd,
                             PutStart, Release, Remove)
from kvpool.rpc import RpcClient
from kvpool.tiers.base import readable_view, writable_view

log = logging.getLogger(__name__)
T = TypeVar("T")


class Client:
    def __init__(self, address: str = "127.0.0.1:7600", *, timeout: float = 10.0, replicas: int | None = None,
                 use_shm: bool = True, writer_node: str = "", data_path: str = "auto", transfer_engine: Any = None,
                 transports: Sequence[str] | None = None):
        """`use_shm`: take the same-host fast paths when the server is on this machine (reads
        from the node's shm arena and index, requests over the servers' unix sockets); False:
        loopback TCP only, as a client on another host would.
        `data_path`: "auto" | "rpc" | "engine"; `transfer_engine`: a started TransferEngine to
        move bytes with (the caller keeps owning it), else one is opened when first needed, with
        `transports` (default: all the engine knows)."""
        self._path = EnginePath(data_path, transfer_engine, transports, timeout)
        self.timeout = timeout
        self.replicas = replicas
        self.use_shm = use_shm
        self.writer_node = writer_node
        self._meta = address if address.startswith(("etcd://", "http://")) else None
        self._static = None if self._meta else address
        self._etcd = None
        self._lock = threading.RLock()
        self._master: RpcClient | None = None
        self._nodes: dict[str, NodeConn] = {}
        self._release: list[int] = []
        self.embedded = False
        self.max_object_bytes = 0
        self._closed = False
        with self._lock:
            self._with_master(lambda m: None)

    # ------------------------------------------------------------------ connections

    def _resolve(self) -> str:
        if self._static:
            return self._static
        from kvpool.cluster import LEADER_KEY, EtcdClient

        if self._etcd is None:
            self._etcd = EtcdClient(self._meta)
        leader = self._etcd.get(LEADER_KEY)
        if leader is None:
            raise Unavailable("no leader master in etcd yet")
        return leader.decode()

    def _connect_master(self) -> RpcClient:
        rpc = RpcClient(self._resolve(), timeout=self.timeout)
        try:
            hello = rpc.call(Hello(PROTOCOL_VERSION, "kvpool-client"))
            if not hello.leader:
                raise NotLeader(f"{rpc.address} is a standby master")
        except BaseException:
            rpc.close()
            raise
        if self.use_shm and hello.hostname == socket.gethostname():
            rpc.use_unix(hello.unix)  # same host: the server's unix socket (falls back to TCP)
        self.embedded = "node" in hello.roles and hello.node is not None
        self.max_object_bytes = hello.max_object_bytes
        if self.embedded:
            n = hello.node
            self._drop_node(n.address)
            self._nodes[n.address] = NodeConn(n.address, rpc, use_shm=self.use_shm, shm_path=n.shm_path,
                                              hostname=n.hostname, arena_size=n.capacity.get("dram"),
                                              segment=n.transfer_segment, index_path=n.index_path)
        self._master = rpc
        return rpc

    def _with_master(self, fn: Callable[[RpcClient], T]) -> T:
        """Run `fn(master)`; on a lost or standby master, reconnect (to the new leader) and retry."""
        deadline = time.monotonic() + self.timeout
        delay = 0.05
        while True:
            try:
                master = self._master or self._connect_master()
                return fn(master)
            except (Unavailable, NotLeader) as exc:
                if self._master is not None and not self._master_alive():
                    self._master = None
                if time.monotonic() + delay > deadline:
                    raise
                log.debug("master call failed (%s); retrying", exc)
                if isinstance(exc, NotLeader) and self._master is not None:
                    self._master.close()
                    self._master = None
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _master_alive(self) -> bool:
        return self._master is not None and self._master._sock is not None

    def _node(self, address: str) -> NodeConn:
        conn = self._nodes.get(address)
        if conn is None:
            conn = self._nodes[address] = NodeConn(address, timeout=self.timeout, use_shm=self.use_shm)
        return conn

    def _drop_node(self, address: str) -> None:
        conn = self._nodes.pop(address, None)
        if conn is not None and conn.rpc is not self._master:
            conn.close()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._release and self._master is not None:
                try:
                    self._master.send_oneway(Release(self._take_release()))
                except KVPoolError:
                    pass
            for address in list(self._nodes):
                conn = self._nodes.pop(address)
                conn.close()
            if self._master is not None:
                self._master.close()
            if self._etcd is not None:
                self._etcd.close()
            self._path.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _take_release(self) -> list[int]:
        out, self._release = self._release, []
        return out

    # ------------------------------------------------------------------ reads

    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None when the key is absent (never other data)."""
        check_key(key)
        return self._get_many([key])[0]

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        """One entry per key, in order; a malformed key is a None entry, like a miss."""
        keys = list(keys)
        valid = [i for i, k in enumerate(keys) if _valid(k)]
        got = self._get_many([keys[i] for i in valid]) if valid else []
        out: list[bytes | None] = [None] * len(keys)
        for i, value in zip(valid, got):
            out[i] = value
        return out

    def get_into(self, key: str, buffer: Any) -> int:
        """Copy the object into `buffer` (writable, large enough); return its size. `KeyNotFound` on a miss."""
        check_key(key)
        n = self.get_batch_into([key], [buffer])[0]
        if n < 0:
            raise KeyNotFound(f"key {key!r} not found")
        return n

    def get_batch_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        """Copy each object into its buffer (bytearray, numpy array, CPU tensor...) with no
        intermediate `bytes`; one entry per key: the object's size, or -1 for a miss or a
        malformed key. A buffer too small for its object raises `InvalidArgument` once the
        others are filled."""
        keys = list(keys)
        if len(buffers) != len(keys):
            raise InvalidArgument(f"{len(keys)} keys but {len(buffers)} buffers")
        views = [writable_view(b, 0) for b in buffers]
        valid = [i for i, k in enumerate(keys) if _valid(k)]
        out = [-1] * len(keys)
        got = self._get_many_into([keys[i] for i in valid], [views[i] for i in valid]) if valid else []
        for i, n in zip(valid, got):
            out[i] = n
        small = [keys[i] for i, n in enumerate(out) if n == TOO_SMALL]
        if small:
            raise InvalidArgument(f"buffer too small for {small[:5]}{'...' if len(small) > 5 else ''}")
        return out

    def _get_many_into(self, keys: list[str], views: list[memoryview]) -> list[int]:
        with self._lock:
            if self.embedded:
                return self._with_master(lambda m: self._read_embedded(m, keys, views, -1))
            return self._from_replicas(keys, lambda conn, idx: conn.get_many_into([keys[i] for i in idx],
                                                                                 [views[i] for i in idx]), -1, views)

    def _read_embedded(self, master: RpcClient, keys: list[str], views: list[memoryview] | None, miss: Any) -> list:
        conn = self._nodes[master.address]
        if not self._path.uses(conn):
            return conn.get_many(keys) if views is None else conn.get_many_into(keys, views)
        out: list[Any] = [miss] * len(keys)
        retry, _ = self._path.read([(conn, list(range(len(keys))))], keys, views, out)
        if retry:
            raise Unavailable(f"reading {len(retry)} object(s) from {conn.address} through the transfer engine failed")
        return out

    def _lookup(self, keys: list[str]):
        def call(m: RpcClient):
            reply = m.call(Lookup(keys, release=self._take_release()))
            return reply.lease_id, reply.entries

        return self._with_master(call)

    def _get_many(self, keys: list[str]) -> list[bytes | None]:
        with self._lock:
            if self.embedded:
                return self._with_master(lambda m: self._read_embedded(m, keys, None, None))
            return self._from_replicas(keys, lambda conn, idx: conn.get_many([keys[i] for i in idx]), None, None)

    def _from_replicas(self, keys: list[str], read: Callable[[NodeConn, list[int]], list], miss: Any,
                       views: list[memoryview] | None) -> list:
        """Cluster read: one `Lookup` for all keys, then `read(node, indexes)` per rpc-path node and
        one engine batch for all engine-path nodes; a key whose node is gone (or whose transfer
        failed) is retried on its next replica. Lock held by the caller."""
        lease_id, entries = self._lookup(keys)
        if lease_id:
            self._release.append(lease_id)
        out: list[Any] = [miss] * len(keys)
        todo = [i for i, e in enumerate(entries) if e is not None and e.locations]
        attempt = 0
        while todo:
            by_node: dict[str, list[int]] = {}
            for i in todo:
                locs = entries[i].locations
                if attempt < len(locs):
                    by_node.setdefault(locs[attempt].address, []).append(i)
            todo = []
            engine_work = []
            for address, idx in by_node.items():
                try:
                    conn = self._node(address)
                    if self._path.uses(conn):
                        engine_work.append((conn, idx))
                        continue
                    values = read(conn, idx)
                except Unavailable:  # that replica's node is gone: try the next replica
                    self._drop_node(address)
                    todo.extend(idx)
                    continue
                for i, v in zip(idx, values):
                    out[i] = v
            if engine_work:
                retry, dead = self._path.read(engine_work, keys, views, out)
                for address in dead:
                    self._drop_node(address)
                todo.extend(retry)
            attempt += 1
        return out

    def exists(self, key: str) -> bool:
        check_key(key)
        return self.exists_batch([key])[0]

    def exists_batch(self, keys: Sequence[str]) -> list[bool]:
        keys = list(keys)
        valid = [i for i, k in enumerate(keys) if _valid(k)]
        with self._lock:
            got = self._with_master(lambda m: m.call(Exists([keys[i] for i in valid])).values) if valid else []
        out = [False] * len(keys)
        for i, v in zip(valid, got):
            out[i] = v
        return out

    def match_prefix(self, keys: Sequence[str]) -> int:
        """n such that keys[0..n) are all present; one round trip for the whole list."""
        keys = list(keys)
        for k in keys:
            check_key(k)
        with self._lock:
            return self._with_master(lambda m: m.call(MatchPrefix(keys)).n)

    # ------------------------------------------------------------------ writes

    def put(self, key: str, value: Any, *, replicas: int | None = None) -> None:
        """Store `value` under `key`; a key that is already complete is left as it is."""
        check_key(key)
        err = self._put_many([key], [readable_view(value)], replicas)[0]
        if err is not None:
            raise err

    def put_from(self, key: str, buffer: Any, *, replicas: int | None = None) -> None:
        """`put` from a buffer or CPU tensor without copying it first."""
        self.put(key, buffer, replicas=replicas)

    def put_batch(self, items: Sequence[tuple[str, Any]], *, replicas: int | None = None) -> list[Exception | None]:
        """One entry per item: None on success, else the typed error for that item alone."""
        out: list[Exception | None] = [None] * len(items)
        idx, keys, views = [], [], []
        for i, (key, value) in enumerate(items):
            try:
                check_key(key)
                views.append(readable_view(value))
                keys.append(key)
                idx.append(i)
            except KVPoolError as exc:
                out[i] = exc
        if keys:
            for i, err in zip(idx, self._put_many(keys, views, replicas)):
                out[i] = err
        return out

    def _put_many(self, keys: list[str], views: list[memoryview], replicas: int | None) -> list[Exception | None]:
        want = replicas or self.replicas or 0
        out: list[Exception | None] = [None] * len(keys)
        ok = []
        for i, v in enumerate(views):
            # Embedded puts carry their bytes in the first message: refuse a hopeless one before
            # sending it. (In cluster mode PutStart refuses it before any byte moves.)
            if self.embedded and self.max_object_bytes and v.nbytes > self.max_object_bytes:
                out[i] = ObjectTooLarge(f"value of {v.nbytes} bytes is larger than the pool's largest object "
                                        f"({self.max_object_bytes} bytes)")
            else:
                ok.append(i)
        if not ok:
            return out
        with self._lock:
            if self.embedded:
                sub = [keys[i] for i in ok]
                sizes = [views[i].nbytes for i in ok]

                def call(m: RpcClient):
                    conn = self._nodes[m.address]
                    if not self._path.uses(conn):
                        return conn.write(sub, sizes, [0] * len(sub), [views[i] for i in ok], want)
                    got = self._path.write([(conn, list(range(len(sub))))], sub, [0] * len(sub),
                                           [views[i] for i in ok], want)
                    return [got[(conn.address, j)] for j in range(len(sub))]

                for i, res in zip(ok, self._with_master(call)):
                    out[i] = (error_from_code(res.code, res.message) if isinstance(res, Err)
                              else res if isinstance(res, Exception) else None)
                return out
            results = self._with_master(lambda m: self._put_cluster([keys[i] for i in ok], [views[i] for i in ok],
                                                                     want, m))
            for i, err in zip(ok, results):
                out[i] = err
            return out

    def _put_cluster(self, keys: list[str], views: list[memoryview], want: int,
                     master: RpcClient) -> list[Exception | None]:
        plans = master.call(PutStart(keys, [v.nbytes for v in views], want, self.writer_node)).plans
        out: list[Exception | None] = [None] * len(keys)
        written: list[list[Placed]] = [[] for _ in keys]
        by_node: dict[str, list[int]] = {}
        for i, plan in enumerate(plans):
            if isinstance(plan, Err):
                out[i] = error_from_code(plan.code, plan.message)
            elif not plan.exists:
                for t in plan.targets:
                    by_node.setdefault(t.address, []).append(i)
        sent: list[tuple[str, list[int]]] = []
        engine_work = []
        for address, idx in by_node.items():  # send to every node first: replica writes overlap
            try:
                conn = self._node(address)
                if self._path.uses(conn):
                    engine_work.append((conn, idx))
                    continue
                conn.start_write([keys[i] for i in idx], [views[i].nbytes for i in idx],
                                 [plans[i].put_id for i in idx], [views[i] for i in idx])
                sent.append((address, idx))
            except Unavailable as exc:  # that node died mid-put: the other replicas may still land
                self._write_failed(address, idx, exc, out)
        if engine_work:
            put_ids = [0 if isinstance(p, Err) else p.put_id for p in plans]
            for (address, i), res in self._path.write(engine_work, keys, put_ids, views).items():
                if isinstance(res, Placed):
                    written[i].append(res)
                elif isinstance(res, Unavailable):
                    self._write_failed(address, [i], res, out)
                elif isinstance(res, Exception) and out[i] is None:
                    out[i] = res
        for address, idx in sent:
            try:
                results = self._nodes[address].finish_write()
            except Unavailable as exc:
                self._write_failed(address, idx, exc, out)
                continue
            for i, res in zip(idx, results):
                if isinstance(res, Placed):
                    written[i].append(res)
                elif out[i] is None:
                    out[i] = error_from_code(res.code, res.message)
        pending = [i for i, p in enumerate(plans) if not isinstance(p, Err) and not p.exists]
        if pending:
            end = master.call(PutEnd([keys[i] for i in pending], [plans[i].put_id for i in pending],
                                     [written[i] for i in pending]))
            for i, err in zip(pending, end.errors):
                if err is not None:
                    out[i] = error_from_code(err.code, err.message)
                elif written[i]:
                    out[i] = None  # published: a failed extra replica does not fail the put
        return out

    def _write_failed(self, address: str, idx: list[int], exc: Exception, out: list[Exception | None]) -> None:
        log.info("write to node %s failed: %s", address, exc)
        self._drop_node(address)
        for i in idx:
            out[i] = out[i] or exc

    def remove(self, key: str) -> bool:
        check_key(key)
        return self.remove_batch([key])[0]

    def remove_batch(self, keys: Sequence[str]) -> list[bool]:
        keys = list(keys)
        valid = [i for i, k in enumerate(keys) if _valid(k)]
        with self._lock:
            if valid:
                self._release_pins()
            got = self._with_master(lambda m: m.call(Remove([keys[i] for i in valid])).values) if valid else []
        out = [False] * len(keys)
        for i, v in zip(valid, got):
            out[i] = v
        return out

    def data_paths(self) -> dict[str, str]:
        """How bytes move to each node this client is connected to: "engine" or "rpc"."""
        with self._lock:
            return {address: "engine" if self._path.uses(conn) else "rpc" for address, conn in self._nodes.items()}

    def _release_pins(self) -> None:
        """Let go of what we read before removing: our own pin or lease would otherwise keep the
        old object alive, and a put of the same key right after the remove would be refused."""
        for address, conn in list(self._nodes.items()):
            try:
                conn.release_pins()
            except KVPoolError:
                self._drop_node(address)
        if self._release and self._master is not None:
            try:  # one-way, ahead of the Remove on the same connection: the master sees it first
                self._master.send_oneway(Release(self._take_release()))
            except KVPoolError:
                pass

    # ------------------------------------------------------------------ admin over RPC

    def admin(self, method: str, **args: Any) -> Any:
        """Call a `MasterService` admin method by name (nodes, node, stats, key_info, evict, ...)."""
        with self._lock:
            return self._with_master(lambda m: m.call(Admin(method, args)).doc["result"])

    def flush(self) -> None:
        """Send pending unpins and lease releases now (they normally ride on later requests)."""
        with self._lock:
            for conn in self._nodes.values():
                conn.flush()
            if self._release and self._master is not None:
                self._master.send_oneway(Release(self._take_release()))


def _valid(key: Any) -> bool:
    try:
        check_key(key)
        return True
    except InvalidArgument:
        return False
