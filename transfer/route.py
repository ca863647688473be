"""Which way bytes go to a peer: the one definition of "same host" and of the route order.

A host is one running kernel. `local_host_id()` is this machine's name and its kernel's boot
id (/proc/sys/kernel/random/boot_id): processes with equal ids share /dev/shm files; a machine
that rebooted, or another one that bears the same name, has another id. Peers publish theirs
(a transfer `SegmentDescriptor.host_id`; the pool's servers in `HelloReply`, `NodeInfo` and
`NodeStats`) and everyone compares them with `same_host`, never host names or addresses.

`route` decides a route from what the peer published: the first of `ROUTES` that both ends
offer, shm only to a peer on this host. It is pure (this process's host id is read once):
callers map its answer to their own paths (`transfer.engine`: its transports;
`kvpool.client.datapath`: the client's data paths) and check only what is theirs to know
(whether a file opens, an RDMA endpoint is registered).
"""

from __future__ import annotations

import functools
import socket
from typing import Collection

ROUTES = ("shm", "rdma", "tcp")  # best first: a local memcpy, one-sided RDMA, then a socket


@functools.cache
def local_host_id() -> str:
    """This kernel instance: the host name and the boot id (a fresh one at every boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:  # not Linux: the name alone
        boot = "no-boot-id"
    return f"{socket.gethostname()}:{boot}"


def same_host(a: str, b: str | None = None) -> bool:
    """Whether host ids `a` and `b` (default: this process's) name one host; an unknown id ("",
    a peer that published none) is never this host."""
    return bool(a) and a == (local_host_id() if b is None else b)


def route(peer_host: str, peer_offers: Collection[str], ours: Collection[str] = ROUTES) -> str | None:
    """The route to a peer on host `peer_host` that offers `peer_offers`, when this end can take
    `ours`: the first of `ROUTES` in both, shm only on the same host; None when none is shared."""
    for name in ROUTES:
        if name in peer_offers and name in ours and (name != "shm" or same_host(peer_host)):
            return name
    return None
