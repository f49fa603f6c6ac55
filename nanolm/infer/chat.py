"""Multi-turn chat over the generation engine: history, context window, terminal loop.

`ChatSession` holds the conversation and renders it in ChatML
(nanolm/data/chatml.py); when the history no longer fits the model's context (with
room left for the reply), the oldest user/assistant exchanges are dropped, and
the session says how many. `run_chat` is the terminal front end: interactive
on a TTY, or scripted (one user turn per line of stdin).
"""

from __future__ import annotations

import itertools
import sys
from typing import Iterator, TextIO

from nanolm.config import SamplingParams
from nanolm.data.chatml import render_chat
from nanolm.errors import UserError
from nanolm.infer.engine import Engine
from nanolm.infer.generate import check_text, stream_text
from nanolm.tokenizer import Tokenizer

HELP = "commands: /reset (forget the conversation), /system TEXT (set the system prompt), /exit"


class ChatSession:
    def __init__(self, engine: Engine, tokenizer: Tokenizer, params: SamplingParams, system: str = "") -> None:
        self.engine = engine
        self.tok = tokenizer
        self.params = params
        self.system = check_text(system, "the system prompt")
        self.turns: list[dict[str, str]] = []  # user/assistant messages, oldest first
        self.dropped_total = 0
        self.last_dropped = 0  # exchanges dropped to fit the last reply

    def reset(self) -> None:
        self.turns = []

    def set_system(self, text: str) -> None:
        self.system = check_text(text, "the system prompt")
        self.reset()

    def _messages(self, turns: list[dict[str, str]]) -> list[dict[str, str]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + turns

    def prompt_ids(self, user_text: str) -> tuple[list[int], int]:
        """Token ids of the conversation plus the new user turn, and how many old exchanges were dropped to fit."""
        # Keep room for a useful reply: the requested length, capped at half the context.
        check_text(user_text, "the user turn")
        room = min(self.params.max_new_tokens, self.engine.max_seq_len // 2)
        limit = self.engine.max_seq_len - max(room, 1)
        turns = self.turns + [{"role": "user", "content": user_text}]
        dropped = 0
        while True:
            ids = self.tok.encode(render_chat(self._messages(turns), add_generation_prompt=True))
            if len(ids) <= limit or len(turns) == 1:
                break
            turns = turns[2:]  # the oldest user/assistant exchange
            dropped += 1
        if len(ids) > limit:  # the new turn alone is too long: keep its end
            ids = ids[-limit:]
        return ids, dropped

    def reply(self, user_text: str) -> Iterator[str]:
        """Stream the assistant's reply to `user_text`; the exchange joins the history once complete."""
        ids, dropped = self.prompt_ids(user_text)
        if dropped:
            self.turns = self.turns[2 * dropped:]
            self.dropped_total += dropped
        self.last_dropped = dropped
        pieces = []
        for piece in stream_text(self.engine, self.tok, ids, self.params, (self.tok.im_end_id, self.tok.eot_id)):
            pieces.append(piece)
            yield piece
        self.turns += [{"role": "user", "content": user_text}, {"role": "assistant", "content": "".join(pieces)}]


def run_chat(session: ChatSession, stdin: TextIO | None = None, out: TextIO | None = None,
             interactive: bool | None = None) -> None:
    """The terminal loop. Scripted mode (stdin not a TTY) echoes each turn so transcripts read well."""
    stdin = stdin if stdin is not None else sys.stdin
    out = out if out is not None else sys.stdout
    interactive = stdin.isatty() if interactive is None else interactive
    if interactive:
        out.write(f"nanolm chat ({HELP})\n")
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
            text = check_text(line.rstrip("\r\n"), f"stdin line {lineno}")
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
        out.write("assistant: " if not interactive else "bot> ")
        out.flush()
        for piece in session.reply(text):
            out.write(piece)
            out.flush()
        out.write("\n")
        if session.last_dropped:
            out.write(f"[context full: dropped the {session.last_dropped} oldest exchange(s)]\n")
        out.flush()
