"""Chunk keys: committed golden vectors (tests/kvpool/golden/vectors.json), an independent
re-derivation from the documented formula, hypothesis properties, and the `kvpool keys` CLI."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.errors import InvalidArgument
from kvpool.keys import Namespace, chunk_keys, chunk_keys_hex, parse_namespace_hex, tail_key
from kvpool.chunk_format import KVLayout

GOLDEN = json.loads((Path(__file__).parent / "golden" / "vectors.json").read_text())["keys"]


def _reference_chain(namespace: bytes, tokens: list[int], chunk_tokens: int) -> list[str]:
    """The chain exactly as keys.py's docstring specifies it, written independently."""
    keys, prev = [], namespace
    for i in range(len(tokens) // chunk_tokens):
        chunk = tokens[i * chunk_tokens : (i + 1) * chunk_tokens]
        prev = xxhash.xxh3_128_digest(prev + struct.pack(f"<{chunk_tokens}I", *chunk))
        keys.append(prev.hex())
    return keys


@pytest.mark.parametrize("case", GOLDEN["namespaces"], ids=lambda c: c["digest"][:8])
def test_namespace_golden(case):
    spec = {k: v for k, v in case.items() if k not in ("canonical_json", "digest", "note")}
    ns = Namespace(**{**spec, "layout": KVLayout(**spec["layout"])})
    assert ns.canonical_json() == case["canonical_json"]
    assert ns.hex() == case["digest"]
    assert xxhash.xxh3_128_hexdigest(b"kvpool-namespace/v1\n" + case["canonical_json"].encode()) == case["digest"]


def test_namespaces_never_collide():
    assert len({c["digest"] for c in GOLDEN["namespaces"]}) == len(GOLDEN["namespaces"])


@pytest.mark.parametrize("case", GOLDEN["chains"], ids=lambda c: f"{c['chunk_tokens']}x{len(c['tokens'])}")
def test_chain_golden(case):
    ns = bytes.fromhex(case["namespace"])
    assert chunk_keys_hex(ns, case["tokens"], case["chunk_tokens"]) == case["keys"]
    assert _reference_chain(ns, case["tokens"], case["chunk_tokens"]) == case["keys"]
    assert len(case["keys"]) == len(case["tokens"]) // case["chunk_tokens"]


@settings(max_examples=200, deadline=None)
@given(ns=st.binary(min_size=16, max_size=16), tokens=st.lists(st.integers(0, 2**32 - 1), max_size=40),
       chunk=st.integers(1, 8))
def test_chain_properties(ns, tokens, chunk):
    keys = chunk_keys(ns, tokens, chunk)
    assert [k.hex() for k in keys] == _reference_chain(ns, tokens, chunk)
    # prefix property: a prompt's keys start with the keys of any of its prefixes
    cut = len(tokens) // 2
    assert keys[: cut // chunk] == chunk_keys(ns, tokens[:cut], chunk)
    assert all(len(k) == 16 for k in keys)


@pytest.mark.parametrize("tokens", [[-1], [2**32], [1.5, 2.0], [[1, 2]], ["a"]])
def test_bad_tokens(tokens):
    with pytest.raises(InvalidArgument):
        chunk_keys(b"\0" * 16, tokens, 1)


def test_bad_arguments():
    with pytest.raises(InvalidArgument):
        chunk_keys(b"short", [1], 1)
    with pytest.raises(InvalidArgument):
        chunk_keys(b"\0" * 16, [1], 0)
    with pytest.raises(InvalidArgument):
        parse_namespace_hex("zz")
    with pytest.raises(InvalidArgument):
        parse_namespace_hex("00" * 8)
    with pytest.raises(InvalidArgument):
        tail_key("a/b")
    with pytest.raises(InvalidArgument):
        Namespace("m", "w", KVLayout(1, 1, 1), tp_rank=2, tp_size=2)
    assert tail_key("r1") == "tail/r1"


def test_cli_keys_prints_the_chain():
    from kvpool.cli import cli

    case = GOLDEN["chains"][0]  # the README's example command
    args = ["keys", "--namespace-hex", case["namespace"], "--chunk-tokens", str(case["chunk_tokens"])]
    result = CliRunner().invoke(cli, [*args, "--tokens", ",".join(map(str, case["tokens"]))])
    assert result.exit_code == 0, result.output
    assert result.output.split() == case["keys"]
    piped = CliRunner().invoke(cli, args, input=" ,".join(map(str, case["tokens"])))
    assert piped.output.split() == case["keys"]


def test_cli_keys_bad_input_is_a_clear_error():
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    run = subprocess.run([sys.executable, "-c", "from kvpool.cli import main; main()", "keys",
                          "--namespace-hex", "nothex", "--chunk-tokens", "4", "--tokens", "1,2"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 2
    assert "error:" in run.stderr and "hex" in run.stderr and "Traceback" not in run.stderr
