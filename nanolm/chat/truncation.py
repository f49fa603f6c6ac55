"""Cutting a rendered conversation, or a preference pair, to a token budget by whole exchanges.

`fit_conversation` (`nanolm prepare` applies it at max_tokens and the loader
at seq_len + 1): a conversation longer than `max_tokens` tokens
(`<|endoftext|>` not counted) keeps its head (the system turn, tools
included) and drops its oldest exchanges (a user question with every turn up
to the next one: replies, calls, tool results; each begins at a token marked
`EXCHANGE`) until it fits. If the last exchange alone does not fit, it is cut
at the end: a reply cut inside keeps no `<|im_end|>`, so the model is never
taught to end a turn where the text did not. A conversation whose head, last
question and first reply token do not fit (no target would be left) is
skipped. A preference pair (`fit_pair`) drops the same old exchanges from
both conversations, so that they keep one prompt. Data prepared before the
EXCHANGE bit existed (plain ChatML, no tools) is cut at its user turns, found
by their place (an odd number of turns starts with a system turn).
"""

from __future__ import annotations

import numpy as np

from nanolm.chat.encoding import EXCHANGE, TARGET

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
