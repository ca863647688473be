"""The thin verbs layer: the only module that touches pyverbs.

Everything above it (transfer/rdma.py: handshake, slicing, completion tracking, timeouts)
talks to the small interface below, which tests/transfer/fake_verbs.py imitates in-process.
Keep this file free of logic: each method is one or two verbs calls.

Interface (what rdma.py uses):
    dev = open_device(name=None, port=1, gid_index=0) -> Device | None
    mr = dev.reg_mr(addr, length)           # .lkey, .rkey, .close()
    cq = dev.create_cq(depth)               # .poll(n) -> list[(wr_id, ok: bool, status: str)]
    qp = dev.create_qp(cq, max_send_wr)     # .info() -> wire.QPInfo; .connect(remote QPInfo)
    qp.post(wr_id, write: bool, local_addr, length, lkey, remote_addr, rkey); qp.close()
    dev.close()

Not exercised on the development machine (its kernel has no RDMA support); see docs/rdma.md.
"""

from __future__ import annotations

import functools
import logging
import random

from transfer.wire import QPInfo

log = logging.getLogger("transfer.verbs")


@functools.cache
def unavailable_reason() -> str | None:
    """Why real RDMA cannot be used here (None when pyverbs finds at least one device).

    Cached per process: devices do not come and go under a running server.
    """
    try:
        from pyverbs.device import get_device_list
    except ImportError as exc:
        return f"pyverbs is not importable ({exc}); see docs/rdma.md"
    try:
        devices = get_device_list()
    except Exception as exc:  # pyverbs raises PyverbsError subclasses
        return f"pyverbs cannot list devices: {exc}"
    if not devices:
        return "pyverbs finds no RDMA device on this machine"
    return None


def open_device(name: str | None = None, port: int = 1, gid_index: int = 0) -> "Device | None":
    """Open the named (or first) RDMA device; None when there is none (reason is logged). The
    pool's `[rpc] rdma_device` / `rdma_gid_index` settings (KVPOOL_RDMA_*) arrive here as arguments."""
    reason = unavailable_reason()
    if reason is not None:
        log.debug("rdma transport disabled: %s", reason)
        return None
    from pyverbs.device import get_device_list

    names = [d.name.decode() if isinstance(d.name, bytes) else d.name for d in get_device_list()]
    return Device(name or names[0], port, gid_index)


class Device:
    """An opened device context with one protection domain."""

    def __init__(self, name: str, port: int, gid_index: int):
        from pyverbs.device import Context
        from pyverbs.pd import PD

        self.name, self.port, self.gid_index = name, port, gid_index
        self.ctx = Context(name=name)
        self.pd = PD(self.ctx)
        port_attr = self.ctx.query_port(port)
        self.lid = port_attr.lid
        self.mtu = port_attr.active_mtu
        self.gid = bytes.fromhex(str(self.ctx.query_gid(port, gid_index)).replace(":", ""))

    def reg_mr(self, addr: int, length: int, remote_write: bool = True) -> "MemoryRegion":
        return MemoryRegion(self, addr, length, remote_write)

    def create_cq(self, depth: int) -> "CompletionQueue":
        return CompletionQueue(self, depth)

    def create_qp(self, cq: "CompletionQueue", max_send_wr: int) -> "QueuePair":
        return QueuePair(self, cq, max_send_wr)

    def close(self) -> None:
        self.pd.close()
        self.ctx.close()


class MemoryRegion:
    """`remote_write=False`: peers may only READ it (a remote WRITE completes with a remote
    access error on the writer)."""

    def __init__(self, dev: Device, addr: int, length: int, remote_write: bool = True):
        import pyverbs.enums as e
        from pyverbs.mr import MR

        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
        if remote_write:
            access |= e.IBV_ACCESS_REMOTE_WRITE
        self.mr = MR(dev.pd, length, access, address=addr)
        self.addr, self.length = addr, length
        self.lkey, self.rkey = self.mr.lkey, self.mr.rkey

    def close(self) -> None:
        self.mr.close()


class CompletionQueue:
    def __init__(self, dev: Device, depth: int):
        from pyverbs.cq import CQ

        self.cq = CQ(dev.ctx, depth, None, None, 0)

    def poll(self, n: int = 32) -> list[tuple[int, bool, str]]:
        import pyverbs.enums as e

        count, wcs = self.cq.poll(n)
        return [(wc.wr_id, wc.status == e.IBV_WC_SUCCESS, str(wc.status)) for wc in wcs[:count]]

    def close(self) -> None:
        self.cq.close()


class QueuePair:
    """An RC queue pair; `connect` walks it INIT -> RTR -> RTS against the remote's QPInfo."""

    def __init__(self, dev: Device, cq: CompletionQueue, max_send_wr: int):
        import pyverbs.enums as e
        from pyverbs.qp import QP, QPCap, QPInitAttr

        self.dev = dev
        cap = QPCap(max_send_wr=max_send_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq.cq, rcq=cq.cq, cap=cap, sq_sig_all=1)
        self.qp = QP(dev.pd, init)
        self.psn = random.getrandbits(24)

    def info(self) -> QPInfo:
        return QPInfo(qpn=self.qp.qp_num, psn=self.psn, lid=self.dev.lid, gid=self.dev.gid, mtu=int(self.dev.mtu))

    def connect(self, remote: QPInfo) -> None:
        import pyverbs.enums as e
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        attr = QPAttr(port_num=self.dev.port)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
        self.qp.to_init(attr)
        gid = GID()
        gid.gid = ":".join(remote.gid.hex()[i:i + 4] for i in range(0, 32, 4))
        gr = GlobalRoute(dgid=gid, sgid_index=self.dev.gid_index)
        attr.ah_attr = AHAttr(port_num=self.dev.port, dlid=remote.lid, is_global=1, gr=gr)
        attr.path_mtu = min(remote.mtu, int(self.dev.mtu))
        attr.dest_qp_num = remote.qpn
        attr.rq_psn = remote.psn
        attr.max_dest_rd_atomic = 16
        attr.min_rnr_timer = 12
        self.qp.to_rtr(attr)
        attr.sq_psn = self.psn
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        attr.max_rd_atomic = 16
        self.qp.to_rts(attr)

    def post(self, wr_id: int, write: bool, local_addr: int, length: int, lkey: int,
             remote_addr: int, rkey: int) -> None:
        import pyverbs.enums as e
        from pyverbs.wr import SGE, SendWR

        wr = SendWR(wr_id=wr_id, opcode=e.IBV_WR_RDMA_WRITE if write else e.IBV_WR_RDMA_READ,
                    num_sge=1, sg=[SGE(local_addr, length, lkey)])
        wr.set_wr_rdma(rkey, remote_addr)
        self.qp.post_send(wr)

    def close(self) -> None:
        self.qp.close()
