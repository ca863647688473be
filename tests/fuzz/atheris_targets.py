"""Coverage-guided fuzzing (atheris: libFuzzer for Python) of the decoders that
tests/fuzz/test_decoders.py fuzzes with hypothesis (issue 14).

Same targets, same property: each target's check is the one test_decoders.py uses (a valid
object or the module's own documented error); any other exception is a crash, and libFuzzer
writes the input to `<artifact_prefix>crash-<sha1>`. Only the decoders' modules and the checks
are instrumented (DECODER_MODULES): msgspec's decoders are C, so for the msgpack targets libFuzzer sees no coverage
inside the decoder, only whether the check decoded or refused (mutation without much guidance).

    python tests/fuzz/atheris_targets.py --list
    python tests/fuzz/atheris_targets.py TARGET -atheris_runs=N    # or -max_total_time=S (seconds)
    python tests/fuzz/atheris_targets.py TARGET [CORPUS_DIR] [libFuzzer flags]

`all` fuzzes every target in one process (the first byte picks the target). Each corpus starts
from the target's valid encodings, written by this harness (`seed-N` files): into CORPUS_DIR when
given (it keeps what libFuzzer adds), else into a temporary directory removed at exit. At exit the
harness prints one line per target: "atheris <target>: <n> inputs tried in <s> s".
Needs `pip install atheris` (the `fuzz` extra); tests/fuzz/test_atheris.py runs it.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import tempfile
import time
import types
from collections import Counter
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).parent))  # test_decoders, fuzz_support

Check = Callable[[bytes], None]


def _fields(data: bytes) -> list[bytes]:
    """Split `data` into length-prefixed fields (1 byte length, then that many bytes); the last
    takes what is left. How one flat input becomes several (tiers.ssd.recover's records)."""
    out, at = [], 0
    while at < len(data):
        n = data[at]
        out.append(data[at + 1:at + 1 + n])
        at += 1 + n
    return out


def _join(*fields: bytes) -> bytes:
    return b"".join(bytes([len(f)]) + f for f in fields)


def targets() -> dict[str, tuple[list[bytes], Check]]:
    """name -> (seed inputs, check). Imports the decoders (main instruments them afterwards)."""
    import test_decoders as td
    from kvpool.messages import PROTOCOL_VERSION
    from kvpool.rpc.frame import HEADER, MAX_MESSAGE, MAX_PAYLOAD
    from transfer import wire

    out = {name: (td.SEEDS.get(name, []), check) for name, (_, check) in td.TARGETS.items()}
    out["transfer.headers"] = ([wire.REQ.pack(wire.MAGIC, wire.VERSION, 1, 0, 7, 1, 0, 4096),
                                wire.RESP.pack(wire.MAGIC, wire.VERSION, 0, 0, 1, 4096)], out["transfer.headers"][1])

    request_check, reply_check = td.TARGETS["rpc.request"][1], td.TARGETS["rpc.reply"][1]

    def rpc_frame(data: bytes) -> None:
        """A frame as a receiver cuts it: the 16-byte header bounds what is read as the message."""
        version, flags, msg_len, payload_len = HEADER.unpack(data[:HEADER.size].ljust(HEADER.size, b"\0"))
        if msg_len > MAX_MESSAGE or payload_len > MAX_PAYLOAD:
            return  # both ends refuse such a header before reading on
        body = data[HEADER.size:HEADER.size + msg_len]
        request_check(body)
        reply_check(body)

    frames = [HEADER.pack(PROTOCOL_VERSION, 0, len(s), 0) + s for s in td.REQUEST_SEEDS[:4] + td.REPLY_SEEDS[:4]]
    out["rpc.frame"] = (frames, rpc_frame)

    def ssd_recover(data: bytes) -> None:
        f = _fields(data)
        td._ssd_reopen([(f[i] or b"k", f[i + 1], f[i + 2] if f[i + 2] else None) for i in range(0, len(f) - 2, 3)][:4])

    import xxhash
    from kvpool.tiers.ssd import _lmdb_key

    def record(key: str, data: bytes) -> bytes:
        meta = td.META.pack(td.SSD_MAGIC, td.SSD_VERSION, len(key.encode()), len(data), xxhash.xxh3_64_intdigest(data))
        return _join(_lmdb_key(key), meta + key.encode(), data)

    out["tiers.ssd.recover"] = ([record("a", b"data"), record("a", b"x") + record("b/c", b"yy" * 8),
                                 record("k", b"z")[:-1] + b"\x00"], ssd_recover)

    try:
        import torch  # noqa: F401
    except ImportError:
        return out  # the codec targets need torch
    from kvpool.chunk_format import HEADER_SIZE
    for name in td._codec_targets():
        seed, _, check = td.codec_target(name)
        out[f"codec.{name}"] = ([seed, seed[HEADER_SIZE:]], check)
    return out


# The modules whose code the targets exercise; instrumenting only these (not all of kvpool, as
# instrument_imports would) saves ~3 s of CPU at each start. test_decoders too: its checks'
# branches (decoded / refused) are the only coverage a decoder written in C (msgspec) shows.
DECODER_MODULES = ("kvpool.messages", "kvpool.rpc.frame", "kvpool.chunk_format", "kvpool.codec", "kvpool.handle",
                   "kvpool.worker_api", "kvpool.tiers.ssd", "kvpool.contract", "transfer.wire", "transfer.descriptor",
                   "transfer.auth", "test_decoders")


def _instrument(atheris, extra: list[Callable]) -> int:
    """Instrument, in place, every function and method defined in DECODER_MODULES (and their
    submodules), and `extra` (closures made before this ran). Returns how many."""
    done: set[int] = set()

    def patch(f) -> None:
        f = getattr(f, "__func__", f)  # staticmethod, classmethod
        if isinstance(f, types.FunctionType) and id(f) not in done:
            done.add(id(f))
            atheris.instrument_func(f)

    for name, mod in list(sys.modules.items()):
        if not any(name == p or name.startswith(p + ".") for p in DECODER_MODULES):
            continue
        for obj in list(vars(mod).values()):
            if getattr(obj, "__module__", None) != name:
                continue
            if isinstance(obj, type):
                for attr in vars(obj).values():
                    for f in (attr.fget, attr.fset) if isinstance(attr, property) else (attr,):
                        patch(f)
            else:
                patch(obj)
    for f in extra:
        patch(f)
    return len(done)


def _all(table: dict[str, tuple[list[bytes], Check]]) -> tuple[list[bytes], Callable[[bytes], str]]:
    names = sorted(table)
    seeds = [bytes([i]) + s for i, n in enumerate(names) for s in table[n][0]]

    def pick(data: bytes) -> str:
        return names[data[0] % len(names)] if data else names[0]

    return seeds, pick


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(2)
    import atheris

    logging.getLogger("kvpool").setLevel(logging.ERROR)  # the SSD tier warns of each damaged record it drops
    table = targets()
    _instrument(atheris, [check for _, check in table.values()])
    target = argv[1]
    if target == "--list":
        print("\n".join(["all", *sorted(table)]))
        return
    if target != "all" and target not in table:
        sys.exit(f"unknown target {target!r}; --list names them")

    start = time.monotonic()
    if target == "all":
        seeds, pick = _all(table)
    else:
        seeds, pick = table[target][0], (lambda data: target)
    tried: Counter[str] = Counter()
    checks = {name: check for name, (_, check) in table.items()}
    skip = 1 if target == "all" else 0

    # -max_total_time is kept from libFuzzer, which would exit() past Python's atexit: the harness
    # stops after the first input past the deadline, through `report`.
    limits = [a for a in argv[2:] if a.startswith("-max_total_time=")]
    deadline = time.monotonic() + float(limits[-1].split("=", 1)[1]) if limits else float("inf")

    def one_input(data: bytes) -> None:
        name = pick(data)
        tried[name] += 1
        checks[name](data[skip:])
        if time.monotonic() >= deadline:
            report()
            os._exit(0)

    flags = [a for a in argv[2:] if a.startswith("-") and a not in limits]
    if not any(a.startswith("-keep_seed=") for a in flags):
        flags.append("-keep_seed=1")  # a seed that adds no Python coverage (a msgpack message) stays a parent
    dirs = [a for a in argv[2:] if not a.startswith("-")]
    if dirs:
        corpus = Path(dirs[0])
        corpus.mkdir(parents=True, exist_ok=True)
    else:
        corpus = Path(tempfile.mkdtemp(prefix=f"kvpool-atheris-{target}-"))  # removed by `report`
    for i, seed in enumerate(seeds):
        (corpus / f"seed-{i}").write_bytes(seed)

    def report() -> None:
        secs = time.monotonic() - start
        for name in sorted(tried) if target == "all" else [target]:
            print(f"atheris {name}: {tried[name]} inputs tried in {secs:.1f} s", file=sys.stderr, flush=True)
        if not dirs:
            shutil.rmtree(corpus, True)

    atexit.register(report)
    atheris.Setup([argv[0], *flags, str(corpus), *dirs[1:]], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
