"""Socket-level fuzz against a real `kvpool serve` on loopback (issue 14).

Random bytes, mutated frames and well-formed messages with random field values go into the pool
RPC port and the transfer engine's data port. Property: the server stays up, never answers with
an `internal` error (an exception a handler did not expect), and serves a well-behaved client
afterwards (a put and a get of fresh bytes).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import typing
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvpool
from fuzz_support import EXAMPLES, LONG_EXAMPLES, TRIED, LyingServer, fuzz_bytes, fuzz_settings
from kvpool import messages as m
from kvpool.errors import KVPoolError
from kvpool.messages import PROTOCOL_VERSION
from kvpool.rpc.client import RpcClient
from kvpool.rpc.frame import HEADER
from transfer import wire
from transfer.descriptor import SegmentDescriptor
from test_decoders import REQUEST_SEEDS
from kvpool.tools.launch.processes import clean_env

IO_TIMEOUT = 5.0


class Served:
    def __init__(self, proc: subprocess.Popen, address: str, data: tuple[str, int], log: Path):
        self.proc, self.address, self.data, self.log = proc, address, data, log

    def rpc(self) -> tuple[str, int]:
        host, _, port = self.address.rpartition(":")
        return host, int(port)

    def assert_serving(self) -> None:
        assert self.proc.poll() is None, f"kvpool serve died: {self.log.read_text()[-3000:]}"
        with kvpool.connect(self.address) as client:
            value = os.urandom(5000)
            key = f"fuzz/after/{value[:8].hex()}"
            client.put(key, value)
            assert client.get(key) == value


def _serve(tmp: Path) -> Served:
    log = tmp / "serve.log"
    env = clean_env()
    proc = subprocess.Popen([str(Path(sys.executable).with_name("kvpool")), "--log-level", "WARNING", "serve",
                             "--port", "0", "--admin-port", "0", "--dram-capacity", "32MiB"],
                            stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, env=env)
    line = proc.stdout.readline().strip()
    assert line.startswith("kvpool serving at "), (line, log.read_text()[-2000:])
    address = line.rsplit(" ", 1)[1]
    rpc = RpcClient(address)
    try:
        hello = rpc.call(m.Hello(PROTOCOL_VERSION, "fuzz"))
    finally:
        rpc.close()
    desc = SegmentDescriptor.from_bytes(hello.node.transfer_segment)
    return Served(proc, address, (desc.host, desc.port), log)


def _stop(s: Served) -> None:
    s.proc.terminate()
    try:
        s.proc.wait(15)
    except subprocess.TimeoutExpired:
        s.proc.kill()
        s.proc.wait(5)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = _serve(tmp_path_factory.mktemp("fuzz-serve"))
    try:
        yield s
    finally:
        _stop(s)


def _poke(addr: tuple[str, int], data: bytes) -> None:
    """One connection: send `data`, half-close, read until the server closes. A server that
    neither answers nor closes within IO_TIMEOUT after our EOF is a hang (the test fails)."""
    with socket.create_connection(addr, timeout=IO_TIMEOUT) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # EPIPE, ECONNRESET, ENOTCONN: it already refused and closed, not a hang
            return
        while True:
            try:
                chunk = sock.recv(1 << 16)
            except ConnectionResetError:
                return
            except socket.timeout:
                raise AssertionError(f"server neither answered nor closed within {IO_TIMEOUT}s after {data[:64]!r}")
            if not chunk:
                return


def _frames():
    """RPC frames: a header (real or mutated) + a message (valid or mutated) + payload bytes."""
    def build(version, flags, body, payload, lie_msg, lie_payload):
        msg_len = len(body) + lie_msg if len(body) + lie_msg >= 0 else 0
        return HEADER.pack(version, flags, msg_len, max(0, len(payload) + lie_payload)) + body + payload
    return st.builds(build, st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION, 0, 2, 0xFFFF]),
                     st.integers(0, 7), fuzz_bytes(REQUEST_SEEDS), st.binary(max_size=64),
                     st.sampled_from([0, 0, 0, -1, 1, 100, 1 << 20]), st.sampled_from([0, 0, 0, 1, 1000, 1 << 30]))


def _data_frames():
    """Transfer data frames: magic and version mostly right, the rest random."""
    def build(magic, version, opcode, seg, off, length, body):
        return wire.REQ.pack(magic, version, opcode, 0, seg, 1, off, length) + body
    return st.builds(build, st.sampled_from([wire.MAGIC, wire.MAGIC, 0]), st.sampled_from([wire.VERSION, wire.VERSION, 9]),
                     st.integers(0, 6), st.integers(0, 4) | st.integers(0, 2**32 - 1),
                     st.integers(0, 2**64 - 1) | st.integers(0, 4096), st.integers(0, 2**64 - 1) | st.integers(0, 4096),
                     st.binary(max_size=128))


def _fuzz_socket(served: Served, target: str, addr, strategy, examples: int) -> None:
    @fuzz_settings(examples)
    @given(strategy)
    def inner(data):
        TRIED[target] += 1
        _poke(addr, data)
        assert served.proc.poll() is None, f"kvpool serve died on {data[:64]!r}: {served.log.read_text()[-3000:]}"

    inner()
    served.assert_serving()


SOCKET_TARGETS = {
    "socket.rpc.random": ("rpc", lambda: st.binary(max_size=256)),
    "socket.rpc.frames": ("rpc", _frames),
    "socket.data.random": ("data", lambda: st.binary(max_size=256)),
    "socket.data.frames": ("data", _data_frames),
}


@pytest.mark.parametrize("target", sorted(SOCKET_TARGETS))
def test_socket_fuzz(served, target):
    port, strategy = SOCKET_TARGETS[target]
    _fuzz_socket(served, target, served.rpc() if port == "rpc" else served.data, strategy(), EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("target", sorted(SOCKET_TARGETS))
def test_socket_fuzz_long(served, target):
    port, strategy = SOCKET_TARGETS[target]
    _fuzz_socket(served, target + " (long)", served.rpc() if port == "rpc" else served.data, strategy(), LONG_EXAMPLES)


# ---- well-formed requests with random field values -------------------------------------------

KEYS = st.one_of(st.sampled_from(["a", "fuzz/k", "tail/r"]), st.text(max_size=12), st.text(min_size=500, max_size=600))
INTS = st.one_of(st.integers(-2, 5), st.sampled_from([-(2**63), 2**63 - 1, 2**31, 1 << 40]))
ANY = st.recursive(st.none() | st.booleans() | INTS | st.text(max_size=8),
                   lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                   max_leaves=6)


def _for_type(hint):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is str:
        return KEYS
    if hint is int:
        return INTS
    if hint is bool:
        return st.booleans()
    if hint is bytes:
        return st.binary(max_size=32)
    if hint is typing.Any:
        return ANY
    if hint is type(None):
        return st.none()
    if origin is list:
        return st.lists(_for_type(args[0]), max_size=4)
    if origin is dict:
        return st.dictionaries(st.text(max_size=8), _for_type(args[1]), max_size=3)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return st.one_of(*[_for_type(a) for a in args])
    if isinstance(hint, type) and issubclass(hint, msgspec.Struct):
        return _struct(hint)
    raise TypeError(f"no strategy for {hint!r}")


def _struct(cls):
    hints = typing.get_type_hints(cls)
    fields = {f.name: _for_type(hints[f.name]) for f in msgspec.structs.fields(cls)}
    if cls is m.NodeCopy:  # never let the server dial out to a random address
        fields["source"] = st.sampled_from(["127.0.0.1:1", "nonsense", ""])
    return st.builds(cls, **fields)


FUZZED_REQUESTS = [t for t in typing.get_args(m.Request) if t is not m.Hello]


def _fuzz_messages(served: Served, target: str, examples: int) -> None:
    rpc = RpcClient(served.address, timeout=IO_TIMEOUT * 2)
    internal: list[str] = []

    @fuzz_settings(examples)
    @given(st.one_of(*[_struct(t) for t in FUZZED_REQUESTS]), st.binary(max_size=64))
    def inner(msg, payload):
        TRIED[target] += 1
        try:
            if isinstance(msg, (m.Release, m.NodeUnpin)):
                rpc.send_oneway(msg)
                return
            rpc.call(msg, [payload] if payload else ())
            rpc.skip_payload()
        except KVPoolError as exc:
            assert rpc.connected, f"the server dropped the connection on {msg!r}: {exc}"
            if exc.code == "internal":
                internal.append(f"{msg!r} -> {exc.code}: {exc}")

    try:
        inner()
    finally:
        rpc.close()
    assert not internal, "handlers raised unexpected exceptions:\n" + "\n".join(internal[:10])
    assert served.proc.poll() is None, served.log.read_text()[-3000:]


@pytest.fixture
def own_served(tmp_path):
    """A pool of its own: random RegisterNode/PutEnd messages leave records that a later
    well-behaved put might be planned onto."""
    s = _serve(tmp_path)
    try:
        yield s
    finally:
        _stop(s)


def test_message_fuzz(own_served):
    _fuzz_messages(own_served, "socket.rpc.messages", EXAMPLES)


@pytest.mark.slow
def test_message_fuzz_long(own_served):
    _fuzz_messages(own_served, "socket.rpc.messages (long)", LONG_EXAMPLES)


# ---- the RPC client against a hostile server -------------------------------------------------

def _replies():
    from test_decoders import REPLY_SEEDS

    def framed(body, lie, payload):
        return HEADER.pack(PROTOCOL_VERSION, 0, max(0, len(body) + lie), len(payload)) + body + payload
    return st.one_of(st.binary(max_size=64),
                     st.builds(framed, fuzz_bytes(REPLY_SEEDS), st.sampled_from([0, 0, 0, -1, 1, 1 << 30]),
                               st.binary(max_size=16)))


def _fuzz_client(target: str, examples: int) -> None:
    server = LyingServer()

    @fuzz_settings(examples)
    @given(_replies())
    def inner(reply):
        TRIED[target] += 1
        server.reply = reply
        client = RpcClient(server.address, timeout=IO_TIMEOUT)
        t0 = time.monotonic()
        try:
            client.call(m.Exists(["a"]))
            client.skip_payload()
        except KVPoolError:  # Unavailable for a broken frame, the typed error of an Err reply
            pass
        finally:
            client.close()
        assert time.monotonic() - t0 < IO_TIMEOUT - 1, f"the client hung on {reply[:64]!r}"

    try:
        inner()
    finally:
        server.close()


def test_client_reply_fuzz():
    _fuzz_client("client.rpc.replies", EXAMPLES)


@pytest.mark.slow
def test_client_reply_fuzz_long():
    _fuzz_client("client.rpc.replies (long)", LONG_EXAMPLES)
