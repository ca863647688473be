"""The KV handle: what a prefill worker hands a decode worker so it can pull a request's KV.

A handle names objects, it holds no KV: the content-addressed chunk keys of the full chunks and
the request-scoped tail object (`tail/<request id>`) with the partial last chunk. It travels as
JSON (msgspec) between workers, so it is a declared, versioned type.

Invariants (checked by `KVHandle.validate` and again by the adapter that loads it):
- `num_tokens == len(token_ids)` when token ids are carried, and
  `num_tokens == len(chunk_keys) * chunk_tokens + (tail tokens)`, where the tail holds
  `num_tokens % chunk_tokens` tokens; `tail_key` is None exactly when that is 0.
- `namespace` is the 32-hex-character digest of the namespace the KV was written under; a loader
  with any other namespace refuses the handle (another model, weight file, dtype or tenant).

Trust (checked by the loader, `engine_adapters.chunk_store.ChunkStore.check_handle`, and by the
decode worker before any side effect): a loader refuses a handle without `token_ids` and
re-derives every chunk key from them and its own namespace (the tenant salt included), so a handle
can name only the keys of its own prompt in its own namespace; the tail key must be
`tail/<request_id>`. With a keyring the prefill worker also signs the handle (`signed`: HMAC-SHA256
under `kvpool.security.keyring.handle_key` of the tenant's secret, over every other field, the tenant's id
included) and a decode worker accepts it only for that tenant with a valid signature (`verify`):
a handle of another tenant, or one edited or made up by whoever relays it (the router, a client),
is refused with `Forbidden`, and `release=true` removes nothing it names.
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec

from kvpool.errors import Forbidden, InvalidArgument

HANDLE_VERSION = 1


class KVHandle(msgspec.Struct, frozen=True, kw_only=True):
    version: int = HANDLE_VERSION
    namespace: str  # Namespace.hex()
    request_id: str | None
    num_tokens: int
    chunk_tokens: int
    chunk_keys: list[str]
    tail_key: str | None = None
    token_ids: list[int] | None = None  # the prompt whose KV this is; lets a loader re-derive keys
    tenant: str | None = None  # with a keyring: the tenant whose KV this is (signed with the rest)
    signature: str | None = None  # with a keyring: hex HMAC-SHA256 of the other fields (`signed`)

    def validate(self) -> "KVHandle":
        """Raise `InvalidArgument` unless the fields agree with each other; return self."""
        if self.version != HANDLE_VERSION:
            raise InvalidArgument(f"KV handle version {self.version} is not supported (this build reads {HANDLE_VERSION})")
        if len(self.namespace) != 32:
            raise InvalidArgument("KV handle namespace must be 32 hex characters")
        if self.chunk_tokens <= 0 or self.num_tokens < 0:
            raise InvalidArgument("KV handle has a non-positive chunk size or a negative token count")
        full, rest = divmod(self.num_tokens, self.chunk_tokens)
        if len(self.chunk_keys) != full:
            raise InvalidArgument(f"KV handle lists {len(self.chunk_keys)} chunk keys for {full} full chunks")
        if (self.tail_key is None) != (rest == 0):
            raise InvalidArgument(f"KV handle tail key {self.tail_key!r} disagrees with a {rest}-token tail")
        if self.token_ids is not None and len(self.token_ids) != self.num_tokens:
            raise InvalidArgument(f"KV handle carries {len(self.token_ids)} token ids for {self.num_tokens} tokens")
        return self

    def _mac(self, key: bytes) -> str:
        unsigned = msgspec.structs.replace(self, signature=None)
        return hmac.new(key, b"kvpool-handle/v1\n" + msgspec.json.encode(unsigned), hashlib.sha256).hexdigest()

    def signed(self, key: bytes, tenant: str | None) -> "KVHandle":
        """This handle for `tenant`, signed under `key` (`kvpool.security.keyring.handle_key`)."""
        bound = msgspec.structs.replace(self, tenant=tenant, signature=None)
        return msgspec.structs.replace(bound, signature=bound._mac(key))

    def verify(self, key: bytes | None, tenant: str | None) -> "KVHandle":
        """Raise `Forbidden` unless the handle is signed under `key` for `tenant`; with no key (no
        keyring) there is nothing to check. Return self."""
        if key is None:
            return self
        if self.signature is None:
            raise Forbidden("the KV handle is not signed: this worker accepts only handles a prefill worker "
                            "of the same tenant signed")
        if self.tenant != tenant:
            raise Forbidden("the KV handle belongs to another tenant")
        if not hmac.compare_digest(self._mac(key), self.signature):
            raise Forbidden("the KV handle's signature does not verify (edited, or not made by a prefill worker "
                            "of this tenant)")
        return self

    @property
    def tail_tokens(self) -> int:
        return self.num_tokens % self.chunk_tokens

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> "KVHandle":
        """Decode and validate; malformed input raises `InvalidArgument`, never a traceback."""
        try:
            handle = msgspec.json.decode(data, type=cls)
        except msgspec.ValidationError as exc:
            raise InvalidArgument(f"malformed KV handle: {exc}") from None
        except msgspec.DecodeError as exc:
            raise InvalidArgument(f"KV handle is not valid JSON: {exc}") from None
        return handle.validate()
