"""Run the router process: bind first (so `--port 0` works and a taken port fails at once), serve
the app with uvicorn, announce the URL on stdout and, when asked, in a ready file (one atomic
rename of `{"url", "port", "pid"}`), and stop on SIGINT/SIGTERM.

Protected mode: a non-loopback address needs a keyring whose tenants have API keys (else the
OpenAI API, and through it every worker, would be open to whoever reaches the address)."""

from __future__ import annotations

import gc
import importlib.util
import logging
import os
import threading
import time
from typing import Callable

from kvpool.security.keyring import AUTH_FILE_ENV, is_loopback
from kvpool.errors import InvalidArgument
from kvpool.listen import bind, url_of, write_ready
from kvpool.router.app import create_app
from kvpool.router.service import Router, RouterConfig

log = logging.getLogger(__name__)


def serve(config: RouterConfig, *, host: str = "127.0.0.1", port: int = 0, ready_file: str | None = None,
          on_ready: Callable[[str], None] | None = None) -> None:
    import uvicorn

    router = Router(config)
    if not router.tenants.api_keys and not is_loopback(host):
        raise InvalidArgument(
            f"kvpool router: refusing to listen on {host} without API keys (protected mode): anyone who reaches "
            f"it could use the workers and the pool. Either listen on 127.0.0.1, or create a keyring with tenants "
            f"(`kvpool auth init --out DIR --tenant NAME`) and set {AUTH_FILE_ENV}=DIR/keyring.toml "
            "(see docs/security.md).")
    sock = bind(host, port)
    actual = sock.getsockname()[1]
    url = url_of(host, sock)
    loop = "uvloop" if _has("uvloop") else "asyncio"
    server = uvicorn.Server(uvicorn.Config(create_app(router), log_level="warning", access_log=False,
                                           proxy_headers=False, loop=loop, http="httptools" if _has("httptools") else "h11",
                                           timeout_graceful_shutdown=5))

    def announce() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.02)
        if server.started:
            if ready_file:
                write_ready(ready_file, {"url": url, "port": actual, "pid": os.getpid()})
            log.info("router (%s) serving at %s, pool %s", config.policy, url, config.pool or "none")
            if on_ready is not None:
                on_ready(url)

    threading.Thread(target=announce, name="announce", daemon=True).start()
    # What exists now (modules, the app) lives as long as the process: out of the collector's
    # full passes, which would otherwise walk all of it in the middle of some request's route.
    gc.collect()
    gc.freeze()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None
