"""What the LMCache plugin reads from LMCache's config and metadata (duck-typed: no LMCache import).

The plugin's own settings live in LMCache's `extra_config` under `remote_storage_plugin.<name>.`
(LMCache's convention for remote storage plugins), every one optional:

    url                  kvpool://HOST:PORT (an embedded pool or a master), or kvpool+etcd://HOST:PORT
                         (cluster mode: the leader master is found in etcd); default:
                         kvpool://<[pool] master> (KVPOOL_MASTER, else 127.0.0.1:7600)
    weights_fingerprint  part of the namespace: engines whose weights differ never share chunks
                         (default `[connector] weights_fingerprint`, "unversioned": the model
                         name alone decides)
    threads              pool connections working in parallel (default 4)
    tenant_salt_file     a file holding the namespace salt (`engine_adapters.chunk_store.plugin_tenant_salt`)

Credentials never go in the URL or the config: the pool client authenticates as `KVPOOL_PRINCIPAL`
of the keyring `KVPOOL_AUTH_FILE`, as every kvpool engine plug-in does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvpool.chunk_format import KVLayout
from kvpool.config import current_settings, default
from kvpool.errors import InvalidArgument

PLUGIN_TYPE = "kvpool"
SCHEMES = ("kvpool://", "kvpool+etcd://")
_DTYPES = {"torch.float16": "float16", "torch.bfloat16": "bfloat16", "torch.float32": "float32"}


def pool_address(url: str) -> str:
    """The `kvpool.connect` address of a plugin URL: kvpool://HOST:PORT[/...] -> HOST:PORT,
    kvpool+etcd://HOST:PORT -> etcd://HOST:PORT; also LMCache's (deprecated) external connector
    URL, external://HOST:PORT/engine_adapters.lmcache.connector/?connector_name=KVPoolConnector."""
    try:
        parts = urlsplit(str(url))
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise InvalidArgument(f"kvpool URL {url!r} is malformed: {exc}") from None
    if parts.scheme not in ("kvpool", "kvpool+etcd", "external"):
        raise InvalidArgument(f"kvpool URL {url!r}: expected kvpool://HOST:PORT or kvpool+etcd://HOST:PORT")
    if parts.username or parts.password:
        raise InvalidArgument(f"kvpool URL {parts.scheme}://...@{host}: credentials do not belong in a URL "
                              "(logged by LMCache); use KVPOOL_AUTH_FILE and KVPOOL_PRINCIPAL")
    if not host or not port:
        raise InvalidArgument(f"kvpool URL {url!r} needs HOST:PORT")
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return ("etcd://" if parts.scheme == "kvpool+etcd" else "") + netloc


def plugin_options(extra_config: dict | None, plugin_name: str) -> dict[str, Any]:
    """The `remote_storage_plugin.<plugin_name>.*` entries of LMCache's extra_config, prefix removed."""
    prefix = f"remote_storage_plugin.{plugin_name}."
    return {k[len(prefix):]: v for k, v in (extra_config or {}).items() if str(k).startswith(prefix)}


@dataclass(frozen=True)
class PluginOptions:
    address: str
    weights_fingerprint: str = default("connector.weights_fingerprint")
    threads: int = 4
    extra: dict = field(default_factory=dict, repr=False)  # all plugin entries (the tenant salt reads its own)

    @classmethod
    def from_lmcache(cls, config: Any, plugin_name: str = PLUGIN_TYPE, url: str | None = None) -> "PluginOptions":
        """Options for plugin `plugin_name`; `url`, when given (a kvpool:// remote_url, an external://
        URL), wins over the extra_config entry."""
        opts = plugin_options(getattr(config, "extra_config", None), plugin_name)
        remote_url = str(getattr(config, "remote_url", None) or "")
        url = (url or opts.get("url") or (remote_url if remote_url.startswith(SCHEMES) else None)
               or f"kvpool://{current_settings().pool.master}")
        try:
            threads = int(opts.get("threads", 4))
        except (TypeError, ValueError):
            threads = 0
        if not 1 <= threads <= 64:
            raise InvalidArgument(f"remote_storage_plugin.{plugin_name}.threads must be 1..64, got {opts.get('threads')!r}")
        fingerprint = opts.get("weights_fingerprint", current_settings().connector.weights_fingerprint)
        return cls(pool_address(url), str(fingerprint), threads, opts)


def check_supported(config: Any, metadata: Any) -> None:
    """Refuse, at start, what the plugin cannot store (a clear error rather than failed puts)."""
    if getattr(metadata, "use_mla", False):
        raise InvalidArgument("the kvpool LMCache plugin stores K and V chunks; MLA (latent) KV caches are not supported")
    if getattr(config, "use_layerwise", False):
        raise InvalidArgument("the kvpool LMCache plugin stores whole chunks; use_layerwise: true is not supported")
    serde = getattr(config, "remote_serde", "naive")
    if serde not in (None, "naive"):
        raise InvalidArgument(f"the kvpool LMCache plugin stores raw KV (remote_serde: naive); remote_serde: {serde} "
                              "is not supported (for compression use a kvpool codec on the pool side)")
    shapes = metadata.get_shapes()
    if len(shapes) != 1:
        raise InvalidArgument(f"the kvpool LMCache plugin stores one KV layer group; this model has {len(shapes)}")


def layout_from_metadata(metadata: Any) -> KVLayout:
    """The kvpool layout of LMCache's chunks: kv_shape is (layers, 2, chunk_size, kv heads, head dim)."""
    layers, kv, chunk, heads, head_dim = (int(x) for x in metadata.kv_shape)
    if kv != 2:
        raise InvalidArgument(f"LMCache kv_shape {tuple(metadata.kv_shape)}: expected K and V (2) in dimension 1")
    dtype = _DTYPES.get(str(metadata.kv_dtype))
    if dtype is None:
        raise InvalidArgument(f"the kvpool LMCache plugin supports float16, bfloat16 and float32 KV, got {metadata.kv_dtype}")
    return KVLayout(layers, heads, head_dim, dtype, int(getattr(metadata, "chunk_size", chunk) or chunk))
