"""Multi-turn chat over the generation engine: history, tools, reasoning, context window, terminal loop.

`ChatSession` holds the conversation as chat-format messages
(nanolm/chat/) and renders it in the tokenizer's layout
(`Tokenizer.chat_format`), with the tools it offers (`tools.Toolbox`) and
thinking on or off. A turn (`ChatSession.turn`) streams the reply as events
(`chat.ReplyParser`: reasoning, content, tool calls). When the reply calls
tools, a built-in one is run and its result fed back as a `tool` message; a
declared one's result is asked for (`ask`), or, when nobody can answer, the
model is told the tool could not be run; then the model continues, at most
`max_tool_rounds` times in one turn. When the history no longer fits the
model's context (with room left for the reply), the oldest exchanges (a user
message with every reply, call and result up to the next one) are dropped,
and the session says how many.

`run_chat` is the terminal front end: interactive on a TTY, or scripted (one
user turn per line of stdin, each part of the transcript on a labelled line:
`user:`, `reasoning:`, `tool call:`, `tool result:`, `assistant:`).
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from typing import Callable, Iterator, TextIO

from nanolm.chat import Call, ChatError, Content, Event, Message, Reasoning, ReplyParser, ToolCall, control_in
from nanolm.config.sampling import SamplingParams
from nanolm.errors import UserError
from nanolm.infer.engine import Engine
from nanolm.infer.generate import check_text, stream_text
from nanolm.infer.bans import ReplyGuides
from nanolm.infer.tools import MAX_TOOL_ROUNDS, Toolbox
from nanolm.tokenizer import Tokenizer

HELP = "commands: /reset (forget the conversation), /system TEXT (set the system prompt), /exit"


@dataclass(frozen=True)
class ToolResult:
    """The result fed back for a call: `source` is "builtin" (run by the chat), "user" (typed in), or
    "unavailable" (nobody could run it; the text tells the model so)."""

    call: ToolCall
    text: str
    source: str


@dataclass(frozen=True)
class Notice:
    """Something the chat tells the user about the turn (a call that did not parse, the round limit)."""

    text: str


TurnEvent = Event | ToolResult | Notice
Ask = Callable[[ToolCall], "str | None"]  # a declared tool's result, or None when there is none


def checked_text(text: str, what: str) -> str:
    """`text`, or UserError when it is not UTF-8 or holds a control token of the chat format, which would
    change the conversation's turns once rendered."""
    check_text(text, what)
    control = control_in(text)
    if control:
        raise UserError(f"{what}: contains {control}, a control token of the chat format; leave it out")
    return text


class ChatSession:
    def __init__(self, engine: Engine, tokenizer: Tokenizer, params: SamplingParams, system: str = "", *,
                 tools: Toolbox | None = None, thinking: bool = False, max_tool_rounds: int = MAX_TOOL_ROUNDS,
                 guide_calls: bool = True) -> None:
        """guide_calls: once the model opens a tool call, hold what it writes to the offered tools' schemas
        (`infer/guide.py`); False reads its calls as they come. With no tools, a reply cannot open a call, nor,
        with thinking off, a think block (`infer/bans.py`)."""
        self.engine = engine
        self.tok = tokenizer
        self.fmt = tokenizer.chat_format
        self.params = params
        self.tools = tools if tools is not None and tools.tools else None
        self.tool_texts = self.tools.texts() if self.tools else ()
        self.thinking = thinking
        if max_tool_rounds < 0:
            raise UserError(f"max_tool_rounds must be >= 0, got {max_tool_rounds}")
        self.max_tool_rounds = max_tool_rounds
        try:
            self.fmt.check("the chat", [], self.tool_texts, str(tokenizer.path))
        except ChatError as e:
            raise UserError(str(e)) from None
        if thinking and not self.fmt.reasoning:
            raise UserError(f"the chat has thinking on, but the tokenizer {tokenizer.path} carries "
                            + ("the plain ChatML template of nanolm before tools and reasoning" if self.fmt.nanolm_layout
                               else "a chat template") + ", which has no think block; drop --think or use a tokenizer "
                            "that has <think>")
        self.system = checked_text(system, "the system prompt")
        # With tools, calls held to their schemas; with none, no call tag; with thinking off, no <think>.
        self.guide = ReplyGuides(tokenizer, engine.model.config.vocab_size, engine.device).reply(
            self.tools.tools if self.tools is not None else (), thinking=thinking, guide_calls=guide_calls)
        self.history: list[Message] = []  # the conversation without the system prompt, oldest first
        self.dropped_total = 0
        self.last_dropped = 0  # exchanges dropped to fit the last turn

    def reset(self) -> None:
        self.history = []

    def set_system(self, text: str) -> None:
        self.system = checked_text(text, "the system prompt")
        self.reset()

    def _messages(self, history: list[Message]) -> list[Message]:
        return ([Message("system", self.system)] if self.system else []) + history

    def _prompt(self, history: list[Message]) -> list[int]:
        text = self.fmt.render(self._messages(history), self.tool_texts, add_generation_prompt=True,
                               thinking=self.thinking)
        return self.tok.encode(text)

    @staticmethod
    def _exchange_len(history: list[Message]) -> int:
        """How many messages the oldest exchange has: its user message and all up to the next one."""
        return next((i for i, m in enumerate(history) if i > 0 and m.role == "user"), len(history))

    def prompt_ids(self, pending: list[Message] | str) -> tuple[list[int], int]:
        """Token ids of the conversation plus `pending` (the turn so far: a user message, and the replies, calls
        and results since), and how many old exchanges were dropped to fit. A string is a new user message."""
        if isinstance(pending, str):
            pending = [Message("user", checked_text(pending, "the user turn"))]
        # Keep room for a useful reply: the requested length, capped at half the context.
        room = min(self.params.max_new_tokens, self.engine.max_seq_len // 2)
        limit = self.engine.max_seq_len - max(room, 1)
        history, dropped = self.history, 0
        while True:
            ids = self._prompt(history + pending)
            if len(ids) <= limit or not history:
                break
            history = history[self._exchange_len(history):]
            dropped += 1
        if len(ids) > limit:  # the turn alone is too long: keep its end
            ids = ids[-limit:]
        return ids, dropped

    def _drop(self, exchanges: int) -> None:
        for _ in range(exchanges):
            self.history = self.history[self._exchange_len(self.history):]
        self.dropped_total += exchanges
        self.last_dropped += exchanges

    def _reply(self, pending: list[Message]) -> Iterator[TurnEvent]:
        """Generate one reply to the conversation and `pending`, streaming its events; appends it to pending."""
        ids, dropped = self.prompt_ids(pending)
        self._drop(dropped)
        parser = ReplyParser(thinking=self.thinking, calls=self.tools is not None, bare_calls=self.fmt.bare_calls)
        guide = self.guide.fork() if self.guide is not None else None
        for piece in stream_text(self.engine, self.tok, ids, self.params, (self.tok.im_end_id, self.tok.eot_id),
                                 guide=guide):
            yield from parser.push(piece)
        yield from parser.finish()
        for problem in parser.problems:
            yield Notice(problem)
        pending.append(parser.message())

    def _result(self, call: ToolCall, ask: Ask | None) -> ToolResult:
        assert self.tools is not None
        names = self.tools.names()
        if call.name not in names:
            return ToolResult(call, f"error: there is no tool named {call.name!r}; the tools are "
                                    f"{', '.join(names)}", "unavailable")
        if self.tools.can_run(call):
            return ToolResult(call, self.tools.run(call), "builtin")
        given = ask(call) if ask is not None else None
        if given is None:
            return ToolResult(call, f"error: the tool {call.name} could not be run in this chat", "unavailable")
        return ToolResult(call, given, "user")

    def turn(self, user_text: str, ask: Ask | None = None) -> Iterator[TurnEvent]:
        """Stream the assistant's answer to `user_text`: the events of each reply and the results of its tool
        calls, reply after reply until one makes no call (or `max_tool_rounds` continuations). ask(call): the
        result of a declared tool's call, or None when there is none. The exchange joins the history once the
        turn is complete."""
        pending = [Message("user", checked_text(user_text, "the user turn"))]
        self.last_dropped = 0
        for rounds in itertools.count():
            yield from self._reply(pending)
            calls = pending[-1].tool_calls
            if not calls:
                break
            for call in calls:
                result = self._result(call, ask)
                pending.append(Message("tool", result.text))
                yield result
            if rounds == self.max_tool_rounds:
                yield Notice(f"stopped after {rounds + 1} replies with tool calls (the limit is "
                             f"{self.max_tool_rounds} continuations per turn); the results are kept for the next turn")
                break
        self.history += pending

    def reply(self, user_text: str) -> Iterator[str]:
        """The content of the answer to `user_text`, as it streams (reasoning and tool calls left out)."""
        for event in self.turn(user_text):
            if isinstance(event, Content):
                yield event.text


# --- the terminal ------------------------------------------------------------------------------------

_DIM, _RESET = "\x1b[2m", "\x1b[0m"


class _Transcript:
    """Writes a turn's events: each part on its own labelled line, reasoning dimmed on a colour terminal."""

    def __init__(self, out: TextIO, interactive: bool) -> None:
        self.out = out
        self.interactive = interactive
        self.color = interactive and getattr(out, "isatty", lambda: False)()
        self.part: str | None = None  # "reasoning" or "content" while one is being written

    def _line(self, text: str) -> None:
        self.end_part()
        self.out.write(text + "\n")

    def _open(self, part: str) -> None:
        if self.part == part:
            return
        self.end_part()
        self.part = part
        label = {"reasoning": "thinking> " if self.interactive else "reasoning: ",
                 "content": "bot> " if self.interactive else "assistant: "}[part]
        self.out.write(label + (_DIM if part == "reasoning" and self.color else ""))

    def end_part(self) -> None:
        if self.part is not None:
            self.out.write((_RESET if self.part == "reasoning" and self.color else "") + "\n")
            self.part = None

    def write(self, event: TurnEvent) -> None:
        if isinstance(event, Reasoning):
            self._open("reasoning")
            self.out.write(event.text)
        elif isinstance(event, Content):
            self._open("content")
            self.out.write(event.text)
        elif isinstance(event, Call):
            self._line(f"tool call: {event.call.name}({event.call.arguments})")
        elif isinstance(event, ToolResult):
            if event.source != "user":  # what the user typed is on the screen already
                self._line(f"tool result: {event.text}")
            if event.source == "unavailable" and not event.text.startswith("error: there is no tool"):
                self._line(f"[{event.call.name} is not a tool this chat can run; the model was told it failed]")
        else:
            self._line(f"[{event.text}]")
        self.out.flush()

    def answered(self) -> None:
        """The label of an answer that has no content."""
        self._open("content")


def run_chat(session: ChatSession, stdin: TextIO | None = None, out: TextIO | None = None,
             interactive: bool | None = None) -> None:
    """The terminal loop. Scripted mode (stdin not a TTY) echoes each turn so transcripts read well; there,
    a declared tool's result cannot be asked for, and the model is told the call failed."""
    stdin = stdin if stdin is not None else sys.stdin
    out = out if out is not None else sys.stdout
    interactive = stdin.isatty() if interactive is None else interactive
    if interactive:
        out.write(f"nanolm chat ({HELP})\n")
        if session.tools is not None:
            out.write(f"tools: {', '.join(session.tools.names())}\n")

    def ask(call: ToolCall) -> str | None:
        """A declared tool's result, typed by the user (interactive only)."""
        transcript.end_part()
        out.write(f"[{call.name} is not a built-in tool: type its result (one line), or an empty line to tell "
                  "the model it failed]\n")
        while True:
            out.write(f"{call.name} result> ")
            out.flush()
            line = stdin.readline()
            text = line.rstrip("\r\n")
            if not text.strip():
                return None
            try:
                return checked_text(text, "the tool result")
            except UserError as e:
                out.write(f"[{e}]\n")

    for lineno in itertools.count(1):
        if interactive:
            out.write("\nyou> ")
            out.flush()
        try:
            line = stdin.readline()
        except UnicodeDecodeError as e:  # stdin decoded strictly (a UTF-8 locale)
            # (It decodes a chunk ahead of the line, so the line number would not be the bad line's.)
            raise UserError(f"stdin: not UTF-8 text ({e.reason}); give UTF-8 text") from None
        if not line:
            break
        try:
            text = checked_text(line.rstrip("\r\n"), f"stdin line {lineno}")
        except UserError as e:
            if not interactive:
                raise
            out.write(f"[{e}]\n")  # at a terminal, say so and let the user type it again
            continue
        if not text.strip():
            continue
        if text.startswith("/"):
            cmd, _, arg = text.partition(" ")
            if cmd == "/exit":
                break
            if cmd == "/reset":
                session.reset()
                out.write("[conversation reset]\n")
            elif cmd == "/system":
                session.set_system(arg.strip())
                out.write(f"[system prompt set: {arg.strip()!r}; conversation reset]\n")
            else:
                out.write(f"[unknown command {cmd}; {HELP}]\n")
            out.flush()
            continue
        if not interactive:
            out.write(f"user: {text}\n")
        transcript = _Transcript(out, interactive)
        for event in session.turn(text, ask if interactive else None):
            transcript.write(event)
        last = session.history[-1]
        if last.role == "assistant" and not last.content and not last.tool_calls:
            transcript.answered()  # an empty answer still has its line
        transcript.end_part()
        if session.last_dropped:
            out.write(f"[context full: dropped the {session.last_dropped} oldest exchange(s)]\n")
        out.flush()
