"""Text in, streamed text out: the glue between a tokenizer and the engine."""

from __future__ import annotations

import sys
from typing import Iterable, Iterator, TextIO

from nanolm.infer.engine import Engine, SamplingParams
from nanolm.tokenizer import Tokenizer


class StreamDecoder:
    """Turns a stream of token ids into text pieces.

    A byte-level token can end in the middle of a multi-byte UTF-8 character
    (common with Chinese and emoji), so text is emitted only up to the last
    complete character and the rest waits for the next token.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already returned

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""  # an incomplete character; wait for more bytes
        piece = text[self.emitted:]
        self.emitted = len(text)
        return piece

    def flush(self) -> str:
        text = self.tok.decode(self.ids)
        piece = text[self.emitted:]
        self.emitted = len(text)
        return piece


def stream_text(engine: Engine, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams,
                stop_ids: Iterable[int]) -> Iterator[str]:
    """Generate and yield text pieces as soon as they form whole characters."""
    dec = StreamDecoder(tokenizer)
    for tid in engine.generate(prompt_ids, params, stop_ids=list(stop_ids)):
        piece = dec.push(tid)
        if piece:
            yield piece
    tail = dec.flush()
    if tail:
        yield tail


def complete(engine: Engine, tokenizer: Tokenizer, prompt: str, params: SamplingParams,
             out: TextIO | None = None) -> str:
    """Continue `prompt`, printing the continuation as it is generated; returns it."""
    out = out if out is not None else sys.stdout
    ids = tokenizer.encode(prompt) or [tokenizer.eot_id]
    pieces = []
    for piece in stream_text(engine, tokenizer, ids, params, (tokenizer.eot_id, tokenizer.im_end_id)):
        pieces.append(piece)
        out.write(piece)
        out.flush()
    return "".join(pieces)
