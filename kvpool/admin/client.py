"""A small synchronous client of the admin REST API (used by `kvpool admin`).

Invariant: every failure surfaces as a `kvpool.errors` class: the server's error body is
rebuilt with `error_from_code` (404 -> KeyNotFound, 401 -> Unauthorized, ...), and a server
that cannot be reached is `Unavailable` with the URL in the message.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import httpx

from kvpool.errors import KVPoolError, Unavailable, error_from_code


class AdminClient:
    def __init__(self, url: str, token: str | None = None, timeout: float = 10.0):
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def _request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise Unavailable(f"cannot reach the admin API at {self.url}: {exc}") from None
        try:
            body = response.json()
        except ValueError:
            body = {}
        if response.is_success:
            return body
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict):
            raise error_from_code(str(error.get("code")), str(error.get("message")))
        raise KVPoolError(f"admin API answered {response.status_code}: {response.text[:200]}")

    def health(self) -> dict[str, Any]:
        return self._request("GET", "/health")

    def nodes(self) -> list[dict[str, Any]]:
        return self._request("GET", "/v1/nodes")["nodes"]

    def node(self, node_id: str) -> dict[str, Any]:
        return self._request("GET", f"/v1/nodes/{quote(node_id, safe='')}")["node"]

    def drain(self, node_id: str) -> Any:
        return self._request("POST", f"/v1/nodes/{quote(node_id, safe='')}/drain")["result"]

    def undrain(self, node_id: str) -> Any:
        return self._request("POST", f"/v1/nodes/{quote(node_id, safe='')}/undrain")["result"]

    def keys(self, prefix: str = "", limit: int = 100) -> list[str]:
        return self._request("GET", "/v1/keys", params={"prefix": prefix, "limit": limit})["keys"]

    def remove_node(self, node_id: str) -> Any:
        return self._request("DELETE", f"/v1/nodes/{quote(node_id, safe='')}")["result"]

    def stats(self) -> dict[str, Any]:
        return self._request("GET", "/v1/stats")["stats"]

    def key(self, key: str) -> dict[str, Any]:
        # '/' stays literal: the route takes the rest of the path (tail/<request id> keys)
        return self._request("GET", f"/v1/keys/{quote(key, safe='/')}")["info"]

    def evict(self, *, target_bytes: int | None = None, keys: list[str] | None = None) -> Any:
        body = {"version": 1, "target_bytes": target_bytes, "keys": keys}
        return self._request("POST", "/v1/evict", json=body)["result"]

    def config(self) -> dict[str, Any]:
        return self._request("GET", "/v1/config")["config"]

    def patch_config(self, changes: dict[str, Any]) -> dict[str, Any]:
        return self._request("PATCH", "/v1/config", json=changes)["config"]

    def metrics(self) -> str:
        try:
            return self._http.get("/metrics").text
        except httpx.HTTPError as exc:
            raise Unavailable(f"cannot reach the admin API at {self.url}: {exc}") from None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "AdminClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
