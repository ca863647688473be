"""Listening sockets and ready files for the HTTP services (router, workers).

A service binds before anything slow (a taken port fails at once, and port 0 gets a free port),
then announces where it listens in a ready file written with one atomic rename, so launchers and
tests start services on free ports without races or partial reads.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path


def bind(host: str, port: int, backlog: int = 1024) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


def url_of(host: str, sock: socket.socket) -> str:
    return f"http://{'[' + host + ']' if ':' in host else host}:{sock.getsockname()[1]}"


def write_ready(path: str | os.PathLike, doc: dict) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)
