r"""A rendered conversation's token ids and its loss mask, placed by the bytes each token spells.

`encode_chat` (and `encode_chats` for a batch: what `nanolm prepare` stores):
the ids are `encode(render(...))`, the whole text encoded once; the layout
renders it as spans that train or not (`ChatFormat.spans`), and a token is a
target when its bytes (the cumulative sum of `Tokenizer.spelled_lengths`)
reach into a span that trains. That needs tokens that spell the text byte for
byte, as every byte-level BPE does; `check_spelling` checks it, and a
tokenizer that does not is refused.

What trains is each assistant turn's reasoning, content, tool calls and
closing `<|im_end|>`; never a system, user or tool turn, nor the scaffolding
(`<|im_start|>assistant\n<think>\n`, the empty block's `\n</think>\n\n` that
the generation prompt writes itself, the `\n` after `<|im_end|>`). A token
that joins scaffolding with reply text (the `\n` of a think block with
leading whitespace of the reply) carries reply text, so it is a target.
Preference data (`final_only`) has the mask on the final reply only: the
earlier turns are the prompt both sides continue.

A stored mask byte has two bits: `TARGET`, and `EXCHANGE` on the
`<|im_start|>` of each user turn that asks something (not a tool result):
where a truncated conversation may begin (nanolm/chat/truncation.py).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from nanolm.chat.templates import Span
from nanolm.errors import UserError

TARGET, EXCHANGE = 1, 2  # the bits of a stored loss-mask byte


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
        raise _not_spelled(tokenizer_file)
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
        raise _not_spelled(tokenizer_file)


def _not_spelled(tokenizer_file: str) -> UserError:
    """What is wrong with a tokenizer whose tokens do not spell a text, and what to use instead."""
    return UserError(f"{tokenizer_file}: the tokens of a conversation do not spell its text byte for byte "
                     "(the tokenizer normalizes or is not byte-level), so the loss mask cannot be placed; use "
                     "a byte-level BPE tokenizer, such as one made by `nanolm tokenizer train`")
