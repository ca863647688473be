"""Acknowledged removes, remembered in etcd until every node has dropped its copy.

A master drops a removed object from its table at once, but the nodes drop their copies later
(its outbox, or when the last reader's lease ends). If the leader dies in between, a node
re-reports the copy to the next leader, and the removed object would come back (found by
issue 14's chaos campaign). So the leader writes `REMOVED_PREFIX<put id>/<key>` before it
answers a remove, deletes it once every replica's node confirmed, and a new leader reads them
all and refuses those copies in the nodes' re-reports (`MasterService.register_node`).

Every record is bound to a shared lease of `ttl_s` (renewed by a fresh grant every `ttl_s / 2`),
so a record whose node never confirms (gone for good, or the leader died) ends by itself within
`ttl_s`: a node that re-reports later than that can still bring a removed object back.
"""

from __future__ import annotations

import logging
import threading
import time

from kvpool.cluster.etcd import EtcdClient
from kvpool.errors import KVPoolError

log = logging.getLogger(__name__)

REMOVED_PREFIX = "/kvpool/removed/"


class RemovalLog:
    def __init__(self, etcd: EtcdClient, ttl_s: float):
        self.etcd = etcd
        self.ttl_s = max(2, int(ttl_s))
        self._lease = 0
        self._lease_renew_at = 0.0
        self._lock = threading.Lock()

    @staticmethod
    def _name(key: str, put_id: int) -> str:
        return f"{REMOVED_PREFIX}{put_id:x}/{key}"

    def record(self, removed: dict[str, int]) -> None:
        """Remember `{key: put id}` (raises `Unavailable` when etcd cannot be written)."""
        with self._lock:
            now = time.monotonic()
            if not self._lease or now >= self._lease_renew_at:
                self._lease = self.etcd.grant(self.ttl_s)
                self._lease_renew_at = now + self.ttl_s / 2
            lease = self._lease
        try:
            self.etcd.put_many({self._name(k, p): b"" for k, p in removed.items()}, lease=lease)
        except KVPoolError:
            with self._lock:
                self._lease = 0  # perhaps the lease is gone (an etcd restart that lost it): grant anew
            raise

    def forget(self, done: list[tuple[str, int]]) -> None:
        """Every node confirmed these (key, put id) removals; best effort (the lease ends them anyway)."""
        try:
            self.etcd.delete_many([self._name(k, p) for k, p in done])
        except KVPoolError as exc:
            log.info("forgetting %d removal(s) in etcd failed (their lease ends them): %s", len(done), exc)

    def load(self) -> list[tuple[str, int]]:
        """Every (key, put id) removal still remembered."""
        out = []
        for name in self.etcd.get_prefix(REMOVED_PREFIX):
            put_id, _, key = name[len(REMOVED_PREFIX):].partition("/")
            try:
                out.append((key, int(put_id, 16)))
            except ValueError:
                continue
        return out
