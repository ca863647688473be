"""Synchronous HTTP clients of kvpool's APIs: `HttpClient` (what every one of them needs) and
`AdminClient`, the admin REST API's (used by `kvpool admin`); the reference workers' is
`reference_worker.client.WorkerClient`.

Invariant: every failure surfaces as a `kvpool.errors` class: the server's error body
(`{"code", "message"}`, or `{"error": {"code", "message", ...}}`: the admin API's, the router's)
is rebuilt with `error_from_code` (404 -> KeyNotFound, 401 -> Unauthorized, ...), and a server
that cannot be reached is `Unavailable` with the URL in the message.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import httpx

from kvpool.errors import KVPoolError, Unavailable, error_from_code


def raise_for(resp: httpx.Response) -> None:
    """The `kvpool.errors` error of an error answer (status 400 and above)."""
    if resp.status_code < 400:
        return
    try:
        doc = resp.json()
        err = doc.get("error", doc)
        code, message = err["code"], err["message"]
    except Exception:
        raise KVPoolError(f"HTTP {resp.status_code} from {resp.request.url}: {resp.text[:200]}") from None
    raise error_from_code(str(code), str(message))


class HttpClient:
    def __init__(self, url: str, *, what: str, timeout: float | httpx.Timeout = 10.0,
                 headers: dict[str, str] | None = None):
        """`what` names the server in errors ("the admin API"); `headers` go with every request."""
        self.url = url.rstrip("/")
        self.what = what
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """The answer to `method path`; an error answer raised as its `kvpool.errors` class."""
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise Unavailable(f"cannot reach {self.what} at {self.url}: {exc}") from None
        raise_for(resp)
        return resp

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AdminClient(HttpClient):
    def __init__(self, url: str, token: str | None = None, timeout: float = 10.0):
        super().__init__(url, what="the admin API", timeout=timeout,
                         headers={"Authorization": f"Bearer {token}"} if token else None)

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self.request(method, path, **kwargs).json()

    def health(self) -> dict[str, Any]:
        return self._json("GET", "/health")

    def nodes(self) -> list[dict[str, Any]]:
        return self._json("GET", "/v1/nodes")["nodes"]

    def node(self, node_id: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/nodes/{quote(node_id, safe='')}")["node"]

    def drain(self, node_id: str) -> Any:
        return self._json("POST", f"/v1/nodes/{quote(node_id, safe='')}/drain")["result"]

    def undrain(self, node_id: str) -> Any:
        return self._json("POST", f"/v1/nodes/{quote(node_id, safe='')}/undrain")["result"]

    def keys(self, prefix: str = "", limit: int = 100) -> list[str]:
        return self._json("GET", "/v1/keys", params={"prefix": prefix, "limit": limit})["keys"]

    def remove_node(self, node_id: str) -> Any:
        return self._json("DELETE", f"/v1/nodes/{quote(node_id, safe='')}")["result"]

    def stats(self) -> dict[str, Any]:
        return self._json("GET", "/v1/stats")["stats"]

    def key(self, key: str) -> dict[str, Any]:
        # '/' stays literal: the route takes the rest of the path (tail/<request id> keys)
        return self._json("GET", f"/v1/keys/{quote(key, safe='/')}")["info"]

    def evict(self, *, target_bytes: int | None = None, keys: list[str] | None = None) -> Any:
        body = {"version": 1, "target_bytes": target_bytes, "keys": keys}
        return self._json("POST", "/v1/evict", json=body)["result"]

    def config(self) -> dict[str, Any]:
        return self._json("GET", "/v1/config")["config"]

    def patch_config(self, changes: dict[str, Any]) -> dict[str, Any]:
        return self._json("PATCH", "/v1/config", json=changes)["config"]
