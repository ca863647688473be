"""What the connector's scheduler side tells its worker side, once per step (vLLM pickles it to
the workers): which paged blocks to fill from the pool, and which chunks to save, each with the
request's `cache_salt` (the namespace its chunk keys are in: `ConnectorSettings.namespace`)."""

from __future__ import annotations

from dataclasses import dataclass, field

try:  # vLLM's marker base class where vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
except ImportError:  # without vLLM the metadata is a plain dataclass (the fake engine in tests drives it)
    KVConnectorMetadata = object

METADATA_VERSION = 2  # 2: specs carry the request's cache_salt


@dataclass
class LoadSpec:
    """Fill the paged blocks of tokens [start, len(token_ids)) from the pool's chunks.

    `token_ids` is the cached prefix (a whole number of chunks); `block_ids` cover it; `start` is
    block-aligned (tokens before it are already in vLLM's local prefix cache).
    """

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int
    cache_salt: str | None = None


@dataclass
class SaveSpec:
    """Save chunks [first_chunk, len(token_ids) // chunk_tokens) once this step has computed them."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    first_chunk: int
    cache_salt: str | None = None


@dataclass
class KVPoolConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    version: int = METADATA_VERSION
