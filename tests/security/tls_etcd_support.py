"""A real etcd serving clients over TLS with --client-cert-auth (as deploy/ runs it), for the
security tests: one place for its command line, its log and its readiness wait."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

from kvpool.tools.launch.processes import free_port


@contextlib.contextmanager
def tls_etcd(d: Path, *, cert: Path, key: Path, ca: Path, listen: str = "127.0.0.1",
             advertise: str = "127.0.0.1") -> Iterator[int]:
    """etcd with data and log under `d`, clients on https://`listen`:PORT (advertised as
    `advertise`) with server certificate `cert`/`key`, client certificates checked against `ca`;
    yields PORT once it accepts connections. The log tail is in the failure if etcd exits."""
    client, peer = free_port(), free_port()
    log_path = d / "etcd.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            ["etcd", "--name", "t", "--data-dir", str(d / "data"),
             "--listen-client-urls", f"https://{listen}:{client}", "--advertise-client-urls", f"https://{advertise}:{client}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"t=http://127.0.0.1:{peer}",
             "--cert-file", str(cert), "--key-file", str(key), "--client-cert-auth", "--trusted-ca-file", str(ca)],
            stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 20
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", client)) == 0:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-2000:]
            time.sleep(0.1)
        yield client
    finally:
        proc.terminate()
        proc.wait(10)
