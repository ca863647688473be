"""Wire messages of the reference workers' HTTP control API (JSON, msgspec-declared, versioned).

KV bytes never travel in these messages: a prefill answer carries a `KVHandle` (which keys in
the pool hold the prompt's KV), and the decode worker pulls the bytes from the pool itself.

Every message has `v` (the wire version, `WIRE_VERSION`); a peer that receives a version it does
not know answers 400 `invalid_argument` instead of guessing.

The decode stream is newline-delimited JSON (`application/x-ndjson`): one `TokenEvent` per line,
the last one with `done=True` (and `finish_reason`), or a line with `error` set.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from kvpool.handle import KVHandle
from kvpool.errors import InvalidArgument, KVPoolError

WIRE_VERSION = 1
NDJSON = "application/x-ndjson"


class Message(msgspec.Struct, kw_only=True, omit_defaults=False):
    v: int = WIRE_VERSION


class ChatMessage(msgspec.Struct):
    role: str
    content: str


class TokenizeRequest(Message):
    """Exactly one of `prompt` (plain text) or `messages` (rendered with the chat template)."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = None

    def __post_init__(self) -> None:  # decoding turns this into `InvalidArgument` (HTTP 400)
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")


class TokenizeResponse(Message):
    token_ids: list[int]


class SamplingParams(msgspec.Struct, kw_only=True):
    """How each token is picked. `temperature` 0 is greedy (argmax). Otherwise token `i` of a
    request (0 = the prefill's first token) is drawn with a generator seeded by (`seed`, i), so
    the same seed gives the same tokens whichever worker computes which position."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


class PrefillRequest(Message):
    token_ids: list[int]
    request_id: str | None = None  # the caller's id; the worker adds a unique suffix
    sampling: SamplingParams | None = None  # None: greedy
    # How many of the prompt's full chunks the pool held when the router routed it (its one
    # match_prefix, in the same namespace); the worker reads them without asking the pool again.
    # A count gone stale costs nothing but reuse: the read stops at the first chunk missing.
    # None: the worker asks the pool itself.
    pool_chunks: Annotated[int, msgspec.Meta(ge=0)] | None = None


class PrefillResponse(Message):
    request_id: str  # the worker's id for this request (names the tail object)
    first_token: int
    handle: KVHandle
    prompt_tokens: int
    cached_tokens: int  # local_cached_tokens + pool_cached_tokens
    local_cached_tokens: int  # served from this worker's own prefix cache
    pool_cached_tokens: int  # fetched from the pool
    computed_tokens: int
    prefill_ms: float  # arrival to first token, including the push of the KV
    text: str = ""  # the first token as text
    fetch_ms: float = 0.0  # of prefill_ms: reading the cached prefix from the pool
    compute_ms: float = 0.0  # of prefill_ms: the forward passes over the computed tokens
    push_ms: float = 0.0  # of prefill_ms: writing the new chunks and the tail to the pool (the hand-off)
    pool_ssd_tokens: int = 0  # of pool_cached_tokens: read from the pool's SSD tier (the rest: DRAM)


class DecodeRequest(Message):
    handle: KVHandle
    first_token: int  # what prefill produced: the decode worker feeds it next
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 16  # total new tokens, the first one included
    stop_token_ids: list[int] | None = None  # default: the model's EOS tokens
    release: bool = True  # remove the tail from the pool when done
    sampling: SamplingParams | None = None  # None: greedy; the same params the prefill had


class GenerateRequest(Message):
    """Prefill and decode on one worker, without a pool round trip: role `both`, and role
    `decode` too (a router sends short uncached prompts there: conditional disaggregation)."""

    token_ids: list[int]
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 16
    request_id: str | None = None
    stop_token_ids: list[int] | None = None
    sampling: SamplingParams | None = None
    pool_chunks: Annotated[int, msgspec.Meta(ge=0)] | None = None  # as in `PrefillRequest`


class ErrorInfo(msgspec.Struct):
    code: str
    message: str


class TokenEvent(Message):
    """One line of a decode stream. `index` 0 is the first token (the prefill's)."""

    request_id: str
    index: int = -1
    token_id: int = -1
    text: str = ""
    done: bool = False
    finish_reason: str | None = None  # "stop" | "length"
    prefill: PrefillResponse | None = None  # first line of a /v1/generate stream
    error: ErrorInfo | None = None


class LoadReport(Message):
    """What a router reads to place requests on this worker."""

    role: str
    queue_length: int  # prefill jobs waiting + decode sequences waiting to join
    active_sequences: int  # sequences in the running decode batch
    kv_tokens: int  # tokens of KV held by running sequences and in-flight prefills
    cache_tokens: int  # tokens in this worker's local prefix cache
    cache_capacity_tokens: int
    max_batch: int
    prefill_queue_tokens: int = 0  # prompt tokens queued or in flight that are still to be computed
    # a decode step of B sequences takes about decode_step_ms + B * decode_token_ms (fitted over recent steps)
    decode_token_ms: float = 0.0  # what each sequence in the batch adds to a step
    decode_step_ms: float = 0.0  # what every step costs whatever its batch (0: all of it is per sequence)
    open_streams: int = 0  # decode/generate streams still open (drain waits for 0)
    draining: bool = False  # refusing new work, finishing what it has
    # With `GET /load?events_since=N`: the KV events after N as `/v1/events` gives them, so one
    # poll brings both. None when not asked for.
    events: "EventsResponse | None" = None


class WorkerInfo(Message):
    role: str
    model_id: str
    namespace: str
    chunk_tokens: int
    dtype: str
    pool: str
    eos_token_ids: list[int]
    max_positions: int = 0  # context length: prompt + generated tokens
    bytes_per_token: int = 0  # KV bytes of one token (all layers, K and V)
    kv_codec: str = "none"  # how its KV chunks are stored in the pool (kvpool.codec)
    # pool bytes of one token as kv_codec stores it (what a fetch moves; 0: bytes_per_token)
    stored_bytes_per_token: int = 0
    # The namespace's canonical JSON (kvpool.keys.Namespace.canonical_json): a router salts it per
    # tenant (tenant_salt replaced by kvpool.security.keyring.tenant_salt) to hash a tenant's prompts.
    namespace_doc: str = ""
    # The tenants whose requests it serves (its keyring's), None: whoever is named (no keyring, or
    # an older worker). A router sends a tenant's requests only to workers that serve it.
    tenants: list[str] | None = None


class TokenizerInfo(Message):
    """What a router needs to tokenize exactly as the worker does, without the model:
    the `tokenizers` JSON, the chat template (jinja) and the special tokens it refers to.

    The worker's `/v1/tokenize` equals, id for id (tests/reference_worker/test_tokenizer_info.py):
      tok = tokenizers.Tokenizer.from_str(tokenizer_json)
      prompt:   ids = tok.encode(prompt).ids (special tokens on); [bos id] + ids if add_bos_token
      messages: text = template.render(messages=[{"role", "content"}, ...], add_generation_prompt=True,
                                       **special_tokens)
                ids = tok.encode(text, add_special_tokens=False).ids  (the template writes its own)
    with `template` compiled as transformers' `apply_chat_template` compiles it:
      jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
      extensions=["jinja2.ext.loopcontrols"]); globals `raise_exception(msg)` (raises) and
      `strftime_now(fmt)`; filter `tojson` = json.dumps(x, ensure_ascii=False, indent=..., ...)
      (jinja's own `tojson` escapes <, >, & and ' and would change the text).
    Special tokens written inside message content are matched as special tokens (transformers'
    default, `sanitize_control_tokens=False`), as `tok.encode` does.
    """

    model_id: str
    tokenizer_json: str
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool  # does plain-text encoding prepend BOS (beyond the JSON's post-processor)
    # Every special token by name (bos_token, eos_token, unk_token, pad_token...): transformers passes
    # them all to the chat template as variables.
    special_tokens: dict[str, str] = {}


class KVEventMsg(msgspec.Struct):
    seq: int
    kind: str  # "stored" | "removed"
    keys: list[str]
    tier: str  # "local" (this worker's prefix cache) | "pool" (chunks this worker wrote or dropped)
    ts: float


class EventsResponse(Message):
    """KV events after sequence number `since` (see `events.py`)."""

    events: list[KVEventMsg]
    next: int  # pass as `since` next time
    dropped: bool = False  # events between `since` and the oldest kept were lost: resync


_encoder = msgspec.json.Encoder()


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes | str, type_: type) -> Any:
    """Parse and validate one message; any problem is `InvalidArgument` (HTTP 400)."""
    try:
        msg = msgspec.json.decode(data, type=type_)
    except msgspec.ValidationError as exc:
        raise InvalidArgument(f"invalid {type_.__name__}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidArgument(f"malformed JSON for {type_.__name__}: {exc}") from None
    if getattr(msg, "v", WIRE_VERSION) != WIRE_VERSION:
        raise InvalidArgument(f"{type_.__name__} version {msg.v} is not supported (this worker speaks {WIRE_VERSION})")
    return msg


def error_event(request_id: str, exc: BaseException) -> TokenEvent:
    code = exc.code if isinstance(exc, KVPoolError) else "internal"
    return TokenEvent(request_id=request_id, done=True, error=ErrorInfo(code=code, message=str(exc)))
