"""Preference pairs (`nanolm prepare --format pairs`, once `--format dpo`): a chosen and a rejected
conversation that share everything but the final reply, the data of `--stage dpo`; and the batches of pairs
the loader makes of them.

Prepare: each pair (read by `iter_preference_records` of nanolm.data.formats)
becomes two adjacent documents, its chosen conversation then its rejected
one, rendered as chat data is (nanolm/data/kinds/chat.py), but with the mask
on the final reply only (DPO compares the log-probabilities of the two final
replies). The split is by pair (pair i goes to val when i % k == 1), a shard
ends only after a pair's second conversation, and `max_tokens` applies to
each conversation, both cut by `fit_pair` (the same old turns dropped from
both); a pair is skipped when either would keep no target. The manifest gives
`options.format = "pairs"` and a "pairs" section with the number of pairs;
data prepared when the kind was named "dpo" (its format and section) reads
as pairs (`nanolm.data.shards.RENAMED_KINDS`).

Loader (`PreferencePairs`). The unit is a pair, and batch_size counts pairs: a
batch has 2 * batch_size rows, row 2i the chosen conversation of its i-th pair
and row 2i + 1 the rejected one (`Batch.pairs` is True), each from position 0
and padded at the end with id 0 and target -1, to the longest row of the batch
rounded up to a multiple of `PAD_MULTIPLE` (at most seq_len). Pairs are not
packed together: one conversation per row keeps a row's log-probability a
plain sum over its targets, and with the padding only at the end, plain causal
attention already keeps the real tokens from seeing it, so pos and seg are
None (the fast attention path). A pair with a conversation longer than seq_len
+ 1 is cut by `fit_pair` (one that cannot be is left out). Epoch e shuffles
the pairs with `np.random.default_rng([seed, e])`, then sorts each run of
`LENGTH_CHUNK` pairs of that order by the length of the pair's longer
conversation, so the pairs of a batch are of about one length: on the idioms
preference set this cuts the padding from about 40% of the positions to about
14% (what is left is mostly the difference between a chosen and a rejected
reply). The cost is that batches within a run go from short to long pairs.
The order does not depend on the batch size. `Loader.describe()` tells how
much of the batches is padding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from nanolm.chat import Conversation, fit_pair
from nanolm.data.formats import iter_preference_records
from nanolm.data.jsonl import ReadStats
from nanolm.data.kinds.base import Chunk, Order, Record, Splits, pinned
from nanolm.data.kinds.chat import ChatKind, Conversations, Documents, chat_state, conversation_chars, \
    conversation_texts, encode_spans, message_texts, targets
from nanolm.data.shards import MANIFEST, Batch, Manifest, PackedData, SplitWriter, write_splits
from nanolm.errors import UserError
from nanolm.progress import fmt_count
from nanolm.tokenizer import Tokenizer

# Preference batches are as wide as their longest row rounded up to a multiple of
# this (at most seq_len): fewer distinct shapes (for torch.compile and the CUDA
# allocator) for a few points of padding.
PAD_MULTIPLE = 8
# Preference pairs are sorted by length within runs of this many of an epoch's
# shuffled order, so that a batch holds pairs of about one length.
LENGTH_CHUNK = 1024


class PairsKind(ChatKind):
    """Preference pairs: each a chosen and a rejected conversation, the mask on their final replies."""

    name = "pairs"
    about = "preference pairs"
    help = ("preference pairs ({\"chosen\", \"rejected\"} conversations, or {\"prompt\", \"chosen\", "
            "\"rejected\"}; --format dpo, its old name, works too)")
    unit = rule_unit = "pair"
    noun = "preference pairs"
    group = 2  # a pair's two conversations stay in one shard
    jsonl_only = "preference data must be .jsonl (one pair per line)"
    segments = False  # one conversation per row, padded at the end
    mixes_as = "pairs"
    mix_fix = "preference pairs cannot be combined with text or chat data: train them in a run of their own"
    unscorable = "preference pairs (--format pairs) have no single text to score; evaluate on text or chat data"
    texts_help = "the chosen conversation's texts (as chat), then the rejected reply's"

    @classmethod
    def units(cls, data: PackedData, seq_len: int) -> PreferencePairs:  # type: ignore[override]
        return PreferencePairs(data, seq_len)

    read_records = staticmethod(iter_preference_records)

    @staticmethod
    def record_texts(pair: tuple[Conversation, Conversation]) -> Iterator[str]:
        yield from conversation_texts(pair[0])
        yield from message_texts(pair[1].messages[-1])

    def plan(self) -> str:
        return f"preference pairs, max {self.cfg.max_tokens} tokens per conversation, "

    def records(self, path: Path) -> Iterator[Record]:
        return pair_records(self.cfg.skip_bad, self.stats, self.tok)(path)

    def job(self, chunk: Chunk) -> tuple[Callable[..., Any], tuple]:
        return encode_pairs, (chunk.items, self.cfg.max_tokens)

    def consume(self, writers: dict[str, SplitWriter], chunk: Chunk, tokens: np.ndarray, mask: np.ndarray,
                lens: np.ndarray, truncated: int, too_long: int) -> None:
        kept = lens > 0  # both conversations of a pair skipped as too long have no tokens
        is_val = np.repeat(np.array(chunk.is_val, dtype=bool), 2)[kept]
        write_splits(writers, is_val, tokens, lens[kept], np.ones(int(kept.sum()), dtype=bool), mask)
        self.truncated += truncated
        self.too_long += too_long

    def finish_splits(self, splits: Splits) -> None:
        for split in splits.values():
            split["n_pairs"] = split["n_docs"] // 2

    def empty(self, files: list[Path]) -> str:
        return (f"no preference pairs in {', '.join(map(str, files))} ({self.stats.bad_lines} bad line(s) skipped, "
                f"{self.too_long} with a conversation longer than max_tokens={self.cfg.max_tokens}); check the "
                "files, or raise --max-tokens")

    def section(self, splits: Splits, n_docs: int) -> dict[str, Any] | None:
        return {"template": self.tok.chat_format.name, "mask": "final reply", "max_tokens": self.cfg.max_tokens,
                "n_pairs": n_docs // 2, "n_trainable": sum(s["n_trainable"] for s in splits.values()),
                "truncated": self.truncated, "skipped_too_long": self.too_long}

    def fitting(self, manifest: Manifest) -> list[str]:
        n_trainable, n_tokens = manifest.section["n_trainable"], manifest.totals["n_tokens"]  # type: ignore[index]
        return [f"trainable (final reply) tokens: {fmt_count(n_trainable)} = {100 * n_trainable / n_tokens:.1f}% "
                f"of all; truncated {self.truncated} pair(s) with a conversation longer than {self.cfg.max_tokens} "
                f"tokens, skipped {self.too_long} that could not be cut to fit"]


def pair_records(skip_bad: bool, stats: ReadStats, tok: Tokenizer) -> Callable[[Path], Iterator[Record]]:
    """Preference pairs as (chosen, rejected) conversations; a pair is one item and one split entry."""
    def records(path: Path) -> Iterator[Record]:
        for pair, nbytes in iter_preference_records(path, skip_bad=skip_bad, stats=stats, fmt=tok.chat_format,
                                                    tokenizer=str(tok.path)):
            yield pair, True, conversation_chars(pair[0]) + len(pair[1].messages[-1].content), nbytes, None
    return records


def encode_pairs(state: dict[str, Any], pairs: list[tuple[Conversation, Conversation]],
                  max_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """Ids and mask of each pair's chosen and rejected conversation (each followed by EOT, mask 0), the
    mask on the final reply only, fitted to max_tokens together (`fit_pair`).

    Returns (tokens, mask, lens, n_truncated, n_too_long); lens[2i], lens[2i + 1] are the lengths of pair i's
    conversations with their EOT, both 0 for a pair skipped as too long.
    """
    fmt = chat_state(state).chat_format
    # Earlier replies are context here: the loss (the sequence log-probability) is on the last one.
    rendered = encode_spans(state, [fmt.spans(c.messages, c.tools, final_only=True) for pair in pairs for c in pair])
    out = Documents(2 * len(pairs), state["dtype"], state["eot"])
    for i in range(len(pairs)):
        pair = rendered[2 * i], rendered[2 * i + 1]
        fitted = out.fitted(pair, max(len(pair[0][0]), len(pair[1][0])), max_tokens, fit_pair)
        if fitted is not None:
            out.add(2 * i, *fitted[0])
            out.add(2 * i + 1, *fitted[1])
    return out.result()


class PreferencePairs(Conversations):
    """Preference data: (chosen, rejected) pairs of conversations, one conversation per row."""

    name = "pairs"
    state_key = "n_pairs"
    noun, short_noun = "preference pairs", "pairs"
    each, cut_what = " a conversation", " with a conversation"

    def __init__(self, data: PackedData, seq_len: int) -> None:
        for s in data.shard_entries():
            if int(s["n_docs"]) % 2:
                raise UserError(f"{data.data_dir / MANIFEST}: preference shard {s['bin']} holds {s['n_docs']} "
                                "conversations, not whole pairs; the data is damaged, run `nanolm prepare --format "
                                f"{PairsKind.name}` again")
        super().__init__(data, seq_len)
        self.n_real = int((self.lengths - 1).sum())  # positions whose next token is in their conversation

    def _fit(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        fitted = self.length.reshape(-1, 2).copy()  # (pairs, 2): chosen, rejected
        long = fitted.max(axis=1) > self.block
        for p in np.flatnonzero(long).tolist():
            cut = fit_pair(self._raw(2 * p), self._raw(2 * p + 1), self.block)
            fitted[p] = (0, 0) if cut is None else (len(cut[0][0]), len(cut[1][0]))
        return fitted, long, fitted[:, 0] > 0

    def tokens(self, k: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """(ids, mask) of the chosen and rejected conversation of kept pair k, fitted to the block."""
        p = int(self.kept[k])
        return fit_pair(self._raw(2 * p), self._raw(2 * p + 1), self.block)  # type: ignore[return-value]

    def order(self, seed: int, epoch: int) -> Order:
        """The kept pairs shuffled, each run of LENGTH_CHUNK then sorted by its longer conversation (stable)."""
        out = np.random.default_rng([seed, epoch]).permutation(len(self.kept))
        longest = self.lengths.max(axis=1)
        for c in range(0, len(out), LENGTH_CHUNK):
            run = out[c:c + LENGTH_CHUNK]
            out[c:c + LENGTH_CHUNK] = run[np.argsort(longest[run], kind="stable")]
        return out

    def file_order(self) -> Order:
        return np.arange(len(self.kept), dtype=np.int64)

    def _widths(self, longest: np.ndarray) -> np.ndarray:
        """Columns of batches whose longest rows are `longest` tokens: rounded up to PAD_MULTIPLE, at most
        seq_len."""
        return np.minimum(self.seq_len, -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE)

    def batch(self, parts: list[np.ndarray], pin: bool) -> Batch:
        """Rows 2i, 2i + 1: the chosen and rejected conversation of kept pair pairs[i], padded with id 0,
        target -1 (see `Batch`)."""
        pairs = np.concatenate(parts)
        rows, width = 2 * len(pairs), int(self._widths(self.lengths[pairs].max() - 1))
        ids = np.zeros((rows, width + 1), dtype=np.int64)  # padding is id 0, mask 0
        mask = np.zeros((rows, width + 1), dtype=np.uint8)
        for i, k in enumerate(pairs.tolist()):
            for j, (t, m) in enumerate(self.tokens(k)):
                ids[2 * i + j, :len(t)], mask[2 * i + j, :len(t)] = t, m
        return pinned(Batch(torch.from_numpy(np.ascontiguousarray(ids[:, :-1])), torch.from_numpy(targets(ids, mask)),
                            pairs=True), pin)

    def tokens_per_epoch(self, order: Order) -> int:
        return self.n_real

    def describe(self, order: Order, batch_size: int) -> str:
        # The padding of the batches of batch_size pairs taken in `order`.
        starts = np.arange(0, len(order), batch_size)
        longest = np.maximum.reduceat(self.lengths.max(axis=1)[order], starts) - 1  # per batch
        rows = 2 * np.diff(np.r_[starts, len(order)])
        padding = 1 - int((self.lengths[order] - 1).sum()) / int((rows * self._widths(longest)).sum())
        return (f"{len(self.kept)} preference pairs ({self.n_real:,} tokens to predict), {batch_size} a batch as "
                f"{2 * batch_size} rows padded to the longest (a multiple of {PAD_MULTIPLE}, at most seq_len "
                f"{self.seq_len}): {100 * padding:.1f}% of positions are padding{self._cut_note()}")

    def holds(self, n_units: int) -> str:
        return f"{n_units} preference pairs"

    def needs(self, step: int) -> str:
        return f"{step} pairs; prepare more pairs, or lower batch_size"
