r"""A generated reply read into reasoning, content and tool calls: the chat format read back.

`parse_tool_call` reads one call, the body of a `<tool_call>…</tool_call>`
block: a JSON object `{"name": ..., "arguments": {...}}`, checked as a
message's call is (`tool_call_from_dict`). GRPO's rewards use it on a
finished reply.

`ReplyParser` takes the text of a reply piece by piece (what `TextStream`
gives, however it is cut) and returns events: `Reasoning` and `Content`
deltas and whole `Call`s; the chat session, the server and the tool-use
benchmarks read every reply with it. The reply is the text after the chat
format's generation prompt (nanolm/chat/templates.py):

- With thinking on, the prompt ends inside an open `<think>` block, so the
  reply is reasoning up to `</think>`; with thinking off the prompt closed an
  empty block, and the reply is content (a model that opens a block of its
  own at the very start, `<think>…</think>`, still has it read as reasoning,
  to the end of the reply if it never closes it).
- In the content, `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`
  is held back until it closes and comes out as a `Call` (`parse_tool_call`);
  one that is not JSON comes out as content, as written, with a problem
  noted; one the reply ends inside comes out as content too. Without tools
  (`calls=False`) the tags are plain content.
- An end of a piece that may begin a tag (`<too`, `</thi`) is held until the
  next piece decides it, so events never depend on how the text was cut.
- Llama 3's templates write a call as the whole reply, a bare JSON object
  `{"name": ..., "parameters": {...}}` with no tags (`bare_calls=True`, what
  `TemplateFormat.bare_calls` finds): content that starts with `{` is held
  to the end of the reply, then read as one call or several separated by `;`
  or newlines; content that does not read as calls comes out as written.

Whitespace: what the template writes around the reply's parts is not part of
them: the newlines that open and close the reasoning (it is
`reasoning.strip("\n")`), the whitespace between `</think>` and the content,
and the whitespace beside a call (before it, between calls, and after the
last when nothing follows). Other whitespace, the model's own, is content as
written; a reply without tags is its text unchanged. A `<think>` written
inside the reasoning stays in it as text (a stream cannot take it back).

`TokenKinds` tells the same parts apart by token id (the tags are single
tokens in nanolm's tokenizers), so the server can give log-probabilities for
the content's tokens alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping

from nanolm.chat.messages import ChatError, Message, ToolCall, tool_call_from_dict
from nanolm.special_tokens import THINK, THINK_END, TOOL_CALL, TOOL_CALL_END


def parse_tool_call(body: str) -> ToolCall:
    """The call a `<tool_call>…</tool_call>` block holds (its text between the tags), or ChatError saying why
    it is not one: the body must be a JSON object `{"name": ..., "arguments": {...}}`."""
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ChatError(f"a tool call the model wrote is not a JSON call ({getattr(e, 'msg', 'nested too deeply')}):"
                        f" {body[:80]!r}") from None
    if not isinstance(obj, dict) or "name" not in obj:
        raise ChatError(f'a tool call the model wrote is not a JSON call (not a {{"name": ..., "arguments": ...}} '
                        f"object): {body[:80]!r}")
    try:
        return tool_call_from_dict("tool call", obj)
    except ChatError as e:
        raise ChatError(f"a tool call the model wrote is not a JSON call ({e}): {body[:80]!r}") from None


@dataclass(frozen=True)
class Reasoning:
    """A piece of the reply's reasoning (what the model wrote inside its think block)."""

    text: str


@dataclass(frozen=True)
class Content:
    """A piece of the reply's content (the answer shown to the user)."""

    text: str


@dataclass(frozen=True)
class Call:
    """A tool call the reply made, whole."""

    call: ToolCall


Event = Reasoning | Content | Call

_START, _REASONING, _CONTENT, _CALL = "start", "reasoning", "content", "call"


def parse_bare_calls(text: str) -> list[ToolCall] | None:
    """The calls a reply in Llama 3's layout is made of: JSON objects `{"name": ..., "parameters"|"arguments":
    {...}}` separated by whitespace or `;`, nothing else; None when the text is not that."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return calls or None
        try:
            obj, at = decoder.raw_decode(text, at)
        except (json.JSONDecodeError, RecursionError):
            return None
        if not isinstance(obj, dict) or set(obj) - {"name", "parameters", "arguments", "type"}:
            return None
        if "parameters" in obj and "arguments" not in obj:
            obj = {"name": obj.get("name"), "arguments": obj["parameters"]}
        try:
            calls.append(tool_call_from_dict("tool call", obj))
        except ChatError:
            return None


def parse_call(body: str) -> ToolCall | str:
    """The call that `<tool_call>{body}</tool_call>` holds, or the problem with it (`parse_tool_call`)."""
    try:
        return parse_tool_call(body.strip())
    except ChatError as e:
        return str(e)


class ReplyParser:
    """Streamed reply text in, `Event`s out (see the module doc).

    thinking: the prompt opened a think block (the reply starts inside it).
    calls: tools were offered, so `<tool_call>` blocks are calls (otherwise plain content).
    prefill: text the prompt already holds after the generation prompt (a forced call's `<tool_call>\n`...),
    read first as the reply's start; its events, if any, are `prefill_events`.

    What the events carried so far is kept: `reasoning`, `content` (their texts), `tool_calls`, and
    `problems` (calls that do not parse, a reply that ends inside a call).
    """

    def __init__(self, *, thinking: bool, calls: bool = True, prefill: str = "", bare_calls: bool = False) -> None:
        self.calls = calls
        self.bare_calls = calls and bare_calls  # calls are bare JSON replies (Llama 3), not <tool_call> blocks
        self._bare = ""  # bare_calls: content that started with "{", held to the end of the reply
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.tool_calls: list[ToolCall] = []
        self.problems: list[str] = []
        self._state = _REASONING if thinking else _START
        self._buf = ""  # text not yet decided: a tag's possible start, a call's body
        self._lead = True  # reasoning: its leading newlines are the template's; content after </think>: likewise
        self._held = ""  # whitespace at the end of the reasoning or content so far, which may be the template's
        self._after_call = False  # a call came since the last content character (or since the start)
        self._done = False
        self.prefill_events = self.push(prefill) if prefill else []

    # --- what comes out ---------------------------------------------------------------------------

    def _out(self, out: list[Event], event: Event) -> None:
        """Record an event and add it to `out`, joined to the previous one when of the same kind."""
        if isinstance(event, Call):
            self.tool_calls.append(event.call)
            out.append(event)
            return
        if not event.text:
            return
        (self.reasoning if isinstance(event, Reasoning) else self.content).append(event.text)
        if out and type(out[-1]) is type(event):
            out[-1] = type(event)(out[-1].text + event.text)
        else:
            out.append(event)

    def _reasoning(self, out: list[Event], text: str) -> None:
        """Reasoning text: newlines at its start (the first time) and at its end are held, the rest goes out."""
        if self._lead:
            text = text.lstrip("\n")
            self._lead = not text
        body = text.rstrip("\n")
        if body:
            self._out(out, Reasoning(self._held + body))
            self._held = ""
        self._held += text[len(body):]

    def _content(self, out: list[Event], text: str) -> None:
        """Content text: with tools, whitespace at its end is held (a call may follow), the rest goes out."""
        if self._lead:
            text = text.lstrip()  # after </think>: the template's "\n\n"
            self._lead = not text
        if not self.calls:
            self._out(out, Content(text))
            return
        if self._after_call:  # whitespace after a call waits too, with what was held before it
            rest = text.lstrip()
            self._held += text[:len(text) - len(rest)]
            text = rest
        body = text.rstrip()
        if body:
            # Whitespace held beside calls joins content on both sides; at the start of the content it only
            # stood beside the call.
            keep = self._held if self.content or not self._after_call else ""
            self._out(out, Content(keep + body))
            self._held, self._after_call = "", False
        self._held += text[len(body):]

    # --- reading ----------------------------------------------------------------------------------

    def push(self, text: str) -> list[Event]:
        """The events that `text`, the next piece of the reply, completes."""
        if self._done:
            raise ValueError("the reply has ended: finish was called")
        out: list[Event] = []
        self._buf += text
        while self._buf and self._step(out):
            pass
        return out

    def _step(self, out: list[Event]) -> bool:
        """Use what the buffer decides in the current state; False when the rest waits for more text."""
        buf = self._buf
        if self._state == _START:
            # Thinking off: a reply that opens a think block of its own (after whitespace, if any) is reasoning.
            head = buf.lstrip()
            if head.startswith(THINK):
                self._state, self._buf = _REASONING, head[len(THINK):]
                return True
            if not head or THINK.startswith(head):
                return False  # only whitespace, or the start of <think>, so far
            self._state, self._lead = _CONTENT, False  # the model's own leading whitespace is content
            return True
        if self._state == _REASONING:
            end = buf.find(THINK_END)
            if end >= 0:
                self._reasoning(out, buf[:end])
                self._state, self._buf, self._held, self._lead = _CONTENT, buf[end + len(THINK_END):], "", True
                return True
            cut = len(buf) - _tag_start_len(buf, THINK_END)
            self._reasoning(out, buf[:cut])
            self._buf = buf[cut:]
            return False
        if self._state == _CONTENT and self.bare_calls:
            if not self._bare and not self.content and not self.tool_calls and not buf.strip():
                return False  # only whitespace so far: a call may follow
            if self._bare or (not self.content and buf.lstrip().startswith("{")):
                self._bare, self._buf = self._bare + buf, ""
                return False
            self.bare_calls = False  # the reply is text: read on as usual
            return True
        if self._state == _CONTENT:
            start = buf.find(TOOL_CALL) if self.calls else -1
            if start >= 0:
                self._content(out, buf[:start])
                self._state, self._buf = _CALL, buf[start + len(TOOL_CALL):]
                return True
            cut = len(buf) - (_tag_start_len(buf, TOOL_CALL) if self.calls else 0)
            self._content(out, buf[:cut])
            self._buf = buf[cut:]
            return False
        end = buf.find(TOOL_CALL_END)  # _CALL: the body waits for its end tag
        if end < 0:
            return False
        body, self._buf, self._state = buf[:end], buf[end + len(TOOL_CALL_END):], _CONTENT
        self._lead = False
        call = parse_call(body)
        if isinstance(call, ToolCall):
            self._out(out, Call(call))
            self._after_call = True
        else:
            self.problems.append(call)
            self._content(out, TOOL_CALL + body + TOOL_CALL_END)
        return True

    def finish(self) -> list[Event]:
        """The events of what was held back, once the reply has ended (no tag can complete any more)."""
        if self._done:
            return []
        self._done = True
        out: list[Event] = []
        buf, self._buf = self._buf, ""
        if self._state == _REASONING:
            self._reasoning(out, buf)  # newlines at the end are the template's, as before </think>
            return out
        if self._state == _START:
            self._lead = False
        elif self._state == _CALL:
            self.problems.append("the reply ended inside a tool call (no </tool_call>)")
            buf, self._lead = TOOL_CALL + buf, False
        if self._bare:
            calls = parse_bare_calls(self._bare)
            for call in calls or ():
                self._out(out, Call(call))
            if calls:
                return out
            if '"name"' in self._bare:
                self.problems.append(f"a tool call the model wrote is not a JSON call: {self._bare.strip()[:80]!r}")
            buf = self._bare + buf  # as content (after </think>, the template's newlines still go)
        self._content(out, buf)
        if self.calls and not self._after_call:
            self._out(out, Content(self._held))  # the model's own whitespace: no call stands beside it
        return out

    def message(self) -> Message:
        """The assistant message of the reply so far (the whole reply after `finish`)."""
        return Message("assistant", "".join(self.content), "".join(self.reasoning), tuple(self.tool_calls))


def read_reply(text: str, *, thinking: bool = False, bare_calls: bool = False) -> Message:
    """The assistant message of a whole reply, calls read (the chat format's `bare_calls` for Llama 3's)."""
    parser = ReplyParser(thinking=thinking, calls=True, bare_calls=bare_calls)
    parser.push(text)
    parser.finish()
    return parser.message()


def _tag_start_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` without completing it (held for the next piece)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


class TokenKinds:
    """Tells the tokens of a reply apart by id as `ReplyParser` tells its text: "reasoning", "call" (the tags
    included) or "content". tag_ids: a tokenizer's ids of the tags (`Tokenizer.tag_ids`); tags it does not
    have as single tokens are not seen (their tokens count as content)."""

    def __init__(self, tag_ids: Mapping[str, int], *, thinking: bool, calls: bool = True,
                 in_call: bool = False) -> None:
        self._think, self._think_end = tag_ids.get(THINK), tag_ids.get(THINK_END)
        self._call, self._call_end = (tag_ids.get(TOOL_CALL), tag_ids.get(TOOL_CALL_END)) if calls else (None, None)
        self._state = "call" if in_call else "reasoning" if thinking else "start"

    def kind(self, token_id: int) -> str:
        """The part of the reply that the next token belongs to."""
        state = self._state
        if state == "start":
            if token_id == self._think:
                self._state = "reasoning"
                return "reasoning"
            state = self._state = "content"
        if state == "reasoning":
            if token_id == self._think_end:
                self._state = "content"
            return "reasoning"
        if state == "call":
            if token_id == self._call_end:
                self._state = "content"
            return "call"
        if token_id == self._call:
            self._state = "call"
            return "call"
        return "content"
