"""The records in the master's tables: an object (`ObjectEntry`, with its `Replica`s) and a store
node (`NodeEntry`). Plain data: the tables that hold them keep their invariants
(`kvpool.master.objects`, `nodes`, `leases`, `tombstones`; `kvpool.master.state` ties them).

- `ObjectEntry.leases` maps lease id -> monotonic expiry; while one is unexpired the object is
  neither evicted nor removed (a `remove` marks it `removing`, hides it from readers, and finishes
  when the last lease is released or expires).
- `NodeEntry.used` is the master's own account: bytes of replicas placed on the node (pending
  and complete). `capacity` comes from the node's registration.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

PENDING = "pending"
COMPLETE = "complete"

NODE_UP = "up"
NODE_DRAINING = "draining"


@dataclass
class Replica:
    node_id: str
    tier: str = "dram"
    segment: str = ""  # the node's segment (arena) name; "" until the write lands
    offset: int = -1  # offset in that segment; -1 while unknown (pending, or SSD tier)


@dataclass
class ObjectEntry:
    key: str
    size: int
    state: str
    replicas: dict[str, Replica]
    put_id: int = 0
    deadline: float = 0.0  # pending only: monotonic time after which the put is reclaimed
    token: int = 0  # pending only: the writer's id of the put (`PutStart.token`), 0: none
    leases: dict[int, float] = field(default_factory=dict)
    removing: bool = False
    last_access: float = field(default_factory=time.monotonic)
    created_at: float = field(default_factory=time.time)

    def visible(self) -> bool:
        return self.state == COMPLETE and not self.removing

    def leased(self, now: float) -> bool:
        if not self.leases:
            return False
        expired = [lid for lid, until in self.leases.items() if until <= now]
        for lid in expired:
            del self.leases[lid]
        return bool(self.leases)

    def lease_until(self) -> float:
        return max(self.leases.values(), default=0.0)


@dataclass
class NodeEntry:
    node_id: str
    address: str  # "host:port" of the node's RPC server
    hostname: str = ""  # the machine's name, for same-host (shm) detection by clients
    segments: list[str] = field(default_factory=list)
    shm_path: str | None = None  # the DRAM arena's /dev/shm file, mappable by same-host clients
    capacity: dict[str, int] = field(default_factory=dict)  # tier -> bytes
    used: int = 0  # bytes placed here by this master's account
    objects: int = 0
    state: str = NODE_UP
    last_heartbeat: float = field(default_factory=time.monotonic)
    registered_at: float = field(default_factory=time.time)
    stats: dict = field(default_factory=dict)  # the node's own last report (store.stats())
    transfer_segment: bytes | None = None  # the transfer engine's SegmentDescriptor, if any
    mark: int = 0  # the generation up to which every remove has reached the node (`MasterState`)

    @property
    def total_capacity(self) -> int:
        return sum(self.capacity.values())

    @property
    def free(self) -> int:
        free = sum(self.capacity.values()) - self.used
        return free if free > 0 else 0

    def to_dict(self, now: float) -> dict:
        return {
            "node_id": self.node_id,
            "address": self.address,
            "hostname": self.hostname,
            "state": self.state,
            "segments": list(self.segments),
            "shm_path": self.shm_path,
            "capacity": dict(self.capacity),
            "capacity_bytes": self.total_capacity,
            "used_bytes": self.used,
            "free_bytes": self.free,
            "objects": self.objects,
            "heartbeat_age_s": round(now - self.last_heartbeat, 3),
            "registered_at": self.registered_at,
            "stats": dict(self.stats),
        }
