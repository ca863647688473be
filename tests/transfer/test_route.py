"""`transfer.route`: what "same host" means and the order routes are tried in."""

from __future__ import annotations

import os
import socket

import msgspec

from transfer import ROUTES, TransferEngine, create_shm_buffer, local_host_id, route, same_host


def test_a_host_is_its_name_and_its_kernels_boot_id_and_another_boot_is_another_host():
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    here = local_host_id()
    assert here == f"{socket.gethostname()}:{boot}"
    assert same_host(here) and same_host(here, here)
    rebooted = f"{socket.gethostname()}:{'0' * len(boot)}"  # same name, another kernel instance
    assert not same_host(rebooted) and not same_host(here, rebooted)
    assert not same_host("") and not same_host("", "")  # a peer that published none is never here
    assert same_host("b:1", "b:1") and not same_host("a:1", "b:1")


def test_the_route_is_the_first_of_shm_rdma_tcp_both_ends_take_shm_only_on_this_host():
    here, there = local_host_id(), "elsewhere:1"
    assert ROUTES == ("shm", "rdma", "tcp")
    assert route(here, ("tcp", "rdma", "shm")) == "shm"
    assert route(there, ("tcp", "rdma", "shm")) == "rdma"  # shm offered, but from another host
    assert route(there, ("shm", "tcp")) == "tcp"
    assert route(here, ("shm", "rdma", "tcp"), ours=("tcp", "rdma")) == "rdma"  # we take no shm
    assert route(here, ("rdma", "tcp"), ours=("shm", "tcp")) == "tcp"
    assert route(here, ("shm",), ours=("tcp",)) is None  # nothing shared
    assert route("", ("shm",)) is None


def test_the_engine_sends_a_segment_of_another_boot_over_tcp_though_its_file_opens():
    owner, peer = TransferEngine(timeout=2.0).start(), TransferEngine(timeout=2.0).start()
    mapping, path = create_shm_buffer(1 << 16)
    try:
        seg = owner.register(mapping, shm_path=path)
        assert seg.host_id == local_host_id() and peer.choose(seg) == "shm"
        other = msgspec.structs.replace(seg, host_id=f"{socket.gethostname()}:another-boot")
        assert peer.choose(other) == "tcp"
        mapping[:5] = b"bytes"
        buf = bytearray(5)
        peer.read(other, 0, buf)  # over the data server: still the same bytes
        assert buf == b"bytes"
    finally:
        peer.close()
        owner.close()
        os.unlink(path)
