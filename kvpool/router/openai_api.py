"""The OpenAI wire format the router speaks: request models, response and stream-chunk builders,
and error bodies, shaped as OpenAI's own API sends them (the official `openai` client is the
test). Pure data in, JSON-ready dicts out; no I/O.

Errors are `{"error": {"message", "type", "param", "code"}}` with OpenAI's statuses: 400 for a
malformed request or a prompt over the context length, 404 for an unknown model, 429 when
admission refuses, 503 when no worker serves.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvpool.errors import KVPoolError


class OpenAIError(KVPoolError):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.http_status = status
        self.type = type_
        self.param = param
        self.code = code or type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def missing_api_key() -> OpenAIError:
    """401 for a request without a key, worded and shaped as OpenAI's (whose code is null)."""
    err = OpenAIError(401, "You didn't provide an API key. You need to provide your API key in an Authorization "
                           "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY). Ask the operator of "
                           "this router for a key.")
    err.code = None
    return err


def invalid_api_key(presented: str) -> OpenAIError:
    """401 for a key no tenant holds; shows at most its first 3 and last 4 characters, as OpenAI does."""
    shown = f"{presented[:3]}***{presented[-4:]}" if len(presented) >= 12 else "***"
    return OpenAIError(401, f"Incorrect API key provided: {shown}. Ask the operator of this router for a key.",
                       code="invalid_api_key")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as OpenAI's clients expect

    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _one(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("max_tokens", "max_completion_tokens", check_fields=False)
    @classmethod
    def _positive(cls, v: int | None, info: Any) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"{info.field_name} must be at least 1")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops or None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"content parts of type {part.get('type')!r} are not supported (text only)")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("messages must not be empty")
        return v

    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("one prompt per request (n=1, no batches)")
            return v[0]
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v

    def token_budget(self) -> int | None:
        return self.max_tokens


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate a request body; any problem is a 400 naming the field, never a traceback."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ())) or None
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        raise bad_request(f"{param}: {msg}" if param else msg, param=param) from None
    if isinstance(req, CompletionRequest):
        for name in ("echo", "logprobs", "suffix"):
            if getattr(req, name):
                raise bad_request(f"{name} is not supported", param=name)
    return req


# -- responses ------------------------------------------------------------------------------------


def usage(out: Any) -> dict[str, Any]:
    """OpenAI's usage object of a request's `Outcome` (backends/base.py)."""
    prompt, completion = out.prompt_tokens, out.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


class Shape:
    """Builds one request's response objects (chat or completion), with a fixed id and time."""

    def __init__(self, chat: bool, model: str, include_usage: bool = False):
        self.chat = chat
        self.model = model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.include_usage = include_usage

    def _object(self, chat_object: str, chat_part: dict[str, Any], text: str, finish: str | None,
                **rest: Any) -> dict[str, Any]:
        """An object of one choice: `chat_part` (delta or message) in a chat, `text` otherwise."""
        part = chat_part if self.chat else {"text": text}
        choice = {"index": 0, **part, "logprobs": None, "finish_reason": finish}
        obj = chat_object if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": [choice], **rest}

    def chunk(self, text: str | None, finish: str | None = None, first: bool = False) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        return self._object("chat.completion.chunk", {"delta": delta}, text or "", finish,
                            **({"usage": None} if self.include_usage else {}))

    def usage_chunk(self, u: dict[str, Any]) -> dict[str, Any]:
        return {**self._object("chat.completion.chunk", {}, "", None), "choices": [], "usage": u}

    def whole(self, text: str, finish: str, u: dict[str, Any]) -> dict[str, Any]:
        message = {"role": "assistant", "content": text, "refusal": None}
        return self._object("chat.completion", {"message": message}, text, finish, usage=u)


class StopMatcher:
    """Cuts the output at the first stop string (excluded, as OpenAI does). Text that could still
    be the start of a stop string is held back until the next token decides."""

    def __init__(self, stops: list[str] | None):
        self.stops = stops or []
        self.text = ""
        self.sent = 0
        self.hit = False

    def push(self, delta: str) -> str:
        """New text that is safe to send now; sets `hit` when a stop string appeared."""
        if not self.stops:
            return delta
        self.text += delta
        start = max(0, self.sent - max(len(s) for s in self.stops) + 1)
        # The stop that completes first wins (then the one that starts first), as an engine that
        # checks while generating sees it, so the cut does not depend on how the text was split.
        found = [(i + len(s), i) for s, i in ((s, self.text.find(s, start)) for s in self.stops) if i >= 0]
        if found:
            cut = min(found)[1]
            self.hit = True
            out, self.sent = self.text[self.sent:cut], cut
            return out
        hold = 0
        for s in self.stops:  # the longest tail that is a proper prefix of a stop string
            for n in range(min(len(s) - 1, len(self.text) - self.sent), 0, -1):
                if self.text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        safe = len(self.text) - hold
        out, self.sent = self.text[self.sent:safe], max(self.sent, safe)
        return out

    def flush(self) -> str:
        if not self.stops or self.hit:
            return ""
        out, self.sent = self.text[self.sent:], len(self.text)
        return out
