"""Packed training batches from the token shards of a prepared data directory (nanolm/data/shards.py).

Every batch is a `Batch`: inputs x, next-token targets y (-1 where no loss is
taken) and, for chat data, each token's position in its conversation and a
segment id per conversation, so that a row can hold several conversations
that do not see each other; for preference data, rows in (chosen, rejected)
pairs.

Text data. A split's shards are cut into windows of seq_len + 1 tokens at
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

Chat data (prepared with `format="chat"`). The unit is a block of seq_len + 1
tokens holding whole conversations (each without its trailing end-of-text
token), padded at the end with id 0. A conversation longer than the block is
cut by `fit_conversation`, ChatML's truncation policy, as `nanolm prepare`
cuts it (one that cannot be cut to fit is left out; the loader says how many). Epoch e
shuffles the conversations with `np.random.default_rng([seed, e])`, packs them
into blocks with `pack_blocks` (over consecutive chunks of `PACK_CHUNK`
conversations), then shuffles the blocks with the same generator. So each
epoch sees every conversation once, in other company, and epochs can differ
by a few blocks; `Loader.describe()` tells how full the blocks are. In a row,
seg numbers the conversations 0, 1, ... (the padding gets the next number),
pos restarts at 0 with each of them, and y is -1 where the loss mask of the
target token is 0 (system and user turns, template scaffolding, padding) and
at the last token of every segment, so nothing predicts across a boundary.

Preference data (prepared with `format="dpo"`: each pair is two adjacent
documents, chosen then rejected, the mask on their final replies). The unit is
a pair, and batch_size counts pairs: a batch has 2 * batch_size rows, row 2i
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

The order of units (windows, blocks or pairs) is one global stream, the same
on every process: epoch 0's units in its order, then epoch 1's, and so on. A
step (`next_batch()` called once on each of world_size ranks) takes the next
batch_size * world_size units of the stream; rank r takes the r-th batch_size
of them. A batch at an epoch boundary takes the end of one epoch and the start
of the next, so within an epoch no unit is seen twice and none is skipped. The
state (`epoch`, `cursor` into the epoch; the epoch's order, for chat data its
blocks, is made again from the seed) is global, so a run can resume with
another number of processes, or another batch size, and continue the same
stream.
"""

from __future__ import annotations

import bisect
from typing import Any, Iterator

import numpy as np
import torch

from nanolm.data.chatml import fit_conversation, fit_pair
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


class _Conversations:
    """The conversations of a chat split, fitted to blocks of seq_len + 1 tokens, and batch assembly."""

    def __init__(self, data: PackedData, seq_len: int) -> None:
        assert data.masks is not None
        self.data = data
        self.block = seq_len + 1
        shard, start, length = data.documents()
        fitted = length.copy()
        for c in np.flatnonzero(length > self.block).tolist():
            cut = fit_conversation(*self._raw(int(shard[c]), int(start[c]), int(length[c])), self.block)
            fitted[c] = 0 if cut is None else len(cut[0])
        self.n_total = len(length)
        self.n_cut = int(((length > self.block) & (fitted > 0)).sum())
        self.kept = np.flatnonzero(fitted > 0)  # conversation ids that are trained on
        self.n_dropped = self.n_total - len(self.kept)
        if len(self.kept) == 0:
            raise UserError(f"{data.data_dir} ({data.split}): none of its {self.n_total} conversations fits in "
                            f"seq_len+1 = {self.block} tokens with a reply token left; raise seq_len, or run "
                            f"`nanolm prepare --format chat --max-tokens {self.block}` on shorter conversations")
        self.shard, self.start, self.length = shard, start, length
        self.lengths = fitted[self.kept]  # fitted length of each kept conversation
        self.n_real = int(self.lengths.sum())
        self._positions = np.arange(self.block, dtype=np.int64)

    def _raw(self, shard: int, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        ids = self.data.check_ids(np.asarray(self.data.shards[shard][start:start + length], dtype=np.int64), shard)
        return ids, np.asarray(self.data.masks[shard][start:start + length])  # type: ignore[index]

    def tokens(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Ids and mask of kept conversation k, fitted to the block."""
        c = int(self.kept[k])
        ids, mask = self._raw(int(self.shard[c]), int(self.start[c]), int(self.length[c]))
        if len(ids) > self.block:
            ids, mask = fit_conversation(ids, mask, self.block)  # type: ignore[misc]
        return ids, mask

    def plan(self, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Blocks of the kept conversations taken in `order`: (conversations block by block, block starts)."""
        packed, starts = pack_blocks(self.lengths[order], self.block)
        return order[packed], starts

    def fill(self, n_blocks: int) -> float:
        """Fraction of the positions of n_blocks blocks that hold a real token."""
        return self.n_real / (n_blocks * self.block)

    def batch(self, blocks: list[np.ndarray], pin: bool) -> Batch:
        """Rows of x, y, pos, seg from blocks given as arrays of kept-conversation indices."""
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
        y = ids[:, 1:].copy()
        y[mask[:, 1:] == 0] = IGNORE_INDEX
        y[seg[:, 1:] != seg[:, :-1]] = IGNORE_INDEX  # the last token of a segment predicts nothing
        batch = Batch(torch.from_numpy(np.ascontiguousarray(ids[:, :-1])), torch.from_numpy(y),
                      torch.from_numpy(np.ascontiguousarray(pos[:, :-1])),
                      torch.from_numpy(np.ascontiguousarray(seg[:, :-1])))
        return batch.pin_memory() if pin else batch

    def describe(self, n_blocks: int) -> str:
        cut = (f"; {self.n_cut} longer than {self.block} tokens cut to fit" if self.n_cut else "") + \
              (f", {self.n_dropped} left out (no reply token would fit)" if self.n_dropped else "")
        hint = "" if self.fill(n_blocks) >= 0.97 else " (the conversations are long for this seq_len: few fit together)"
        return (f"{len(self.kept)} conversations ({self.n_real:,} tokens) packed into {n_blocks} blocks of "
                f"seq_len+1 = {self.block}: {100 * self.fill(n_blocks):.1f}% of positions hold a real token"
                f"{hint}{cut}")


class _Pairs:
    """The preference pairs of a dpo split, fitted to seq_len + 1 tokens a conversation, and batch assembly."""

    def __init__(self, data: PackedData, seq_len: int) -> None:
        assert data.masks is not None
        self.data = data
        self.block = seq_len + 1
        self.seq_len = seq_len
        shard, start, length = data.documents()
        self.shard, self.start, self.length = shard, start, length
        fitted = length.reshape(-1, 2).copy()  # (pairs, 2): chosen, rejected
        for p in np.flatnonzero(fitted.max(axis=1) > self.block).tolist():
            cut = fit_pair(self._raw(2 * p), self._raw(2 * p + 1), self.block)
            fitted[p] = (0, 0) if cut is None else (len(cut[0][0]), len(cut[1][0]))
        self.n_total = len(fitted)
        self.n_cut = int(((fitted.max(axis=1) > 0) & (length.reshape(-1, 2).max(axis=1) > self.block)).sum())
        self.kept = np.flatnonzero(fitted[:, 0] > 0)  # pair ids that are trained on
        self.n_dropped = self.n_total - len(self.kept)
        if len(self.kept) == 0:
            raise UserError(f"{data.data_dir} ({data.split}): none of its {self.n_total} preference pairs fits in "
                            f"seq_len+1 = {self.block} tokens a conversation with a reply token left; raise seq_len, "
                            f"or run `nanolm prepare --format dpo --max-tokens {self.block}` on shorter pairs")
        self.lengths = fitted[self.kept]  # (kept pairs, 2) fitted lengths
        self.n_real = int((self.lengths - 1).sum())  # positions whose next token is in their conversation

    def _raw(self, doc: int) -> tuple[np.ndarray, np.ndarray]:
        shard, start, length = int(self.shard[doc]), int(self.start[doc]), int(self.length[doc])
        ids = self.data.check_ids(np.asarray(self.data.shards[shard][start:start + length], dtype=np.int64), shard)
        return ids, np.asarray(self.data.masks[shard][start:start + length])  # type: ignore[index]

    def tokens(self, k: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """(ids, mask) of the chosen and rejected conversation of kept pair k, fitted to the block."""
        p = int(self.kept[k])
        chosen, rejected = self._raw(2 * p), self._raw(2 * p + 1)
        return fit_pair(chosen, rejected, self.block)  # type: ignore[return-value]

    def group(self, order: np.ndarray) -> np.ndarray:
        """The kept pairs in `order`, each run of LENGTH_CHUNK sorted by its longer conversation (stable)."""
        longest = self.lengths.max(axis=1)
        out = order.copy()
        for c in range(0, len(out), LENGTH_CHUNK):
            run = out[c:c + LENGTH_CHUNK]
            out[c:c + LENGTH_CHUNK] = run[np.argsort(longest[run], kind="stable")]
        return out

    def width(self, pairs: np.ndarray) -> int:
        """Columns of a batch of these kept pairs: the longest row, rounded up to PAD_MULTIPLE, at most seq_len."""
        longest = int(self.lengths[pairs].max()) - 1
        return min(self.seq_len, -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE)

    def batch(self, pairs: np.ndarray, pin: bool) -> Batch:
        """Rows 2i, 2i + 1: the chosen and rejected conversation of kept pair pairs[i], padded with id 0,
        target -1 (see `Batch`)."""
        rows, width = 2 * len(pairs), self.width(pairs)
        ids = np.zeros((rows, width + 1), dtype=np.int64)  # padding is id 0, mask 0
        mask = np.zeros((rows, width + 1), dtype=np.uint8)
        for i, k in enumerate(pairs.tolist()):
            for j, (t, m) in enumerate(self.tokens(k)):
                ids[2 * i + j, :len(t)], mask[2 * i + j, :len(t)] = t, m
        y = ids[:, 1:].copy()
        y[mask[:, 1:] == 0] = IGNORE_INDEX
        batch = Batch(torch.from_numpy(np.ascontiguousarray(ids[:, :-1])), torch.from_numpy(y), pairs=True)
        return batch.pin_memory() if pin else batch

    def padding(self, order: np.ndarray, batch_size: int) -> float:
        """Fraction of the positions of the batches of batch_size pairs taken in `order` that are padding."""
        starts = np.arange(0, len(order), batch_size)
        longest = np.maximum.reduceat(self.lengths.max(axis=1)[order], starts) - 1  # per batch
        widths = np.minimum(self.seq_len, -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE)  # as width()
        rows = 2 * np.diff(np.r_[starts, len(order)])
        return 1 - int((self.lengths[order] - 1).sum()) / int((rows * widths).sum())

    def describe(self, order: np.ndarray, batch_size: int) -> str:
        cut = (f"; {self.n_cut} with a conversation longer than {self.block} tokens cut to fit" if self.n_cut else "") \
            + (f", {self.n_dropped} left out (no reply token would fit)" if self.n_dropped else "")
        return (f"{len(self.kept)} preference pairs ({self.n_real:,} tokens to predict), {batch_size} a batch as "
                f"{2 * batch_size} rows padded to the longest (a multiple of {PAD_MULTIPLE}, at most seq_len "
                f"{self.seq_len}): {100 * self.padding(order, batch_size):.1f}% of positions are padding{cut}")


def _check_positive(**kw: int) -> None:
    for name, v in kw.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise UserError(f"{name}={v!r}: must be a positive integer")


def _text_batch(tokens: np.ndarray, pin: bool) -> Batch:
    x = torch.from_numpy(np.ascontiguousarray(tokens[:, :-1]))
    y = torch.from_numpy(np.ascontiguousarray(tokens[:, 1:]))
    batch = Batch(x, y)
    return batch.pin_memory() if pin else batch


class Loader:
    """Shuffled packed batches for one rank, from the global stream of windows or blocks (see module doc)."""

    def __init__(self, data: PackedData, batch_size: int, seq_len: int, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1, pin_memory: bool | None = None) -> None:
        _check_positive(batch_size=batch_size, seq_len=seq_len, world_size=world_size)
        if not 0 <= rank < world_size:
            raise UserError(f"rank={rank}: must be in [0, world_size={world_size})")
        self.data = data
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.epoch = 0
        self.cursor = 0  # position in this epoch's order of the next step's first unit
        self._orders: dict[int, Any] = {}  # epoch -> window permutation (text), block plan (chat), pairs (dpo)
        self._chat = _Conversations(data, seq_len) if data.is_chat else None
        self._pairs = _Pairs(data, seq_len) if data.is_dpo else None
        self._n_windows = int(data.n_windows(seq_len).sum()) if data.kind == "text" else 0
        # Units (windows, blocks or pairs) in epoch 0; chat epochs can differ by a few blocks.
        self.epoch_windows: int = self._units(0)
        # Input positions per epoch (preference data: those with a next token, padding left out).
        self.tokens_per_epoch: int = self._pairs.n_real if self._pairs else self.epoch_windows * seq_len
        step = batch_size * world_size
        if self.epoch_windows < step:
            if self._pairs is not None:
                raise UserError(f"{data.data_dir} ({data.split}): {self.epoch_windows} preference pairs, but a step "
                                f"takes batch_size x world_size = {step} pairs; prepare more pairs, or lower "
                                "batch_size")
            if self._chat is not None:
                raise UserError(f"{data.data_dir} ({data.split}): {len(self._chat.kept)} conversations make "
                                f"{self.epoch_windows} blocks of seq_len+1 = {seq_len + 1} tokens, but a step takes "
                                f"batch_size x world_size = {step}; prepare more conversations, or lower batch_size")
            # One shard needs step windows of seq_len tokens, plus the first input token.
            raise UserError(
                f"{data.data_dir} ({data.split}): {data.n_tokens} tokens make {self.epoch_windows} windows of "
                f"seq_len+1 = {seq_len + 1} tokens, but a step takes batch_size x world_size = {step}; it needs at "
                f"least {step * seq_len + 1} tokens: prepare more text, or lower batch_size or seq_len")

    def _order(self, epoch: int) -> Any:
        if epoch not in self._orders:
            self._orders = {e: p for e, p in self._orders.items() if e >= self.epoch}  # drop past epochs
            rng = np.random.default_rng([self.seed, epoch])
            if self._pairs is not None:
                self._orders[epoch] = self._pairs.group(rng.permutation(len(self._pairs.kept)))
            elif self._chat is None:
                n = self._n_windows
                self._orders[epoch] = rng.permutation(n) if n <= SHUFFLE_BLOCK else \
                    _BlockShuffle(n, SHUFFLE_BLOCK, self.seed, epoch, rng)
            else:
                convs, starts = self._chat.plan(rng.permutation(len(self._chat.kept)))
                self._orders[epoch] = _shuffle_blocks(convs, starts, rng)
        return self._orders[epoch]

    def _units(self, epoch: int) -> int:
        if self._pairs is not None:
            return len(self._pairs.kept)
        if self._chat is None:
            return self._n_windows
        return len(self._order(epoch)[1]) - 1

    def _ranges(self, start: int, count: int) -> list[tuple[int, int, int]]:
        """(epoch, lo, hi): the units at positions start .. start+count-1 of the stream from (self.epoch, 0)."""
        out, epoch = [], self.epoch
        while count > 0:
            n = self._units(epoch)
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
        if self._pairs is not None:
            return self._pairs.describe(self._order(0), self.batch_size)
        if self._chat is None:
            return (f"{self.epoch_windows} windows of seq_len+1 = {self.seq_len + 1} tokens per epoch "
                    f"from {self.data.n_tokens:,} tokens")
        return self._chat.describe(self.epoch_windows)

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
        if self._pairs is not None:
            pairs = np.concatenate([self._order(e)[lo:hi] for e, lo, hi in ranges])
            return self._pairs.batch(pairs, self.pin_memory)
        if self._chat is None:
            windows = np.concatenate([self._order(e)[lo:hi] for e, lo, hi in ranges])
            return _text_batch(self.data.gather(windows, self.seq_len), self.pin_memory)
        blocks = []
        for e, lo, hi in ranges:
            convs, starts = self._order(e)
            blocks += [convs[starts[j]:starts[j + 1]] for j in range(lo, hi)]
        return self._chat.batch(blocks, self.pin_memory)

    def skip(self, n: int) -> None:
        """Move the stream position n units on (into the next epochs as needed)."""
        self.cursor += n
        while self.cursor >= self._units(self.epoch):
            self.cursor -= self._units(self.epoch)
            self.epoch += 1

    def state_dict(self) -> dict[str, Any]:
        """The global stream position (identical on every rank), JSON-serialisable."""
        state = {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "seq_len": self.seq_len}
        if self._pairs is not None:
            state["n_pairs"] = self._pairs.n_total
        elif self._chat is None:
            state["epoch_windows"] = self.epoch_windows
        else:
            state["n_conversations"] = self._chat.n_total
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream saved by `state_dict` (from any number of ranks, any batch size)."""
        if self._pairs is not None:
            if state.get("seq_len") != self.seq_len or state.get("n_pairs") != self._pairs.n_total:
                raise UserError(f"the saved data position is for {state.get('n_pairs')} preference pairs at seq_len "
                                f"{state.get('seq_len')}, but {self.data.data_dir} ({self.data.split}) has "
                                f"{self._pairs.n_total} pairs at seq_len {self.seq_len}; resume with the same "
                                "prepared data and seq_len, or start a new run")
        elif self._chat is None:
            if state.get("seq_len") != self.seq_len or state.get("epoch_windows") != self.epoch_windows:
                raise UserError(f"the saved data position is for {state.get('epoch_windows')} windows of seq_len "
                                f"{state.get('seq_len')}, but {self.data.data_dir} ({self.data.split}) has "
                                f"{self.epoch_windows} windows of seq_len {self.seq_len}; resume with the same "
                                "prepared data and seq_len, or start a new run")
        elif state.get("seq_len") != self.seq_len or state.get("n_conversations") != self._chat.n_total:
            raise UserError(f"the saved data position is for {state.get('n_conversations')} conversations at seq_len "
                            f"{state.get('seq_len')}, but {self.data.data_dir} ({self.data.split}) has "
                            f"{self._chat.n_total} conversations at seq_len {self.seq_len}; resume with the same "
                            "prepared data and seq_len, or start a new run")
        cursor, epoch, seed = int(state["cursor"]), int(state["epoch"]), int(state["seed"])
        old = (self.seed, self.epoch, self._orders)
        self.seed, self.epoch, self._orders = seed, epoch, {}  # the stream is defined by the seed it started with
        if not (epoch >= 0 and 0 <= cursor < self._units(epoch)):
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


def _shuffle_blocks(convs: np.ndarray, starts: np.ndarray,
                    rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The same blocks in a random order: (conversations block by block, block starts)."""
    counts = np.diff(starts)
    perm = rng.permutation(len(counts))
    new_counts = counts[perm]
    new_starts = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(new_counts, out=new_starts[1:])
    # Entry i of the new order is entry (old start of its block) + (i - new start of its block).
    shift = np.repeat(starts[:-1][perm] - new_starts[:-1], new_counts)
    return convs[np.arange(len(convs)) + shift], new_starts


def iter_eval_batches(data: PackedData, batch_size: int, seq_len: int,
                      max_batches: int | None = None) -> Iterator[Batch]:
    """The split's windows (or, for chat data, blocks of its conversations in file order; for preference
    data, its pairs in file order) in order, batch_size at a time; the same batches on every call.

    The last batch holds the remaining units and may be smaller, so weight a
    mean by its number of targets. max_batches stops early (the first batches, always).
    """
    _check_positive(batch_size=batch_size, seq_len=seq_len)
    pin = torch.cuda.is_available()
    if data.is_dpo:
        pairs = _Pairs(data, seq_len)
        n = len(pairs.kept)
    elif data.is_chat:
        chat = _Conversations(data, seq_len)
        convs, starts = chat.plan(np.arange(len(chat.kept)))
        n = len(starts) - 1
    else:
        n = int(data.n_windows(seq_len).sum())
        if n == 0:
            raise UserError(f"{data.data_dir} ({data.split}): {data.n_tokens} tokens, fewer than one window of "
                            f"seq_len+1 = {seq_len + 1} in any shard; prepare more text or lower seq_len")
    for i, start in enumerate(range(0, n, batch_size)):
        if max_batches is not None and i >= max_batches:
            return
        stop = min(start + batch_size, n)
        if data.is_dpo:
            yield pairs.batch(np.arange(start, stop, dtype=np.int64), pin)
        elif data.is_chat:
            yield chat.batch([convs[starts[j]:starts[j + 1]] for j in range(start, stop)], pin)
        else:
            yield _text_batch(data.gather(np.arange(start, stop, dtype=np.int64), seq_len), pin)
