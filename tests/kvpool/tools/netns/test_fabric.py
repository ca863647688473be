"""The namespace fabric (kvpool.tools.netns): real namespaces, real packets. A one-way cut drops
one direction only and heals; the delay line holds packets back; nothing is left behind, not
even by an owner that was SIGKILLed. Needs root and iproute2/nftables: skipped otherwise."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from kvpool.tools.netns import Fabric, reap_stale, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=f"no namespace fabric here: {unavailable()}")

RECEIVE = textwrap.dedent("""
    import socket, sys
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[1], 9999)); s.settimeout(1.5)
    print("ready", flush=True)
    try:
        print("got", s.recvfrom(100)[0].decode())
    except TimeoutError:
        print("lost")
""")
SEND = textwrap.dedent("""
    import socket, sys, time
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(5):
        s.sendto(b"hello", (sys.argv[1], 9999)); time.sleep(0.05)
""")


def _datagram(net: Fabric, src: str, dst: str) -> str:
    """Send datagrams from `src` to `dst`: "got hello" when one arrived, "lost" when none did."""
    receiver = subprocess.Popen([*net.exec_prefix(dst), sys.executable, "-c", RECEIVE, net.ip(dst)],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout.readline().strip() == "ready"
        sent = net.run(src, [sys.executable, "-c", SEND, net.ip(dst)])
        assert sent.returncode == 0, sent.stderr
        return receiver.stdout.readline().strip()
    finally:
        receiver.kill()
        receiver.wait()


def _ours(tag: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(tag)]


@pytest.mark.parametrize("delay_ms", [0.0, 2.0], ids=["bridge", "delay-line"])
def test_a_one_way_cut_drops_one_direction_and_heals(delay_ms):
    with Fabric(["a", "b", "c"], delay_ms=delay_ms).start() as net:
        tag = net.tag
        assert _datagram(net, "a", "b") == "got hello"
        net.cut("a", "b")
        assert _datagram(net, "a", "b") == "lost"
        assert _datagram(net, "b", "a") == "got hello"  # the other way still flows
        assert _datagram(net, "c", "b") == "got hello"  # and so does everyone else
        net.heal()
        assert _datagram(net, "a", "b") == "got hello"
        net.partition(["a"], ["b", "c"])
        assert [_datagram(net, *pair) for pair in (("a", "c"), ("c", "a"), ("b", "c"))] == ["lost", "lost", "got hello"]
        net.heal()
        assert _datagram(net, "c", "a") == "got hello"
        assert len(_ours(tag)) == 4  # hub + 3 members
    assert _ours(tag) == []


def test_the_delay_line_never_delivers_early():
    with Fabric(["a", "b"], delay_ms=5.0).start() as net:
        rtt = net.rtt_ms("a", "b", samples=20)
    assert rtt["min"] >= 10.0, rtt  # two 5 ms legs; load can only make it later


def test_a_fabric_whose_owner_was_killed_is_reaped():
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import time
        from kvpool.tools.netns import Fabric
        net = Fabric(["x", "y"]).start()
        net.spawn("x", ["sleep", "600"])
        print(net.tag, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    tag = owner.stdout.readline().strip()
    try:
        assert len(_ours(tag)) == 3
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    assert sorted(reap_stale()) == sorted(f"{tag}-{n}" for n in ("hub", "x", "y")) or _ours(tag) == []
    assert _ours(tag) == []
