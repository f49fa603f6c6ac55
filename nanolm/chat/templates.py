r"""The text of a conversation: nanolm's two chat layouts, as Python spans, Jinja and Go templates, and a
tokenizer's own Jinja template.

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

- `TemplateFormat`: any other template (Llama 3's, SmolLM2's, Qwen2.5's),
  rendered by Jinja as transformers renders it, so a model fine-tuned through
  nanolm sees the format it was made with; its assistant text is found from
  the template's `{% generation %}` markers, or from prefixes of the
  conversation (see the class).

Tools through a template that has no place for them (one that never reads
`tools`, such as SmolLM2's): the conversation is first written as plain
messages in the text of the QWEN3 layout, then the template renders those.
The tool list becomes a system message, the conversation's own system text
then a blank line then `_TOOLS_HEAD`, one JSON object per line and
`_TOOLS_TAIL` (QWEN3's system turn, word for word; a conversation without a
system message gets one holding the tool list alone, which takes the place
of a default system prompt the template would insert); an assistant's calls
are appended to its content as `<tool_call>\n{"name": …, "arguments": …}\n</tool_call>`
(a newline before each but a first that opens an empty reply); consecutive
tool results become one user message, each result in
`<tool_response>\n…\n</tool_response>`, joined by newlines. The calls are part
of the assistant's text, so they train; the tags need not be tokens of their
own (SmolLM2 spells `<tool_call>` in several), and the call guide and the
reply parser read them back as text. Chat, serve, eval, prepare and GRPO all
render through the format, so they all see this one layout.

Reasoning through a template that never reads `reasoning_content` (nor
`enable_thinking`, nor writes `<think>`) is refused, one line naming the
tokenizer: a conversation with reasoning, and thinking switched on, are
`ChatError`s rather than reasoning silently dropped or a think block the
model was never shown (`ChatFormat.reasoning` says which formats have one).

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

import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Mapping, Sequence

from jinja2 import TemplateError, meta, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from markupsafe import Markup

from nanolm.chat.messages import ROLES, ChatError, Message, ToolCall, message_from_dict
from nanolm.errors import UserError
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
    # Whether it is one of nanolm's layouts (calls in <tool_call>, reasoning in <think>), which replies are read
    # back in and a forced call is prefilled in; False for a tokenizer's own template.
    nanolm_layout: bool = True
    # Whether an assistant's tool call is written as a bare JSON object, the whole reply (Llama 3's templates),
    # rather than in <tool_call> tags: replies are read back so (ReplyParser's bare_calls).
    bare_calls: bool = False

    @property
    def reasoning(self) -> bool:
        """Whether it renders an assistant's reasoning and has a think block to prompt with (thinking on)."""
        return self.tools

    @property
    def guided_calls(self) -> bool:
        """Whether its calls are <tool_call> blocks, which the call guide (infer/guide.py) holds to the offered
        tools' schemas: nanolm's layouts and a template's own that writes them (Qwen's), not Llama 3's bare JSON
        calls nor a layout without tools. The chat session and the server both guide by it."""
        return self.tools and not self.bare_calls

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


def _calls_text(content: str, calls: Sequence[ToolCall]) -> str:
    """An assistant's calls as QWEN3 writes them after its content: each in <tool_call> tags, a newline before
    each but a first that directly opens an empty reply."""
    return "".join(("\n" if content or k else "") + f'{TOOL_CALL}\n{{"name": "{c.name}", "arguments": '
                   f'{c.arguments}}}\n{TOOL_CALL_END}' for k, c in enumerate(calls))


def _tool_results(results: Sequence[str]) -> str:
    """Consecutive tool results as the text of one user turn, each in <tool_response> tags (QWEN3's)."""
    return "\n".join(f"{TOOL_RESPONSE}\n{r}\n{TOOL_RESPONSE_END}" for r in results)


def _tools_text(system: str | None, tools: Sequence[str]) -> str:
    """The system turn's text with tools offered (QWEN3's): the system text and a blank line, then the list."""
    return ("" if system is None else system + "\n\n") + _TOOLS_HEAD + "".join("\n" + t for t in tools) \
        + _TOOLS_TAIL


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
            out.append(Span(_turn("system", _tools_text(messages[0].content if system else None, tools))))
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
                reply = m.content.lstrip("\n") + _calls_text(m.content, m.tool_calls) + IM_END
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


# A tokenizer's own Jinja chat template (Llama 3's, SmolLM2's, Qwen2.5's), rendered as transformers renders
# it: a sandboxed environment with trim_blocks / lstrip_blocks, `tojson`, `raise_exception`, `strftime_now`,
# loop controls and the `{% generation %}` block, here written to wrap what it renders in two private-use
# characters when nanolm asks for the assistant's text (`nanolm_marks`), and to render it unchanged otherwise.
_OPEN, _CLOSE = "\U000f0000", "\U000f0001"
_MARKS = "nanolm_marks"
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


class _Generation(Extension):
    """`{% generation %}…{% endgeneration %}`: the assistant's text, marked when `nanolm_marks` is true."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_mark", [nodes.Name(_MARKS, "load")]), [], [], body) \
            .set_lineno(lineno)

    def _mark(self, marks: Any, caller: Any) -> str:
        text = caller()
        return f"{_OPEN}{text}{_CLOSE}" if marks is True else text


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> Markup:
    return Markup(json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys))


def _raise(message: str) -> None:
    raise TemplateError(message)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[_Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class TemplateFormat(ChatFormat):
    """A tokenizer's own Jinja chat template, neither of nanolm's layouts.

    `render` is the template's text (what transformers' `apply_chat_template` gives). `spans` mark the
    assistant's text: the rendered characters inside the template's `{% generation %}` blocks where it has
    them, else what each assistant turn adds to the conversation rendered up to it with the generation
    prompt (messages[:k] + prompt, then messages[:k+1]), which needs each such prefix to be a prefix of the
    whole text; a template where neither holds is refused (UserError). Tools are offered to the template as
    it expects them (`tools=`, a list of JSON schemas) where it reads `tools` (`reads_tools`); where it does
    not, the conversation is written as plain messages with the tools, calls and results in QWEN3's text
    (`plain_messages`, the module doc), so `tools` is true either way. Reasoning goes in as
    `reasoning_content`, thinking as `enable_thinking`, where the template has them (`reasoning`).
    """

    name = "template"
    nanolm_layout = False
    ollama_template = ""  # no Go version of a template nanolm did not write

    def __init__(self, template: str, where: str = "the tokenizer", variables: Mapping[str, Any] | None = None):
        self.template, self.where = template, where
        self.variables = dict(variables or {})  # bos_token, eos_token, ... of tokenizer_config.json
        env = _environment()
        try:
            self._compiled = env.from_string(template)
            self.reads_tools = "tools" in meta.find_undeclared_variables(env.parse(template))
        except TemplateError as e:
            detail = " ".join(str(e).split())
            raise UserError(f"{where}: chat_template is not valid Jinja ({detail}); fix the template "
                            "(chat_template.jinja, or tokenizer_config.json's chat_template) or remove it") from None
        self.tools = True  # in the template's own place, or as text in a system turn (plain_messages)
        # A template that reads neither an assistant's reasoning nor the thinking switch, nor writes a think
        # block, has no place for reasoning: it would be dropped without a word.
        self._reasoning = any(word in template for word in ("reasoning_content", "enable_thinking", THINK))
        self.marked = _GENERATION.search(template) is not None
        self.bare_calls = self.reads_tools and self._writes_bare_calls()

    @property
    def reasoning(self) -> bool:
        return self._reasoning

    def plain_messages(self, messages: Sequence[Message], tools: Sequence[str]) -> list[Message]:
        """The conversation as the template is given it where it never reads `tools`: the tool list in a system
        message, calls appended to their assistant's content and tool results in user messages, all in QWEN3's
        text (module doc). A template that reads `tools` gets the messages unchanged."""
        if self.reads_tools:
            return list(messages)
        out: list[Message] = []
        rest = list(messages)
        if tools:
            system = rest.pop(0).content if rest and rest[0].role == "system" else None
            out.append(Message("system", _tools_text(system, tools)))
        results: list[str] = []  # the tool results of the run in progress
        for k, m in enumerate(rest):
            if m.role == "tool":
                results.append(m.content)
                if k + 1 == len(rest) or rest[k + 1].role != "tool":
                    out.append(Message("user", _tool_results(results)))
                    results = []
            elif m.tool_calls:
                out.append(Message(m.role, m.content + _calls_text(m.content, m.tool_calls), m.reasoning))
            else:
                out.append(m)
        return out

    def _writes_bare_calls(self) -> bool:
        """Whether the template writes an assistant's call as a bare JSON object (`{"name": ..., "parameters":
        ...}`, Llama 3) rather than in <tool_call> tags: found by rendering a probe call."""
        tool = json.dumps({"type": "function", "function": {"name": "nanolm_probe", "description": "",
                                                            "parameters": {"type": "object", "properties": {}}}})
        probe = [Message("user", "hi"), Message("assistant", tool_calls=(ToolCall("nanolm_probe", '{"x": 1}'),))]
        try:
            text = self.render(probe, [tool])
        except ChatError:
            return False
        at = text.rfind('"nanolm_probe"')
        start = text.rfind("{", 0, at)
        if at < 0 or start < 0 or text[:start].rstrip().endswith(TOOL_CALL):
            return False
        try:
            obj, _ = json.JSONDecoder().raw_decode(text, start)
        except json.JSONDecodeError:
            return False
        return isinstance(obj, dict) and obj.get("name") == "nanolm_probe" and \
            {"x": 1} in (obj.get("parameters"), obj.get("arguments"))

    def _text(self, messages: Sequence[Message], tools: Sequence[str], add_generation_prompt: bool,
              thinking: bool = False, marks: bool = False) -> str:
        if not self._reasoning and (thinking or any(m.reasoning for m in messages)):
            raise self._no_reasoning("the conversation", "thinking on" if thinking else "reasoning")
        if not self.reads_tools:
            messages, tools = self.plain_messages(messages, tools), ()
        dicts = []
        for m in messages:
            d = m.to_dict()
            if m.tool_calls:  # templates read arguments as an object (`arguments | tojson`)
                d["tool_calls"] = [{"type": "function", "function": {"name": c.name,
                                                                    "arguments": json.loads(c.arguments)}}
                                   for c in m.tool_calls]
            dicts.append(d)
        try:
            return self._compiled.render(**self.variables, messages=dicts,
                                         tools=[json.loads(t) for t in tools] or None, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         enable_thinking=thinking, **{_MARKS: marks})
        except TemplateError as e:
            detail = " ".join(str(e).split())  # one line, whatever the template's message holds
            raise ChatError(f"the chat template of {self.where} cannot render this conversation ({detail})") \
                from None

    def render(self, messages: Sequence[Message], tools: Sequence[str] = (), *,
               add_generation_prompt: bool = False, thinking: bool = False) -> str:
        return self._text(messages, tools, add_generation_prompt, thinking)

    def generation_prompt(self, thinking: bool = False) -> str:
        probe = [Message("user", "hi")]
        whole = self.render(probe, add_generation_prompt=True, thinking=thinking)
        return whole[len(self.render(probe)):]

    def check(self, where: str, messages: Sequence[Message], tools: Sequence[str], tokenizer: str) -> None:
        """ChatError for a conversation with reasoning where the template has no place for it; tools are
        rendered by every template (as text where it has no place for them)."""
        if not self._reasoning and any(m.reasoning for m in messages):
            raise self._no_reasoning(where, "reasoning", tokenizer)

    def _no_reasoning(self, where: str, what: str, tokenizer: str | None = None) -> ChatError:
        return ChatError(f"{where} has {what}, but the chat template of {tokenizer or self.where} has no think block "
                         "(it never reads reasoning_content or enable_thinking); leave reasoning and thinking out, "
                         "or use a tokenizer whose template has <think>")

    def spans(self, messages: Sequence[Message], tools: Sequence[str] = (), *,
              final_only: bool = False) -> list[Span]:
        last = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=-1)
        trained: list[tuple[int, int]] = []
        if self.marked:
            marked = self._text(messages, tools, False, marks=True)
            text, at, open_at = "", 0, None
            for piece in re.split(f"([{_OPEN}{_CLOSE}])", marked):
                if piece == _OPEN:
                    open_at = at
                elif piece == _CLOSE and open_at is not None:
                    trained.append((open_at, at))
                    open_at = None
                else:
                    text += piece
                    at += len(piece)
            if final_only:
                trained = trained[-1:]
        else:
            text = self.render(messages, tools)
            for k, m in enumerate(messages):
                if m.role != "assistant" or (final_only and k != last):
                    continue
                start = self._prefix(text, messages[:k], tools, True)
                end = self._prefix(text, messages[:k + 1], tools, False)
                if end < start:
                    raise self._not_nested()
                trained.append((start, end))
        exchanges = []
        for k, m in enumerate(messages):
            if m.role == "user":
                try:
                    exchanges.append(self._prefix(text, messages[:k], tools, False))
                except (UserError, ChatError):
                    pass  # a template that cannot render the turns before it: no cut point there
        return _cut(text, trained, exchanges)

    def _prefix(self, text: str, messages: Sequence[Message], tools: Sequence[str], prompt: bool) -> int:
        """The length of messages rendered (with the generation prompt when asked), which must begin text."""
        head = self.render(messages, tools, add_generation_prompt=prompt)
        if not text.startswith(head):
            raise self._not_nested()
        return len(head)

    def _not_nested(self) -> UserError:
        return UserError(f"{self.where}: the chat template has no {{% generation %}} markers and a conversation "
                         "rendered up to an assistant turn is not a prefix of the whole, so the assistant's "
                         "tokens cannot be found; wrap each assistant reply in {% generation %}…{% endgeneration %} "
                         "in its chat_template")


def _cut(text: str, trained: Sequence[tuple[int, int]], exchanges: Sequence[int]) -> list[Span]:
    """text as spans: those in a trained range train, and one starts at each exchange offset."""
    bounds = sorted({0, len(text), *exchanges, *(x for r in trained for x in r)})
    starts = set(exchanges)
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if a < b:
            out.append(Span(text[a:b], trains=any(x <= a and b <= y for x, y in trained), exchange=a in starts))
    return out


def format_of(template: str | None, where: str = "the tokenizer",
              variables: Mapping[str, Any] | None = None) -> ChatFormat:
    """The layout a tokenizer's chat template renders: CHATML for nanolm's earlier template (and a tokenizer
    with none), QWEN3 for nanolm's and the Qwen3-style ChatML with <think> (MiniMind-3's, Qwen3's), and the
    template itself (`TemplateFormat`) for any other. where: the tokenizer, named in errors; variables: its
    special tokens (bos_token, ...) that a template may read."""
    if template is None or template == CHATML.template:
        return CHATML
    if template == QWEN3.template or (IM_START in template and THINK in template):
        return QWEN3
    return TemplateFormat(template, where, variables)


def render_chat(messages: Sequence[Message | Mapping[str, Any]], add_generation_prompt: bool = False, *,
                tools: Sequence[str] = (), fmt: ChatFormat = QWEN3, thinking: bool = False) -> str:
    """The text of messages (Message or OpenAI dicts) in layout `fmt`; ChatError on a malformed message."""
    msgs = [m if isinstance(m, Message) else message_from_dict(f"messages[{i}]", m) for i, m in enumerate(messages)]
    return fmt.render(msgs, tools, add_generation_prompt=add_generation_prompt, thinking=thinking)
