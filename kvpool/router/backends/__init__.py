"""What the router talks to, behind one `Backend` protocol (base.py): `reference` (kvpool's own
prefill/decode workers) and `vllm` (vLLM OpenAI servers with kvpool's connector). Each owns its
HTTP clients and maps its errors."""

from __future__ import annotations

from typing import Any

from kvpool.errors import InvalidArgument
from kvpool.router.backends.base import Backend
from kvpool.router.backends.reference import ReferenceBackend
from kvpool.router.backends.vllm import VLLMBackend

ENGINES = ("reference", "vllm")


def make_backend(engine: str, vllm: Any = None, *, keyring: Any = None) -> Backend:
    """The backend for `engine`: "reference" (with `keyring`, the internal token on every call)
    or "vllm" (`vllm`: its `VLLMSettings`)."""
    if engine == "reference":
        return ReferenceBackend(keyring)
    if engine != "vllm":
        raise InvalidArgument(f"unknown engine {engine!r}: 'reference' (the reference workers) or 'vllm'")
    if vllm is None or not vllm.model_path:
        raise InvalidArgument("a router for vLLM servers (--engine vllm) needs the model folder they load: "
                              "--tokenizer DIR ([router] tokenizer)")
    return VLLMBackend(vllm)


__all__ = ["Backend", "ENGINES", "ReferenceBackend", "VLLMBackend", "make_backend"]
