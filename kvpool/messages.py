"""Wire messages of the pool RPC (client <-> master, client <-> node, node <-> master).

Every message is a `msgspec.Struct` tagged with its class name and encoded as a msgpack array.
The protocol version (`PROTOCOL_VERSION`) travels in every frame header (`kvpool.rpc.frame`) and is
checked first; `Hello` repeats it so a client learns the server's version before anything else.
Bulk bytes never go inside a message: they follow it in the same frame as a raw payload, and
messages say how the payload is cut (`sizes`).

Conventions: batch messages carry parallel lists (`keys[i]`, `sizes[i]`, ...) and replies keep
input order; a size of -1 means "absent" (a miss), never an error.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import msgspec

from kvpool.errors import InvalidArgument, KVPoolError

PROTOCOL_VERSION = 1


class Msg(msgspec.Struct, tag=True, array_like=True):
    """Base of all wire messages."""


# ---- generic replies -------------------------------------------------------------------------

class Ok(Msg):
    pass


class Err(Msg):
    """A typed error: `code` is a `kvpool.errors` code, rebuilt by `error_from_code`."""

    code: str
    message: str


def per_item(one: Callable[..., Any], *columns: Sequence[Any]) -> list[Any]:
    """`one(*row)` for each row of the parallel `columns`, a `KVPoolError` becoming that row's
    `Err`: a batch answers per item, so one bad key never fails the others. Columns of
    different lengths are a malformed message (`InvalidArgument`)."""
    if len({len(c) for c in columns}) > 1:
        raise InvalidArgument(f"a batch message's lists must have the same length, got {[len(c) for c in columns]}")
    out: list[Any] = []
    for row in zip(*columns):
        try:
            out.append(one(*row))
        except KVPoolError as exc:
            out.append(Err(exc.code, str(exc)))
    return out


class Bools(Msg):
    values: list[bool]


class Count(Msg):
    n: int


class Info(Msg):
    """A free-form JSON-able document (stats, admin answers)."""

    doc: dict[str, Any]


# ---- shared records --------------------------------------------------------------------------

class NodeInfo(Msg):
    node_id: str
    address: str  # host:port of the node's RPC server
    hostname: str
    segments: list[str]
    shm_path: Union[str, None]
    capacity: dict[str, int]  # tier -> bytes
    transfer_segment: Union[bytes, None] = None  # transfer engine SegmentDescriptor.to_bytes()
    index_path: Union[str, None] = None  # the DRAM index same-host readers map (kvpool.shm.index)
    unix: Union[str, None] = None  # the node RPC's unix socket, for same-host clients (kvpool.rpc)
    host_id: str = ""  # the node's host (`transfer.route.local_host_id`): who is on the same host
    read_address: Union[str, None] = None  # host:port of its read workers' port for `NodeGet` (kvpool.node.readers)


class Held(Msg):
    """One object a node holds: reported on (re-)registration so a new master loses nothing."""

    key: str
    size: int
    tier: str
    put_id: int


class Placed(Msg):
    """Where a write landed (one replica)."""

    node_id: str
    tier: str
    segment: str
    offset: int


class Target(Msg):
    node_id: str
    address: str
    ticket: bytes = b""  # the master's put ticket for this node (`kvpool.security.tickets`; auth on)


class PutPlan(Msg):
    put_id: int  # 0 with exists=True: the key is already complete, nothing to write
    targets: list[Target]
    exists: bool = False


class Location(Msg):
    node_id: str
    address: str
    tier: str
    offset: int


class Entry(Msg):
    size: int
    locations: list[Location]


# ---- master requests -------------------------------------------------------------------------

class Hello(Msg):
    version: int
    client: str = ""


class HelloReply(Msg):
    version: int
    roles: list[str]  # "master", "node" (embedded: both)
    leader: bool  # this master is the leader (always true in embedded mode)
    node: Union[NodeInfo, None]  # set when the server is (also) a node
    max_object_bytes: int
    replicas: int  # default replica count
    hostname: str = ""  # the server's machine, for people (same host is `host_id`)
    unix: Union[str, None] = None  # the server's unix socket (kvpool.rpc), for same-host clients
    scope: str = ""  # how the pool stores this client's keys: "<tenant>\x00" + key ("": unscoped; kvpool.security.authz)
    host_id: str = ""  # the server's host (`transfer.route.local_host_id`): who is on the same host


class PutStart(Msg):
    keys: list[str]
    sizes: list[int]
    replicas: int = 0  # 0: the master's default
    writer_node: str = ""  # the writer's node id when it is itself a node (local-first)
    token: int = 0  # the writer's random id of this put, the same on its retries (0: none)


class PutPlans(Msg):
    plans: list[Union[PutPlan, Err]]


class PutEnd(Msg):
    keys: list[str]
    put_ids: list[int]
    written: list[list[Placed]]  # per key: the replicas that landed; empty = abort


class BatchResult(Msg):
    errors: list[Union[Err, None]]


class Lookup(Msg):
    keys: list[str]
    release: list[int] = []  # lease ids the client is done with (piggy-backed)
    lease: bool = True


class LookupReply(Msg):
    lease_id: int  # 0: no lease taken
    entries: list[Union[Entry, None]]


class Release(Msg):
    """One-way: lease ids the client is done with."""

    lease_ids: list[int]


class Exists(Msg):
    keys: list[str]


class MatchPrefix(Msg):
    keys: list[str]


class Remove(Msg):
    keys: list[str]


class RegisterNode(Msg):
    info: NodeInfo
    objects: list[Held]
    mark: int = 0  # the last mark a master granted this node (`HeartbeatReply.mark`); 0: none


class Heartbeat(Msg):
    node_id: str
    stats: dict[str, Any]
    dropped: list[Held] = []  # objects the node no longer holds (evicted by its own policy)
    moved: list[Held] = []  # objects whose tier changed (demoted / promoted)


class HeartbeatReply(Msg):
    known: bool  # False: the master does not know this node (or lost track of it); it must register again
    # Every remove up to this generation has reached the node; it refuses writes of puts up to
    # it from now on (`kvpool.master.state`). 0: no news.
    mark: int = 0


class Admin(Msg):
    """An admin call by method name (see `MasterService` admin methods)."""

    method: str
    args: dict[str, Any] = {}


# ---- node requests ---------------------------------------------------------------------------

class NodeGet(Msg):
    """Reply: `NodeData`, payload = the found values back to back."""

    keys: list[str]
    unpin: list[int] = []


class NodeData(Msg):
    sizes: list[int]  # -1: absent; from a node's read port -1 is "not here, ask the node", ABSENT is absent
    ssd: list[int] = []  # positions the node read from its SSD tier (the rest of the hits: DRAM)


ABSENT = -3  # a `NodeData` size from a node's read port: the node has no such object (`kvpool.node.readers`)


class NodePin(Msg):
    """Pin objects in the DRAM arena for a reader that copies them itself (a same-host reader
    through shm, or any reader through the transfer engine). Reply: `Pins`. `inline=False`:
    pin every hit, none rides in the payload (the engine data path reads them all)."""

    keys: list[str]
    unpin: list[int] = []
    inline: bool = True


class Pins(Msg):
    """offsets[i] == -1 with sizes[i] >= 0: the object is small and follows in the payload.
    `grants[i]`: the node's READ grant of that range (`transfer.grant`) when its transfer engine
    requires grants (authentication on); empty otherwise."""

    pin_id: int
    offsets: list[int]
    sizes: list[int]  # -1: absent
    grants: list[bytes] = []
    ssd: list[int] = []  # positions the node read from its SSD tier (promoted, or inline copies)


class NodeUnpin(Msg):
    """One-way. `touched`: keys a same-host reader read through the shm index since its last
    report (counted as hits; recency for eviction)."""

    pin_ids: list[int]
    touched: list[str] = []


class NodeWrite(Msg):
    """Payload = the values back to back, each written under the put the master granted
    (`PutStart`; a node refuses put id 0). `tickets[i]`: the plan's ticket for this node (a
    cluster node with a keyring takes no write without one). Reply: `WriteReply`."""

    keys: list[str]
    sizes: list[int]
    put_ids: list[int]
    replicas: int = 0
    tickets: list[bytes] = []


class NodeReserve(Msg):
    """Engine data path, phase 1 at a node: reserve arena space for each object under its
    granted put; the writer then moves the bytes with the transfer engine and ends with
    `NodeCommit`. Reply: `Slots`."""

    keys: list[str]
    sizes: list[int]
    put_ids: list[int]
    replicas: int = 0
    unpin: list[int] = []
    tickets: list[bytes] = []  # as `NodeWrite.tickets`


class Slot(Msg):
    """Where to write one object: arena `offset` in the node's transfer segment, for put `put_id`.
    offset == -1: the key is already complete, nothing to write."""

    put_id: int
    offset: int
    grant: bytes = b""  # the node's WRITE grant of [offset, +size) until the put's deadline (auth on)


class Slots(Msg):
    results: list[Union[Slot, Err]]
    segment: Union[bytes, None]  # the node's transfer engine SegmentDescriptor.to_bytes()


class NodeCommit(Msg):
    """Engine data path, phase 2 at a node: ok[i] -> the bytes of put_ids[i] are in place, commit
    them (embedded mode: and publish); not ok -> abort the reservation. Reply: `WriteReply`."""

    keys: list[str]
    put_ids: list[int]
    ok: list[bool]


class WriteReply(Msg):
    results: list[Union[Placed, Err]]


class Put(Msg):
    """`PutStart`, `NodeWrite` and `PutEnd` in one frame, to a server that is the master and the
    node at once (embedded, `kvpool.embedded`): it starts the puts at its master, writes the
    payload (the values back to back) into its node under the granted put ids, and ends them,
    as the three messages would. Reply: `WriteReply` (an already complete key: a `Placed` with
    offset -1 and no tier)."""

    keys: list[str]
    sizes: list[int]
    replicas: int = 0
    token: int = 0  # as `PutStart.token`


class PutReserve(Msg):
    """`PutStart` and `NodeReserve` in one frame, to an embedded pool (as `Put`): the engine
    path's put starts at the master and reserves the node's arena under the granted put ids.
    Reply: `Slots` (`Slot.put_id`: the granted put; offset -1: complete already, nothing to do)."""

    keys: list[str]
    sizes: list[int]
    replicas: int = 0
    token: int = 0  # as `PutStart.token`
    unpin: list[int] = []


class PutCommit(Msg):
    """`NodeCommit` and `PutEnd` in one frame, to an embedded pool: ok[i] -> commit the bytes of
    put_ids[i] and end that put (published); not ok -> abort both. Reply: `WriteReply`."""

    keys: list[str]
    put_ids: list[int]
    ok: list[bool]


class NodeRemove(Msg):
    """Remove objects, each only if it is still the copy written by `put_ids[i]` (0: any)."""

    keys: list[str]
    put_ids: list[int]


class NodeCopy(Msg):
    """Pull objects from the node at `source` and store them here under the same put ids (a
    drain). Reply: `WriteReply`, one entry per key."""

    keys: list[str]
    put_ids: list[int]
    source: str


class NodeStats(Msg):
    pass


Request = Union[
    Hello, PutStart, PutEnd, Lookup, Release, Exists, MatchPrefix, Remove, RegisterNode, Heartbeat,
    Admin, NodeGet, NodePin, NodeUnpin, NodeWrite, NodeRemove, NodeCopy, NodeStats, NodeReserve, NodeCommit, Put,
    PutReserve, PutCommit,
]
Reply = Union[
    Ok, Err, Bools, Count, Info, HelloReply, PutPlans, BatchResult, LookupReply, HeartbeatReply,
    NodeData, Pins, WriteReply, Slots,
]
