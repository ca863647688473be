"""`kvpool keys`: print the chunk keys of a token sequence, for debugging cache misses."""

from __future__ import annotations

import sys

import click

from kvpool.errors import InvalidArgument
from kvpool.keys import chunk_keys, parse_namespace_hex


def _parse_tokens(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise InvalidArgument("--tokens must be comma-separated integers, e.g. 1,2,3") from None


@click.command()
@click.option("--namespace-hex", required=True, help="The 16-byte namespace digest as 32 hex characters.")
@click.option("--chunk-tokens", required=True, type=click.IntRange(min=1), help="Tokens per chunk.")
@click.option("--tokens", help="Comma-separated token ids; '-' or omitted reads them from stdin.")
def keys(namespace_hex: str, chunk_tokens: int, tokens: str | None) -> None:
    """Print one key (32 lowercase hex characters) per full chunk of TOKENS, one per line.

    key[i] = xxh3_128(key[i-1] || tokens of chunk i as little-endian u32), key[-1] = namespace.
    A partial last chunk has no key.
    """
    namespace = parse_namespace_hex(namespace_hex)
    text = sys.stdin.read() if tokens in (None, "-") else tokens
    for key in chunk_keys(namespace, _parse_tokens(text), chunk_tokens):
        click.echo(key.hex())
