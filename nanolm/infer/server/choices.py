"""The choices of a chat completion: each reply read (`chat.ReplyParser`) into OpenAI's message or stream deltas.

A `ChatPlan` is what the route made of the request for reading its replies:
whether the prompt opened a think block, whether tools were offered, and the
text prefilled after the generation prompt (a forced call). A `Choice` reads
one choice's reply as it streams and answers in OpenAI's shapes (the
reasoning as `reasoning_content`, as vLLM and DeepSeek send it):

- the message: `content` (null when the reply only calls tools),
  `reasoning_content` (when thinking was on or the reply reasoned), and
  `tool_calls`, each `{"id": "call_<24 hex>", "type": "function", "function":
  {"name", "arguments"}}` with the arguments as JSON text;
- stream deltas: `{"reasoning_content": ...}` and `{"content": ...}` pieces,
  and for each call, once it has closed, `{"tool_calls": [{"index", "id",
  "type", "function": {"name", "arguments": ""}}]}` then its arguments in
  `{"tool_calls": [{"index", "function": {"arguments": ...}}]}`;
- finish_reason `tool_calls` when the reply made calls and ended by itself.

Log-probabilities are the content's tokens' (`chat.TokenKinds`): those of
the reasoning and of tool calls are left out. In a stream, the tokens of
content held back (a possible tag) come with the delta that releases it.

Nothing here needs the `serve` extra.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from nanolm.chat import Call, Content, Message, Reasoning, ReplyParser, TokenKinds
from nanolm.infer.engine import Token
from nanolm.tokenizer import Tokenizer


@dataclass(frozen=True)
class ChatPlan:
    """How a request's replies are read: the prompt opened a think block (`thinking`), tools were offered
    (`calls`), and `prefill` was written after the generation prompt (read as the reply's start)."""

    thinking: bool = False
    calls: bool = False
    prefill: str = ""
    tools: tuple[Any, ...] = ()  # the tool objects offered, which a guide holds calls to
    bare_calls: bool = False  # calls are bare JSON replies (a Llama 3 template), not <tool_call> blocks


def call_id() -> str:
    """A new tool call id, in OpenAI's form."""
    return f"call_{uuid.uuid4().hex[:24]}"


class Choice:
    """One choice's reply, read as it comes (`deltas`) or whole (`read`), answered in OpenAI's shapes."""

    def __init__(self, tokenizer: Tokenizer, plan: ChatPlan) -> None:
        self.plan = plan
        self.parser = ReplyParser(thinking=plan.thinking, calls=plan.calls, prefill=plan.prefill,
                                  bare_calls=plan.bare_calls)
        self._kinds = TokenKinds(tokenizer.tag_ids, thinking=plan.thinking, calls=plan.calls, in_call=bool(plan.prefill))
        self.ids: list[str] = []  # the id of each call, in order
        self.content_tokens: list[Token] = []  # the log-probabilities of the content's tokens
        self._given = 0  # how many of them a stream has sent

    def _tokens(self, tokens: list[Token]) -> None:
        for t in tokens:
            if t.token is not None and self._kinds.kind(t.token) == "content":
                self.content_tokens.append(t)

    def _unsent(self) -> list[Token]:
        out, self._given = self.content_tokens[self._given:], len(self.content_tokens)
        return out

    def _new_id(self) -> tuple[int, str]:
        self.ids.append(call_id())
        return len(self.ids) - 1, self.ids[-1]

    def deltas(self, text: str | None, tokens: list[Token], end: bool = False) -> list[tuple[dict[str, Any], list]]:
        """The stream deltas of the next piece of the reply (and of its end, when `end`), each with the content
        tokens' log-probabilities it carries."""
        self._tokens(tokens)
        events, self.parser.prefill_events = self.parser.prefill_events, []  # (a forced call's opening: none)
        events += self.parser.push(text) if text else []
        events += self.parser.finish() if end else []
        out: list[tuple[dict[str, Any], list]] = []
        for e in events:
            if isinstance(e, Reasoning):
                out.append(({"reasoning_content": e.text}, []))
            elif isinstance(e, Content):
                out.append(({"content": e.text}, self._unsent()))
            elif isinstance(e, Call):
                k, cid = self._new_id()
                out.append(({"tool_calls": [{"index": k, "id": cid, "type": "function",
                                             "function": {"name": e.call.name, "arguments": ""}}]}, []))
                out.append(({"tool_calls": [{"index": k, "function": {"arguments": e.call.arguments}}]}, []))
        return out

    def last_tokens(self) -> list[Token]:
        """The content tokens' log-probabilities a stream has not sent yet (for its last chunk)."""
        return self._unsent()

    def read(self, text: str, tokens: list[Token]) -> None:
        """The whole reply at once."""
        self.deltas(text, tokens, end=True)

    def finish_reason(self, finish: str) -> str:
        return "tool_calls" if self.parser.tool_calls and finish == "stop" else finish

    def message(self) -> dict[str, Any]:
        """The reply as the message of a chat completion (after `read`)."""
        return assistant_message(self.parser.message(), self.ids, self.plan.thinking)


def assistant_message(msg: Message, ids: list[str], thinking: bool) -> dict[str, Any]:
    """A parsed reply as the message of a chat completion: `content` (null when it only calls tools),
    `reasoning_content` (when thinking was on or it reasoned), `tool_calls` with their ids."""
    out: dict[str, Any] = {"role": "assistant", "content": msg.content or (None if msg.tool_calls else "")}
    if thinking or msg.reasoning:
        out["reasoning_content"] = msg.reasoning
    if msg.tool_calls:
        out["tool_calls"] = [{"id": cid, **c.to_dict()} for cid, c in zip(ids, msg.tool_calls)]
    return out
