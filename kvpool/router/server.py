"""Run the router process: bind first (so `--port 0` works and a taken port fails at once), serve
the app with uvicorn, announce the URL on stdout and, when asked, in a ready file (one atomic
rename of `{"url", "port", "pid"}`), and stop on SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

from kvpool.listen import bind, url_of, write_ready
from kvpool.router.app import create_app
from kvpool.router.service import Router, RouterConfig

log = logging.getLogger(__name__)


def serve(config: RouterConfig, *, host: str = "127.0.0.1", port: int = 0, ready_file: str | None = None,
          on_ready: Callable[[str], None] | None = None) -> None:
    import uvicorn

    sock = bind(host, port)
    actual = sock.getsockname()[1]
    url = url_of(host, sock)
    loop = "uvloop" if _has("uvloop") else "asyncio"
    server = uvicorn.Server(uvicorn.Config(create_app(Router(config)), log_level="warning", access_log=False,
                                           loop=loop, http="httptools" if _has("httptools") else "h11",
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
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
