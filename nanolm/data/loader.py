"""Training batches from the token shards of a prepared data directory (nanolm/data/shards.py).

Every batch is a `Batch`: inputs x, next-token targets y (-1 where no loss is
taken) and, for chat data, each token's position in its conversation and a
segment id per conversation, so that a row can hold several conversations
that do not see each other; for preference data, rows in (chosen, rejected)
pairs.

What a unit is, and how an epoch of units is ordered and batched, is the data
kind's (`UnitKind`, given by the kind's class: nanolm/data/kinds/): windows
of text (text.py), blocks of packed conversations (chat.py), preference pairs
(pairs.py), RL prompts (prompts.py) or input and output blocks (blocks.py).
The one `Loader` and `iter_eval_batches` drive any of them.

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
itself.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch

from nanolm.data import kinds
from nanolm.data.kinds.base import Order, UnitKind
from nanolm.data.shards import MANIFEST, Batch, PackedData
from nanolm.errors import UserError


def unit_kind(data: PackedData, seq_len: int) -> UnitKind:
    """The units of a split at seq_len, of the kind its data is."""
    return kinds.get(data.kind, str(data.data_dir / MANIFEST)).units(data, seq_len)


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
