"""Where training batches come from: one prepared data set, a curriculum of several, or a weighted mixture.

`DataStream` stands between the training loop and the `Loader`s, one per
data set, each with its own global stream of units (windows for text, blocks
for chat data, pairs for preference data; see nanolm/data/loader.py). For a
single data set (`data.path`) it is that set's Loader, unchanged: the same
batches, the same `describe()` and the same `state_dict()`.

With `data.sets`, every `next_batch()` takes one micro-batch from one set.
Which set is a decision every rank must make alike, so it is made from
global state only: a call of `next_batch()` on each of world_size ranks
takes batch_size * world_size units of the chosen set's stream (rank r the
r-th batch_size of them), and the stream counts, per set, the units so
taken (`units`). Per-rank token counts play no part (preference batches
differ in width between ranks).

Curriculum (`data.mode = "curriculum"`): the sets are used in order. A
set's budget, in units, is `epochs * units in its epoch 0` (fractions of an
epoch allowed; a chat epoch can differ from epoch 0 by a few blocks) or
`tokens * units per epoch / tokens per epoch`: for text and chat data a unit
is seq_len input positions, so that is tokens / seq_len; for preference
pairs a token is an input position with a target (padding not counted), so
a pair counts as the set's mean real tokens per pair. The budget is rounded
up to whole optimizer steps of batch_size * grad_accum units (grad_accum
counting the micro-batches of a step over all ranks, as train.grad_accum
does): a set is done at the first optimizer-step boundary at or after its
budget, so it takes less than one step's units more than asked. This
deviates from switching at a micro-batch boundary on purpose: every step's
batches come from one set, and the switch falls on the same unit whatever
the number of processes, so 2 processes train as 1 does (as with one data
set) and a resume on another number of processes switches where the first
run would have. The last set may have no budget: it is then used until the
run stops. If it has one, the stream is `exhausted` once that is spent, and
the loop stops after that step ("data_done").

Mixture (`data.mode = "mixture"`): the stream is a sequence of slots of
batch_size units, numbered over all ranks (a call of `next_batch()` on each
of world_size ranks takes the next world_size slots, rank r the r-th). Each
slot comes from the set that is furthest behind its share, i.e. with the
largest w_i * (n + b) - units_i, where w_i is its weight over the sum of the
weights, n the units taken from all sets so far and b = batch_size (ties go
to the earlier set). This is a smooth weighted round-robin: after any number
of slots, each set's count is within one slot of its exact share, and the
order depends on nothing but the weights, computed in exact fractions. Every
set keeps its own Loader stream, which continues where it left off whenever
the set comes up again. Since the slots and their sets do not depend on the
number of processes, 2 processes take the batches 1 process takes with twice
the accumulation, and a resume on another number of processes continues the
same sequence. A step of several slots mixes the sets.

Set i's Loader is seeded with train.seed + i, so a directory listed twice is
read in another order the second time. The state (`state_dict`) holds each
set's Loader state (global, so a resume may use another number of processes)
and its units, and the curriculum's current set; `load_state_dict` refuses a
state made for other sets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from nanolm.config import Config, DataConfig, DataSetConfig, default_set_name
from nanolm.data.loader import Loader
from nanolm.data import kinds
from nanolm.data.shards import MANIFEST, Batch, Manifest, PackedData
from nanolm.errors import UserError


@dataclass
class SetStream:
    """One data set of a stream: its train split, its Loader and what the stream may take of it."""

    name: str
    path: str
    data: PackedData
    loader: Loader
    budget: int | None  # curriculum: units to take before the next set; None = until the run stops
    budget_text: str  # the budget as configured, e.g. "2 epochs" or "5,000,000 tokens"
    weight: Fraction  # mixture: share of the micro-batches (the weights sum to 1); curriculum: 1

    @property
    def unit_name(self) -> str:
        """What the set's units are called: windows, blocks or pairs."""
        return self.loader.units.name


def _budget(spec: DataSetConfig, loader: Loader, step: int) -> tuple[int | None, str]:
    """A set's budget in units, rounded up to whole optimizer steps of `step` units (see module doc), and as
    configured; (None, "") when it has none."""
    if spec.epochs:
        units = Fraction(repr(spec.epochs)) * loader.epoch_windows
        text = f"{spec.epochs:g} epoch{'' if spec.epochs == 1 else 's'}"
    elif spec.tokens:
        units = Fraction(spec.tokens * loader.epoch_windows, loader.tokens_per_epoch)
        text = f"{spec.tokens:,} tokens"
    else:
        return None, ""
    return max(1, math.ceil(units / step)) * step, text


class DataStream:
    """Training batches for one rank from one data set, a curriculum or a mixture (see module doc)."""

    def __init__(self, data: DataConfig, batch_size: int, seq_len: int, *, grad_accum: int = 1, seed: int = 0,
                 rank: int = 0, world_size: int = 1, pin_memory: bool | None = None) -> None:
        """grad_accum: micro-batches per optimizer step over all ranks (train.grad_accum); a curriculum moves
        to its next set only between optimizer steps."""
        if data.sets:
            specs, self.single = data.sets, False
        elif data.path:
            specs, self.single = (DataSetConfig(path=data.path, name=default_set_name(data.path)),), True
        else:
            raise UserError("data.path is empty; pass --data <dir made by `nanolm prepare`>")
        self.mode = "single" if self.single else data.mode
        self.batch_size = batch_size
        self.grad_accum = grad_accum
        self.seq_len = seq_len
        self.step_units = batch_size * world_size  # units of one set that one next_batch() on every rank takes
        self.rank, self.world_size = rank, world_size
        parts = [PackedData(Path(s.path), "train") for s in specs]
        set_kinds = [kinds.get(p.kind, str(p.data_dir / MANIFEST)) for p in parts]
        first = parts[0]
        for s, p, kind in zip(specs[1:], parts[1:], set_kinds[1:]):
            fp, fp0 = p.manifest.tokenizer.fingerprint, first.manifest.tokenizer.fingerprint
            if fp != fp0:
                raise UserError(f"data.sets: {specs[0].path} and {s.path} were prepared with different tokenizers "
                                f"({fp0[:12]} and {fp[:12]}); prepare every set with the same tokenizer")
            refusal = kinds.mix_refusal(set_kinds[0], kind)  # which kinds mix is the kinds' to say
            if refusal:
                raise UserError(f"data.sets: {specs[0].path} holds {first.kind} data and {s.path} {p.kind} data; "
                                f"{refusal}")
        total_weight = sum(Fraction(repr(s.weight)) for s in specs)
        self.sets: list[SetStream] = []
        for i, (s, p) in enumerate(zip(specs, parts)):
            loader = Loader(p, batch_size, seq_len, seed=seed + i, rank=rank, world_size=world_size,
                            pin_memory=pin_memory)
            budget, text = _budget(s, loader, batch_size * grad_accum) if data.mode == "curriculum" else (None, "")
            weight = Fraction(repr(s.weight)) / total_weight if data.mode == "mixture" else Fraction(1)
            self.sets.append(SetStream(s.name, s.path, p, loader, budget, text, weight))
        # The kind the stream trains as (a text/chat mix: chat), and whether its batches may carry segments (then
        # the attention must keep them apart).
        self.kind: str = kinds.stream_kind(set_kinds).name
        self.segments: bool = any(k.segments for k in set_kinds)
        self.vocab_size: int = first.vocab_size
        self.manifest: Manifest = first.manifest  # tokenizer info, shared by all sets
        self.n_tokens: int = sum(p.n_tokens for p in parts)
        self.units = [0] * len(self.sets)  # units taken from each set so far, over all ranks
        self.active = 0  # curriculum: the set the next batch comes from
        self.exhausted = False  # curriculum: the last set's budget is spent
        self._last: tuple[int, int, int] | None = None  # (set, epoch, cursor) where the last batch started
        self._events: list[dict[str, Any]] = []

    @classmethod
    def from_config(cls, cfg: Config, rank: int = 0, world_size: int = 1) -> DataStream:
        tc = cfg.train
        return cls(cfg.data, tc.batch_size, tc.seq_len, grad_accum=tc.grad_accum, seed=tc.seed, rank=rank,
                   world_size=world_size)

    # -------------------------------------------------------------------- what the loop reads

    @property
    def current(self) -> SetStream:
        """The set the next batch comes from."""
        return self.sets[self._pick()]

    @property
    def epoch_windows(self) -> int:
        """Units in epoch 0 of the current set (for one data set: the Loader's epoch_windows)."""
        return self.current.loader.epoch_windows

    def describe(self) -> list[str]:
        """Lines on what the stream holds: for one data set, the Loader's line; for several, one line per set
        with its budget or weight and how many optimizer steps an epoch of it lasts."""
        if self.single:
            return [self.sets[0].loader.describe()]
        lines, per_step = [], self.batch_size * self.grad_accum  # units per optimizer step
        for i, s in enumerate(self.sets):
            ew = s.loader.epoch_windows
            if self.mode == "mixture":
                plan = f"{float(s.weight):.1%} of the micro-batches (by weight)"
            elif s.budget is None:
                plan = "until the run stops"
            else:
                epochs = "" if s.budget_text.endswith(("epoch", "epochs")) else f" ({s.budget / ew:.2f} epochs)"
                plan = (f"{s.budget_text} = {s.budget:,} {s.unit_name}{epochs} = {s.budget // per_step:,} steps"
                        + (f", then {self.sets[i + 1].name!r}" if i + 1 < len(self.sets) else ", then stop"))
            share = float(s.weight) if self.mode == "mixture" else 1.0
            per_epoch = f" | one epoch = {ew / (per_step * share):.1f} steps"
            lines.append(f"{i + 1}/{len(self.sets)} {s.name!r} ({s.data.kind}, {s.path}): {plan} | "
                         f"{s.loader.describe()}{per_epoch}")
        return lines

    def position(self) -> dict[str, Any]:
        """Where the last batch came from: its set, and the epoch and cursor (into that epoch's order) of that
        set's global stream where the batch started; before the first batch, where it will come from. With
        several sets, also `units`: the units taken from that set so far (all ranks)."""
        if self._last is None:
            i = self._pick()
            loader = self.sets[i].loader
            where = (i, loader.epoch, loader.cursor)
        else:
            where = self._last
        i, epoch, cursor = where
        pos = {"set": self.sets[i].name, "set_index": i, "epoch": epoch, "cursor": cursor}
        if not self.single:
            pos["units"] = self.units[i]
        return pos

    def pop_events(self) -> list[dict[str, Any]]:
        """Curriculum moves since the last call, oldest first: {"message", "done", "next", "units", "epochs"}
        (next is None when the curriculum is over)."""
        events, self._events = self._events, []
        return events

    def val_sets(self, seq_len: int | None = None) -> list[tuple[str, PackedData]]:
        """(name, val split) of each set whose val split holds more than seq_len tokens."""
        out = []
        for s in self.sets:
            try:
                val = PackedData(s.data.data_dir, "val")
            except UserError:
                continue
            if val.n_tokens > (seq_len or self.seq_len):
                out.append((s.name, val))
        return out

    def combine_eval(self, results: dict[str, dict[str, float]]) -> dict[str, float]:
        """Per-set validation results {name: {"val_loss": ...}} -> one record: each metric as `<key>/<name>`
        and, for the metrics every set has, their mean (in a mixture weighted by the sets' weights) as `<key>`.
        One data set: its results unchanged."""
        results = {name: r for name, r in results.items() if r}
        if self.single or not results:
            return next(iter(results.values()), {})
        weights = {s.name: float(s.weight) for s in self.sets}
        common = [k for k in next(iter(results.values())) if all(k in r for r in results.values())]
        total = sum(weights[name] for name in results)
        out = {k: sum(weights[name] * r[k] for name, r in results.items()) / total for k in common}
        for name, r in results.items():
            out.update({f"{k}/{name}": v for k, v in r.items()})
        return out

    # -------------------------------------------------------------------- batches

    def _pick(self, units: list[int] | None = None) -> int:
        """The set the next batch (a mixture: the next slot) comes from, given the units taken so far."""
        if self.mode != "mixture":
            return self.active
        units = self.units if units is None else units
        after = sum(units) + self.batch_size
        return max(range(len(self.sets)), key=lambda i: (self.sets[i].weight * after - units[i], -i))

    def next_batch(self) -> Batch:
        """This rank's next micro-batch, from the set whose turn it is (see module doc)."""
        if self.mode == "mixture":
            return self._next_slot()
        i = self._pick()
        loader = self.sets[i].loader
        self._last = (i, loader.epoch, loader.cursor)
        batch = loader.next_batch()
        self.units[i] += self.step_units
        if self.mode == "curriculum":
            self._advance()
        return batch

    def _next_slot(self) -> Batch:
        """Mixture: the sets of the world_size slots this call takes on all ranks, in slot order; this rank
        reads its own slot, at the offset that the earlier slots of its set in this call leave, and every
        set's stream moves on by the units its slots took."""
        taken = [0] * len(self.sets)  # units of each set taken by the earlier slots of this call
        units, mine = list(self.units), None
        for r in range(self.world_size):
            i = self._pick(units)
            if r == self.rank:
                mine = (i, taken[i])
            if r == 0:  # the position logged (by rank 0): where slot 0 of this call starts in its set
                loader = self.sets[i].loader
                self._last = (i, loader.epoch, loader.cursor)
            units[i] += self.batch_size
            taken[i] += self.batch_size
        i, offset = mine  # type: ignore[misc]
        batch = self.sets[i].loader.peek(offset)
        for j, n in enumerate(taken):
            if n:
                self.sets[j].loader.skip(n)
        self.units = units
        return batch

    def _advance(self) -> None:
        """Move on once the current set's budget is spent: to the next set, or mark the stream exhausted."""
        s = self.sets[self.active]
        if s.budget is None or self.units[self.active] < s.budget or self.exhausted:
            return
        units = self.units[self.active]
        nxt = self.sets[self.active + 1].name if self.active + 1 < len(self.sets) else None
        epochs = units / s.loader.epoch_windows
        tokens = units * s.loader.tokens_per_epoch // s.loader.epoch_windows
        message = (f"curriculum: {s.name!r} done ({epochs:.2f} epochs, {units:,} {s.unit_name}, "
                   f"{tokens:,} tokens; budget {s.budget_text}); " + (f"next {nxt!r}" if nxt else "the last set"))
        self._events.append({"message": message, "done": s.name, "next": nxt, "units": units, "epochs": epochs})
        if nxt is None:
            self.exhausted = True
        else:
            self.active += 1

    # -------------------------------------------------------------------- resume

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable and the same on every rank: for one data set its Loader's state; for several,
        each set's Loader state and units, the mode and the curriculum's current set."""
        if self.single:
            return self.sets[0].loader.state_dict()
        return {"mode": self.mode, "active": self.active, "last": list(self._last) if self._last else None,
                "sets": [{"name": s.name, "path": s.path, "units": self.units[i], "loader": s.loader.state_dict()}
                         for i, s in enumerate(self.sets)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict` (saved by any number of ranks); refused when it is for other sets."""
        names = [s.name for s in self.sets]
        if self.single:
            if "sets" in state:
                raise UserError(f"the saved data position is for data.sets {[e.get('name') for e in state['sets']]}, "
                                f"but this run reads one data set (data.path); resume with the same data.sets, "
                                "or start a new run")
            self.sets[0].loader.load_state_dict(state)
            return
        if "sets" not in state:
            raise UserError(f"the saved data position is for one data set (data.path), but this run reads "
                            f"data.sets {names}; resume with the same data, or start a new run")
        saved = [e.get("name") for e in state["sets"]]
        if saved != names or state.get("mode") != self.mode:
            raise UserError(f"the saved data position is for the {state.get('mode')} {saved}, but this run has the "
                            f"{self.mode} {names}; resume with the same data.sets and data.mode, or start a new run")
        try:
            units = [int(e["units"]) for e in state["sets"]]
            active = int(state["active"])
            last = tuple(int(v) for v in state["last"]) if state.get("last") is not None else None
        except (KeyError, TypeError, ValueError):
            raise UserError("the saved data position is damaged (no units/active set); start a new run") from None
        if not (0 <= active < len(self.sets)) or min(units) < 0 or (last is not None and len(last) != 3):
            raise UserError(f"the saved data position (set {active}, units {units}) is out of range; "
                            "the checkpoint's state is damaged")
        for s, e in zip(self.sets, state["sets"]):
            s.loader.load_state_dict(e["loader"])
        self.units, self.active, self._last = units, active, last  # type: ignore[assignment]
        self.exhausted, self._events = False, []
        s = self.sets[active]
        if active == len(self.sets) - 1 and s.budget is not None and units[active] >= s.budget:
            self.exhausted = True  # stopped with the curriculum over: nothing left to report
        elif self.mode == "curriculum":
            self._advance()  # a budget lowered since the save moves on at once (and says so)
