"""The REST admin API of a pool master (FastAPI; OpenAPI at `/docs`, schema at `/openapi.json`).

Thin: parse, call the master service, wrap the answer. The master service is anything with the
methods below (`MasterService.admin`, a `kvpool.master.admin_ops.AdminOps`); each may be sync or async.

    nodes() -> list[node]            node(node_id) -> node
    drain_node(node_id) -> result    undrain_node(node_id) -> result
    remove_node(node_id) -> result   stats() -> mapping
    tenant_stats(tenant) -> mapping  key_info(key) -> mapping
    keys(prefix, limit) -> list[str] evict(target_bytes=None, keys=None) -> result
    config() -> mapping              patch_config(changes: dict) -> mapping

Invariants:
- Every error reaches the client as `ErrorBody` with the status of its `kvpool.errors` class
  (400 malformed input, 401 token, 404 unknown key or node, 413, 503, ...); an unexpected
  exception is logged here and answered 500 without a traceback. The app keeps serving.
- With a bearer token configured (`settings.security.admin_token`, or `admin_token_file`), every endpoint
  but the probes and the schema requires it (`kvpool.security.admin_token`); a refused request never
  reaches the master. `/metrics` also takes the metrics token (`settings.security.metrics_token`),
  which opens nothing else. With a keyring (`settings.security.auth_file`) the token is required:
  the app refuses to be made without one. With no configuration at all, the user's own admin and
  metrics tokens are used (`kvpool.security.local`: made on first use, 0600), so another local
  user is refused; `KVPOOL_LOCAL_AUTH=off` leaves the API open on loopback as before. A request
  body over 1 MiB is answered 413 (`kvpool.security.http_guard`).
- A tenant (its derived token, `kvpool.security.admin_token`) sees only its own keys, named as it names
  them, and its own use and quota: another tenant's key answers exactly as a missing key (404,
  the same body); every other endpoint is 403 for it.
- `admin_token` is never returned by `GET /v1/config`.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

from fastapi import Body, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpool.admin import schemas as s
from kvpool.security.admin_token import TenantTokens, needs_token
from kvpool.security.keyring import load_keyring
from kvpool.security.local import local_token
from kvpool.admin.metrics import ServiceMetrics, render, to_builtins, with_node_tiers
from kvpool.contract import check_key, check_stored_key, scope_prefix
from kvpool.config import Settings, load_settings
from kvpool.errors import InvalidArgument, KeyNotFound, KVPoolError
from kvpool.security.http_guard import HttpGuard

log = logging.getLogger(__name__)

REDACTED = "***"
_SECRET_FIELDS = ("admin_token", "admin_token_file", "metrics_token", "metrics_token_file")


async def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a master method, sync or async; sync ones run in a worker thread because they take
    the master's lock and must not stall this event loop."""
    if inspect.iscoroutinefunction(fn):
        return to_builtins(await fn(*args, **kwargs))
    result = await run_in_threadpool(fn, *args, **kwargs)
    if inspect.isawaitable(result):
        result = await result
    return to_builtins(result)


def _error_doc(code: str, message: str) -> dict[str, Any]:
    return s.ErrorBody(error=s.ErrorDetail(code=code, message=message)).model_dump()


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content=_error_doc(code, message),
                        headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)


def _validation_message(exc: RequestValidationError | ValidationError) -> str:
    parts = []
    for e in exc.errors():
        if e.get("type") == "json_invalid":
            parts.append(f"malformed JSON body: {e.get('ctx', {}).get('error', e['msg'])}")
            continue
        loc = ".".join(str(p) for p in e.get("loc", ()) if p not in ("body", 0))
        msg = e["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "malformed request"


def _redact(config: dict[str, Any]) -> dict[str, Any]:
    return {k: (REDACTED if k in _SECRET_FIELDS and v else v) for k, v in config.items()}


def _check_version(version: Any) -> None:
    if version != s.API_VERSION or isinstance(version, bool):
        raise InvalidArgument(f"unsupported request version {version}; this server speaks {s.API_VERSION}")


def _check_patch(changes: dict[str, Any]) -> dict[str, Any]:
    """Shape checks only; which fields may change live (and to what) is the master's call."""
    if "version" in changes:
        _check_version(changes["version"])
    changes = {k: v for k, v in changes.items() if k != "version"}
    if not changes:
        raise InvalidArgument("empty config patch: send a JSON object of fields to change")
    secret = [k for k in changes if k in _SECRET_FIELDS]
    if secret:
        raise InvalidArgument(f"{secret} cannot be changed through the API; restart with a new setting")
    return changes


class _CatchAll:
    """Answer an unexpected exception with a 500 `ErrorBody` and keep the connection usable.
    (Starlette's own last-resort handler re-raises after answering, which makes the server drop
    the keep-alive connection.)"""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            log.exception("admin %s %s failed", scope.get("method"), scope.get("path"))
            if started:  # too late for a clean answer; the server closes the connection
                raise
            response = _error(500, "internal", f"internal error ({type(exc).__name__}); see the master's log")
            await response(scope, receive, send)


def _tenant(request: Request) -> str | None:
    """The tenant asking (its token, `kvpool.security.admin_token`), or None: the admin's whole view."""
    return request.scope.get("state", {}).get("tenant")


def _readiness(stats: dict[str, Any]) -> tuple[bool, str]:
    if stats.get("leader") is False:
        return False, f"standby master; the leader is {stats.get('leader_address') or 'unknown'}"
    if stats.get("recovering"):
        return False, "new leader waiting for nodes to re-report what they hold"
    up = stats.get("nodes_up", stats.get("nodes"))
    if isinstance(up, int) and up < 1:
        return False, "no store node is up"
    return True, ""


def create_app(master_service: Any, settings: Settings | None = None, *,
               metrics: ServiceMetrics | None = None) -> FastAPI:
    """The admin app for `master_service`. `metrics` is the master's registry holder (one is
    made, watching `master_service.stats()`, if not given); it is served at `/metrics`."""
    settings = settings or load_settings()
    keyring = load_keyring(settings.security.auth_file)
    admin_token, metrics_token = settings.security.admin_token, settings.security.metrics_token
    if keyring is None and not admin_token:  # no configuration: the user's own tokens (kvpool.security.local)
        admin_token, metrics_token = local_token("admin"), metrics_token or local_token("metrics")
    if keyring is not None and not admin_token:
        raise InvalidArgument(
            f"admin API: a keyring is set ({settings.security.auth_file}) but no admin token, so anyone who reaches "
            "the admin port could list every tenant's keys and evict them. Give it a token in a file: "
            "KVPOOL_ADMIN_TOKEN_FILE=admin.token (`kvpool auth init` writes one), or turn the admin API off "
            "(admin_port = 0).")
    svc = master_service
    # The scrape reads a snapshot that `/metrics` takes just before rendering: the master's
    # methods may be coroutines, which the (threaded) collector could not await.
    snapshot: dict[str, Any] = {}
    if metrics is None:
        metrics = ServiceMetrics("master")

        def latest() -> dict[str, Any]:
            if "error" in snapshot:
                raise snapshot["error"]
            return snapshot.get("doc", {})

        metrics.watch_stats(latest)  # one collector, so one kvpool_stats_up

    errors = {c: {"model": s.ErrorBody} for c in (400, 401, 403, 404, 413, 500, 503)}

    app = FastAPI(title="kvpool admin", version=str(s.API_VERSION), responses=errors,
                  description="Admin API of a kvpool master: nodes, stats, keys, eviction, config.")
    app.state.authenticated = lambda: bool(settings.security.admin_token)  # protected mode (server.py): a configured token

    @app.exception_handler(KVPoolError)
    async def _typed(request: Request, exc: KVPoolError) -> JSONResponse:
        log.info("%s %s -> %s: %s", request.method, request.url.path, exc.code, exc)
        return _error(exc.http_status, exc.code, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, InvalidArgument.code, _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _error(exc.status_code, code, str(exc.detail))

    app.add_middleware(_CatchAll)
    # Outermost: who is asking (the admin token, a tenant's: kvpool/security/admin_token.py), then the body
    # cap, before anything else runs.
    app.add_middleware(HttpGuard, what="the admin API", token=lambda: admin_token, needs_token=needs_token,
                       tenants=TenantTokens(keyring), metrics_token=lambda: metrics_token,
                       error_body=lambda status, code, message: _error_doc(code, message))

    @app.get("/health", response_model=s.Health, tags=["health"])
    async def health() -> s.Health:
        """The process is up and serving HTTP."""
        return s.Health(status="ok")

    @app.get("/ready", response_model=s.Health, tags=["health"], responses={503: {"model": s.Health}})
    async def ready() -> Any:
        """Ready to serve the pool: this master leads and at least one node is up."""
        try:
            ok, detail = _readiness(await _call(svc.stats))
        except KVPoolError as exc:
            ok, detail = False, str(exc)
        if ok:
            return s.Health(status="ok", detail=detail)
        return JSONResponse(status_code=503, content=s.Health(status="not ready", detail=detail).model_dump())

    @app.get("/v1/nodes", response_model=s.Nodes, tags=["nodes"])
    async def nodes() -> s.Nodes:
        """Every registered store node: address, state, capacity and use per tier, heartbeat."""
        return s.Nodes(nodes=await _call(svc.nodes))

    @app.get("/v1/nodes/{node_id}", response_model=s.Node, tags=["nodes"])
    async def node(node_id: str) -> s.Node:
        return s.Node(node=await _call(svc.node, node_id))

    @app.post("/v1/nodes/{node_id}/drain", response_model=s.Done, tags=["nodes"])
    async def drain(node_id: str) -> s.Done:
        """Stop placing new objects on the node; existing ones stay readable."""
        return s.Done(result=await _call(svc.drain_node, node_id))

    @app.post("/v1/nodes/{node_id}/undrain", response_model=s.Done, tags=["nodes"])
    async def undrain(node_id: str) -> s.Done:
        """Place new objects on the node again."""
        return s.Done(result=await _call(svc.undrain_node, node_id))

    @app.delete("/v1/nodes/{node_id}", response_model=s.Done, tags=["nodes"])
    async def remove(node_id: str) -> s.Done:
        """Forget the node and drop its replicas from the index."""
        return s.Done(result=await _call(svc.remove_node, node_id))

    @app.get("/v1/stats", response_model=s.Stats, tags=["stats"])
    async def stats(request: Request) -> s.Stats:
        """Per tier: capacity, used, hits, misses, evictions, bytes in/out; and pool totals.
        A tenant: its own use and quota (bytes, every replica counted; keys)."""
        tenant = _tenant(request)
        if tenant is not None:
            return s.Stats(stats=await _call(svc.tenant_stats, tenant))
        return s.Stats(stats=with_node_tiers(await _call(svc.stats), await _call(svc.nodes)))

    @app.get("/v1/keys", response_model=s.Keys, tags=["keys"])
    async def list_keys(request: Request, prefix: str = "", limit: int = Query(100, ge=1, le=10_000)) -> s.Keys:
        """Complete keys starting with `prefix` (at most `limit`; the order is the master's)."""
        tenant = _tenant(request)
        if tenant is None:
            return s.Keys(keys=await _call(svc.keys, prefix=prefix, limit=limit))
        if "\x00" in prefix:
            raise InvalidArgument("prefix must not contain NUL")
        scope = scope_prefix(tenant)
        keys = await _call(svc.keys, prefix=scope + prefix, limit=limit)
        return s.Keys(keys=[k[len(scope):] for k in keys])

    @app.get("/v1/keys/{key:path}", response_model=s.KeyInfo, tags=["keys"])
    async def key_info(request: Request, key: str) -> s.KeyInfo:
        """Replicas, size, state and lease of one object (`tail/...` keys may contain '/'; a
        tenant's key as stored, `<tenant>%00<key>`, for the admin)."""
        tenant = _tenant(request)
        if tenant is None:
            check_stored_key(key)
            return s.KeyInfo(key=key, info=await _call(svc.key_info, key))
        check_key(key)
        try:  # its own key, as stored; another tenant's is simply not this name: the same miss
            info = await _call(svc.key_info, scope_prefix(tenant) + key)
        except KeyNotFound:
            raise KeyNotFound(f"key {key!r} not found") from None
        return s.KeyInfo(key=key, info={**info, "key": key})

    @app.post("/v1/evict", response_model=s.Done, tags=["keys"])
    async def evict(request: s.EvictRequest) -> s.Done:
        """Evict `keys`, or evict by the tiers' policy until `target_bytes` are freed."""
        _check_version(request.version)
        for key in request.keys or ():
            check_stored_key(key)  # the admin names tenants' keys as stored
        return s.Done(result=await _call(svc.evict, target_bytes=request.target_bytes, keys=request.keys))

    @app.get("/v1/config", response_model=s.Config, tags=["config"])
    async def get_config() -> s.Config:
        return s.Config(config=_redact(await _call(svc.config)))

    @app.patch("/v1/config", response_model=s.Config, tags=["config"])
    async def patch_config(changes: dict[str, Any] = Body(..., examples=[{"lease_s": 5.0}])) -> s.Config:
        """Change settings at run time (e.g. replicas, lease_s, put_timeout_s, high_watermark);
        answers the whole config after the change. Fields the master cannot change live: 400."""
        updated = await _call(svc.patch_config, _check_patch(changes))
        return s.Config(config=_redact(updated if isinstance(updated, dict) else await _call(svc.config)))

    @app.get("/metrics", tags=["metrics"], response_class=Response)
    async def prometheus() -> Response:
        """Prometheus text exposition (`kvpool_` prefix)."""
        try:
            stats, nodes = await _call(svc.stats), await _call(svc.nodes)
            snapshot.pop("error", None)
            snapshot["doc"] = {**with_node_tiers(stats, nodes), "nodes": nodes}  # per-node rows too
        except Exception as exc:  # reported as kvpool_stats_up 0 by the collector; the scrape still answers
            snapshot["error"] = exc
        body, content_type = await run_in_threadpool(render, metrics.registry)
        return Response(content=body, media_type=content_type)

    return app
