"""The contract between the router and the workers behind it: a `Backend` per worker API
(`reference`: kvpool's own workers; `vllm`: vLLM OpenAI servers with kvpool's connector). While
it runs a request, a backend calls back into the `Router` (service.py: its `workers`,
`worker_failed`, `another_decoder`, and its `metrics` and `cost`).

A backend owns its HTTP clients (made in `start`, closed in `close`) and maps what its workers
answer to the router's terms: `BeforeFirst` for a failure before anything of the step reached
the client (the router may retry elsewhere), a `kvpool.errors` error otherwise, `WorkerRefused`
from a poll when nothing listens at the worker's address (out of rotation at once).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Protocol

import aiohttp

from kvpool import worker_api as wire
from kvpool.errors import Unavailable

if TYPE_CHECKING:
    from kvpool.router.policy import Decision, RouteRequest
    from kvpool.router.service import Router
    from kvpool.router.tenants import Tenant
    from kvpool.router.workers import WorkerState


READ_TIMEOUT_S = 600.0  # a worker that sends nothing this long during a call has failed
POLL_TIMEOUT_S = 1.0  # a poll unanswered this long has failed (4 polls' time: workers.py polls every 0.25 s)


@dataclass
class Piece:
    text: str = ""
    finish: str | None = None  # "stop" | "length" on the last piece


@dataclass
class Outcome:
    """What one request did, filled in while it streams."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    decision: "Decision | None" = None
    route_s: float = 0.0


class BeforeFirst(Exception):
    """A worker failed before this step streamed anything: the step may be retried elsewhere."""

    def __init__(self, worker: str, error: Exception):
        super().__init__(str(error))
        self.worker = worker
        self.error = error


def failed(worker: str, error: Exception, streamed: bool) -> Exception:
    """`error` of a step on `worker`, as the router must see it: `BeforeFirst` (retryable) while
    nothing of the step has reached the client."""
    return error if streamed else BeforeFirst(worker, error)


def unreachable(host: Router, worker: "WorkerState", path: str, exc: Exception, streamed: bool) -> Exception:
    """`worker` could not be reached or broke off during its call to `path`: out of rotation, and
    the step's error."""
    why = f"{type(exc).__name__}: {exc}"
    host.worker_failed(worker, path.rsplit("/", 1)[-1], f"{path}: {why}")
    return failed(worker.name, Unavailable(f"worker {worker.name} failed{' mid-request' if streamed else ''}: {why}"),
                  streamed)


class WorkerRefused(Unavailable):
    """Nothing listens at the worker's address (a poll): out of rotation now, not after
    `FAIL_AFTER` failed polls. Stays in the router: a client never sees it."""


@dataclass
class Request:
    """One routed request, as a backend runs it."""

    ids: list[int]
    max_tokens: int
    sampling: wire.SamplingParams
    request_id: str
    tenant: "Tenant | None"
    keys: list[str]  # the prompt's chunk keys (in the tenant's namespace)
    route: "RouteRequest"

    @property
    def pool_chunks(self) -> int | None:
        """The prompt's chunks the pool held when routed (None: the pool did not answer), for
        the worker, which then need not ask again."""
        return self.route.pool_prefix_chunks if self.route.pool_matched else None


class Backend(Protocol):
    """Workers of one API behind the router.

    Invariants: every request `run` counts in flight on a worker (`WorkerState.prefill_sent` /
    `decode_sent`) is uncounted exactly once, however it ends; a failure before anything reached
    the client raises `BeforeFirst`, after it a `kvpool.errors` error; the cost model learns only
    from successful prefills."""

    engine: str  # "reference" | "vllm"
    registers_itself: bool  # its workers join by POST /admin/workers; else the router keeps asking
    tenant_header: bool  # its workers take X-KVPool-Tenant; else a tenant goes by vLLM's cache_salt
    kv_events: bool  # its workers publish KV events to subscribe to (kv_events.py), not with their load
    http: aiohttp.ClientSession | None  # for calls off the request path (the dashboard's /metrics reads)

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def describe(self, url: str, role: str | None) -> wire.WorkerInfo:
        """What the worker at `url` serves (registration); `role`: as given, if the API cannot say."""

    async def tokenizer(self, url: str) -> wire.TokenizerInfo: ...

    async def poll(self, state: "WorkerState") -> tuple[wire.LoadReport, wire.EventsResponse | None]:
        """The worker's load, and its KV events since `state.events_since` if it sends them;
        `Unavailable` after `POLL_TIMEOUT_S` without an answer."""

    def run(self, host: Router, decision: "Decision", req: Request, out: Outcome) -> AsyncIterator[Piece]:
        """Execute `decision`: text pieces, the last with its finish reason."""


def client_session(headers: dict[str, str]) -> aiohttp.ClientSession:
    """A backend's aiohttp session (made on the event loop: in `start`)."""
    return aiohttp.ClientSession(
        headers=headers, connector=aiohttp.TCPConnector(limit=1024, ttl_dns_cache=300),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=READ_TIMEOUT_S))


async def get(http: aiohttp.ClientSession, url: str, path: str, timeout: float) -> bytes:
    """The body of a 200 answer to GET `url + path`; `Unavailable` otherwise (`WorkerRefused` when
    the connection is refused)."""
    try:
        async with http.get(url + path, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            body, status = await resp.read(), resp.status
    except aiohttp.ClientConnectorError as exc:
        raise WorkerRefused(f"worker {url} unreachable: {type(exc).__name__}: {exc}") from exc
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise Unavailable(f"worker {url} unreachable: {type(exc).__name__}: {exc}") from exc
    if status != 200:
        raise Unavailable(f"worker {url} answered {status} to {path}: {body[:200]!r}")
    return body


__all__ = ["Backend", "BeforeFirst", "Outcome", "Piece", "Request", "WorkerRefused", "client_session",
           "failed", "get", "unreachable"]
