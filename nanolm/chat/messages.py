r"""Chat messages: their roles, tool calls and reasoning, read from the shapes users and API clients have, and
the rules of their order.

A message (`Message`) has a role (`ROLES`: system, user, assistant, tool), a
content, and on an assistant message its reasoning and its tool calls
(`ToolCall`: a function name and its arguments as JSON text).
`message_from_dict` accepts OpenAI / TRL / MiniMind dicts: `tool_calls` in
OpenAI form (`{"function": {"name", "arguments"}}`) or bare (`{"name",
"arguments"}`), the list itself or its JSON text, arguments a JSON object or
its text; reasoning as `reasoning_content`, or inside `<think>…</think>` at
the start of the content (split as the template splits it,
`split_reasoning`). `tools_from_value` reads the tools offered to a
conversation. `check_conversation` holds the rules of order (a tool result
answers a call; an optional system message comes first). No text may hold a
control string or tag (`control_in`): rendered, it would open or close turns,
calls or reasoning the conversation does not have; only a reply the model
wrote, sent back in a server's history (`replies_as_written`), renders as it
was written. A message that breaks the format is a `ChatError` naming it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

from nanolm.special_tokens import SPECIAL_TOKENS, TAG_TOKENS, THINK, THINK_END


@dataclass(frozen=True)
class Role:
    """The rule of one role: whether its messages train and the other names API clients may give it."""

    trains: bool
    aliases: tuple[str, ...] = ()


ROLES: dict[str, Role] = {
    "system": Role(trains=False, aliases=("developer",)),  # "developer": OpenAI's newer name for it
    "user": Role(trains=False),
    "assistant": Role(trains=True),
    "tool": Role(trains=False),  # a function's result, rendered inside a user turn
}
# Every role name a request may use -> the role it renders as (each role, then its aliases).
ROLE_NAMES: dict[str, str] = {name: role for role, rule in ROLES.items() for name in (role, *rule.aliases)}

# Rendered into the text, these would open or close turns, calls or reasoning the data does not have.
_CONTROL = re.compile("|".join(re.escape(t) for t in (*SPECIAL_TOKENS, *TAG_TOKENS)))


def control_in(text: str) -> str | None:
    """The first control string or tag (`<|im_start|>`, `<think>`, ...) in text, or None when it holds none."""
    m = _CONTROL.search(text)
    return m.group() if m else None


class ChatError(ValueError):
    """A message or conversation that breaks the format: `where` names the message, the text says what."""


@dataclass(frozen=True)
class ToolCall:
    """A function call an assistant makes: the function's name and its arguments as JSON text (a JSON object)."""

    name: str
    arguments: str

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's form (what the Jinja template and API clients read)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Message:
    """One message: role, content, and for an assistant its reasoning and tool calls (see the module doc)."""

    role: str
    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's form, which the Jinja template renders as `render` does: role and content, and
        `reasoning_content` and `tool_calls` where there are some."""
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning:
            d["reasoning_content"] = self.reasoning
        if self.tool_calls:
            d["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        return d


@dataclass(frozen=True)
class Conversation:
    """Messages and the tools offered to them (each tool's JSON text, as the template writes it).
    empty_think: the empty think block before each trained reply without reasoning is trained on too (an SFT
    augmentation, `nanolm prepare --empty-think-ratio`), so a model asked to think closes it when it has
    nothing to reason about."""

    messages: tuple[Message, ...]
    tools: tuple[str, ...] = ()
    empty_think: bool = False


def _type(value: Any) -> str:
    return {bool: "true/false", type(None): "null", int: "a number", float: "a number", str: "a string",
            list: "an array"}.get(type(value), "an object")


def checked_text(where: str, text: Any, *, as_written: bool = False) -> str:
    """text, or ChatError unless it is a string of valid Unicode holding no control string or tag (rendered,
    one would change the conversation's structure); as_written: text a model wrote, rendered back as it was
    written, whose control strings and tags are let through."""
    if not isinstance(text, str):
        raise ChatError(f"{where} must be a string, got {_type(text)}")
    bad = re.search("[\ud800-\udfff]", text)
    if bad:
        raise ChatError(f"{where} holds an unpaired surrogate escape \\u{ord(bad.group()):04x}, "
                        "which is not valid Unicode")
    control = None if as_written else control_in(text)
    if control:
        raise ChatError(f"{where} contains the control token {control}, which would change the conversation's "
                        "turns")
    return text


def _json_value(where: str, value: Any, what: str) -> Any:
    """value, or the JSON it holds when it is a string."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ChatError(f"{where} is not valid JSON ({getattr(e, 'msg', 'nested too deeply')}); give {what}") \
            from None


def tool_call_from_dict(where: str, call: Any, *, as_written: bool = False) -> ToolCall:
    """A ToolCall from OpenAI's `{"function": {"name", "arguments"}}` or a bare `{"name", "arguments"}`;
    as_written: a call a model wrote, whose arguments may hold control strings (`checked_text`)."""
    if not isinstance(call, dict):
        raise ChatError(f'{where} must be an object {{"function": {{"name": ..., "arguments": ...}}}}, '
                        f"got {_type(call)}")
    fn = call.get("function", call)
    if not isinstance(fn, dict):
        raise ChatError(f"{where}.function must be an object with a name and arguments, got {_type(fn)}")
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ChatError(f"{where} has no function name (a non-empty string)")
    if '"' in name or "\\" in name:
        raise ChatError(f"{where}: the function name {name[:40]!r} holds a quote or backslash; use a plain name")
    checked_text(f"{where} name", name)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        parsed = _json_value(f"{where}.arguments", args, 'a JSON object such as {"x": 1}')
        text = args
    else:
        parsed, text = args, json.dumps(args, ensure_ascii=False)  # as the template's tojson writes it
    if not isinstance(parsed, dict):
        raise ChatError(f"{where}.arguments must be a JSON object (the function's named arguments), "
                        f"got {_type(parsed)}")
    return ToolCall(name, checked_text(f"{where}.arguments", text, as_written=as_written))


def split_reasoning(content: str) -> tuple[str, str]:
    """(reasoning, content) of an assistant text holding `</think>`, split as the Jinja template splits it."""
    if THINK_END not in content:
        return "", content
    head = content.split(THINK_END)[0].rstrip("\n")
    return head.split(THINK)[-1].lstrip("\n"), content.split(THINK_END)[-1].lstrip("\n")


def message_from_dict(where: str, m: Any, *, replies_as_written: bool = False) -> Message:
    """A Message from an OpenAI / TRL / MiniMind message dict (see the module doc), or ChatError.

    replies_as_written: an assistant message is a reply a model wrote, sent back (a server's conversation
    history): its content, reasoning and call arguments may hold control strings and tags, which render as the
    model wrote them (a model may write a tag where the reply's format has no place for it, `<tool_call>` with
    no tools offered); the texts of every other role, and of every message of training data, never may.
    Other keys (`tool_call_id`, `name`, MiniMind's `tools` on a system message) are not read here.
    """
    if not isinstance(m, dict):
        raise ChatError(f'{where} must be an object {{"role": ..., "content": ...}}, got {_type(m)}')
    if "role" not in m:
        raise ChatError(f'{where} has no "role"; use one of {", ".join(ROLES)}')
    name = m["role"]
    role = ROLE_NAMES.get(name) if isinstance(name, str) else None
    if role is None:
        shown = json.dumps(name[:40], ensure_ascii=False) if isinstance(name, str) else _type(name)
        raise ChatError(f"{where} has unknown role {shown}; allowed roles: {', '.join(ROLES)}")
    content = m.get("content")
    calls: tuple[ToolCall, ...] = ()
    if role == "assistant" and m.get("tool_calls") not in (None, "", []):
        raw = _json_value(f"{where}.tool_calls", m["tool_calls"], "an array of calls")
        if not isinstance(raw, list):
            raw = [raw] if isinstance(raw, dict) else raw
        if not isinstance(raw, list):
            raise ChatError(f"{where}.tool_calls must be an array of calls, got {_type(raw)}")
        calls = tuple(tool_call_from_dict(f"{where}.tool_calls[{i}]", c, as_written=replies_as_written)
                      for i, c in enumerate(raw))
    if content is None and (calls or role == "tool"):
        content = ""
    if "content" not in m and not calls:
        raise ChatError(f'{where} ({role}) has no "content"')
    if not isinstance(content, str):
        raise ChatError(f"{where}.content must be a string, got {_type(content)}")
    reasoning = ""
    if role == "assistant":
        given = m.get("reasoning_content")
        if isinstance(given, str):
            reasoning = given
        elif given is not None:
            raise ChatError(f"{where}.reasoning_content must be a string, got {_type(given)}")
        else:
            reasoning, content = split_reasoning(content)
        checked_text(f"{where}.reasoning_content", reasoning, as_written=replies_as_written)
        if not content.strip() and not calls:
            raise ChatError(f"{where}.content is empty" + (" (only whitespace)" if content else ""))
    elif role != "tool" and not content.strip():
        raise ChatError(f"{where}.content is empty" + (" (only whitespace)" if content else ""))
    return Message(role, checked_text(f"{where}.content", content,
                                      as_written=replies_as_written and role == "assistant"), reasoning, calls)


def tools_from_value(where: str, value: Any) -> tuple[str, ...]:
    """The tools of a conversation as the JSON text the template writes for each (`tojson`), from a list of
    tool objects (OpenAI's `{"type": "function", "function": {...}}` or a bare function) or its JSON text."""
    tools = _json_value(where, value, "an array of tool objects")
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise ChatError(f"{where} must be an array of tool objects, got {_type(tools)}")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise ChatError(f'{where}[{i}] must be a tool object with a function name, such as {{"type": '
                            '"function", "function": {"name": "add", "parameters": {...}}}')
        out.append(checked_text(f"{where}[{i}]", json.dumps(tool, ensure_ascii=False)))
    return tuple(out)


def check_conversation(where: str, messages: Sequence[Message], *, complete: bool = True,
                       names: Sequence[str] | None = None) -> None:
    """ChatError unless messages are in order: an optional system message first, then user turns each
    answered by the assistant, which may call tools whose results (tool messages) come next and are
    answered in turn. complete: training data, held to all of it and ending with an assistant reply;
    otherwise a prompt, held only to the rules of tools (a result answers a call, a call is answered before
    anything else) and to having a user turn, ending anywhere but at an unanswered call. names: what to call
    each message in the messages (default `where[i]`)."""
    names = names or [f"{where}[{i}]" for i in range(len(messages))]
    prev: Message | None = None
    for i, m in enumerate(messages):
        at = names[i]
        if complete:  # a prompt may hold turns in any order the template renders (API clients send such)
            if m.role == "system" and i > 0:
                raise ChatError(f"{at} is a system message, but a system message may only come first")
            if m.role == "user" and prev is not None and prev.role == "user":
                raise ChatError(f"{at} is user after user; user and assistant turns must alternate")
            if m.role == "assistant" and (prev is None or prev.role == "system"):
                raise ChatError(f"{at} is assistant, but the first turn (after an optional system message) "
                                "must be user")
            if m.role == "assistant" and prev.role == "assistant" and not prev.tool_calls:
                raise ChatError(f"{at} is assistant after assistant; user and assistant turns must alternate")
        if m.role in ("user", "assistant") and prev is not None and prev.tool_calls:
            raise ChatError(f"{at} is {m.role}, but {names[i - 1]} called a tool; give its result as a "
                            '"tool" message first')
        if m.role == "tool":
            calls = 0
            for j in range(i - 1, -1, -1):
                if messages[j].role != "tool":
                    calls = len(messages[j].tool_calls)
                    break
            if calls == 0:
                raise ChatError(f"{at} is a tool result with no tool call before it; a tool message answers "
                                "an assistant message's tool_calls")
            results = i - j
            if results > calls:
                raise ChatError(f"{at} is tool result {results} after {calls} tool call(s); give one result "
                                "per call")
        prev = m
    if complete:
        if not any(m.role == "assistant" for m in messages):
            raise ChatError(f"{where} has no assistant turn, so nothing to train on")
        if messages[-1].role != "assistant" or messages[-1].tool_calls:
            raise ChatError(f"{where} ends with a {'tool call' if messages[-1].tool_calls else messages[-1].role} "
                            "turn; a conversation must end with an assistant reply (drop the unanswered turn)")
    elif messages and messages[-1].role == "assistant" and messages[-1].tool_calls:
        raise ChatError(f"{where} ends with a tool call; add its result as a \"tool\" message")
    if not any(m.role == "user" for m in messages):
        raise ChatError(f"{where} has no user turn; a conversation starts with one (after an optional system "
                        "message)")

