"""A node served from one epoll loop (`kvpool.rpc.loop`, issue 29): real pools, real client
processes over loopback TCP. Many clients at once get exactly their bytes while objects are
removed and re-put under them; a reply the client is slow to read keeps its object pinned and
blocks nobody else; a tenant's get answered on the loop is scoped like any other; the loop spins
for a sole client only while the CPUs are calm. Each runs with the loop, and where it says
something of both, also with a thread per connection (`rpc_loop=False`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import kvpool
from kvpool.config import Settings, load_settings
from kvpool.embedded import EmbeddedPool
from kvpool.errors import AlreadyExists, KeyNotFound, KVPoolError
from kvpool.messages import Bools, Exists, Lookup, MatchPrefix, NodeGet, PutStart, Release, Remove
from kvpool.rpc import RpcClient, RpcServer
from test_rpc import _psi

WORD = 16  # a stamped value is one 16-byte word repeated: (key index, version)


def stamped(i: int, version: int, size: int) -> np.ndarray:
    word = np.array([i, version], dtype="<u8").view(np.uint8)
    return np.tile(word, size // WORD)


def pool_with(loop: bool, **extra) -> EmbeddedPool:
    return EmbeddedPool(load_settings(port=0, admin_port=0, heartbeat_s=0.2, rpc_loop=loop, **extra)).start()


@pytest.mark.parametrize("loop", [True, False], ids=["loop", "threads"])
def test_many_client_processes_get_whole_values_while_they_are_removed_and_put_again(loop):
    """8 client processes read 4 KiB to 1 MiB stamped values (gets answered on the loop, and
    puts of their own handed to their connections' threads) while this process removes and
    re-puts the shared ones with a new version: every get is a miss or one whole version of
    its key, never bytes of two versions or of another key (a pin held until the reply is sent)."""
    pool = pool_with(loop, dram_capacity="48MiB")
    assert (pool.rpc._loop is not None) == loop
    sizes = [4096, 65536, 1 << 20]
    keys = [(f"shared/{i}", sizes[i % 3]) for i in range(12)]
    writer = kvpool.connect(pool.address, use_shm=False)
    for i, (key, size) in enumerate(keys):
        writer.put(key, stamped(i, 0, size))
    code = textwrap.dedent("""
        import sys
        import numpy as np
        import kvpool
        from kvpool.errors import KeyNotFound
        address, me = sys.argv[1], int(sys.argv[2])
        sizes = [4096, 65536, 1 << 20]
        c = kvpool.connect(address, use_shm=False, transports=("tcp",))
        out = np.empty(1 << 20, np.uint8)
        hits = misses = 0
        for n in range(400):
            i = (me * 7 + n) % 12
            try:
                got = c.get_into(f"shared/{i}", out)
            except KeyNotFound:
                misses += 1
                continue
            words = out[:got].view("<u8").reshape(-1, 2)
            assert got == sizes[i % 3], (i, got)
            assert (words[:, 0] == i).all() and (words[:, 1] == words[0, 1]).all(), f"torn value of key {i}"
            hits += 1
            if n % 50 == 0:  # a put of its own: handed to the connection's thread, then back to the loop
                mine = np.full(65536, me, np.uint8)
                c.put(f"own/{me}/{n}", mine)
                assert c.get(f"own/{me}/{n}") == mine.tobytes()
        print(hits, misses)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, pool.address, str(me)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for me in range(8)]
    done = threading.Event()
    replaced, failed = [0], []

    def churn() -> None:
        version = 0
        try:
            while not done.is_set():
                version += 1
                for i, (key, size) in enumerate(keys):
                    if i % 2 == version % 2:
                        writer.remove(key)
                        try:
                            writer.put(key, stamped(i, version, size))
                            replaced[0] += 1
                        except AlreadyExists:  # still pinned by a reader while it is removed: later
                            pass
        except Exception as exc:
            failed.append(exc)

    t = threading.Thread(target=churn)
    t.start()
    try:
        results = [p.communicate(timeout=240) for p in procs]
    finally:
        done.set()
        t.join()
        writer.close()
        pool.stop()
    assert not failed and replaced[0] > len(keys)  # the values really changed under the readers
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-2000:]
        hits, misses = map(int, out.split())
        assert hits > 0


@pytest.mark.parametrize("loop", [True, False], ids=["loop", "threads"])
def test_a_reply_read_slowly_keeps_its_object_pinned_until_its_last_byte(loop):
    """A client asks for an 8 MiB object and reads nothing yet: its reply cannot all go out at
    once, and the rest is sent from the arena as the client reads (the loop does not copy it).
    Meanwhile the object is removed and DRAM is filled with other values: its space must stay
    held until the last byte is sent, so the reply is the object's bytes, whole. (Releasing the
    pin when the first part went out lets the new puts overwrite the tail.)"""
    pool = pool_with(loop, dram_capacity="24MiB")
    size = 8 << 20
    c = kvpool.connect(pool.address, use_shm=False)
    slow = RpcClient(pool.address)
    try:
        c.put("big", stamped(1, 1, size))
        slow.send_request(NodeGet(["big"]))
        reply = slow.recv_reply()  # the header: the rest waits in the kernel and in the node
        assert reply.sizes == [size]
        assert c.remove("big") is True
        stored = 0
        for n in range(8):  # 16 MiB of other values: without the pin, some land where "big" was
            try:
                c.put(f"filler/{n}", stamped(2, n, 2 << 20))
                stored += 1
            except KVPoolError:
                pass  # DRAM full of pinned or newer objects: refused, which is fine
        assert stored > 0
        got = np.frombuffer(slow.read_payload(size), np.uint8)
        assert np.array_equal(got, stamped(1, 1, size))
        assert slow.call(Exists(["big"])) is not None  # the connection is still in frame
        assert c.get("big") is None
    finally:
        slow.close()
        c.close()
        pool.stop()


def test_a_client_that_does_not_read_its_reply_blocks_no_one_else():
    """The loop never blocks on one connection: while a client leaves an 8 MiB reply unread,
    other clients' gets are answered (with a send that blocked, they would time out)."""
    pool = pool_with(True, dram_capacity="32MiB")
    c = kvpool.connect(pool.address, use_shm=False)
    slow = RpcClient(pool.address)
    try:
        c.put("big", stamped(1, 1, 8 << 20))
        c.put("small", stamped(2, 1, 65536))
        slow.send_request(NodeGet(["big"]))
        others = [kvpool.connect(pool.address, use_shm=False, timeout=5.0) for _ in range(3)]
        for other in others:
            for _ in range(20):
                assert other.get("small") == stamped(2, 1, 65536).tobytes()
            other.close()
        reply = slow.recv_reply()
        assert reply.sizes == [8 << 20]
        assert slow.read_payload(8 << 20) == stamped(1, 1, 8 << 20).tobytes()
    finally:
        slow.close()
        c.close()
        pool.stop()


def test_a_tenants_get_on_the_loop_is_scoped_to_its_own_keys(tmp_path):
    """Authentication on: the node answers NodeGet on its loop thread, after the same
    authorization and key scoping as on a thread. Tenant beta's get of acme's key is a miss,
    its get of acme's key as stored ("acme\\x00key") is refused, and acme reads its own."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[2] / "security"))
    from pool_auth_support import cred, write_keyring

    keyring = write_keyring(tmp_path / "keyring.toml")
    pool = pool_with(True, dram_capacity="16MiB", auth_file=str(keyring))
    threads: list[str] = []
    get = pool.rpc.handlers[NodeGet]

    def recording(msg, payload, conn):
        threads.append(threading.current_thread().name)
        return get(msg, payload, conn)

    pool.rpc.handlers[NodeGet] = recording
    acme = kvpool.connect(pool.address, credential=cred("acme"), use_shm=False)
    beta = kvpool.connect(pool.address, credential=cred("beta"), use_shm=False)
    try:
        secret = b"acme's KV" * 1000
        acme.put("doc", secret)
        assert acme.get("doc") == secret
        assert beta.get("doc") is None
        with pytest.raises(KeyNotFound):
            beta.get_into("doc", bytearray(len(secret)))
        raw = RpcClient(pool.address, credential=cred("beta"))
        try:
            with pytest.raises(KVPoolError):
                raw.call(NodeGet(["acme\x00doc"]))
            assert raw.call(NodeGet(["doc"])).sizes == [-1]
        finally:
            raw.close()
        assert threads and set(threads) == {"pool-loop"}  # every get was answered on the loop
    finally:
        acme.close()
        beta.close()
        pool.stop()


def test_the_loop_spins_for_a_sole_client_only_while_the_cpus_are_calm(tmp_path):
    """As a thread per connection does (`kvpool.rpc.spin`): a client alone with a calm server is
    told to spin for its replies (FLAG_SPIN) and is answered in order through bursts and
    pauses; under CPU pressure nobody spins."""
    from kvpool.rpc.spin import CpuPressure

    code = textwrap.dedent("""
        import sys, time
        from kvpool.messages import Exists
        from kvpool.rpc import RpcClient
        c = RpcClient(sys.argv[1])
        for i in range(200):
            assert c.call(Exists(["yes", "no"])).values == [True, False]
            if i % 50 == 0:
                time.sleep(0.01)
        print(c._hinted)
    """)
    hinted = {}
    for avg10 in (0.0, 90.0):
        srv = RpcServer({Exists: lambda m, p, c: Bools([k == "yes" for k in m.keys])}, name="spin",
                        settings=Settings(server_spin=64), inline={Exists: None}).start()
        assert srv._loop is not None
        srv.spin.pressure = CpuPressure(10, _psi(tmp_path, avg10))
        srv.spin.calm()
        try:
            out = subprocess.run([sys.executable, "-c", code, srv.address], capture_output=True, text=True,
                                 timeout=60)
            hinted[avg10] = out.stdout.strip()
            assert hinted[avg10] in ("True", "False"), out.stderr
        finally:
            srv.stop()
    assert hinted == {0.0: "True", 90.0: "False"}


class CountingDecoder:
    """Wraps the RPC's request decoder and counts the messages it decodes."""

    def __init__(self, inner):
        self.inner, self.count = inner, 0

    def decode(self, body):
        self.count += 1
        return self.inner.decode(body)


@pytest.mark.parametrize("loop", [True, False], ids=["loop", "threads"])
def test_a_request_handed_to_its_thread_is_decoded_once(loop, monkeypatch):
    """A request the loop cannot answer (here Remove: not inline) goes to its connection's
    thread with the message the loop decoded: one decode per request, on the loop or not,
    and the handler runs on the connection's thread, not the loop's."""
    import kvpool.rpc.loop as rpc_loop
    import kvpool.rpc.server as rpc_server

    counting = CountingDecoder(rpc_server.request_decoder)
    for mod in (rpc_server, rpc_loop):
        if hasattr(mod, "request_decoder"):
            monkeypatch.setattr(mod, "request_decoder", counting)
    where: list[str] = []

    def remove(msg, payload, conn):
        where.append(threading.current_thread().name)
        return Bools([True] * len(msg.keys))

    srv = RpcServer({Exists: lambda m, p, c: Bools([k == "yes" for k in m.keys]), Remove: remove}, name="once",
                    settings=Settings(rpc_loop=loop), inline={Exists: None}).start()
    c = RpcClient(srv.address)
    try:
        for i in range(10):
            assert c.call(Exists(["yes"])).values == [True]
            assert c.call(Remove([f"k{i}", "x"])).values == [True, True]
        assert counting.count == 20
        assert len(where) == 10 and "once-loop" not in where
    finally:
        c.close()
        srv.stop()


@pytest.mark.parametrize("embedded", [True, False], ids=["embedded", "standalone"])
def test_the_master_answers_lookups_on_its_loop(embedded):
    """Lookup, Release, Exists and MatchPrefix (short reads under the master's lock) are
    answered on the serve loop, in the embedded pool and in a standalone master; a put's start
    (it may make room) on its connection's thread."""
    from kvpool.master.server import MasterServer

    if embedded:
        server, loop_name = pool_with(True, dram_capacity="16MiB"), "pool-loop"
    else:
        server, loop_name = MasterServer(load_settings(port=0, admin_port=0, heartbeat_s=0.2)).start(), "master-loop"
    rpc = server.rpc
    assert rpc._loop is not None
    where: dict[str, set[str]] = {}
    for kind in (Lookup, Release, Exists, MatchPrefix, PutStart):
        def recording(msg, payload, conn, handler=rpc.handlers[kind], name=kind.__name__):
            where.setdefault(name, set()).add(threading.current_thread().name)
            return handler(msg, payload, conn)

        rpc.handlers[kind] = recording
    c = RpcClient(server.address)
    try:
        for _ in range(3):
            reply = c.call(Lookup(["a", "b"]))
            assert reply.entries == [None, None]
            c.send_oneway(Release([reply.lease_id]))
            assert c.call(Exists(["a"])).values == [False]
            assert c.call(MatchPrefix(["a", "b"])).n == 0
        c.call(PutStart(["k"], [100]))
    finally:
        c.close()
        server.stop()
    assert {k: v for k, v in where.items() if k != "PutStart"} == {
        "Lookup": {loop_name}, "Release": {loop_name}, "Exists": {loop_name}, "MatchPrefix": {loop_name}}
    assert loop_name not in where["PutStart"]


def test_a_big_reply_is_written_by_its_thread_while_the_loop_serves_the_others():
    """A reply of a megabyte or more is handed to its connection's thread (its handler ran on
    the loop): while a client leaves a 32 MiB reply unread (more than the kernel buffers hold,
    so its writer blocks), other connections' small gets are answered on the loop, and the big
    reply's release (its unpin) runs on the thread that wrote it, once the client read it all.
    A small reply is sent, and released, by the loop."""
    from kvpool.messages import NodeData

    blobs = {"small": bytes(range(256)) * 256, "big": bytes(range(256)) * (128 << 10)}
    released: list[tuple[str, str]] = []

    def get(msg, payload, conn):
        key = msg.keys[0]
        return NodeData([len(blobs[key])]), [memoryview(blobs[key])], lambda: released.append(
            (key, threading.current_thread().name))

    srv = RpcServer({NodeGet: get}, name="big", inline={NodeGet: None}).start()
    assert srv._loop is not None and srv._loop.big_reply <= len(blobs["big"])
    slow, fast = RpcClient(srv.address, timeout=30), RpcClient(srv.address, timeout=5)
    try:
        slow.send_request(NodeGet(["big"]))
        assert slow.recv_reply().sizes == [len(blobs["big"])]  # its header: the rest waits
        out = bytearray(len(blobs["small"]))
        for _ in range(20):
            assert fast.call(NodeGet(["small"])).sizes == [len(out)]
            fast.read_payload_into(memoryview(out))
            assert out == blobs["small"]
        assert ("big", "big-loop") not in released and not [r for r in released if r[0] == "big"]
        assert slow.read_payload(len(blobs["big"])) == blobs["big"]
        assert fast.call(NodeGet(["small"])).sizes == [len(out)]  # the loop took the big one's connection back
        fast.read_payload_into(memoryview(out))
        assert slow.call(NodeGet(["small"])).sizes == [len(out)]
        slow.read_payload_into(memoryview(out))
    finally:
        slow.close()
        fast.close()
        srv.stop()
    big = [name for key, name in released if key == "big"]
    assert len(big) == 1 and big[0] != "big-loop"
    assert {name for key, name in released if key == "small"} == {"big-loop"}


def test_requests_sent_back_to_back_stay_with_the_thread_the_loop_handed_them_to(monkeypatch):
    """Requests the loop cannot answer (here Remove, as a put), sent back to back, are served by
    the connection's thread that took the first, without a trip back through the loop for each
    (`STAY_S`); once the client pauses for longer, the connection is the loop's again (an inline
    Exists is answered there); a client that leaves while its thread waits ends only its own
    connection."""
    import time

    from kvpool.rpc.loop import STAY_S, ServeLoop

    handed: list[int] = []
    hand_over = ServeLoop.hand_over

    def counted(self, link, msg=None):
        handed.append(1)
        hand_over(self, link, msg)

    monkeypatch.setattr(ServeLoop, "hand_over", counted)
    where: list[str] = []

    def exists(msg, payload, conn):
        where.append(threading.current_thread().name)
        return Bools([k == "yes" for k in msg.keys])

    srv = RpcServer({Exists: exists, Remove: lambda m, p, c: Bools([True] * len(m.keys))}, name="stay",
                    settings=Settings(rpc_loop=True), inline={Exists: None}).start()
    c = RpcClient(srv.address)
    try:
        for i in range(50):
            assert c.call(Remove([f"k{i}"])).values == [True]
        assert len(handed) < 25, f"{len(handed)} hand-overs for 50 back-to-back requests"
        time.sleep(STAY_S * 200)  # well past the wait, even on a loaded machine
        assert c.call(Exists(["yes"])).values == [True]
        assert where[-1] == "stay-loop"
        d = RpcClient(srv.address)
        assert d.call(Remove(["d"])).values == [True]
        d.close()  # while its thread waits for a next request
        time.sleep(STAY_S * 5)
        assert c.call(Remove(["after"])).values == [True] and c.call(Exists(["no"])).values == [False]
    finally:
        c.close()
        srv.stop()
