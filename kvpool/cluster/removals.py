"""Acknowledged removes, remembered in etcd for the next leader.

A master drops a removed object from its table at once, but the nodes drop their copies later
(its outbox, or when the last reader's lease ends), and a node the master did not know held a
copy (dropped while paused, or not yet re-reported after a failover) is never told. If such a
node re-reports the copy to the next leader, the removed object would come back (found by
issue 14's chaos campaign). So the leader writes `REMOVED_PREFIX<put id hex>/<key>` before it
answers a remove, and a new leader reads them all and refuses those copies in the nodes'
re-reports (`MasterService.register_node`).

Every record is bound to a shared lease of `ttl_s` (a fresh one granted every `ttl_s / 2`), so it
lives between `ttl_s / 2` and `ttl_s`; etcd forgets it by itself. Known limit: a node that
re-reports a removed copy later than that can still bring it back.
"""

from __future__ import annotations

import threading
import time

from kvpool.cluster.etcd import EtcdClient
from kvpool.errors import KVPoolError

REMOVED_PREFIX = "/kvpool/removed/"


class RemovalLog:
    def __init__(self, etcd: EtcdClient, ttl_s: float):
        self.etcd = etcd
        self.ttl_s = max(2, int(ttl_s))
        self._lease = 0
        self._lease_renew_at = 0.0
        self._lock = threading.Lock()

    def record(self, removed: dict[str, int]) -> None:
        """Remember `{key: put id}` (raises `Unavailable` when etcd cannot be written)."""
        with self._lock:
            now = time.monotonic()
            if not self._lease or now >= self._lease_renew_at:
                self._lease = self.etcd.grant(self.ttl_s)
                self._lease_renew_at = now + self.ttl_s / 2
            lease = self._lease
        try:
            self.etcd.put_many({f"{REMOVED_PREFIX}{p:x}/{k}": b"" for k, p in removed.items()}, lease=lease)
        except KVPoolError:
            with self._lock:
                self._lease = 0  # perhaps the lease is gone (an etcd restart that lost it): grant anew
            raise

    def load(self) -> list[tuple[str, int]]:
        """Every (key, put id) remove still remembered."""
        out = []
        for name in self.etcd.get_prefix(REMOVED_PREFIX):
            put_id, _, key = name[len(REMOVED_PREFIX):].partition("/")
            try:
                out.append((key, int(put_id, 16)))
            except ValueError:
                continue
        return out
