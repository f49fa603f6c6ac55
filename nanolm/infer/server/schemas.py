"""The server's wire format: pydantic models of the requests, and the shapes of errors, events and usage.

Requests are validated strictly ("0.5" is not a number, 1 is not a bool) and
each failure becomes one OpenAI error body naming the field (`param`), so a
client can act on it. Imported only when a server is built: pydantic comes
with the `serve` extra.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nanolm.config import SEED_RANGE, SamplingParams
from nanolm.data.chatml import ROLE_NAMES

# Every stop string is looked for after every token; OpenAI takes up to 4, so 16 leaves room and keeps
# that check from multiplying the worker's time per token (20 000 stop strings made it 50x slower).
MAX_STOPS = 16
# The defaults a request's sampling fields show; the server applies its own (`nanolm serve --temperature ...`,
# SamplingParams' unless told) to the fields a request leaves out (ServerState.sampling_params).
_DEFAULTS = SamplingParams()


class _Strict(BaseModel):
    # strict: "0.5" is not a number and 1 is not a bool; unknown OpenAI fields are ignored.
    model_config = ConfigDict(strict=True, extra="ignore")


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
    n: int = 1

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

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"nanolm returns one choice per request; n must be 1, got {v}")
        return v


class Message(_Strict):
    role: str
    content: Any  # a string, or OpenAI's list of {"type": "text", "text": ...} parts

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        if v not in ROLE_NAMES:
            raise ValueError(f"unknown role {v!r}; use one of {', '.join(ROLE_NAMES)}")
        return v

    @field_validator("content")
    @classmethod
    def _text(cls, v: Any) -> str:
        if isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                        and isinstance(p.get("text"), str) for p in v):
            return "".join(p["text"] for p in v)
        raise ValueError('must be a string or a list of {"type": "text", "text": "..."} parts')


class ChatRequest(_Common):
    messages: list[Message]
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v: list) -> list:
        if not v:
            raise ValueError("must hold at least one message")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("log probabilities are not supported")
        return v


class CompletionRequest(_Common):
    prompt: str
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("echo", "logprobs", "suffix")
    @classmethod
    def _unsupported(cls, v: Any) -> Any:
        if v:
            raise ValueError("not supported")
        return v


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
