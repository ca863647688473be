"""Run one worker process: load the model, connect to the pool, serve the HTTP API until SIGINT
or SIGTERM, then stop the engine thread and close the pool client.

The listening socket is bound before uvicorn starts, so `port=0` works: the real port is
reported through `on_ready(url)` and, when given, written to `ready_file` as JSON
(`{"url", "port", "pid", "role"}`, one atomic rename) once the server accepts connections.
That is how launchers and tests start workers on free ports without races.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Callable

from engine_adapters.serving.service import Worker, WorkerConfig

log = logging.getLogger(__name__)


def bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _write_ready(path: Path, doc: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def build_worker(config: WorkerConfig, *, model_cache: str | None = None, dtype: str = "float32") -> Worker:
    import kvpool
    from engine_adapters.model import load_reference_model

    started = time.perf_counter()
    rm = load_reference_model(cache_dir=model_cache, dtype=dtype)
    log.info("model %s loaded in %.1f s", rm.model_id, time.perf_counter() - started)
    pool = kvpool.connect(config.pool)
    return Worker(config, rm, pool)


def serve(config: WorkerConfig, *, host: str = "127.0.0.1", port: int = 0, ready_file: str | None = None,
          model_cache: str | None = None, dtype: str = "float32",
          on_ready: Callable[[str], None] | None = None) -> None:
    import uvicorn

    from engine_adapters.serving.app import create_app

    sock = bind(host, port)  # first, so a taken port fails before the slow model load
    worker = build_worker(config, model_cache=model_cache, dtype=dtype).start()
    actual = sock.getsockname()[1]
    url = f"http://{host}:{actual}"
    server = uvicorn.Server(uvicorn.Config(create_app(worker), log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=5))

    def announce() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.02)
        if server.started:
            if ready_file:
                _write_ready(Path(ready_file), {"url": url, "port": actual, "pid": os.getpid(), "role": config.role})
            log.info("%s worker serving at %s (pool %s)", config.role, url, config.pool)
            if on_ready is not None:
                on_ready(url)

    threading.Thread(target=announce, name="announce", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        worker.stop()
        try:
            worker.pool.close()
        except Exception as exc:  # closing a dead pool connection must not mask the exit
            log.debug("closing the pool client: %s", exc)
        sock.close()
