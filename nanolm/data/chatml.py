r"""The chat format of nanolm's models: messages, tools and reasoning; their text, ids and loss mask; truncation.

Every other module renders, checks, parses or cuts a conversation through this one.

Messages (`Message`, `ToolCall`; `message_from_dict` reads the shapes users
and API clients have). A message has a role (`ROLES`: system, user, assistant,
tool), a content, and on an assistant message its reasoning and its tool calls
(each a function name and its arguments as JSON text). `message_from_dict`
accepts OpenAI / TRL / MiniMind dicts: `tool_calls` in OpenAI form
(`{"function": {"name", "arguments"}}`) or bare (`{"name", "arguments"}`), the
list itself or its JSON text, arguments a JSON object or its text; reasoning as
`reasoning_content`, or inside `<think>…</think>` at the start of the content
(split as the template splits it). `check_conversation` holds the rules of
order (a tool result answers a call; an optional system message comes first).
No text may hold a control string or tag (`control_in`): rendered, it would
open or close turns, calls or reasoning the conversation does not have.

Text: two layouts (`ChatFormat`), and a tokenizer's chat template says which
it uses (`format_of`):

- `QWEN3` (every tokenizer nanolm trains now): the Qwen3-style ChatML that
  MiniMind-3 ships, byte for byte. Each turn is `<|im_start|>{role}\n…<|im_end|>\n`;
  tools are listed in the system turn inside `<tools></tools>` (one JSON object
  per line, then the instruction for calls); an assistant turn is
  `<think>\n{reasoning}\n</think>\n\n{content}`, then each call as
  `<tool_call>\n{"name": …, "arguments": …}\n</tool_call>` (a newline before
  each but a first one that directly follows the think block); consecutive
  tool results share one user turn, each inside
  `\n<tool_response>\n…\n</tool_response>`. The generation prompt is
  `<|im_start|>assistant\n<think>\n`, closed at once (`\n</think>\n\n`) unless
  thinking is switched on (`enable_thinking` / `open_thinking` in the
  template, `thinking=True` here).
- `CHATML`: the plain ChatML of tokenizers made before tools and reasoning
  (Qwen2-Instruct's, MiniMind2's): turns only, generation prompt
  `<|im_start|>assistant\n`. Tokenizers and checkpoints made then keep it.

`ChatFormat.template` is the layout in Jinja, the `chat_template` of
tokenizer_config.json (and a GGUF export); `render` is the Python rendering,
and the two give the same text for any conversation (tests/test_chatml.py
checks it through `transformers.apply_chat_template`).

Ids and loss mask (`encode_chat`, and `encode_chats` for a batch: what
`nanolm prepare` stores): the ids are `encode(render(...))`, the whole text
encoded once; the layout renders it as spans that train or not
(`ChatFormat.spans`), and a token is a target when its bytes (the cumulative
sum of `Tokenizer.spelled_lengths`) reach into a span that trains. That needs
tokens that spell the text byte for byte, as every byte-level BPE does;
`check_spelling` checks it, and a tokenizer that does not is refused. What trains is each assistant turn's
reasoning, content, tool calls and closing `<|im_end|>`; never a system, user
or tool turn, nor the scaffolding (`<|im_start|>assistant\n<think>\n`, the
empty block's `\n</think>\n\n` that the generation prompt writes itself, the
`\n` after `<|im_end|>`). A token that joins scaffolding with reply text (the
`\n` of a think block with leading whitespace of the reply) carries reply
text, so it is a target. Preference data (`final_only`) has the mask on the
final reply only: the earlier turns are the prompt both sides continue. The
mask's second bit (`EXCHANGE`) marks the `<|im_start|>` of each user turn that
asks something (not a tool result): where a truncated conversation may begin.

Truncation (`fit_conversation`; `nanolm prepare` applies it at max_tokens and
the loader at seq_len + 1): a conversation longer than `max_tokens` tokens
(`<|endoftext|>` not counted) keeps its head (the system turn, tools included)
and drops its oldest exchanges (a user question with every turn up to the
next one: replies, calls, tool results) until it fits. If the last exchange
alone does not fit, it is cut at the end: a reply cut inside keeps no
`<|im_end|>`, so the model is never taught to end a turn where the text did
not. A conversation whose head, last question and first reply token do not fit
(no target would be left) is skipped. A preference pair (`fit_pair`) drops the
same old exchanges from both conversations, so that they keep one prompt.
Data prepared before the EXCHANGE bit existed (plain ChatML, no tools) is cut
at its user turns, found by their place (an odd number of turns starts with a
system turn).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from nanolm.errors import UserError
from nanolm.special_tokens import SPECIAL_TOKENS, TAG_TOKENS

EOT, IM_START, IM_END = SPECIAL_TOKENS
TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END, THINK, THINK_END = TAG_TOKENS
TURN_SEP = "\n"  # after each <|im_end|>

TARGET, EXCHANGE = 1, 2  # the bits of a stored loss-mask byte


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


# --- messages ------------------------------------------------------------------------------------


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
    """Messages and the tools offered to them (each tool's JSON text, as the template writes it)."""

    messages: tuple[Message, ...]
    tools: tuple[str, ...] = ()


def _type(value: Any) -> str:
    return {bool: "true/false", type(None): "null", int: "a number", float: "a number", str: "a string",
            list: "an array"}.get(type(value), "an object")


def checked_text(where: str, text: Any) -> str:
    """text, or ChatError unless it is a string of valid Unicode holding no control string or tag (rendered,
    one would change the conversation's structure)."""
    if not isinstance(text, str):
        raise ChatError(f"{where} must be a string, got {_type(text)}")
    bad = re.search("[\ud800-\udfff]", text)
    if bad:
        raise ChatError(f"{where} holds an unpaired surrogate escape \\u{ord(bad.group()):04x}, "
                        "which is not valid Unicode")
    control = control_in(text)
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


def tool_call_from_dict(where: str, call: Any) -> ToolCall:
    """A ToolCall from OpenAI's `{"function": {"name", "arguments"}}` or a bare `{"name", "arguments"}`."""
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
    return ToolCall(name, checked_text(f"{where}.arguments", text))


def split_reasoning(content: str) -> tuple[str, str]:
    """(reasoning, content) of an assistant text holding `</think>`, split as the Jinja template splits it."""
    if THINK_END not in content:
        return "", content
    head = content.split(THINK_END)[0].rstrip("\n")
    return head.split(THINK)[-1].lstrip("\n"), content.split(THINK_END)[-1].lstrip("\n")


def message_from_dict(where: str, m: Any) -> Message:
    """A Message from an OpenAI / TRL / MiniMind message dict (see the module doc), or ChatError.

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
        calls = tuple(tool_call_from_dict(f"{where}.tool_calls[{i}]", c) for i, c in enumerate(raw))
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
        checked_text(f"{where}.reasoning_content", reasoning)
        if not content.strip() and not calls:
            raise ChatError(f"{where}.content is empty" + (" (only whitespace)" if content else ""))
    elif role != "tool" and not content.strip():
        raise ChatError(f"{where}.content is empty" + (" (only whitespace)" if content else ""))
    return Message(role, checked_text(f"{where}.content", content), reasoning, calls)


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


# --- text ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """A piece of rendered text: whether its tokens train, and whether it opens an exchange (a user question)."""

    text: str
    trains: bool = False
    exchange: bool = False


_TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
               "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
               "\"arguments\": <args-json-object>}\n</tool_call>")


def _jinja(text: str) -> str:
    """A Python string as a Jinja string literal."""
    return "'" + text.replace("\\", "\\\\").replace("\n", "\\n").replace("'", "\\'") + "'"


class ChatFormat:
    """A chat layout: its spans and Python rendering, its generation prompt, its Jinja template."""

    name: str
    template: str
    ollama_template: str  # the layout in Go's text/template, for an ollama Modelfile (`nanolm export ollama`)
    tools: bool  # whether it can render tools, tool calls and reasoning

    def spans(self, messages: Sequence[Message], tools: Sequence[str] = (), *,
              final_only: bool = False) -> list[Span]:
        raise NotImplementedError

    def generation_prompt(self, thinking: bool = False) -> str:
        raise NotImplementedError

    def render(self, messages: Sequence[Message], tools: Sequence[str] = (), *,
               add_generation_prompt: bool = False, thinking: bool = False) -> str:
        """The text of a conversation, then the generation prompt when asked: what `template` renders."""
        text = "".join(s.text for s in self.spans(messages, tools))
        return text + self.generation_prompt(thinking) if add_generation_prompt else text

    def check(self, where: str, messages: Sequence[Message], tools: Sequence[str], tokenizer: str) -> None:
        """ChatError when the conversation needs what this layout cannot render (tools, calls, reasoning)."""
        if self.tools:
            return
        needs = "tools" if tools else next(
            ("tool calls" if m.tool_calls else "tool results" if m.role == "tool" else "reasoning"
             for m in messages if m.tool_calls or m.role == "tool" or m.reasoning), None)
        if needs:
            raise ChatError(f"{where} has {needs}, but the tokenizer {tokenizer} carries the plain ChatML template "
                            "of nanolm before tools and reasoning; train a new tokenizer with `nanolm tokenizer "
                            "train` (it has <tool_call>, <think>, ...) or use one that has them")


def _turn(role: str, content: str) -> str:
    return f"{IM_START}{role}\n{content}{IM_END}{TURN_SEP}"


class _ChatML(ChatFormat):
    name = "chatml"
    tools = False
    # One line with no newline between tags, so the output does not depend on the trim_blocks /
    # lstrip_blocks settings of whoever renders it (transformers sets both).
    template = ("{% for message in messages %}"
                "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
                "{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

    def spans(self, messages: Sequence[Message], tools: Sequence[str] = (), *,
              final_only: bool = False) -> list[Span]:
        out = []
        for i, m in enumerate(messages):
            trains = ROLES[m.role].trains and (not final_only or i == len(messages) - 1)
            if trains:
                out += [Span(f"{IM_START}{m.role}\n"), Span(m.content + IM_END, trains=True), Span(TURN_SEP)]
            else:
                out.append(Span(_turn(m.role, m.content), exchange=m.role == "user"))
        return out

    def generation_prompt(self, thinking: bool = False) -> str:
        return f"{IM_START}assistant\n"

    # ollama hands the conversation as .Messages (each with .Role and .Content; a Modelfile SYSTEM arrives as
    # a first system message), and the template ends with the generation prompt itself.
    ollama_template = "{{ range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}" \
                      "<|im_start|>assistant\n"


class _Qwen3(ChatFormat):
    name = "qwen3"
    tools = True
    # Written with whitespace control on every tag, so trim_blocks / lstrip_blocks do not matter.
    template = "".join([
        "{%- if tools -%}",
        "{{- '<|im_start|>system\\n' -}}",
        "{%- if messages and messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}",
        "{{- ", _jinja(_TOOLS_HEAD), " -}}",
        "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}",
        "{{- ", _jinja(_TOOLS_TAIL + IM_END + TURN_SEP), " -}}",
        "{%- elif messages and messages[0].role == 'system' -%}",
        "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}",
        "{%- endif -%}",
        "{%- for message in messages -%}",
        "{%- set content = message.content if message.content is string else '' -%}",
        "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}",
        "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' -}}",
        "{%- elif message.role == 'assistant' -%}",
        "{%- set reasoning = '' -%}",
        "{%- if message.reasoning_content is string -%}{%- set reasoning = message.reasoning_content -%}",
        "{%- elif '</think>' in content -%}",
        "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}",
        "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}",
        "{%- endif -%}",
        "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n'"
        " + content.lstrip('\\n') -}}",
        "{%- for call in message.tool_calls or [] -%}",
        "{%- set fn = call.function if call.function is defined else call -%}",
        "{%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}",
        "{{- '<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' -}}",
        "{{- fn.arguments if fn.arguments is string else fn.arguments | tojson -}}",
        "{{- '}\\n</tool_call>' -}}",
        "{%- endfor -%}",
        "{{- '<|im_end|>\\n' -}}",
        "{%- elif message.role == 'tool' -%}",
        "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}",
        "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' -}}",
        "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}",
        "{%- endif -%}",
        "{%- endfor -%}",
        "{%- if add_generation_prompt -%}",
        "{{- '<|im_start|>assistant\\n<think>\\n' -}}",
        "{%- if not ((enable_thinking is defined and enable_thinking) or "
        "(open_thinking is defined and open_thinking)) -%}{{- '\\n</think>\\n\\n' -}}{%- endif -%}",
        "{%- endif -%}",
    ])

    def spans(self, messages: Sequence[Message], tools: Sequence[str] = (), *,
              final_only: bool = False) -> list[Span]:
        out: list[Span] = []
        system = messages[0].role == "system" if messages else False
        if tools:
            head = messages[0].content + "\n\n" if system else ""
            out.append(Span(f"{IM_START}system\n{head}{_TOOLS_HEAD}" + "".join("\n" + t for t in tools)
                            + _TOOLS_TAIL + IM_END + TURN_SEP))
        elif system:
            out.append(Span(_turn("system", messages[0].content)))
        for i, m in enumerate(messages):
            if m.role == "system" and i == 0:
                continue
            if m.role in ("user", "system"):
                out.append(Span(_turn(m.role, m.content), exchange=m.role == "user"))
            elif m.role == "tool":
                first = i == 0 or messages[i - 1].role != "tool"
                last = i == len(messages) - 1 or messages[i + 1].role != "tool"
                out.append(Span((f"{IM_START}user" if first else "") + f"\n{TOOL_RESPONSE}\n{m.content}\n"
                                f"{TOOL_RESPONSE_END}" + (IM_END + TURN_SEP if last else "")))
            else:
                trains = not final_only or i == len(messages) - 1
                reasoning = m.reasoning.strip("\n")
                calls = "".join(("\n" if m.content or k else "") + f'{TOOL_CALL}\n{{"name": "{c.name}", '
                                f'"arguments": {c.arguments}}}\n{TOOL_CALL_END}' for k, c in enumerate(m.tool_calls))
                reply = m.content.lstrip("\n") + calls + IM_END
                out.append(Span(f"{IM_START}assistant\n{THINK}\n"))
                if reasoning:
                    out.append(Span(f"{reasoning}\n{THINK_END}\n\n{reply}", trains=trains))
                else:
                    out += [Span(f"\n{THINK_END}\n\n"), Span(reply, trains=trains)]
                out.append(Span(TURN_SEP))
        return out

    def generation_prompt(self, thinking: bool = False) -> str:
        return f"{IM_START}assistant\n{THINK}\n" + ("" if thinking else f"\n{THINK_END}\n\n")

    # For ollama (Go's text/template, no whitespace trimming anywhere): .Messages with .Role, .Content,
    # .Thinking and .ToolCalls, .Tools (each prints as its JSON), .Think; consecutive tool results share a
    # user turn, closed when another message (or the generation prompt) follows.
    _tools_block = _TOOLS_HEAD + "{{ range $.Tools }}\n{{ . }}{{ end }}" + _TOOLS_TAIL
    ollama_template = "".join([
        '{{ $prev := "" }}',
        '{{ if and .Tools (or (not .Messages) (ne (index .Messages 0).Role "system")) }}',
        f"<|im_start|>system\n{_tools_block}<|im_end|>\n{{{{ end }}}}",
        "{{ range $i, $m := .Messages }}",
        '{{ if and (eq $prev "tool") (ne .Role "tool") }}<|im_end|>\n{{ end }}',
        '{{ if eq .Role "system" }}<|im_start|>system\n{{ .Content }}',
        f"{{{{ if $.Tools }}}}\n\n{_tools_block}{{{{ end }}}}<|im_end|>\n",
        '{{ else if eq .Role "assistant" }}<|im_start|>assistant\n<think>\n{{ .Thinking }}\n</think>\n\n{{ .Content }}',
        "{{ range $j, $c := .ToolCalls }}{{ if or $m.Content $j }}\n{{ end }}",
        '<tool_call>\n{"name": "{{ .Function.Name }}", "arguments": {{ .Function.Arguments }}}\n</tool_call>{{ end }}',
        "<|im_end|>\n",
        '{{ else if eq .Role "tool" }}{{ if ne $prev "tool" }}<|im_start|>user{{ end }}',
        "\n<tool_response>\n{{ .Content }}\n</tool_response>",
        "{{ else }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}",
        "{{ $prev = .Role }}{{ end }}",
        '{{ if eq $prev "tool" }}<|im_end|>\n{{ end }}',
        "<|im_start|>assistant\n<think>\n{{ if not .Think }}\n</think>\n\n{{ end }}",
    ])


CHATML: ChatFormat = _ChatML()
QWEN3: ChatFormat = _Qwen3()
CHAT_TEMPLATE = QWEN3.template  # what `nanolm tokenizer train` writes


def format_of(template: str | None) -> ChatFormat:
    """The layout a tokenizer's chat template renders: CHATML for nanolm's earlier template (and a tokenizer
    with none), QWEN3 for any other (nanolm's, MiniMind-3's, Qwen3's)."""
    return CHATML if template is None or template == CHATML.template else QWEN3


def render_chat(messages: Sequence[Message | Mapping[str, Any]], add_generation_prompt: bool = False, *,
                tools: Sequence[str] = (), fmt: ChatFormat = QWEN3, thinking: bool = False) -> str:
    """The text of messages (Message or OpenAI dicts) in layout `fmt`; ChatError on a malformed message."""
    msgs = [m if isinstance(m, Message) else message_from_dict(f"messages[{i}]", m) for i, m in enumerate(messages)]
    return fmt.render(msgs, tools, add_generation_prompt=add_generation_prompt, thinking=thinking)


# --- parsing a generated reply -------------------------------------------------------------------

_CALL = re.compile(re.escape(TOOL_CALL) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_END), re.S)


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


def parse_reply(text: str, *, thinking: bool = False) -> tuple[Message, list[str]]:
    """The assistant Message a generated reply holds, and the problems met (a call that is not JSON).

    text: what the model wrote after the generation prompt, with the closing `<|im_end|>` dropped.
    thinking: the prompt opened a think block, so the reply starts inside it (up to `</think>`).
    Calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (`parse_tool_call`); one that does not
    parse stays in the content and is reported.
    """
    reasoning = ""
    if thinking or text.lstrip().startswith(THINK):
        if THINK_END in text:
            head, _, text = text.partition(THINK_END)
            reasoning = head.split(THINK)[-1].strip("\n")
        elif thinking:
            return Message("assistant", "", text.strip("\n")), []
    calls, problems, kept = [], [], []
    at = 0
    for m in _CALL.finditer(text):
        try:
            calls.append(parse_tool_call(m.group(1)))
        except ChatError as e:
            problems.append(str(e))
            continue
        kept.append(text[at:m.start()])
        at = m.end()
    kept.append(text[at:])
    return Message("assistant", "".join(kept).strip(), reasoning, tuple(calls)), problems


# --- ids and loss mask ---------------------------------------------------------------------------


def encode_chat(spans: Sequence[Span], ids: Sequence[int], token_lengths: np.ndarray,
                tokenizer_file: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of a conversation: ids = encode of the spans' text joined; token_lengths[id] = the UTF-8
    bytes each token stands for (`Tokenizer.spelled_lengths`). The mask is TARGET on each token whose bytes
    reach into a span that trains, with EXCHANGE on the first token of each exchange span (see the module
    doc). `encode_chats` is the same for many conversations at once."""
    return encode_chats([spans], [ids], token_lengths, tokenizer_file)[0]


def encode_chats(spans: Sequence[Sequence[Span]], ids: Sequence[Sequence[int]], token_lengths: np.ndarray,
                 tokenizer_file: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """`encode_chat` of each conversation, computed over all of them at once (a few numpy calls in all rather
    than per span: what `nanolm prepare` runs on each batch)."""
    counts = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter((t for x in ids for t in x), dtype=np.int64, count=int(counts.sum()))
    ends = np.cumsum(token_lengths[flat])  # byte offsets over the batch's texts joined
    starts = ends - token_lengths[flat]
    train_a, train_b, marks, conv_ends = [], [], [], []
    at = 0
    for conv in spans:
        for sp in conv:
            n = len(sp.text.encode("utf-8"))
            if sp.trains and n:
                train_a.append(at)
                train_b.append(at + n)
            if sp.exchange:
                marks.append(at)
            at += n
        conv_ends.append(at)
    token_ends = np.cumsum(counts)
    # Each conversation's tokens must spell its text: its last token ends where its text does.
    spelled = np.where(counts > 0, ends[np.maximum(token_ends - 1, 0)] if len(flat) else 0, np.r_[0, conv_ends[:-1]])
    if not np.array_equal(spelled, np.asarray(conv_ends, dtype=np.int64)):
        raise UserError(f"{tokenizer_file}: the tokens of a conversation do not spell its text byte for byte "
                        "(the tokenizer normalizes or is not byte-level), so the loss mask cannot be placed; use "
                        "a byte-level BPE tokenizer, such as one made by `nanolm tokenizer train`")
    # TARGET on tokens [first, last) of each trained span: +1 / -1 at the edges, summed along the batch.
    edges = np.zeros(len(flat) + 1, dtype=np.int64)
    np.add.at(edges, np.searchsorted(ends, np.asarray(train_a, dtype=np.int64), side="right"), 1)
    np.add.at(edges, np.searchsorted(starts, np.asarray(train_b, dtype=np.int64), side="left"), -1)
    mask = (np.cumsum(edges[:-1]) > 0).astype(np.uint8)
    mask[np.searchsorted(starts, np.asarray(marks, dtype=np.int64), side="left")] |= EXCHANGE
    bounds = np.r_[0, token_ends]
    return [(flat[x:y], mask[x:y]) for x, y in zip(bounds[:-1], bounds[1:])]


def check_spelling(text: str, ids: Sequence[int], token_bytes: Sequence[bytes], tokenizer_file: str) -> None:
    """UserError unless the tokens' bytes joined are the text's: what `encode_chat` relies on (checked once per
    batch by `nanolm prepare`)."""
    if b"".join(token_bytes[i] for i in ids) != text.encode("utf-8"):
        raise UserError(f"{tokenizer_file}: the tokens of a conversation do not spell its text byte for byte "
                        "(the tokenizer normalizes or is not byte-level), so the loss mask cannot be placed; use "
                        "a byte-level BPE tokenizer, such as one made by `nanolm tokenizer train`")


# --- truncation ----------------------------------------------------------------------------------

LEGACY_IM_START_ID = 1  # <|im_start|> in every tokenizer nanolm made before the EXCHANGE bit


def _exchanges(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Where each exchange starts (see the module doc); found by place in data from before the EXCHANGE bit."""
    marks = np.flatnonzero(mask & EXCHANGE)
    if len(marks):
        return marks
    starts = np.flatnonzero(ids == LEGACY_IM_START_ID)
    return starts[len(starts) % 2::2]


def fit_conversation(ids: np.ndarray, mask: np.ndarray,
                     max_tokens: int) -> tuple[np.ndarray, np.ndarray] | None:
    """A rendered conversation (no trailing EOT) cut to at most max_tokens tokens by the truncation
    policy of the module doc, or None when no target would be left. Returned as is when it fits."""
    if len(ids) <= max_tokens:
        return ids, mask
    return _cut(ids, mask, _first_kept(ids, mask, max_tokens), max_tokens)


def fit_pair(chosen: tuple[np.ndarray, np.ndarray], rejected: tuple[np.ndarray, np.ndarray],
             max_tokens: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]] | None:
    """The two rendered conversations of a preference pair, (ids, mask) each with no trailing EOT, cut
    to at most max_tokens tokens each by the truncation policy of `fit_conversation`, dropping the same
    old exchanges from both so that they still share their prompt; None when either would keep no target.
    Returned as is when both fit.
    """
    if len(chosen[0]) <= max_tokens and len(rejected[0]) <= max_tokens:
        return chosen, rejected
    first = max(_first_kept(*chosen, max_tokens), _first_kept(*rejected, max_tokens))
    c, r = _cut(*chosen, first, max_tokens), _cut(*rejected, first, max_tokens)
    return None if c is None or r is None else (c, r)


def _first_kept(ids: np.ndarray, mask: np.ndarray, max_tokens: int) -> int:
    """The index (in `_exchanges`) of the oldest exchange kept when the head and the exchanges from it on fit
    in max_tokens; the last exchange when even it alone does not fit."""
    starts = _exchanges(ids, mask)
    head, n = int(starts[0]), len(ids)
    for first, at in enumerate(starts):
        if head + n - int(at) <= max_tokens:
            return first
    return len(starts) - 1


def _cut(ids: np.ndarray, mask: np.ndarray, first: int,
         max_tokens: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The head and the exchanges from `first` on, cut at the end to max_tokens tokens; None when no target
    is left."""
    starts = _exchanges(ids, mask)
    keep = np.r_[0:int(starts[0]), int(starts[first]):len(ids)][:max_tokens]
    if not (mask[keep] & TARGET).any():
        return None
    return ids[keep], mask[keep]
