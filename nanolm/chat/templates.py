r"""The text of a conversation: nanolm's two chat layouts, as Python spans, Jinja and Go templates.

A tokenizer's chat template says which layout it uses (`format_of`):

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

`ChatFormat.spans` renders a conversation as `Span`s, pieces of text that
train or not and that open an exchange or not (what nanolm/chat/encoding.py
turns into the loss mask); `render` is their text. `ChatFormat.template` is
the layout in Jinja, the `chat_template` of tokenizer_config.json (and a GGUF
export), and `ollama_template` the same in Go's text/template (an ollama
Modelfile); `render` and the two templates give the same text for any
conversation (tests/test_chatml.py checks the Jinja one through
`transformers.apply_chat_template`, tests/test_export_ollama.py the Go one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from nanolm.chat.messages import ROLES, ChatError, Message, message_from_dict
from nanolm.special_tokens import (IM_END, IM_START, THINK, THINK_END, TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE,
                                   TOOL_RESPONSE_END)

TURN_SEP = "\n"  # after each <|im_end|>


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

