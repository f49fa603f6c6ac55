"""Streamed text: token ids in, text pieces out, cut at stop strings.

Three small parts, each usable alone: `StreamDecoder` turns ids into text as
they come, `StopStrings` cuts that text at the first stop string while
holding back an end that may yet become one, and `TextStream` chains the two
for the generate command, the chat session and the server.
"""

from __future__ import annotations

import codecs
from typing import Sequence

from nanolm.tokenizer import Tokenizer


class StreamDecoder:
    """Turns a stream of token ids into text pieces, in constant work per id.

    The pieces joined equal `tokenizer.decode(ids)`: each id's bytes (the
    tokenizer's `token_bytes` table) go through one incremental lossy UTF-8
    decoder, which is what the byte-level decoder does to the whole list at
    once. A token can end in the middle of a multi-byte character (common with
    Chinese and emoji); those bytes wait inside the decoder (3 at most) for the
    next token, and bytes that can never form a character come out as U+FFFD
    as soon as that is certain. An id past the tokenizer's vocabulary (a
    model's vocab_size is often rounded up beyond it, and an undertrained model
    may sample one) stands for no text.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._bytes = tokenizer.token_bytes()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """The text that `token_id` completes; "" while a character is still incomplete."""
        if not 0 <= token_id < len(self._bytes):
            return ""
        return self._utf8.decode(self._bytes[token_id])

    def flush(self) -> str:
        """The end of the text: an incomplete character left at the end becomes U+FFFD, as in `decode`."""
        return self._utf8.decode(b"", final=True)

    def pending_bytes(self) -> int:
        """Bytes of an incomplete character held for the next token (0 to 3)."""
        return len(self._utf8.getstate()[0])


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Index of the earliest occurrence in text[start:] of any stop string, or None."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else None


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that begins some stop string (and may yet complete it).

    Streamed text holds that much back: it may turn out to be the start of a stop string.
    """
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class StopStrings:
    """Cuts streamed text before the first stop string; the stop string itself never comes out.

    `push` returns what is safe to show now: the text up to an end that may
    begin a stop string, which is held back until the next piece decides it
    (also past a shorter stop string found after that start: the longer one,
    if it completes, cuts first). Only that held end (shorter than the
    longest stop string) is searched again, so the work per piece does not
    grow with the text.
    """

    def __init__(self, stops: Sequence[str] = ()) -> None:
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = list(stops)
        self.stopped = False  # a stop string has occurred; everything after it is dropped
        self._held = ""

    def push(self, piece: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return piece
        text = self._held + piece
        cut = find_stop(text, self.stops)
        if cut is None:
            safe = len(text) - stop_prefix_len(text, self.stops)
        else:
            # A longer stop string begun before the one found may yet complete, and cut earlier: wait for it.
            begun = self._begun_before(text, cut)
            if begun is None:
                self.stopped, self._held = True, ""
                return text[:cut]
            safe = begun
        self._held = text[safe:]
        return text[:safe]

    def _begun_before(self, text: str, cut: int) -> int | None:
        """The first index before `cut` where the end of `text` begins some stop string it does not complete."""
        longest = max(len(s) for s in self.stops)
        for at in range(max(0, len(text) - longest + 1), cut):
            end = text[at:]
            if any(len(s) > len(end) and s.startswith(end) for s in self.stops):
                return at
        return None

    def flush(self) -> str:
        """The held end, at the end of the text, cut at a stop string it holds: none can complete any more."""
        held, self._held = self._held, ""
        cut = find_stop(held, self.stops)
        if cut is not None:
            self.stopped = True
            return held[:cut]
        return held


class TextStream:
    """Token ids in, the text to show out: a StreamDecoder followed by StopStrings.

    Stop after a push that sets `stopped`; otherwise call `finish` once the ids
    end, for the rest of the text.
    """

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = ()) -> None:
        self._decoder = StreamDecoder(tokenizer)
        self._stops = StopStrings(stops)

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    def push(self, token_id: int) -> str:
        return self._stops.push(self._decoder.push(token_id))

    def finish(self) -> str:
        return self._stops.push(self._decoder.flush()) + self._stops.flush()
