"""A real `kvpool serve` for the data-plane and limits attacks: with or without a keyring, with
extra `KVPOOL_*` settings in its environment (limits, deadlines), its process id for /proc."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvpool.messages import NodeStats
from kvpool.rpc import RpcClient
from pool_auth_support import clean_env, cred
from transfer import SegmentDescriptor


class Serve:
    def __init__(self, log: Path, keyring: Path | None = None, env: dict[str, str] | None = None, *args: str):
        extra = dict(env or {})
        if keyring is not None:
            extra["KVPOOL_AUTH_FILE"] = str(keyring)
        self.keyring = keyring
        self.log = log
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("kvpool")), "--log-level", "INFO", "serve", "--port", "0",
             "--admin-port", "0", *args],
            stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, env=clean_env(**extra))
        line = self.proc.stdout.readline().strip()
        if not line.startswith("kvpool serving at "):
            self.stop()
            raise AssertionError(f"kvpool serve did not start: {line!r}\n{log.read_text()[-3000:]}")
        self.address = line.rsplit(" ", 1)[1]
        host, _, port = self.address.rpartition(":")
        self.host, self.port = host, int(port)
        self.pid = self.proc.pid

    def stats(self) -> dict:
        rpc = RpcClient(self.address, credential=cred("node") if self.keyring else None)
        try:
            return rpc.call(NodeStats()).doc
        finally:
            rpc.close()

    def segment(self) -> SegmentDescriptor:
        """The node's arena as the transfer engine serves it (what `Hello`/`NodeStats` hand out)."""
        return SegmentDescriptor.from_bytes(self.stats()["transfer_segment"])

    def rss_anon(self) -> int:
        """Private memory (heap, stacks): what an allocation costs; the arena is shared memory."""
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no RssAnon")

    def log_text(self) -> str:
        return self.log.read_text()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
