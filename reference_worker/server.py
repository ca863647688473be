"""Run one worker process: load the model, connect to the pool, serve the HTTP API until SIGINT
or SIGTERM, drain, then stop the engine thread and close the pool client.

The listening socket is bound before uvicorn starts, so `port=0` works: the real port is
reported through `on_ready(url)` and, when given, written to `ready_file` as JSON
(`{"url", "port", "pid", "role"}`, one atomic rename) once the server accepts connections.
That is how launchers and tests start workers on free ports without races.

Shutdown is a drain: the first SIGTERM/SIGINT makes the worker refuse new work (503, /health
503 "draining"), tells the router (`POST {router}/admin/workers/drain`, best effort), waits until
nothing accepted is in flight (at most `[worker] drain_timeout_s`), then stops uvicorn; the process exits 0.
A second signal stops at once. uvicorn's own signal handlers are switched off for this: they
would stop the server at the first signal and re-raise it after shutdown (a non-zero exit).

With a router, the worker registers itself once serving (`POST {router}/admin/workers {"url"}`),
every 1 s until the router answers, then again every 5 s, so a restarted router relearns it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from typing import Any, Callable, Iterator

from reference_worker.config import NO_POOL
from reference_worker.service import Worker, WorkerConfig
from kvpool.config import Settings, default
from kvpool.security.keyring import check_bind, load_keyring
from kvpool.security.http_guard import internal_headers
from kvpool.listen import bind, url_of, write_ready

log = logging.getLogger(__name__)


class RouterRegistration:
    """Keeps this worker known to a router, from a daemon thread; failures are logged, never raised.

    Invariant: once `drain()` has begun no register POST is sent any more (the loop is stopped and
    joined before the drain POST), so a router never re-adds a worker that asked to leave.
    """

    RETRY_S = 1.0  # router unreachable or answering 5xx
    REFRESH_S = 5.0  # registered: repeat, so a restarted router relearns this worker

    def __init__(self, router_url: str, worker_url: str, timeout_s: float = 2.0):
        self.router_url = router_url.rstrip("/")
        self.worker_url = worker_url
        self.timeout_s = timeout_s
        self._stop = threading.Event()
        self._lock = threading.Lock()  # start vs stop from different threads (announce, drain)
        self._thread: threading.Thread | None = None
        self._failing = False
        self._registered = False
        self._client: Any = None  # one httpx.Client: a new one per POST built a TLS context each time (~20 ms)

    def start(self) -> None:
        with self._lock:
            if self._stop.is_set() or self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="router-registration", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stop.set()
            thread = self._thread
        if thread is not None:
            thread.join(self.timeout_s + 1)

    def drain(self) -> None:
        """Stop registering, then tell the router this worker is leaving (best effort)."""
        self.stop()
        self._post("/admin/workers/drain")
        if self._client is not None:
            self._client.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            registered = self._post("/admin/workers")
            self._stop.wait(self.REFRESH_S if registered else self.RETRY_S)

    def _post(self, path: str) -> bool:
        """True when the router answered below 500 (a 4xx is logged: retrying soon will not fix it)."""
        import httpx

        url = self.router_url + path
        if self._client is None:  # used by one thread at a time: the loop's, then drain()'s after join
            self._client = httpx.Client(timeout=self.timeout_s)
        try:
            resp = self._client.post(url, json={"url": self.worker_url},
                                     headers=internal_headers())  # the router's /admin needs it with a keyring
        except httpx.HTTPError as exc:
            self._failed(f"POST {url}: {type(exc).__name__}: {exc}")
            return False
        if resp.status_code >= 500:
            self._failed(f"POST {url}: HTTP {resp.status_code} {resp.text[:200]}")
            return False
        if resp.status_code >= 400:
            log.warning("router refused POST %s for %s: HTTP %d %s", url, self.worker_url, resp.status_code,
                        resp.text[:200])
        elif self._failing or not self._registered or path.endswith("/drain"):  # not every 5 s refresh
            log.info("POST %s for %s: ok", url, self.worker_url)
            self._registered = True
        self._failing = False
        return True

    def _failed(self, what: str) -> None:
        # once per outage at warning level: an absent router would otherwise log every second
        log.log(logging.DEBUG if self._failing else logging.WARNING, "%s (retrying)", what)
        self._failing = True


def _make_server(config: Any) -> Any:
    """uvicorn's Server minus its signal handling (see the module docstring); defined here so that
    importing this module does not import uvicorn."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server(config)


class _Drain:
    """What the first SIGTERM/SIGINT starts (in its own thread: a signal handler must return fast)."""

    def __init__(self, worker: Worker, server: Any, registration: RouterRegistration | None, timeout_s: float):
        self.worker = worker
        self.server = server
        self.registration = registration
        self.timeout_s = timeout_s
        self._thread: threading.Thread | None = None

    def on_signal(self, signum: int, frame: Any) -> None:
        if self._thread is not None:
            log.warning("signal %d during the drain: stopping now", signum)
            self.server.force_exit = True
            self.server.should_exit = True
            return
        log.info("signal %d: draining (at most %.0f s)", signum, self.timeout_s)
        self._thread = threading.Thread(target=self._run, name="drain", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        self.worker.start_drain()  # before telling the router: what it still sends gets a 503, not lost
        if self.registration is not None:
            self.registration.drain()
        if self.worker.wait_idle(max(0.0, self.timeout_s - (time.monotonic() - started))):
            log.info("drained in %.2f s", time.monotonic() - started)
        else:
            log.warning("drain timed out after %.0f s with %d requests/streams in flight; stopping anyway",
                        self.timeout_s, self.worker.admission.in_flight)
        self.server.should_exit = True


@contextlib.contextmanager
def _signals_to(handler: Callable[[int, Any], None]) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():  # only the main thread may; then no drain
        log.warning("serving from a non-main thread: SIGTERM/SIGINT will not drain this worker")
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def build_worker(config: WorkerConfig, *, model_cache: str | None = None, dtype: str = default("worker.dtype")) -> Worker:
    import kvpool
    from reference_worker.model import load_reference_model

    started = time.perf_counter()
    rm = load_reference_model(cache_dir=model_cache, dtype=dtype)
    log.info("model %s loaded in %.1f s", rm.model_id, time.perf_counter() - started)
    # untenanted requests; with a keyring, each tenant gets its own (and a keyring of tenants only,
    # no principal of the worker's own, serves no untenanted request: no client for them)
    keyring = load_keyring()
    own = keyring.own_credential() if keyring is not None else None
    pooled = config.pool != NO_POOL and (keyring is None or own is not None)
    pool = kvpool.connect(config.pool, credential=own) if pooled else None
    return Worker(config, rm, pool, keyring=keyring)


def serve(settings: Settings, role: str, *, ready_file: str | None = None,
          on_ready: Callable[[str], None] | None = None) -> None:
    """Serve a `role` worker as `settings` say ([worker], [pool]) until a signal, then drain (see
    the module docstring). Signals drain only when this runs on the main thread (the only one that
    may install signal handlers)."""
    import uvicorn

    from reference_worker.app import create_app

    w, config = settings.worker, WorkerConfig.from_settings(settings, role)
    check_bind(w.host, load_keyring() is not None, "kvpool worker")  # protected mode
    sock = bind(w.host, w.port)  # first, so a taken port fails before the slow model load
    if w.cpus:
        from reference_worker.cpus import parse, pin

        log.info("pinned to cores %s with %d torch thread(s)", w.cpus, pin(parse(w.cpus), w.threads))
    elif w.threads:
        import torch

        torch.set_num_threads(w.threads)
    worker = build_worker(config, model_cache=w.model_cache, dtype=w.dtype).start()
    actual = sock.getsockname()[1]
    url = url_of(w.host, sock)
    server = _make_server(uvicorn.Config(create_app(worker), log_level="warning", access_log=False,
                                         timeout_graceful_shutdown=5))
    registration = RouterRegistration(w.router, url) if w.router else None
    if registration is not None:  # httpx logs every request at INFO: one line per 5 s refresh, forever
        logging.getLogger("httpx").setLevel(logging.WARNING)
    drain = _Drain(worker, server, registration, w.drain_timeout_s)

    def announce() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.02)
        if server.started:
            if ready_file:
                write_ready(ready_file, {"url": url, "port": actual, "pid": os.getpid(), "role": config.role})
            log.info("%s worker serving at %s (pool %s)", config.role, url, config.pool)
            if on_ready is not None:
                on_ready(url)
            if registration is not None:
                registration.start()  # no-op once a drain has stopped it

    threading.Thread(target=announce, name="announce", daemon=True).start()
    try:
        with _signals_to(drain.on_signal):
            server.run(sockets=[sock])
    finally:
        if registration is not None:
            registration.stop()
        worker.stop()
        try:
            worker.pool.close()
        except Exception as exc:  # closing a dead pool connection must not mask the exit
            log.debug("closing the pool client: %s", exc)
        sock.close()
