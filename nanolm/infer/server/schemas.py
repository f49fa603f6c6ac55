"""The server's wire format: pydantic models of the requests, and the shapes of errors, events and usage.

Requests are validated strictly ("0.5" is not a number, 1 is not a bool) and
each failure becomes one OpenAI error body naming the field (`param`), so a
client can act on it. What a chat message says (its tool calls, its order in
the conversation) is the chat format's to check, in the route. Imported only when a server is built: pydantic comes
with the `serve` extra.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from nanolm.chat import ROLE_NAMES
from nanolm.config.sampling import SEED_RANGE, SamplingParams
from nanolm.infer.engine import Token

# Every stop string is looked for after every token; OpenAI takes up to 4, so 16 leaves room and keeps
# that check from multiplying the worker's time per token (20 000 stop strings made it 50x slower).
MAX_STOPS = 16
# At most this many choices per request (`n`), and at most the server's max_batch (checked by the route).
MAX_N = 64
# OpenAI's limits: up to 20 alternatives per token in chat, 5 in the legacy completions API.
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
# The defaults a request's sampling fields show; the server applies its own (`nanolm serve --temperature ...`,
# SamplingParams' unless told) to the fields a request leaves out (ServerState.sampling_params).
_DEFAULTS = SamplingParams()


class _Strict(BaseModel):
    # strict: "0.5" is not a number and 1 is not a bool; NaN and Infinity (which Python's JSON reads) are not
    # numbers either; unknown OpenAI fields are ignored.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str | None = None  # any name is accepted; responses carry the served model's name
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(_DEFAULTS.temperature, ge=0, le=2)
    top_p: float = Field(_DEFAULTS.top_p, gt=0, le=1)
    top_k: int = Field(_DEFAULTS.top_k, ge=0)  # not OpenAI's; vLLM and others take it too (0 = off)
    max_tokens: int | None = Field(None, ge=1)
    stop: list[str] = []
    seed: int | None = Field(_DEFAULTS.seed, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    presence_penalty: float = Field(_DEFAULTS.presence_penalty, ge=-2, le=2)
    frequency_penalty: float = Field(_DEFAULTS.frequency_penalty, ge=-2, le=2)
    repetition_penalty: float = Field(_DEFAULTS.repetition_penalty, gt=0, le=10)  # the usual extension (vLLM's)
    n: int = Field(1, ge=1, le=MAX_N)  # choices; sample i of a seeded request draws with seed + i
    # OpenAI's {"<token id>": bias}: read, and its ids checked against the vocabulary, by the route
    logit_bias: dict[str, float] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: Any) -> Any:
        return [] if v is None else [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        if len(v) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings are allowed, got {len(v)}")
        return v


class Message(_Strict):
    """One message of a chat request; what it says is checked by the chat format (`chat.message_from_dict`)."""

    role: str
    content: Any  # a string, OpenAI's list of {"type": "text", "text": ...} parts, or null beside tool_calls
    tool_calls: Any = None  # an assistant's calls: [{"id", "type": "function", "function": {"name", "arguments"}}]
    tool_call_id: str | None = None  # a tool result's call; accepted, not needed (results answer calls in order)
    name: str | None = None
    reasoning_content: Any = None  # an assistant's reasoning

    @model_validator(mode="before")
    @classmethod
    def _content_may_be_left_out_beside_calls(cls, data: Any) -> Any:
        # OpenAI: content is "required unless tool_calls is specified".
        if isinstance(data, dict) and "content" not in data and data.get("tool_calls"):
            return {**data, "content": None}
        return data

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        if v not in ROLE_NAMES:
            raise ValueError(f"unknown role {v!r}; use one of {', '.join(ROLE_NAMES)}")
        return v

    @field_validator("content")
    @classmethod
    def _text(cls, v: Any) -> str | None:
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                        and isinstance(p.get("text"), str) for p in v):
            return "".join(p["text"] for p in v)
        raise ValueError('must be a string or a list of {"type": "text", "text": "..."} parts')

    def as_dict(self) -> dict[str, Any]:
        """The message in OpenAI's form, for `chat.message_from_dict`."""
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls is not None:
            d["tool_calls"] = self.tool_calls
        if self.reasoning_content is not None:
            d["reasoning_content"] = self.reasoning_content
        return d


# What a request may hold beside its messages to steer the chat template, as vLLM takes it.
THINKING_KWARGS = ("enable_thinking", "open_thinking")  # Qwen3's name, MiniMind's


class ChatRequest(_Common):
    messages: list[Message]
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None  # OpenAI tool objects; checked by the chat format (`chat.tools_from_value`)
    # "none" (the tools are not offered), "auto" (the default), "required" (a call), or
    # {"type": "function", "function": {"name": ...}} (a call of that function); `forced_call` reads it
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None  # {"enable_thinking": true} lets the model reason first

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v: list) -> list:
        if not v:
            raise ValueError("must hold at least one message")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        if v is None or v in ("none", "auto", "required"):
            return v
        fn = v.get("function") if isinstance(v, dict) and v.get("type") == "function" else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]:
            return v
        raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": "..."}}')

    @field_validator("chat_template_kwargs")
    @classmethod
    def _thinking_is_a_bool(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        for name in THINKING_KWARGS:
            if v is not None and name in v and not isinstance(v[name], bool):
                raise ValueError(f"{name} must be true or false")
        return v

    def forced_call(self) -> str | None:
        """What tool_choice forces: None (nothing: "auto" or "none"), "" (some call: "required"), or a name."""
        if isinstance(self.tool_choice, dict):
            return self.tool_choice["function"]["name"]
        return "" if self.tool_choice == "required" else None

    def thinking(self) -> bool:
        """Whether the request switches thinking on (`chat_template_kwargs`: enable_thinking or open_thinking)."""
        kwargs = self.chat_template_kwargs or {}
        return any(kwargs.get(name) is True for name in THINKING_KWARGS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs set to true")
        return v

    def logprobs_wanted(self) -> int | None:
        """None, or how many of the most likely tokens each token's entry lists."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: str
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    suffix: str | None = None

    @field_validator("echo", "suffix")
    @classmethod
    def _unsupported(cls, v: Any) -> Any:
        if v:
            raise ValueError("not supported")
        return v

    def logprobs_wanted(self) -> int | None:
        return self.logprobs


# --- responses ---------------------------------------------------------------------------------------

def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _param_name(loc: Sequence[Any]) -> str | None:
    """("messages", 0, "role") -> "messages[0].role"."""
    name = ""
    for part in loc:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name or None


def validation_error(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """The first error as (message, param): one line a client can act on."""
    e = errors[0]
    loc = [p for p in e.get("loc", ()) if p != "body"]  # FastAPI puts request bodies under "body"
    param = _param_name(loc)
    msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
    if e.get("type") == "finite_number":
        msg = "must be a number (NaN and Infinity are not numbers)"
    return (f"{param}: {msg}" if param else f"request body: {msg}"), param


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n".encode("utf-8")


class Usage:
    """A request's token counts, for the usage field."""

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0

    def as_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


# --- log-probabilities, in OpenAI's two shapes ---------------------------------------------------------

def _token_text(token_bytes: list[bytes], tid: int) -> tuple[str, list[int]]:
    """A token's text (its bytes decoded, U+FFFD where it ends mid-character) and its bytes."""
    b = token_bytes[tid] if 0 <= tid < len(token_bytes) else b""
    return b.decode("utf-8", errors="replace"), list(b)


def chat_logprobs(token_bytes: list[bytes], tokens: list[Token]) -> dict[str, Any]:
    """The chat API's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    content = []
    for t in tokens:
        if t.token is None:  # a stop id: not part of the reply
            continue
        text, raw = _token_text(token_bytes, t.token)
        top = []
        for tid, lp in t.top_logprobs or ():
            alt, alt_raw = _token_text(token_bytes, tid)
            top.append({"token": alt, "logprob": lp, "bytes": alt_raw})
        content.append({"token": text, "logprob": t.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content}


class CompletionLogprobs:
    """The completions API's `logprobs` of one choice: tokens, token_logprobs, top_logprobs, text_offset (the
    character offset of each token's text in the choice's text, counted across the stream)."""

    def __init__(self, token_bytes: list[bytes]) -> None:
        self.token_bytes = token_bytes
        self.offset = 0

    def block(self, tokens: list[Token]) -> dict[str, Any]:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t in tokens:
            if t.token is None:
                continue
            text, _ = _token_text(self.token_bytes, t.token)
            out["tokens"].append(text)
            out["token_logprobs"].append(t.logprob)
            out["top_logprobs"].append({_token_text(self.token_bytes, tid)[0]: lp
                                        for tid, lp in t.top_logprobs or ()})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out
