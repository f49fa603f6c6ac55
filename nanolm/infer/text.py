"""Streamed text: token ids in, text pieces out.

`StreamDecoder` turns ids into text as they come, in constant work per id.
"""

from __future__ import annotations

import codecs
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
