"""Run an ASGI app (the admin app, a node's /metrics) with uvicorn in a background thread of the
calling process.

Invariants: `serve_in_thread` returns only once the socket is bound and the server accepts
connections (or raises `Unavailable`); `handle.port` is the real port even when 0 was asked;
`handle.stop()` is idempotent and returns once the thread has finished.

Protected mode: an app that declares `app.state.authenticated` (the admin app: whether a bearer
token is configured) is refused a non-loopback address while that is false.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

from kvpool.security.keyring import is_loopback
from kvpool.errors import InvalidArgument, Unavailable
from kvpool.listen import bind, url_of

log = logging.getLogger(__name__)


class ServerHandle:
    """A uvicorn server in a daemon thread; `.url`, `.port`, `.stop()`."""

    def __init__(self, app: Any, host: str, port: int):
        import uvicorn

        authenticated = getattr(getattr(app, "state", None), "authenticated", None)
        if authenticated is not None and not authenticated() and not is_loopback(host):
            raise InvalidArgument(
                f"admin API: refusing to listen on {host} without a bearer token (protected mode): anyone who "
                "reaches it could list keys and evict everything. Either listen on 127.0.0.1, set admin_port = 0, "
                "or give it a token in a file: KVPOOL_ADMIN_TOKEN_FILE=admin.token (`kvpool auth init` writes "
                "one; see docs/security.md).")
        try:  # bound here so port 0 works and the port is known before the thread starts
            self._sock = bind(host, port)
        except OSError as exc:
            raise Unavailable(f"HTTP server cannot listen on {host}:{port}: {exc.strerror}") from None
        self.port = self._sock.getsockname()[1]
        self.url = url_of(host, self._sock)
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                                timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name=f"http-{self.port}", daemon=True)
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except BaseException as exc:  # surfaced by start(); a thread's exception is otherwise lost
            self._error = exc
            log.exception("HTTP server on port %d stopped with an error", self.port)

    def start(self, timeout: float = 10.0) -> "ServerHandle":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if self._error is not None or not self._thread.is_alive():
                raise Unavailable(f"HTTP server on port {self.port} failed to start: {self._error!r}")
            if time.monotonic() > deadline:
                self.stop()
                raise Unavailable(f"HTTP server on port {self.port} did not start within {timeout}s")
            time.sleep(0.01)
        log.info("serving HTTP at %s", self.url)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        with contextlib.suppress(OSError):
            self._sock.close()


def serve_in_thread(app: Any, host: str = "127.0.0.1", port: int = 0) -> ServerHandle:
    """Serve `app` on host:port from a daemon thread; returns when it accepts connections."""
    return ServerHandle(app, host, port).start()
