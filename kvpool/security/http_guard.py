"""What every kvpool HTTP service checks before its app sees a request: the body size, and a
bearer token where one is required. Used by the admin API, the router and the workers' app.

`HttpGuard` is ASGI middleware:
- Body cap (`[security] http_max_body`, 1 MiB): a request body over the cap
  is answered 413 before the app runs. The body is read as it arrives and dropped once over the
  cap (never more than `max_body` bytes are held); the rest is read and discarded up to `DRAIN_LIMIT`, so the client,
  still sending, reads the 413 instead of a connection reset. A larger body gets the 413 and the
  connection is closed at once.
- Bearer token: when `token()` returns a token, every path for which `needs_token(path)` is true
  must carry `Authorization: Bearer <token>` (constant-time compare), else 401 with
  `WWW-Authenticate: Bearer`; checked before the body is read.
- Metrics token (optional, `metrics_token()`): a bearer token that opens `/metrics` and nothing
  else, the one a Prometheus scraper holds (it cannot call an admin endpoint or a worker with it).
- Tenants (optional, the admin API's `TenantTokens`): `tenants.tenant_of(presented)` names the
  tenant whose own token was presented instead of the service's; its request gets
  `scope["state"]["tenant"]`, or a 403 when `tenants.refusal(method, path, tenant)` says why it
  may not ask that.

Error bodies are the service's own shape (`error_body(status, code, message)`): OpenAI's for the
router, `{"code", "message"}` for workers, `ErrorBody` for the admin API.

`internal_token()` / `internal_headers()`: the token a router presents to workers (and workers to
their router); None / {} when no keyring is configured (then nothing is checked).
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any, Callable

from kvpool.security.keyring import internal_http_token, load_keyring
from kvpool.config import current_settings, read_secret_file
from kvpool.errors import InvalidArgument

log = logging.getLogger(__name__)

DRAIN_LIMIT = 64 << 20  # read and drop at most this much of an oversized body before answering
TENANT_HEADER = "x-kvpool-tenant"  # router -> worker: the tenant a request is for (with the internal token)

ErrorBody = Callable[[int, str, str], Any]


def plain_error(status: int, code: str, message: str) -> dict[str, Any]:
    """`{"code", "message"}`: the workers' error shape (kvpool.errors codes)."""
    return {"code": code, "message": message}


INTERNAL_TOKEN_FILE_ENV = "KVPOOL_INTERNAL_TOKEN_FILE"


def internal_token(keyring: Any = None) -> str | None:
    """The router<->worker bearer token when `keyring` (default: the one `KVPOOL_AUTH_FILE` names)
    is set: the file `[security] internal_token_file` names (KVPOOL_INTERNAL_TOKEN_FILE; `kvpool auth
    init` writes internal.token), else derived from the keyring's node secret
    (`kvpool.security.keyring.internal_http_token`). A keyring of tenants only (a router's or a
    worker's, which hold no node secret) needs the file: `InvalidArgument` says so."""
    keyring = keyring if keyring is not None else load_keyring()
    if keyring is None:
        return None
    path = current_settings().security.internal_token_file
    if path:
        return read_secret_file(path, INTERNAL_TOKEN_FILE_ENV)
    node = [e for e in keyring.entries.values() if e.principal.role == "node"]
    if not node:
        raise InvalidArgument(
            f"keyring {keyring.source} holds no node principal (a router or worker holds only its tenants'), so "
            f"the internal token between router and workers cannot be derived from it: set "
            f"{INTERNAL_TOKEN_FILE_ENV}=internal.token (`kvpool auth init` writes it; see docs/security.md)")
    return internal_http_token(node[0].secret)


def metrics_token() -> str | None:
    """The token a Prometheus scraper presents (`[security] metrics_token`, or read from
    `metrics_token_file`: KVPOOL_METRICS_TOKEN(_FILE)), for the router's and workers' /metrics."""
    return current_settings().security.metrics_token


def internal_headers(keyring: Any = None) -> dict[str, str]:
    token = internal_token(keyring)
    return {"Authorization": f"Bearer {token}"} if token else {}


def bearer_of(headers: dict[bytes, bytes] | list[tuple[bytes, bytes]] | Any) -> str | None:
    """The token of an `Authorization: Bearer <token>` header in ASGI raw headers, or None."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            token = token.strip()
            return token if scheme.lower() == "bearer" and token else None
    return None


def same_token(presented: str | None, expected: str) -> bool:
    return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())


class HttpGuard:
    def __init__(self, app: Any, *, error_body: ErrorBody = plain_error,
                 token: Callable[[], str | None] | None = None,
                 needs_token: Callable[[str], bool] = lambda path: path != "/health",
                 what: str = "this service", tenants: Any = None,
                 metrics_token: Callable[[], str | None] | None = None):
        self.app = app
        self.metrics_token = metrics_token
        self.tenants = tenants
        self.error_body = error_body
        self.max_body = current_settings().security.http_max_body
        self.token = token
        self.needs_token = needs_token
        self.what = what

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        expected = self.token() if self.token is not None else None
        if (expected or self.tenants) and self.needs_token(scope["path"]):
            presented = bearer_of(scope["headers"])
            scraper = self.metrics_token() if self.metrics_token is not None and scope["path"] == "/metrics" else None
            if not (expected and same_token(presented, expected)) and not (scraper and same_token(presented, scraper)):
                tenant = self.tenants.tenant_of(presented) if presented and self.tenants else None
                if tenant is not None:
                    refusal = self.tenants.refusal(scope["method"], scope["path"], tenant)
                    if refusal is not None:
                        log.info("%s %s refused: tenant %s", scope["method"], scope["path"], tenant)
                        await self._answer(send, 403, "forbidden", refusal)
                        return
                    scope.setdefault("state", {})["tenant"] = tenant
                elif expected:
                    why = "a wrong bearer token" if presented else "no bearer token"
                    log.info("%s %s refused: %s", scope["method"], scope["path"], why)
                    await self._answer(send, 401, "unauthorized",
                                       f"{self.what} requires 'Authorization: Bearer <token>'; the request had "
                                       f"{why} (see docs/security.md)", {"www-authenticate": "Bearer"})
                    return
        declared = _content_length(scope["headers"])
        if declared is not None and declared > DRAIN_LIMIT:
            await self._too_large(send, declared, close=True)
            return
        body, total, more = bytearray(), 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total <= self.max_body:
                body += chunk
            elif total > DRAIN_LIMIT:
                await self._too_large(send, total, close=True)
                return
            more = message.get("more_body", False)
        if total > self.max_body:
            await self._too_large(send, total, close=False)
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # after the body: the disconnect a streaming response waits for

        await self.app(scope, replay, send)

    async def _too_large(self, send: Any, size: int, close: bool) -> None:
        log.info("request body of %d bytes refused (limit %d)", size, self.max_body)
        await self._answer(send, 413, "request_too_large",
                           f"the request body is {'at least ' if close else ''}{size} bytes; {self.what} accepts "
                           f"at most {self.max_body} bytes (KVPOOL_HTTP_MAX_BODY)",
                           {"connection": "close"} if close else None)

    async def _answer(self, send: Any, status: int, code: str, message: str,
                      extra: dict[str, str] | None = None) -> None:
        await send_json(send, status, self.error_body(status, code, message), extra)


async def send_json(send: Any, status: int, body: Any, extra: dict[str, str] | None = None) -> None:
    """Answer an ASGI request with `body` as JSON (what the guards use to refuse before the app)."""
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def _content_length(headers: Any) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
