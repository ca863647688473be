"""A small synchronous etcd v3 client over etcd's JSON gateway (httpx), enough for membership
and leader election: leases, put, get, prefix range, delete, and create-if-absent.

Why not a gRPC client: the pool's control loops are plain threads, and the gateway ships with
every etcd (3.4 included) with no extra dependency. Every failure becomes `Unavailable`.

TLS: `etcds://host:port` (or https://) speaks TLS, checking etcd's certificate against the CA in
`KVPOOL_ETCD_CA_FILE` (else the system's), and presents the client certificate in
`KVPOOL_ETCD_CERT_FILE` + `KVPOOL_ETCD_KEY_FILE` when set: with etcd's `--client-cert-auth`,
only holders of a certificate from its CA reach it at all (docs/security.md, deploy/k8s/etcd.yaml).
"""

from __future__ import annotations

import base64
import logging
import os
import ssl
from typing import Any

import httpx

from kvpool.errors import InvalidArgument, Unavailable

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per etcd request drowns the logs


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _prefix_end(prefix: bytes) -> bytes:
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\x00"


TXN_OPS = 100  # operations per transaction (etcd refuses more than --max-txn-ops, 128 by default)

TLS_ENV = ("KVPOOL_ETCD_CA_FILE", "KVPOOL_ETCD_CERT_FILE", "KVPOOL_ETCD_KEY_FILE")


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
    ca, cert, key = (os.environ.get(name) or None for name in TLS_ENV)
    try:
        ctx = ssl.create_default_context(cafile=ca)
        if cert or key:
            if not (cert and key):
                raise InvalidArgument("etcd client certificate: set both KVPOOL_ETCD_CERT_FILE and KVPOOL_ETCD_KEY_FILE")
            ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidArgument(f"etcd TLS files ({', '.join(TLS_ENV)}): {exc}") from None
    return ctx


class EtcdClient:
    def __init__(self, meta: str, timeout: float = 2.0):
        self.url = parse_etcd_url(meta)
        verify = _tls_context() if self.url.startswith("https://") else True
        self._http = httpx.Client(base_url=self.url, timeout=timeout, verify=verify)

    def close(self) -> None:
        self._http.close()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            resp = self._http.post(path, json=body)
        except httpx.HTTPError as exc:
            raise Unavailable(f"etcd at {self.url} is unreachable: {exc}") from None
        if resp.status_code != 200:
            raise Unavailable(f"etcd {path} failed: HTTP {resp.status_code} {resp.text[:200]}")
        return resp.json()

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
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = lease
        self._post("/v3/kv/put", body)

    def get(self, key: str) -> bytes | None:
        kvs = self._post("/v3/kv/range", {"key": _b64(key)}).get("kvs", [])
        return _unb64(kvs[0].get("value", "")) if kvs else None

    def get_with_lease(self, key: str) -> tuple[bytes, int] | None:
        """(value, lease id) of `key` (lease 0: none), or None when absent."""
        kvs = self._post("/v3/kv/range", {"key": _b64(key)}).get("kvs", [])
        return (_unb64(kvs[0].get("value", "")), int(kvs[0].get("lease", 0))) if kvs else None

    def get_prefix(self, prefix: str) -> dict[str, bytes]:
        raw = prefix.encode()
        kvs = self._post("/v3/kv/range", {"key": _b64(raw), "range_end": _b64(_prefix_end(raw))}).get("kvs", [])
        return {_unb64(kv["key"]).decode(): _unb64(kv.get("value", "")) for kv in kvs}

    def delete(self, key: str) -> None:
        self._post("/v3/kv/deleterange", {"key": _b64(key)})

    def delete_range(self, start: str, end: str) -> None:
        """Delete every key in [start, end)."""
        self._post("/v3/kv/deleterange", {"key": _b64(start), "range_end": _b64(end)})

    def put_many(self, items: dict[str, str | bytes], lease: int = 0, compare: list[dict[str, Any]] | None = None) -> bool:
        """Put every item, in transactions of at most `TXN_OPS` (etcd's default limit is 128).
        `compare` (see `lease_is`): each transaction puts only while it holds; False when one did not."""
        ops: list[dict[str, Any]] = []
        for key, value in items.items():
            put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
            if lease:
                put["lease"] = lease
            ops.append({"request_put": put})
        return self._txn(ops, compare)

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
        ops: list[dict[str, Any]] = [{"request_put": {"key": _b64(k), "value": _b64(v)}}
                                     for k, v in (puts or {}).items()]
        if delete_range is not None:
            ops.append({"request_delete_range": {"key": _b64(delete_range[0]), "range_end": _b64(delete_range[1])}})
        return bool(self._post("/v3/kv/txn", {"compare": compare, "success": ops}).get("succeeded", False))

    @staticmethod
    def lease_is(key: str, lease: int) -> list[dict[str, Any]]:
        """A transaction condition: `key` exists under `lease` (a leader's fence)."""
        return [{"key": _b64(key), "result": "EQUAL", "target": "LEASE", "lease": lease}]

    def create(self, key: str, value: str | bytes, lease: int = 0) -> bool:
        """Put `key` only if it does not exist (one transaction); True if this call created it."""
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = lease
        doc = self._post("/v3/kv/txn", {
            "compare": [{"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}],
            "success": [{"request_put": put}],
        })
        return bool(doc.get("succeeded", False))
