"""The delay line of a `Fabric` with latency: one process, in the fabric's hub namespace, that
every IPv4 packet between members passes through, each delayed by the same one-way time.

    ip netns exec HUB python -m kvpool.tools.netns.wire --delay-ms 0.5 --member NS1=10.77.0.1 ...

Why a process: this kernel has no netem (CONFIG_NET_SCH_NETEM unset), nor fq or etf, the
qdiscs that would honour a BPF program's departure times; no qdisc here can hold a packet back
for a while. So each member's link is a TUN device (`eth0` in its namespace) whose other end is
this process: it reads a packet from member A's device, and writes it to the device of the
member owning the destination address `delay` seconds after it was read. The delay is per
packet, so TCP inside the namespaces sees it (its RTT, slow start and window); rate limits and
drops stay in the kernel (tbf on each `eth0`, nft in each namespace; see `fabric`).

Invariants: packets from one member to another leave in the order they came (one FIFO per
destination, constant delay); a packet for an address no member owns is dropped; the TUN
devices are not persistent: they vanish when this process ends, which cuts every link.
The MTU is large (`MTU`) so that a TCP segment is one read and one write of up to 64 KiB:
per-packet work in Python is the cost here, not bytes.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import os
import socket
import struct
import subprocess
import sys
import threading
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
MTU = 65000


class Wire:
    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self.out: dict[bytes, int] = {}  # destination IPv4 address -> the TUN fd of its member
        self.queues: dict[int, collections.deque] = {}
        self.ready: dict[int, threading.Condition] = {}
        self.dropped = 0

    def add(self, device: str, address: str) -> int:
        fd = os.open("/dev/net/tun", os.O_RDWR)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", device.encode(), IFF_TUN | IFF_NO_PI))
        self.out[socket.inet_aton(address)] = fd
        self.queues[fd] = collections.deque()
        self.ready[fd] = threading.Condition()
        return fd

    def run(self) -> None:
        for fd in self.queues:
            threading.Thread(target=self._read, args=(fd,), daemon=True).start()
            threading.Thread(target=self._write, args=(fd,), daemon=True).start()

    def _read(self, fd: int) -> None:
        while True:
            packet = os.read(fd, MTU + 64)
            if len(packet) < 20 or packet[0] >> 4 != 4:
                continue  # not IPv4 (members have IPv6 off; nothing else is routed)
            dst = self.out.get(packet[16:20])
            if dst is None:
                self.dropped += 1
                continue
            due = time.monotonic() + self.delay_s
            with self.ready[dst]:
                self.queues[dst].append((due, packet))
                self.ready[dst].notify()

    def _write(self, fd: int) -> None:
        queue, ready = self.queues[fd], self.ready[fd]
        while True:
            with ready:
                while not queue:
                    ready.wait()
                due, packet = queue.popleft()
            wait = due - time.monotonic()
            if wait > 0:  # never early: a link delivers no sooner than its delay (sleep wakes late, ~0.1 ms)
                time.sleep(wait)
            try:
                os.write(fd, packet)
            except OSError:  # the member's device is down (its namespace going away): drop
                pass


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--delay-ms", type=float, required=True, help="one-way delay of every packet")
    p.add_argument("--member", action="append", default=[], metavar="NETNS=ADDRESS",
                   help="a member namespace and its address (its TUN becomes eth0 there)")
    a = p.parse_args(argv)
    sys.setswitchinterval(1e-4)  # a thread woken by a packet takes the GIL within 0.1 ms, not 5 ms
    wire = Wire(a.delay_ms / 1000)
    for i, spec in enumerate(a.member):
        netns, address = spec.split("=", 1)
        device = f"t{i}"  # in the hub namespace, private to this fabric
        wire.add(device, address)
        for cmd in (["ip", "link", "set", "dev", device, "netns", netns],
                    ["ip", "-n", netns, "link", "set", "dev", device, "name", "eth0"],
                    ["ip", "-n", netns, "link", "set", "dev", "eth0", "mtu", str(MTU), "up"]):
            subprocess.run(cmd, check=True, capture_output=True)
    wire.run()
    print("wire ready", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main(sys.argv[1:])
