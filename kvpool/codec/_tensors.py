"""Tensor plumbing the codecs share: dtypes, argument checks, byte views of buffers."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from kvpool.errors import FormatError, InvalidArgument
from kvpool.chunk_format import KVLayout

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# unit roundoff of each layout dtype: rounding a real y into it moves it by at most |y| * u
UNIT_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
# ... or by half its subnormal step, where |y| is below its normal range (float16's is 6e-5)
SUBNORMAL_HALF_STEP = {"float32": 2.0**-150, "bfloat16": 2.0**-134, "float16": 2.0**-25}


def torch_dtype(layout: KVLayout) -> torch.dtype:
    return TORCH_DTYPES[layout.dtype]


def empty_kv(layout: KVLayout, tokens: int) -> torch.Tensor:
    return torch.empty(layout.shape(tokens), dtype=torch_dtype(layout))


def check_kv(layout: KVLayout, kv: Any, what: str = "kv") -> int:
    """`kv` must be a CPU tensor of the layout's dtype and shape `layout.shape(tokens)`, 1 <= tokens
    <= chunk_tokens; returns tokens."""
    if not isinstance(kv, torch.Tensor):
        raise InvalidArgument(f"{what} must be a torch.Tensor, got {type(kv).__name__}")
    if kv.device.type != "cpu":
        raise InvalidArgument(f"{what} must be on the CPU (copy device tensors to the host first)")
    if kv.dim() != 5:
        raise InvalidArgument(f"{what} has shape {tuple(kv.shape)}, expected [layers, 2, kv_heads, tokens, head_dim]")
    tokens = int(kv.shape[3])
    if not 0 < tokens <= layout.chunk_tokens or tuple(kv.shape) != layout.shape(tokens):
        raise InvalidArgument(f"{what} has shape {tuple(kv.shape)}, the layout expects {layout.shape(tokens)} "
                              f"with 1 <= tokens <= {layout.chunk_tokens}")
    if kv.dtype != torch_dtype(layout):
        raise InvalidArgument(f"{what} is {kv.dtype}, the layout stores {layout.dtype}")
    return tokens


def byte_view(buf: Any, nbytes: int | None = None) -> torch.Tensor:
    """A flat uint8 tensor over `buf` (bytes, bytearray, memoryview, numpy array), no copy.

    Read-only buffers give a tensor that must not be written (torch warns; we do not write)."""
    view = memoryview(buf).cast("B")
    if nbytes is not None:
        if view.nbytes < nbytes:
            raise InvalidArgument(f"buffer holds {view.nbytes} bytes, need {nbytes}")
        view = view[:nbytes]
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.frombuffer(view, dtype=torch.uint8)


def payload_view(payload: Any, expected: int, codec: str, tokens: int) -> torch.Tensor:
    """A uint8 view of a fixed-rate payload, which must be exactly `expected` bytes long."""
    n = memoryview(payload).nbytes
    if n != expected:
        raise FormatError(f"{codec} payload of {n} bytes; a {tokens}-token chunk of this layout encodes to "
                          f"{expected} bytes (truncated or not a {codec} chunk)")
    return byte_view(payload)
