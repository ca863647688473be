"""Helpers the worker tests import (a module name no other test folder uses, unlike `conftest`)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class RecordingRouter:
    """A tiny real HTTP server standing in for the router: records every POST (time, path, JSON
    body) and answers 503 to the first `fail_first` ones, then 200 `{}`."""

    def __init__(self, port: int = 0, fail_first: int = 0):
        self.posts: list[tuple[float, str, dict]] = []
        self.fail_first = fail_first
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
                with lock:
                    outer.posts.append((time.monotonic(), self.path, body))
                    failing = len(outer.posts) <= outer.fail_first
                reply = b'{"code": "unavailable", "message": "starting"}' if failing else b"{}"
                self.send_response(503 if failing else 200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def paths(self) -> list[str]:
        return [p for _, p, _ in self.posts]

    def wait_for(self, predicate, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self):
                return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
