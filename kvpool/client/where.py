"""Where objects live: the client's first question, before any byte moves.

- `MasterWhere`: `Lookup` gives each key's replicas and a lease over the hits (released with the
  next lookup), `PutStart` places a put, `PutEnd` publishes the replicas that landed.
- `EmbeddedWhere` (master and its only node share one server): every key is at that node, which
  checks visibility itself: a local answer, no round trip. Puts take the master's protocol all
  the same (`MasterWhere.plan` / `publish`, answered by that server; over the RPC paths both ride
  with the write in one `Put` frame, `kvpool.embedded`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from kvpool.errors import ObjectTooLarge, error_from_code
from kvpool.messages import Err, Lookup, Placed, PutEnd, PutStart
from kvpool.rpc import RpcClient


@dataclass
class Plan:
    put_id: int = 0
    targets: list[str] = field(default_factory=list)  # node addresses to write to
    exists: bool = False  # already complete: nothing to write
    error: Exception | None = None  # refused before any byte moved
    tickets: dict[str, bytes] | None = None  # node address -> the master's put ticket (auth on)

    @property
    def to_write(self) -> bool:
        return self.error is None and not self.exists


class EmbeddedWhere:
    """`address`: the pool's (and its node's); `max_object_bytes`: the node's largest object."""

    def __init__(self, address: str, max_object_bytes: int = 0):
        self.address = address
        self.max_object_bytes = max_object_bytes
        self._here = [address]  # shared by every key's answer (read, never changed)

    def find(self, master: RpcClient, keys: Sequence[str]) -> list[list[str]]:
        return [self._here] * len(keys)

    def too_large(self, sizes: Sequence[int]) -> list[Exception | None]:
        """Per value: the error of one larger than the pool's largest object, else None. The bytes
        travel in the first message (`Put`): a hopeless put is refused before sending them."""
        limit = self.max_object_bytes
        return [ObjectTooLarge(f"value of {n} bytes is larger than the pool's largest object ({limit} bytes)")
                if limit and n > limit else None for n in sizes]


class MasterWhere:
    """`leases`: lease ids to release, shared with the client (it also releases them itself
    before a remove and on close)."""

    def __init__(self, leases: list[int], writer_node: str = ""):
        self.leases = leases
        self.writer_node = writer_node  # placement prefers this node (a writer that is itself a node)

    def find(self, master: RpcClient, keys: Sequence[str]) -> list[list[str]]:
        release, self.leases[:] = list(self.leases), []
        reply = master.call(Lookup(list(keys), release=release))
        if reply.lease_id:
            self.leases.append(reply.lease_id)
        return [[loc.address for loc in e.locations] if e is not None else [] for e in reply.entries]

    def plan(self, master: RpcClient, keys: Sequence[str], sizes: Sequence[int], replicas: int,
             token: int = 0) -> list[Plan]:
        """`token`: the put's id, the same on its retries (`MasterService.put_start`)."""
        plans = master.call(PutStart(list(keys), list(sizes), replicas, self.writer_node, token)).plans
        return [Plan(error=error_from_code(p.code, p.message)) if isinstance(p, Err)
                else Plan(p.put_id, [t.address for t in p.targets], p.exists,
                          tickets={t.address: t.ticket for t in p.targets} if p.targets and p.targets[0].ticket
                          else None)
                for p in plans]

    def publish(self, master: RpcClient, keys: Sequence[str], plans: Sequence[Plan], written: list[list[Placed]],
                errors: list[Exception | None]) -> list[Exception | None]:
        pending = [i for i, p in enumerate(plans) if p.to_write]
        if pending:
            end = master.call(PutEnd([keys[i] for i in pending], [plans[i].put_id for i in pending],
                                     [written[i] for i in pending]))
            for i, err in zip(pending, end.errors):
                if err is not None:
                    errors[i] = error_from_code(err.code, err.message)
                elif written[i]:
                    errors[i] = None  # published: a failed extra replica does not fail the put
        return errors
