"""A small synchronous etcd v3 client over etcd's JSON gateway (HTTP/1.1 keep-alive, the
standard library's `http.client`), enough for membership and leader election: leases, put, get,
prefix range, delete, create-if-absent and guarded transactions.

Why not a gRPC client: the pool's control loops are plain threads, and the gateway ships with
every etcd (3.4 included) with no extra dependency. Every failure becomes `Unavailable`.

Why not httpx (used before issue 29): httpcore reads each response with a 64 KiB `recv`, a
fresh 64 KiB allocation shrunk to the few hundred bytes that came. In a thread's malloc arena
that pattern fragments without end: a process doing only a keepalive and a get every 0.5 s in a
thread grew its arena by ~2.5 MiB/h, all of it free memory glibc could not reuse
(kvpool/tools/scripts/idle_heap.py); that was the idle master's creep. `http.client` reads
through one 8 KiB buffer per connection.

Thread-safe: each call takes an idle connection (or opens one) and puts it back afterwards, so
concurrent callers (a master's election, node watch and removes) never wait on each other.

TLS: `etcds://host:port` (or https://) speaks TLS, checking etcd's certificate against the CA in
`KVPOOL_ETCD_CA_FILE` (else the system's), and presents the client certificate in
`KVPOOL_ETCD_CERT_FILE` + `KVPOOL_ETCD_KEY_FILE` when set: with etcd's `--client-cert-auth`,
only holders of a certificate from its CA reach it at all (docs/security.md, deploy/k8s/etcd.yaml).
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import select
import ssl
import threading
from typing import Any

from kvpool.config import current_settings
from kvpool.errors import InvalidArgument, Unavailable

log = logging.getLogger(__name__)

IDLE_CONNECTIONS = 4  # kept open per client for reuse; more concurrent calls open (and close) their own


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _put_op(key: str, value: str | bytes, lease: int = 0) -> dict[str, Any]:
    put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        put["lease"] = lease
    return put


def _prefix_end(prefix: bytes) -> bytes:
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\x00"


TXN_OPS = 100  # operations per transaction (etcd refuses more than --max-txn-ops, 128 by default)



def _readable(sock: Any) -> bool:
    """An idle keep-alive socket with something to read has been closed by the server."""
    try:
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):
        return True


def parse_etcd_url(meta: str) -> str:
    """"etcd://host:port" (or http://) -> "http://host:port", "etcds://host:port" (or https://) ->
    "https://host:port"; a comma list uses the first."""
    if not isinstance(meta, str) or "://" not in meta:
        raise InvalidArgument(f"meta must look like etcd://host:port or etcds://host:port, got {meta!r}")
    scheme, _, rest = meta.partition("://")
    if scheme not in ("etcd", "http", "etcds", "https") or not rest:
        raise InvalidArgument(f"meta must look like etcd://host:port or etcds://host:port, got {meta!r}")
    return ("https://" if scheme in ("etcds", "https") else "http://") + rest.split(",")[0].rstrip("/")


def _tls_context() -> ssl.SSLContext:
    """etcds://: the CA and client certificate of `[pool] etcd_ca_file`, `etcd_cert_file`, `etcd_key_file`
    (KVPOOL_ETCD_CA_FILE, ...)."""
    pool = current_settings().pool
    ca, cert, key = pool.etcd_ca_file or None, pool.etcd_cert_file or None, pool.etcd_key_file or None
    try:
        ctx = ssl.create_default_context(cafile=ca)
        if cert or key:
            if not (cert and key):
                raise InvalidArgument("etcd client certificate: set both KVPOOL_ETCD_CERT_FILE and KVPOOL_ETCD_KEY_FILE")
            ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidArgument(f"etcd TLS files (KVPOOL_ETCD_CA_FILE, _CERT_FILE, _KEY_FILE): {exc}") from None
    return ctx


class EtcdClient:
    def __init__(self, meta: str, timeout: float = 2.0):
        self.url = parse_etcd_url(meta)
        scheme, _, netloc = self.url.partition("://")
        host, _, port = netloc.rpartition(":")
        if not port.isdigit():
            raise InvalidArgument(f"meta must name a port (etcd://host:port), got {meta!r}")
        self._host, self._port, self._timeout = host.strip("[]"), int(port), timeout
        self._tls = _tls_context() if scheme == "https" else None
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        with self._lock:
            idle, self._idle, self._closed = self._idle, [], True
        for conn in idle:
            conn.close()

    def _connection(self) -> http.client.HTTPConnection:
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if conn.sock is not None and not _readable(conn.sock):
                    return conn
                conn.close()  # etcd closed it while idle (a restart): a reused one would fail the call
        if self._tls is not None:
            return http.client.HTTPSConnection(self._host, self._port, timeout=self._timeout, context=self._tls)
        return http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)

    def _release(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < IDLE_CONNECTIONS:
                self._idle.append(conn)
                return
        conn.close()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        conn = self._connection()
        try:
            conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException) as exc:  # socket errors, TLS, timeouts, a cut reply
            conn.close()
            raise Unavailable(f"etcd at {self.url} is unreachable: {exc or type(exc).__name__}") from None
        if resp.will_close:
            conn.close()
        else:
            self._release(conn)
        if resp.status != 200:
            raise Unavailable(f"etcd {path} failed: HTTP {resp.status} {data[:200].decode(errors='replace')}")
        try:
            return json.loads(data)
        except ValueError:
            raise Unavailable(f"etcd {path} answered something other than JSON: {data[:200]!r}") from None

    # -- leases
    def grant(self, ttl: int) -> int:
        return int(self._post("/v3/lease/grant", {"TTL": int(ttl), "ID": 0})["ID"])

    def keepalive(self, lease_id: int) -> int:
        """Refresh a lease; returns its TTL, 0 when it has already expired."""
        doc = self._post("/v3/lease/keepalive", {"ID": lease_id})
        return int(doc.get("result", {}).get("TTL", 0))

    def revoke(self, lease_id: int) -> None:
        self._post("/v3/lease/revoke", {"ID": lease_id})

    # -- keys
    def put(self, key: str, value: str | bytes, lease: int = 0) -> None:
        self._post("/v3/kv/put", _put_op(key, value, lease))

    def get(self, key: str) -> bytes | None:
        found = self.get_with_lease(key)
        return found[0] if found is not None else None

    def get_with_lease(self, key: str) -> tuple[bytes, int] | None:
        """(value, lease id) of `key` (lease 0: none), or None when absent."""
        kvs = self._post("/v3/kv/range", {"key": _b64(key)}).get("kvs", [])
        return (_unb64(kvs[0].get("value", "")), int(kvs[0].get("lease", 0))) if kvs else None

    def get_prefix(self, prefix: str) -> dict[str, bytes]:
        raw = prefix.encode()
        kvs = self._post("/v3/kv/range", {"key": _b64(raw), "range_end": _b64(_prefix_end(raw))}).get("kvs", [])
        return {_unb64(kv["key"]).decode(): _unb64(kv.get("value", "")) for kv in kvs}

    def put_many(self, items: dict[str, str | bytes], compare: list[dict[str, Any]] | None = None) -> bool:
        """Put every item, in transactions of at most `TXN_OPS` (etcd's default limit is 128).
        `compare` (see `lease_is`): each transaction puts only while it holds; False when one did not."""
        return self._txn([{"request_put": _put_op(key, value)} for key, value in items.items()], compare)

    def _txn(self, ops: list[dict[str, Any]], compare: list[dict[str, Any]] | None = None) -> bool:
        for i in range(0, len(ops), TXN_OPS):
            body: dict[str, Any] = {"success": ops[i:i + TXN_OPS]}
            if compare:
                body["compare"] = compare
            if not self._post("/v3/kv/txn", body).get("succeeded", False) and compare:
                return False
        return True

    def txn(self, compare: list[dict[str, Any]], puts: dict[str, str | bytes] | None = None,
            delete_range: tuple[str, str] | None = None) -> bool:
        """One transaction: the puts and the range delete, only if `compare` holds."""
        ops = [{"request_put": _put_op(k, v)} for k, v in (puts or {}).items()]
        if delete_range is not None:
            ops.append({"request_delete_range": {"key": _b64(delete_range[0]), "range_end": _b64(delete_range[1])}})
        return self._txn(ops, compare)

    @staticmethod
    def lease_is(key: str, lease: int) -> list[dict[str, Any]]:
        """A transaction condition: `key` exists under `lease` (a leader's fence)."""
        return [{"key": _b64(key), "result": "EQUAL", "target": "LEASE", "lease": lease}]

    def create(self, key: str, value: str | bytes, lease: int = 0) -> bool:
        """Put `key` only if it does not exist (one transaction); True if this call created it."""
        return self._txn([{"request_put": _put_op(key, value, lease)}],
                         [{"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}])
