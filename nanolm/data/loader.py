"""Packed training batches from the token shards of a prepared data directory (nanolm/data/shards.py).

Every batch is a `Batch`: inputs x, next-token targets y (-1 where no loss is
taken) and, for chat data, each token's position in its conversation and a
segment id per conversation, so that a row can hold several conversations
that do not see each other; for preference data, rows in (chosen, rejected)
pairs.

The five kinds of unit, one class each behind one protocol (`UnitKind`),
which the one `Loader` and `iter_eval_batches` drive:

Text data (`Windows`). A split's shards are cut into windows of seq_len + 1 tokens at
stride seq_len (window j of a shard covers tokens [j*T, j*T + T], T =
seq_len): the inputs x = window[:-1] and targets y = window[1:] of consecutive
windows tile the shard with no padding and no gap; the last (n - 1) % T tokens
of each shard are never a target. Documents run into each other, separated by
their end-of-text token, as in GPT-2/nanoGPT pretraining; pos and seg are None
(plain causal attention, positions 0..T-1). Epoch e's order of its n windows
(numbered across the shards in order) is `np.random.default_rng([seed,
e]).permutation(n)`. Past `SHUFFLE_BLOCK` windows that permutation would grow
with the data (8 bytes a window: 1.5 GB at 100B tokens, seq_len 512), so the
shuffle takes two levels: the windows fall into ceil(n / SHUFFLE_BLOCK) blocks
of consecutive windows (the last one shorter), the same generator permutes the
blocks, and the epoch takes the blocks in that order, each block's windows in
the order of `np.random.default_rng([seed, e, block]).permutation(its size)`,
made when a batch first needs them (the loader keeps the last two). Memory then
stays at a few blocks' orders, however large the data; the cost is that a
stretch of SHUFFLE_BLOCK windows of the stream comes from one region of the
data (at seq_len 512, 0.5B consecutive tokens), which is also what keeps the
reads of data larger than the page cache local. Windows are read with
`os.pread` from the shard files (`PackedData.gather`; shards.py says why).

Chat data (`PackedConversations`, prepared with `format="chat"`). The unit is
a block of seq_len + 1 tokens holding whole conversations (each without its
trailing end-of-text token), padded at the end with id 0. A conversation
longer than the block is cut by `fit_conversation`, ChatML's truncation
policy, as `nanolm prepare` cuts it (one that cannot be cut to fit is left
out; the loader says how many). Epoch e shuffles the conversations with
`np.random.default_rng([seed, e])`, packs them into blocks with `pack_blocks`
(over consecutive chunks of `PACK_CHUNK` conversations), then shuffles the
blocks with the same generator. So each
epoch sees every conversation once, in other company, and epochs can differ
by a few blocks; `Loader.describe()` tells how full the blocks are. In a row,
seg numbers the conversations 0, 1, ... (the padding gets the next number),
pos restarts at 0 with each of them, and y is -1 where the loss mask of the
target token is 0 (system and user turns, template scaffolding, padding) and
at the last token of every segment, so nothing predicts across a boundary.

Preference data (`PreferencePairs`, prepared with `format="dpo"`: each pair is
two adjacent documents, chosen then rejected, the mask on their final
replies). The unit is a pair, and batch_size counts pairs: a batch has 2 * batch_size rows, row 2i
the chosen conversation of its i-th pair and row 2i + 1 the rejected one
(`Batch.pairs` is True), each from position 0 and padded at the end with id 0
and target -1, to the longest row of the batch rounded up to a multiple of
`PAD_MULTIPLE` (at most seq_len). Pairs are not packed together: one
conversation per row keeps a row's log-probability a plain sum over its
targets, and with the padding only at the end, plain causal attention already
keeps the real tokens from seeing it, so pos and seg are None (the fast
attention path). A pair with a conversation longer than seq_len + 1 is cut by
`fit_pair` (one that cannot be is left out). Epoch e shuffles the pairs with
`np.random.default_rng([seed, e])`, then sorts each run of `LENGTH_CHUNK`
pairs of that order by the length of the pair's longer conversation, so
the pairs of a batch are of about one length: on the idioms preference set
this cuts the padding from about 40% of the positions to about 14% (what is
left is mostly the difference between a chosen and a rejected reply). The
cost is that batches within a run go from short to long pairs. The order
does not depend on the batch size. `Loader.describe()` tells how much of the
batches is padding.

Input and output blocks (`Blocks`, prepared with `format="blocks"`, for
--stage blocks): the unit is a record, a row its input and output blocks of
seq_len tokens side by side (nanolm/data/blocks.py), each epoch in the order of
`np.random.default_rng([seed, e]).permutation(n)` of the records that fit.

RL prompts (`Prompts`, prepared with `format="prompts"`): the unit is a
prompt; a batch is a `PromptBatch` (nanolm/data/prompts.py) of batch_size
prompts' conversation ids and records, each epoch in the order of
`np.random.default_rng([seed, e]).permutation(n)`.

The order of units (windows, blocks, pairs or prompts) is one global stream, the same
on every process: epoch 0's units in its order, then epoch 1's, and so on. A
step (`next_batch()` called once on each of world_size ranks) takes the next
batch_size * world_size units of the stream; rank r takes the r-th batch_size
of them. A batch at an epoch boundary takes the end of one epoch and the start
of the next, so within an epoch no unit is seen twice and none is skipped. The
state (`epoch`, `cursor` into the epoch; the epoch's order, for chat data its
blocks, is made again from the seed) is global, so a run can resume with
another number of processes, or another batch size, and continue the same
stream. A saved state also holds the count a resume checks against, named by
the kind (`epoch_windows`, `n_conversations` or `n_pairs`).

A kind says how many units an epoch holds (the length of its order), in
which order (`order`, `file_order`), how a slice of that order becomes a
`Batch`, what it holds (`describe`) and what a saved state is checked
against; the Loader's messages are built from the phrases it gives about
itself. A new kind of unit is one class and one entry in `KINDS`.
"""

from __future__ import annotations

import bisect
from typing import Any, Callable, Iterator, Protocol

import numpy as np
import torch

from nanolm.data.blocks import Blocks
from nanolm.data.chatml import TARGET, fit_conversation, fit_pair
from nanolm.data.prompts import PromptBatch, read_records
from nanolm.data.shards import IGNORE_INDEX, Batch, PackedData
from nanolm.errors import UserError

# Conversations packed together (see pack_blocks); a larger chunk packs
# tighter, a smaller one varies the blocks' make-up more between epochs.
PACK_CHUNK = 4096
# Below this fraction of positions holding a token, pack_blocks tries a second packer.
GOOD_FILL = 0.99
# Preference batches are as wide as their longest row rounded up to a multiple of
# this (at most seq_len): fewer distinct shapes (for torch.compile and the CUDA
# allocator) for a few points of padding.
PAD_MULTIPLE = 8
# Preference pairs are sorted by length within runs of this many of an epoch's
# shuffled order, so that a batch holds pairs of about one length.
LENGTH_CHUNK = 1024
# Text epochs of more than this many windows are shuffled in two levels (see the module doc);
# at or below it, one permutation of the epoch (8 bytes a window: 8 MiB at the threshold).
SHUFFLE_BLOCK = 1 << 20


def pack_blocks(lengths: np.ndarray, capacity: int, chunk: int = PACK_CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """Group items of the given lengths (each in [1, capacity]) into blocks of at most `capacity`.

    Each run of `chunk` consecutive items is packed on its own, by best-fit
    decreasing (`_best_fit_decreasing`) or by `_fill_exactly`. The first chunk
    that best-fit leaves more than 1 - GOOD_FILL empty is packed both ways, and
    the way that needs fewer blocks packs the chunks after it too: the items
    come in random order, so one chunk is much like another, and trying both on
    every chunk would cost up to ten times as long. Returns (order, starts): the
    item indices block by block, and where each block starts in order
    (n_blocks + 1 entries). Deterministic.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(f"item lengths must be in [1, {capacity}], got {lengths.min()}..{lengths.max()}")
    blocks: list[list[int]] = []
    exact: bool | None = None  # whether _fill_exactly packs; None until a chunk has decided it
    for c0 in range(0, len(lengths), chunk):
        sub = lengths[c0:c0 + chunk].tolist()
        if exact:
            packed = _fill_exactly(sub, capacity)
        else:
            packed = _best_fit_decreasing(sub, capacity)
            if exact is None and sum(sub) < GOOD_FILL * len(packed) * capacity:
                other = _fill_exactly(sub, capacity)
                exact = len(other) < len(packed)
                packed = other if exact else packed
        blocks += [[c0 + i for i in b] for b in packed]
    order = np.fromiter((i for b in blocks for i in b), dtype=np.int64, count=len(lengths))
    starts = np.zeros(len(blocks) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in blocks], out=starts[1:])
    return order, starts


def _best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Blocks of item indices: the longest item first, each into the open block it leaves the least room in,
    or into a new one. Near-optimal when a block holds many items."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep their order
    smallest = min(lengths)
    blocks: list[list[int]] = []
    free: list[int] = []  # room left in the open blocks, ascending
    owner: list[int] = []  # the block of each entry of `free`
    for i in order:
        n = lengths[i]
        j = bisect.bisect_left(free, n)
        if j == len(free):
            b, room = len(blocks), capacity - n
            blocks.append([i])
        else:
            b, room = owner.pop(j), free.pop(j) - n
            blocks[b].append(i)
        if room >= smallest:  # a block with less room can take nothing more
            j = bisect.bisect_left(free, room)
            free.insert(j, room)
            owner.insert(j, b)
    return blocks


def _fill_exactly(lengths: list[int], capacity: int) -> list[list[int]]:
    """Blocks of item indices, one at a time: the longest item left, then the subset of the items left
    that fills the room best (subset sum over lengths, as bitsets). Better than best-fit when a block
    holds only a few items, where best-fit leaves gaps smaller than any item."""
    by_length: dict[int, list[int]] = {}
    for i in range(len(lengths) - 1, -1, -1):  # pop() then takes items in their given order
        by_length.setdefault(lengths[i], []).append(i)
    present = sorted(by_length)  # distinct lengths left, ascending
    blocks: list[list[int]] = []

    def take(n: int) -> int:
        items = by_length[n]
        i = items.pop()
        if not items:
            del by_length[n]
            present.remove(n)
        return i

    while present:
        first = present[-1]
        block = [take(first)]
        room = capacity - first
        # reach: bit v set when some subset of the lengths tried so far sums to v (<= room).
        reach, full, steps = 1, (1 << (room + 1)) - 1, []
        for n in present[:bisect.bisect_right(present, room)]:
            for _ in range(min(len(by_length[n]), room // n)):
                steps.append((n, reach))
                reach = (reach | (reach << n)) & full
            if reach >> room & 1:
                break  # the room can be filled exactly
        v = reach.bit_length() - 1  # the best sum; walk back through the steps that made it
        for n, before in reversed(steps):
            if v == 0:
                break
            if not before >> v & 1:
                v -= n
                block.append(take(n))
        blocks.append(block)
    return blocks


class Order(Protocol):
    """An epoch's units in their order: len() is how many there are (the epoch's count), and a contiguous
    slice [lo:hi] gives what `UnitKind.batch` takes for those units."""

    def __len__(self) -> int: ...

    def __getitem__(self, s: slice) -> Any: ...


class UnitKind(Protocol):
    """One kind of unit the Loader streams (see the module doc): what it needs to know of the kind.

    Messages are built by the Loader from the phrases a kind gives about itself (holds, needs, amount, empty).
    """

    name: str  # what a unit is called in messages: "windows", "blocks", "pairs"
    state_key: str  # the key, in a saved stream position, of the count it is checked against
    n_state: int  # that count for this split and seq_len

    def order(self, seed: int, epoch: int) -> Order:
        """The units of an epoch in the epoch's shuffled order."""
        ...

    def file_order(self) -> Order:
        """The units in file order (evaluation)."""
        ...

    def batch(self, parts: list[Any], pin: bool) -> Batch:
        """The batch of the units of `parts` (slices of orders, in stream order), pinned if `pin`."""
        ...

    def tokens_per_epoch(self, order: Order) -> int:
        """Input positions an epoch of this order holds (preference data: those with a next token)."""
        ...

    def describe(self, order: Order, batch_size: int) -> str:
        """One line on what an epoch of this order holds."""
        ...

    def holds(self, n_units: int) -> str:
        """What the split holds, for a message that says it is too little: "100 tokens make 12 windows ..."."""
        ...

    def needs(self, step: int) -> str:
        """The size of a step of `step` units as that message gives it ("14", "42 pairs"), then the fix."""
        ...

    def amount(self, count: Any, seq_len: Any, again: bool = False) -> str:
        """`count` of what n_state counts at seq_len, in words (again: named a second time in a message)."""
        ...

    def empty(self) -> str:
        """What is wrong when the split holds no unit at all, and the fix."""
        ...


class Windows:
    """Text data: windows of seq_len + 1 tokens at stride seq_len, read from the shard files."""

    name = "windows"
    state_key = "epoch_windows"

    def __init__(self, data: PackedData, seq_len: int) -> None:
        self.data, self.seq_len = data, seq_len
        self.n_state = int(data.n_windows(seq_len).sum())  # every epoch holds every window

    def order(self, seed: int, epoch: int) -> Order:
        n, rng = self.n_state, np.random.default_rng([seed, epoch])
        return rng.permutation(n) if n <= SHUFFLE_BLOCK else _BlockShuffle(n, SHUFFLE_BLOCK, seed, epoch, rng)

    def file_order(self) -> Order:
        return np.arange(self.n_state, dtype=np.int64)

    def batch(self, parts: list[np.ndarray], pin: bool) -> Batch:
        tokens = self.data.gather(np.concatenate(parts), self.seq_len)  # (B, T+1)
        x = torch.from_numpy(np.ascontiguousarray(tokens[:, :-1]))
        y = torch.from_numpy(np.ascontiguousarray(tokens[:, 1:]))
        return _pinned(Batch(x, y), pin)

    def tokens_per_epoch(self, order: Order) -> int:
        return len(order) * self.seq_len

    def describe(self, order: Order, batch_size: int) -> str:
        return (f"{len(order)} windows of seq_len+1 = {self.seq_len + 1} tokens per epoch "
                f"from {self.data.n_tokens:,} tokens")

    def holds(self, n_units: int) -> str:
        return f"{self.data.n_tokens} tokens make {n_units} windows of seq_len+1 = {self.seq_len + 1} tokens"

    def needs(self, step: int) -> str:
        # One shard needs step windows of seq_len tokens, plus the first input token.
        return (f"{step}; it needs at least {step * self.seq_len + 1} tokens: prepare more text, or lower "
                "batch_size or seq_len")

    def amount(self, count: Any, seq_len: Any, again: bool = False) -> str:
        return f"{count} windows of seq_len {seq_len}"

    def empty(self) -> str:
        return (f"{self.data.n_tokens} tokens, fewer than one window of seq_len+1 = {self.seq_len + 1} in any "
                "shard; prepare more text or lower seq_len")


class _Conversations:
    """What the kinds made of whole conversations of a chat or preference split (with their loss masks)
    share: the documents, fitted to seq_len + 1 tokens each by ChatML's truncation policy.

    A subclass fits its units (`_fit`) and says what they are called (noun, short_noun, each, cut_what).
    """

    noun: str  # what n_state counts: "conversations", "preference pairs"
    short_noun: str  # the same, named again in a message
    each: str  # what must fit in a block: "" (a conversation: the unit), " a conversation" (of a pair)
    cut_what: str  # what of a unit was too long: "" (a conversation), " with a conversation" (a pair)

    def __init__(self, data: PackedData, seq_len: int) -> None:
        assert data.masks is not None
        self.data, self.seq_len, self.block = data, seq_len, seq_len + 1
        self.shard, self.start, self.length = data.documents()
        fitted, long, kept = self._fit()
        self.n_state = len(long)  # units of the split, trained on or not
        self.n_cut = int((long & kept).sum())
        self.kept = np.flatnonzero(kept)  # unit ids that are trained on
        self.n_dropped = self.n_state - len(self.kept)
        if len(self.kept) == 0:
            raise UserError(f"{data.data_dir} ({data.split}): {self.empty()}")
        self.lengths = fitted[self.kept]  # fitted length(s) of each kept unit

    def _fit(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per unit: its fitted length(s), 0 when it cannot be cut to fit; whether it was longer than a block;
        whether it is kept (trained on)."""
        raise NotImplementedError

    def _raw(self, doc: int) -> tuple[np.ndarray, np.ndarray]:
        """Ids and mask of document `doc` of the split, as stored."""
        shard, start, length = int(self.shard[doc]), int(self.start[doc]), int(self.length[doc])
        ids = self.data.doc_ids(shard, start, length)
        return ids, np.asarray(self.data.masks[shard][start:start + length])  # type: ignore[index]

    def amount(self, count: Any, seq_len: Any, again: bool = False) -> str:
        return f"{count} {self.short_noun if again else self.noun} at seq_len {seq_len}"

    def empty(self) -> str:
        return (f"none of its {self.n_state} {self.noun} fits in seq_len+1 = {self.block} tokens{self.each} with "
                f"a reply token left; raise seq_len, or run `nanolm prepare --format {self.data.kind} --max-tokens "
                f"{self.block}` on shorter {self.short_noun}")

    def _cut_note(self) -> str:
        """The end of `describe`: the units cut to fit, and those left out."""
        return (f"; {self.n_cut}{self.cut_what} longer than {self.block} tokens cut to fit" if self.n_cut else "") + \
               (f", {self.n_dropped} left out (no reply token would fit)" if self.n_dropped else "")


class PackedConversations(_Conversations):
    """Chat data: blocks of seq_len + 1 tokens, each packing whole conversations that do not see each other."""

    name = "blocks"
    state_key = "n_conversations"
    noun = short_noun = "conversations"
    each = cut_what = ""

    def __init__(self, data: PackedData, seq_len: int) -> None:
        super().__init__(data, seq_len)
        self.n_real = int(self.lengths.sum())
        self._positions = np.arange(self.block, dtype=np.int64)

    def _fit(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        long = self.length > self.block
        fitted = self.length.copy()
        for c in np.flatnonzero(long).tolist():
            cut = fit_conversation(*self._raw(c), self.block)
            fitted[c] = 0 if cut is None else len(cut[0])
        return fitted, long, fitted > 0

    def tokens(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Ids and mask of kept conversation k, fitted to the block."""
        ids, mask = self._raw(int(self.kept[k]))
        if len(ids) > self.block:
            ids, mask = fit_conversation(ids, mask, self.block)  # type: ignore[misc]
        return ids, mask

    def _plan(self, order: np.ndarray) -> _Blocks:
        """Blocks of the kept conversations taken in `order`."""
        packed, starts = pack_blocks(self.lengths[order], self.block)
        return _Blocks(order[packed], starts)

    def order(self, seed: int, epoch: int) -> Order:
        # The conversations shuffled, packed, then the blocks shuffled, all with one generator.
        rng = np.random.default_rng([seed, epoch])
        return self._plan(rng.permutation(len(self.kept))).shuffled(rng)

    def file_order(self) -> Order:
        return self._plan(np.arange(len(self.kept)))

    def batch(self, parts: list[list[np.ndarray]], pin: bool) -> Batch:
        """Rows of x, y, pos, seg from blocks given as arrays of kept-conversation indices."""
        blocks = [b for part in parts for b in part]
        rows, width = len(blocks), self.block
        ids = np.zeros((rows, width), dtype=np.int64)  # padding is id 0, mask 0
        mask = np.zeros((rows, width), dtype=np.uint8)
        seg = np.empty((rows, width), dtype=np.int64)
        pos = np.empty((rows, width), dtype=np.int64)
        for r, convs in enumerate(blocks):
            at = 0
            for s, k in enumerate(convs.tolist()):
                t, m = self.tokens(k)
                n = len(t)
                ids[r, at:at + n], mask[r, at:at + n] = t, m
                seg[r, at:at + n], pos[r, at:at + n] = s, self._positions[:n]
                at += n
            seg[r, at:], pos[r, at:] = len(convs), self._positions[:width - at]
        y = _targets(ids, mask)
        y[seg[:, 1:] != seg[:, :-1]] = IGNORE_INDEX  # the last token of a segment predicts nothing
        return _pinned(Batch(torch.from_numpy(np.ascontiguousarray(ids[:, :-1])), torch.from_numpy(y),
                             torch.from_numpy(np.ascontiguousarray(pos[:, :-1])),
                             torch.from_numpy(np.ascontiguousarray(seg[:, :-1]))), pin)

    def tokens_per_epoch(self, order: Order) -> int:
        return len(order) * self.seq_len

    def describe(self, order: Order, batch_size: int) -> str:
        fill = self.n_real / (len(order) * self.block)  # of the positions, those holding a real token
        hint = "" if fill >= 0.97 else " (the conversations are long for this seq_len: few fit together)"
        return (f"{len(self.kept)} conversations ({self.n_real:,} tokens) packed into {len(order)} blocks of "
                f"seq_len+1 = {self.block}: {100 * fill:.1f}% of positions hold a real token{hint}{self._cut_note()}")

    def holds(self, n_units: int) -> str:
        return f"{len(self.kept)} conversations make {n_units} blocks of seq_len+1 = {self.block} tokens"

    def needs(self, step: int) -> str:
        return f"{step}; prepare more conversations, or lower batch_size"


class PreferencePairs(_Conversations):
    """Preference data: (chosen, rejected) pairs of conversations, one conversation per row."""

    name = "pairs"
    state_key = "n_pairs"
    noun, short_noun = "preference pairs", "pairs"
    each, cut_what = " a conversation", " with a conversation"

    def __init__(self, data: PackedData, seq_len: int) -> None:
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
        return _pinned(Batch(torch.from_numpy(np.ascontiguousarray(ids[:, :-1])), torch.from_numpy(_targets(ids, mask)),
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


class Prompts:
    """RL prompts (`format="prompts"`, nanolm/data/prompts.py): the unit is a prompt, its conversation's ids
    and its record; a batch is a `PromptBatch` of batch_size of them. Epoch e's order is
    `np.random.default_rng([seed, e]).permutation(n)`."""

    name = "prompts"
    state_key = "n_prompts"

    def __init__(self, data: PackedData, seq_len: int) -> None:
        self.data, self.seq_len = data, seq_len
        self.shard, self.start, self.length = data.documents()
        self.n_state = len(self.length)
        if self.n_state == 0:
            raise UserError(f"{data.data_dir} ({data.split}): {self.empty()}")
        self.records = read_records(data.data_dir, data.split, self.n_state)

    def order(self, seed: int, epoch: int) -> Order:
        return np.random.default_rng([seed, epoch]).permutation(self.n_state)

    def file_order(self) -> Order:
        return np.arange(self.n_state, dtype=np.int64)

    def batch(self, parts: list[np.ndarray], pin: bool) -> PromptBatch:
        index = np.concatenate(parts).tolist()
        prompts = []
        for k in index:
            shard, start, length = int(self.shard[k]), int(self.start[k]), int(self.length[k])
            prompts.append(self.data.doc_ids(shard, start, length).tolist())
        return PromptBatch(prompts, [self.records[k] for k in index], index)

    def tokens_per_epoch(self, order: Order) -> int:
        return int(self.length.sum())

    def describe(self, order: Order, batch_size: int) -> str:
        return (f"{self.n_state} prompts ({int(self.length.sum()):,} tokens, {int(self.length.max())} the longest), "
                f"{batch_size} a micro-batch")

    def holds(self, n_units: int) -> str:
        return f"{n_units} prompts"

    def needs(self, step: int) -> str:
        return f"{step} prompts; prepare more prompts, or lower batch_size"

    def amount(self, count: Any, seq_len: Any, again: bool = False) -> str:
        return f"{count} prompts"

    def empty(self) -> str:
        return "no prompts; run `nanolm prepare --format prompts` on a file that holds some"


# The unit kind of each data format (PackedData.kind); a new kind of unit is one class and one entry here.
KINDS: dict[str, Callable[[PackedData, int], UnitKind]] = {
    "text": Windows, "chat": PackedConversations, "dpo": PreferencePairs, "prompts": Prompts, "blocks": Blocks}


def unit_kind(data: PackedData, seq_len: int) -> UnitKind:
    """The units of a split at seq_len, of the kind its data format makes."""
    return KINDS[data.kind](data, seq_len)


def _targets(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """(R, W - 1) next-token targets of rows of ids (R, W), IGNORE_INDEX where the mask of the target is 0."""
    y = ids[:, 1:].copy()
    y[(mask[:, 1:] & TARGET) == 0] = IGNORE_INDEX
    return y


def _pinned(batch: Batch, pin: bool) -> Batch:
    return batch.pin_memory() if pin else batch


def _check_positive(**kw: int) -> None:
    for name, v in kw.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise UserError(f"{name}={v!r}: must be a positive integer")


class Loader:
    """Shuffled packed batches for one rank, from the global stream of one kind of unit (see module doc)."""

    def __init__(self, data: PackedData, batch_size: int, seq_len: int, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1, pin_memory: bool | None = None) -> None:
        _check_positive(batch_size=batch_size, seq_len=seq_len, world_size=world_size)
        if not 0 <= rank < world_size:
            raise UserError(f"rank={rank}: must be in [0, world_size={world_size})")
        self.data, self.batch_size, self.seq_len, self.seed = data, batch_size, seq_len, seed
        self.rank, self.world_size = rank, world_size
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.epoch = 0
        self.cursor = 0  # position in this epoch's order of the next step's first unit
        self._orders: dict[int, Order] = {}  # epoch -> its order (the last ones made)
        self.units: UnitKind = unit_kind(data, seq_len)
        # Units (windows, blocks or pairs) in epoch 0; chat epochs can differ by a few blocks.
        self.epoch_windows: int = self.epoch_units(0)
        # Input positions per epoch (preference data: those with a next token, padding left out).
        self.tokens_per_epoch: int = self.units.tokens_per_epoch(self._order(0))
        step = batch_size * world_size
        if self.epoch_windows < step:
            raise UserError(f"{data.data_dir} ({data.split}): {self.units.holds(self.epoch_windows)}, but a step "
                            f"takes batch_size x world_size = {self.units.needs(step)}")

    def _order(self, epoch: int) -> Order:
        if epoch not in self._orders:
            self._orders = {e: p for e, p in self._orders.items() if e >= self.epoch}  # drop past epochs
            self._orders[epoch] = self.units.order(self.seed, epoch)
        return self._orders[epoch]

    def epoch_units(self, epoch: int) -> int:
        """Units (windows, blocks or pairs) in epoch `epoch` of the stream."""
        return len(self._order(epoch))

    def _ranges(self, start: int, count: int) -> list[tuple[int, int, int]]:
        """(epoch, lo, hi): the units at positions start .. start+count-1 of the stream from (self.epoch, 0)."""
        out, epoch = [], self.epoch
        while count > 0:
            n = self.epoch_units(epoch)
            if start < n:
                take = min(count, n - start)
                out.append((epoch, start, start + take))
                count -= take
                start = 0
            else:
                start -= n
            epoch += 1
        return out

    def describe(self) -> str:
        """One line on what an epoch holds (for chat data: how full the packed blocks are; for preference
        data: how much of epoch 0's batches is padding)."""
        return self.units.describe(self._order(0), self.batch_size)

    def next_batch(self) -> Batch:
        """This rank's next batch: (batch_size, seq_len) tensors; for preference data (2 * batch_size, width)
        with width <= seq_len, rows in pairs (see `Batch`)."""
        batch = self.peek(self.rank * self.batch_size)
        self.skip(self.batch_size * self.world_size)
        return batch

    def peek(self, offset: int) -> Batch:
        """The batch of the batch_size units `offset` units past the stream position, without taking them
        (`next_batch` is peek(rank * batch_size) then skip(batch_size * world_size))."""
        ranges = self._ranges(self.cursor + offset, self.batch_size)
        return self.units.batch([self._order(e)[lo:hi] for e, lo, hi in ranges], self.pin_memory)

    def skip(self, n: int) -> None:
        """Move the stream position n units on (into the next epochs as needed)."""
        self.cursor += n
        while self.cursor >= self.epoch_units(self.epoch):
            self.cursor -= self.epoch_units(self.epoch)
            self.epoch += 1

    def state_dict(self) -> dict[str, Any]:
        """The global stream position (identical on every rank), JSON-serialisable; with the count of the
        kind's units (`UnitKind.state_key`) that a resume checks."""
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "seq_len": self.seq_len,
                self.units.state_key: self.units.n_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream saved by `state_dict` (from any number of ranks, any batch size)."""
        units, key = self.units, self.units.state_key
        if state.get("seq_len") != self.seq_len or state.get(key) != units.n_state:
            raise UserError(f"the saved data position is for {units.amount(state.get(key), state.get('seq_len'))}, "
                            f"but {self.data.data_dir} ({self.data.split}) has "
                            f"{units.amount(units.n_state, self.seq_len, again=True)}; resume with the same "
                            "prepared data and seq_len, or start a new run")
        cursor, epoch, seed = int(state["cursor"]), int(state["epoch"]), int(state["seed"])
        old = (self.seed, self.epoch, self._orders)
        self.seed, self.epoch, self._orders = seed, epoch, {}  # the stream is defined by the seed it started with
        if not (epoch >= 0 and 0 <= cursor < self.epoch_units(epoch)):
            self.seed, self.epoch, self._orders = old
            raise UserError(f"the saved data position (epoch {epoch}, cursor {cursor}) is out of range; "
                            "the checkpoint's state is damaged")
        self.cursor = cursor


class _BlockShuffle:
    """The order of a text epoch's n windows in two levels (see the module doc), sliced like an array.

    Holds the blocks' order (n / block entries) and the orders of the last two
    blocks read (block int64 each), not the n int64 of a full permutation.
    """

    def __init__(self, n: int, block: int, seed: int, epoch: int, rng: np.random.Generator) -> None:
        self.n, self.block, self.seed, self.epoch = n, block, seed, epoch
        self.blocks = rng.permutation(-(-n // block))  # block ids in the epoch's order
        sizes = np.minimum(block, n - self.blocks * block)
        self.starts = np.zeros(len(sizes) + 1, dtype=np.int64)  # where each block begins in the epoch
        np.cumsum(sizes, out=self.starts[1:])
        self._cache: dict[int, np.ndarray] = {}  # position in the block order -> its windows, in order

    def __len__(self) -> int:
        return self.n

    def _windows(self, j: int) -> np.ndarray:
        """The windows of the epoch's j-th block, in their shuffled order."""
        if j not in self._cache:
            if len(self._cache) >= 2:  # batches move forward, so the oldest is done with
                del self._cache[next(iter(self._cache))]
            b = int(self.blocks[j])
            size = int(self.starts[j + 1] - self.starts[j])
            self._cache[j] = b * self.block + np.random.default_rng([self.seed, self.epoch, b]).permutation(size)
        return self._cache[j]

    def __getitem__(self, s: slice) -> np.ndarray:
        lo, hi, step = s.indices(self.n)
        if step != 1:
            raise ValueError("a block-shuffled order is read in contiguous slices")
        parts = []
        j = int(np.searchsorted(self.starts, lo, side="right")) - 1
        while lo < hi:
            end = min(hi, int(self.starts[j + 1]))
            parts.append(self._windows(j)[lo - self.starts[j]:end - self.starts[j]])
            lo, j = end, j + 1
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)




class _Blocks:
    """A chat epoch's order: its blocks, each a run of kept-conversation indices; a slice is a list of blocks."""

    def __init__(self, convs: np.ndarray, starts: np.ndarray) -> None:
        self.convs, self.starts = convs, starts  # the conversations block by block; where each block starts

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, s: slice) -> list[np.ndarray]:
        lo, hi, _ = s.indices(len(self))
        return [self.convs[self.starts[j]:self.starts[j + 1]] for j in range(lo, hi)]

    def shuffled(self, rng: np.random.Generator) -> _Blocks:
        """The same blocks in a random order."""
        counts = np.diff(self.starts)
        perm = rng.permutation(len(counts))
        new_counts = counts[perm]
        new_starts = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(new_counts, out=new_starts[1:])
        # Entry i of the new order is entry (old start of its block) + (i - new start of its block).
        shift = np.repeat(self.starts[:-1][perm] - new_starts[:-1], new_counts)
        return _Blocks(self.convs[np.arange(len(self.convs)) + shift], new_starts)


def iter_eval_batches(data: PackedData, batch_size: int, seq_len: int,
                      max_batches: int | None = None) -> Iterator[Batch]:
    """The split's windows (or, for chat data, blocks of its conversations in file order; for preference
    data, its pairs in file order) in order, batch_size at a time; the same batches on every call.

    The last batch holds the remaining units and may be smaller, so weight a
    mean by its number of targets. max_batches stops early (the first batches, always).
    """
    _check_positive(batch_size=batch_size, seq_len=seq_len)
    pin = torch.cuda.is_available()
    units = unit_kind(data, seq_len)
    order = units.file_order()
    if len(order) == 0:
        raise UserError(f"{data.data_dir} ({data.split}): {units.empty()}")
    for i, start in enumerate(range(0, len(order), batch_size)):
        if max_batches is not None and i >= max_batches:
            return
        yield units.batch([order[start:start + batch_size]], pin)
