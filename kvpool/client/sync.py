"""`Client`: the synchronous pool SDK (satisfies `kvpool.contract.PoolClient`). Thread-safe (one lock).

Every read and write goes the same way: ask *where* (`kvpool.client.where`: the master, or for
an embedded pool a local answer), group the keys by node, and hand each node's share to that
node's data path (`kvpool.client.datapath`: shm copy, node RPC, or the transfer engine).

Round trips, embedded pool: a get 0 on the same host when the node's shm index has the key, else
1 (`NodePin` + copy, or `NodeGet` from another host); a put 1 (`Put`: the cluster's `PutStart`,
write and `PutEnd` in one frame, answered in the pool's process); on the engine path a put is
the cluster's, message by message. Cluster mode: a get is `Lookup` at the master (replicas + a
lease; the previous leases are released on the same message) then one read from a node (the next
replica if that node is gone); a put is `PutStart`, one write per replica node (all sent before
any reply is awaited), `PutEnd`. Batch forms cost one master round trip for all keys plus one
per node.

Misses: `get` returns None, `get_into` raises `KeyNotFound`. Errors are `kvpool.errors` types.
Master failover (address `etcd://...`): calls that fail with `Unavailable` / `NotLeader` find
the new leader in etcd and retry until `timeout`; a put restarts from `PutStart`, under the same
put token, so the master replaces the put's own unfinished first attempt. A node that
is the master's own server (embedded) failing counts as the master failing.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any, Callable, Sequence, TypeVar

from kvpool.client.datapath import DataPaths
from kvpool.client.nodes import EXISTS, TOO_SMALL, NodeConn
from kvpool.client.where import EmbeddedWhere, MasterWhere
from kvpool.security.keyring import Credential
from kvpool.config import current_settings
from kvpool.contract import check_key
from kvpool.errors import InvalidArgument, KeyNotFound, KVPoolError, NotLeader, Unavailable
from kvpool.messages import PROTOCOL_VERSION, Admin, Exists, Hello, MatchPrefix, Placed, Release, Remove
from kvpool.rpc import RpcClient
from kvpool.rpc.client import credential_from
from kvpool.shm.views import readable_view, writable_view
from transfer.route import same_host

log = logging.getLogger(__name__)
T = TypeVar("T")
_MISS = object()  # `_direct_get`: the key is absent


class Client:
    def __init__(self, address: str | None = None, *, timeout: float = 10.0, replicas: int | None = None,
                 use_shm: bool = True, writer_node: str = "", data_path: str = "auto", transfer_engine: Any = None,
                 transports: Sequence[str] | None = None, credential: Credential | None = None):
        """`use_shm`: take the same-host fast paths when the server is on this machine (reads
        from the node's shm arena and index, requests over the servers' unix sockets); False:
        loopback TCP only, as a client on another host would.
        `data_path`: "auto" | "rpc" | "engine" (`kvpool.client.datapath`); `transfer_engine`: a
        started TransferEngine to move bytes with (the caller keeps owning it), else one is
        opened when first needed, with `transports` (default: all the engine knows).
        `credential`: who to be on every connection (default: the principal `KVPOOL_PRINCIPAL`
        names in the keyring file `KVPOOL_AUTH_FILE`; neither set: no authentication)."""
        self._paths = DataPaths(data_path, transfer_engine, transports, timeout)
        self.timeout = timeout
        self.replicas = replicas
        self.use_shm = use_shm
        self._rpc_settings = current_settings()
        address = address or self._rpc_settings.pool.master  # KVPOOL_MASTER, else 127.0.0.1:7600
        self.credential = credential if credential is not None else credential_from(self._rpc_settings)
        self.scope = ""  # how the pool stores our keys (a tenant's: "<tenant>\x00" + key), from its hello
        self._meta = address if address.startswith(("etcd://", "http://", "etcds://", "https://")) else None
        self._static = None if self._meta else address
        self._etcd = None
        self._lock = threading.RLock()
        self._master: RpcClient | None = None
        self._nodes: dict[str, NodeConn] = {}
        self._leases: list[int] = []  # to release with the next lookup, or before a remove
        self._cluster = MasterWhere(self._leases, writer_node)
        self._where: EmbeddedWhere | MasterWhere = self._cluster
        self.embedded = False
        self.max_object_bytes = 0
        self._closed = False
        with self._lock:
            self._with_master(lambda m: None)

    # ------------------------------------------------------------------ connections

    def _resolve(self) -> str:
        if self._static:
            return self._static
        from kvpool.cluster import EtcdClient
        from kvpool.cluster.membership import leader_address

        if self._etcd is None:
            self._etcd = EtcdClient(self._meta)
        return leader_address(self._etcd)

    def _connect_master(self) -> RpcClient:
        rpc = RpcClient(self._resolve(), timeout=self.timeout, settings=self._rpc_settings,
                        credential=self.credential)
        try:
            hello = rpc.call(Hello(PROTOCOL_VERSION, "kvpool-client"))
            if not hello.leader:
                raise NotLeader(f"{rpc.address} is a standby master")
        except BaseException:
            rpc.close()
            raise
        if self.use_shm and same_host(hello.host_id):
            rpc.use_unix(hello.unix)  # the server's unix socket (falls back to TCP)
        self.embedded = "node" in hello.roles and hello.node is not None
        self.max_object_bytes = hello.max_object_bytes
        self.scope = hello.scope
        self._where = self._cluster
        if self.embedded:  # the master's own server is the node: share the connection
            n = hello.node
            self._drop_node(n.address)
            self._nodes[n.address] = NodeConn(n.address, rpc, use_shm=self.use_shm, shm_path=n.shm_path,
                                              host_id=n.host_id, arena_size=n.capacity.get("dram"),
                                              segment=n.transfer_segment, index_path=n.index_path,
                                              scope=self.scope, read_address=n.read_address)
            self._where = EmbeddedWhere(n.address, hello.max_object_bytes)
        self._master = rpc
        return rpc

    def _with_master(self, fn: Callable[[RpcClient], T]) -> T:
        """Run `fn(master)`; on a lost or standby master, reconnect (to the new leader) and retry."""
        deadline = 0.0  # set at the first failure: a call that succeeds reads no clock
        delay = 0.05
        while True:
            try:
                master = self._master or self._connect_master()
                return fn(master)
            except (Unavailable, NotLeader) as exc:
                if self._master is not None and not self._master.connected:
                    self._master = None
                now = time.monotonic()
                deadline = deadline or now + self.timeout
                if now + delay > deadline:
                    raise
                log.debug("master call failed (%s); retrying", exc)
                if isinstance(exc, NotLeader) and self._master is not None:
                    self._master.close()
                    self._master = None
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _node(self, address: str) -> NodeConn:
        conn = self._nodes.get(address)
        if conn is None:
            conn = self._nodes[address] = NodeConn(address, timeout=self.timeout, use_shm=self.use_shm,
                                                   settings=self._rpc_settings, credential=self.credential,
                                                   scope=self.scope)
        return conn

    def _drop_node(self, address: str) -> None:
        conn = self._nodes.pop(address, None)
        if conn is not None and conn.rpc is not self._master:
            conn.close()

    def _node_gone(self, address: str, why: Exception) -> None:
        """A node could not be reached: forget it; if it is the master's own server, the master
        is gone too (raise, so `_with_master` reconnects)."""
        log.info("node %s failed: %s", address, why)
        if self._master is not None and address == self._master.address:
            raise why if isinstance(why, Unavailable) else Unavailable(str(why))
        self._drop_node(address)

    def _by_path(self, pairs: list[tuple[int, str]]) -> dict[Any, list]:
        """{data path: [(node, indexes)]} for (key index, node address) pairs; nodes that
        cannot be reached are under None as (address, indexes)."""
        by_node: dict[str, list[int]] = {}
        if len(pairs) == 1:  # a single get or put: nothing to group
            by_node[pairs[0][1]] = [pairs[0][0]]
        else:
            for i, address in pairs:
                idx = by_node.get(address)
                if idx is None:
                    by_node[address] = [i]
                else:
                    idx.append(i)
        groups: dict[Any, list] = {}
        for address, idx in by_node.items():
            try:
                conn = self._nodes.get(address) or self._node(address)
                path = conn.path or self._paths.choose(conn)
            except Unavailable as exc:
                self._node_gone(address, exc)
                groups.setdefault(None, []).append((address, idx))
                continue
            groups.setdefault(path, []).append((conn, idx))
        return groups

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._send_release()
            for address in list(self._nodes):
                self._nodes.pop(address).close()
            if self._master is not None:
                self._master.close()
            if self._etcd is not None:
                self._etcd.close()
            self._paths.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send_release(self) -> None:
        """Release the leases of what we read (one-way); a lost master forgets them anyway."""
        if self._leases and self._master is not None:
            release = list(self._leases)
            self._leases.clear()
            try:
                self._master.send_oneway(Release(release))
            except KVPoolError:
                pass

    # ------------------------------------------------------------------ reads

    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None when the key is absent (never other data)."""
        check_key(key)
        if self.embedded:
            data = self._direct_get(key, None)
            if data is not None:
                return None if data is _MISS else data
        return self._read([key], None, None)[0]

    def _direct_get(self, key: str, view: memoryview | None) -> Any:
        """One key from an embedded pool over its node RPC (its read port first): the same
        `NodeGet` on the same connections as `_read`, without the general path's grouping (on a
        loaded machine each layer of Python costs microseconds: issue 29). `view`: fill it and
        return the size (a miss raises `KeyNotFound`), else return the bytes (or `_MISS`). None:
        take the general path (another data path, or the connection is down: `_read` reconnects
        and retries)."""
        with self._lock:
            rpc = self._master
            conn = self._nodes.get(rpc.address) if rpc is not None and rpc.connected else None
            if conn is None or conn.rpc is not rpc or (conn.path or self._paths.choose(conn)) is not self._paths.rpc:
                return None
            try:
                got = self._paths.rpc.get_one(conn, key, view)
            except Unavailable:
                return None
        if got is None:
            if view is None:
                return _MISS
            raise KeyNotFound(f"key {key!r} not found")
        if view is not None and got == TOO_SMALL:
            raise InvalidArgument(f"buffer too small for {key!r}")
        return got

    def get_batch(self, keys: Sequence[str], *, tiers: list[str] | None = None) -> list[bytes | None]:
        """One entry per key, in order; a malformed key is a None entry, like a miss.
        `tiers`: a list to fill, one entry per key, with the tier that served it ("dram" |
        "ssd"; "" for a miss): what hit-rate counters by tier need."""
        keys = list(keys)
        if tiers is None:
            return _by_valid_key(keys, lambda idx: self._read([keys[i] for i in idx], None, None), None)
        tiers[:] = [""] * len(keys)

        def read(idx: list[int]) -> list:
            found = [""] * len(idx)
            out = self._read([keys[i] for i in idx], None, None, found)
            for i, tier in zip(idx, found):
                tiers[i] = tier
            return out

        return _by_valid_key(keys, read, None)

    def get_into(self, key: str, buffer: Any) -> int:
        """Copy the object into `buffer` (writable, large enough); return its size. `KeyNotFound` on a miss."""
        check_key(key)
        view = writable_view(buffer, 0)
        if self.embedded:
            n = self._direct_get(key, view)
            if n is not None:
                return n
        n = self._read([key], [view], -1)[0]
        if n == TOO_SMALL:
            raise InvalidArgument(f"buffer too small for {key!r}")
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
        out = _by_valid_key(keys, lambda idx: self._read([keys[i] for i in idx], [views[i] for i in idx], -1), -1)
        small = [keys[i] for i, n in enumerate(out) if n == TOO_SMALL]
        if small:
            raise InvalidArgument(f"buffer too small for {small[:5]}{'...' if len(small) > 5 else ''}")
        return out

    def _read(self, keys: list[str], views: list[memoryview] | None, miss: Any, tiers: list | None = None) -> list:
        with self._lock:
            return self._with_master(lambda m: self._read_once(m, keys, views, miss, tiers))

    def _read_once(self, master: RpcClient, keys: list[str], views: list[memoryview] | None, miss: Any,
                   tiers: list | None = None) -> list:
        """Find the replicas, then read each key from its first one that answers."""
        replicas = self._where.find(master, keys)
        out: list[Any] = [miss] * len(keys)
        todo = [i for i, r in enumerate(replicas) if r]
        attempt = 0
        while todo:
            groups = self._by_path([(i, replicas[i][attempt]) for i in todo if attempt < len(replicas[i])])
            todo = [i for _, idx in groups.pop(None, []) for i in idx]
            for path, work in groups.items():
                retry, dead = path.read(work, keys, views, out, tiers)
                for address in dead:
                    self._node_gone(address, Unavailable(f"node {address} is unreachable"))
                todo.extend(retry)
            attempt += 1
        return out

    def exists(self, key: str) -> bool:
        check_key(key)
        return self.exists_batch([key])[0]

    def exists_batch(self, keys: Sequence[str]) -> list[bool]:
        keys = list(keys)
        with self._lock:
            return _by_valid_key(keys, lambda idx: self._with_master(
                lambda m: m.call(Exists([keys[i] for i in idx])).values), False)

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
        err = self._write([key], [readable_view(value)], replicas)[0]
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
            for i, err in zip(idx, self._write(keys, views, replicas)):
                out[i] = err
        return out

    def _write(self, keys: list[str], views: list[memoryview], replicas: int | None) -> list[Exception | None]:
        want = replicas or self.replicas or 0
        token = secrets.randbits(63) | 1  # one id for all attempts: the master knows a retry from another put
        with self._lock:
            return self._with_master(lambda m: self._write_once(m, keys, views, want, token))

    def _write_once(self, master: RpcClient, keys: list[str], views: list[memoryview],
                    want: int, token: int) -> list[Exception | None]:
        """Plan (`PutStart`), write every replica (all nodes' requests in flight together),
        publish (`PutEnd`); to an embedded pool over its RPC, the three in one `Put`."""
        if self.embedded:
            done = self._put_here(master, keys, views, want, token)
            if done is not None:
                return done
        where = self._cluster
        plans = where.plan(master, keys, [v.nbytes for v in views], want, token)
        errors: list[Exception | None] = [p.error for p in plans]
        written: list[list[Placed]] = [[] for _ in keys]
        groups = self._by_path([(i, address) for i, p in enumerate(plans) if p.to_write for address in p.targets])
        for address, lost in groups.pop(None, []):
            for i in lost:
                errors[i] = errors[i] or Unavailable(f"node {address} is unreachable")
        results: dict[tuple[str, int], Any] = {}
        tickets = [p.tickets for p in plans] if any(p.tickets for p in plans) else None
        for path, work in groups.items():
            results.update(path.write(work, keys, [p.put_id for p in plans], views, want, tickets))
        for (address, i), res in results.items():
            if isinstance(res, Placed):
                written[i].append(res)
            elif isinstance(res, Unavailable):
                self._node_gone(address, res)
                errors[i] = errors[i] or res
            elif res is not EXISTS:
                errors[i] = errors[i] or res
        return where.publish(master, keys, plans, written, errors)

    def _put_here(self, master: RpcClient, keys: list[str], views: list[memoryview], want: int,
                  token: int) -> list[Exception | None] | None:
        """An embedded pool's put: one `Put` (the cluster's three steps in one frame), or on the
        engine path `PutReserve`, the WRITE, `PutCommit`; None when this is no embedded pool."""
        conn = self._nodes.get(master.address)
        if conn is None or conn.rpc is not master or not isinstance(self._where, EmbeddedWhere):
            return None
        path = conn.path or self._paths.choose(conn)
        errors = self._where.too_large([v.nbytes for v in views])
        todo = [i for i, err in enumerate(errors) if err is None]
        if len(todo) < len(keys):
            keys, views = [keys[i] for i in todo], [views[i] for i in todo]
        if not todo:
            return errors
        if path is self._paths.engine:
            done = path.write([(conn, list(range(len(keys))))], keys, [0] * len(keys), views, want, None, token)
            results = [done.get((conn.address, j), Unavailable("no answer")) for j in range(len(keys))]
        else:
            results = path.put(conn, keys, views, want, token)
        for i, res in zip(todo, results):
            if isinstance(res, Unavailable):
                self._node_gone(master.address, res)  # the master's own server: raises, so the put is retried
            if isinstance(res, KVPoolError):
                errors[i] = res
        return errors

    def remove(self, key: str) -> bool:
        check_key(key)
        return self.remove_batch([key])[0]

    def remove_batch(self, keys: Sequence[str]) -> list[bool]:
        keys = list(keys)

        def remove(idx: list[int]) -> list[bool]:
            self._release_pins()
            return self._with_master(lambda m: m.call(Remove([keys[i] for i in idx])).values)

        with self._lock:
            return _by_valid_key(keys, remove, False)

    def data_paths(self) -> dict[str, str]:
        """How bytes move to each node this client is connected to: "shm", "rpc" or "engine"."""
        with self._lock:
            return {address: self._paths.choose(conn).name for address, conn in self._nodes.items()}

    def _release_pins(self) -> None:
        """Let go of what we read before removing: our own pin or lease would otherwise keep the
        old object alive, and a put of the same key right after the remove would be refused."""
        for address, conn in list(self._nodes.items()):
            try:
                conn.release_pins()
            except KVPoolError:
                self._drop_node(address)
        self._send_release()  # one-way, ahead of the Remove on the same connection: the master sees it first

    # ------------------------------------------------------------------ admin over RPC

    def admin(self, method: str, **args: Any) -> Any:
        """Call a master admin method by name (nodes, node, stats, key_info, keys, config)."""
        with self._lock:
            return self._with_master(lambda m: m.call(Admin(method, args)).doc["result"])

    def flush(self) -> None:
        """Send pending unpins and lease releases now (they normally ride on later requests)."""
        with self._lock:
            for conn in self._nodes.values():
                conn.flush()
            self._send_release()


def _by_valid_key(keys: list[Any], call: Callable[[list[int]], list], miss: Any) -> list:
    """call(indexes of the well-formed keys) -> their results; `miss` for the others (a
    malformed key in a batch is a miss, never an error for the whole batch)."""
    out = [miss] * len(keys)
    valid = []
    for i, key in enumerate(keys):
        try:
            check_key(key)
        except InvalidArgument:
            continue
        valid.append(i)
    for i, value in zip(valid, call(valid) if valid else ()):
        out[i] = value
    return out
