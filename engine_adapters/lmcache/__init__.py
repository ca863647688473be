"""LMCache remote storage backend on the kvpool: LMCache (0.5.x) keeps its local CPU tier and
stores and loads its KV chunks in the pool, so a prefix one engine computed is loaded by another.

Enable it in LMCache's config (see docs/lmcache.md) with one remote storage plugin entry, the way
LMCache 0.5 registers third-party remote stores (`remote_storage_plugins`, which replaced the
deprecated `remote_url`):

    remote_storage_plugins: ["kvpool"]
    extra_config:
      remote_storage_plugin.kvpool.module_path: engine_adapters.lmcache
      remote_storage_plugin.kvpool.class_name: KVPoolConnectorAdapter
      remote_storage_plugin.kvpool.url: kvpool://127.0.0.1:7600

What it stores:
- One LMCache chunk (a `MemoryObj` in LMCache's KV_2LTD format, `[2, layers, tokens, heads *
  head_dim]`) is one kvpool chunk object (`kvpool.chunk_format`: header, checksum, MAC under a
  keyring, layer-major payload). A chunk that fails its check is a miss, never KV.
- Its pool key is `lmcache/<namespace hex>/<LMCache's key string>`: LMCache's own identity
  (model, world size, worker, chunk hash, dtype, tags) under a kvpool namespace that also covers
  the KV layout, the weights fingerprint and the tenant salt.

The parts:

    options.py    the plugin's settings: URL -> pool address, extra_config keys, what is supported
    chunks.py     LMCacheChunks: KV_2LTD tensors <-> chunk objects, pool keys (no LMCache import)
    connector.py  KVPoolConnector (LMCache's RemoteConnector) and KVPoolConnectorAdapter (its
                  ConnectorAdapter); imports lmcache

`import engine_adapters.lmcache` works without LMCache installed; the two LMCache classes are
imported on first use, and without the `lmcache` package that use raises an ImportError that says
how to install it.
"""

from __future__ import annotations

from typing import Any

_LMCACHE_CLASSES = ("KVPoolConnector", "KVPoolConnectorAdapter")


def __getattr__(name: str) -> Any:
    if name not in _LMCACHE_CLASSES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from engine_adapters.lmcache import connector
    except ImportError as exc:
        if exc.name is None or not exc.name.split(".")[0] == "lmcache":
            raise
        raise ImportError(f"engine_adapters.lmcache.{name} needs the lmcache package (tested with lmcache 0.5.6): "
                          f"pip install 'kvpool[lmcache]' ({exc})", name="lmcache") from exc
    value = getattr(connector, name)
    globals()[name] = value
    return value


__all__ = list(_LMCACHE_CLASSES)
