"""Packed training batches from memory-mapped token shards (`nanolm prepare` output).

A split's shards are cut into windows of seq_len + 1 tokens at stride seq_len
(window j of a shard covers tokens [j*T, j*T + T], T = seq_len): the inputs
x = window[:-1] and targets y = window[1:] of consecutive windows tile the
shard with no padding and no gap; the last (n - 1) % T tokens of each shard
are never a target. Documents run into each other, separated by their
end-of-text token, as in GPT-2/nanoGPT pretraining.

The order of windows is one global stream, the same on every process: epoch e
is the permutation `np.random.default_rng([seed, e]).permutation(N)` of the N
windows, and the stream is epoch 0's permutation, then epoch 1's, and so on.
A step (`next_batch()` called once on each of world_size ranks) takes the
next batch_size * world_size windows of the stream; rank r takes the r-th
batch_size of them. A batch at an epoch boundary takes the end of one epoch
and the start of the next, so within an epoch no window is seen twice and none
is skipped. The state (`epoch`, `cursor` into the epoch) is global, so a run
can resume with another number of processes, or another batch size, and
continue the same stream.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from nanolm.data.prepare import FORMAT_VERSION, MANIFEST
from nanolm.errors import UserError


class PackedData:
    """The shards of one split of a prepared data directory, memory-mapped read-only.

    shards[i] is a 1-D memmap of token ids; offsets[i] the uint64 document starts.
    """

    def __init__(self, data_dir: Path, split: str = "train", *, tokenizer_fingerprint: str | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.split = split
        manifest_path = self.data_dir / MANIFEST
        if not self.data_dir.is_dir():
            raise UserError(f"{self.data_dir}: no such data directory; run `nanolm prepare` to make it")
        if not manifest_path.is_file():
            raise UserError(f"{manifest_path}: not found, so {self.data_dir} holds no prepared data; "
                            "run `nanolm prepare` to make it")
        try:
            m = json.loads(manifest_path.read_text(encoding="utf-8"))
            version = m.get("version")
        except (ValueError, AttributeError):
            raise UserError(f"{manifest_path}: not a nanolm manifest; run `nanolm prepare` again") from None
        if version != FORMAT_VERSION:
            raise UserError(f"{manifest_path}: data format version {version!r}, this nanolm reads version "
                            f"{FORMAT_VERSION}; run `nanolm prepare` again")
        self.manifest: dict[str, Any] = m
        self.vocab_size: int = int(m["tokenizer"]["vocab_size"])
        self.dtype = np.dtype(m["dtype"])
        fingerprint = m["tokenizer"]["fingerprint"]
        if tokenizer_fingerprint is not None and tokenizer_fingerprint != fingerprint:
            raise UserError(f"{manifest_path}: data was tokenized with tokenizer {fingerprint[:16]} "
                            f"({m['tokenizer'].get('path')}) but the tokenizer in use is {tokenizer_fingerprint[:16]}; "
                            "use that tokenizer, or run `nanolm prepare` again with this one")
        entry = m["splits"].get(split)
        if not entry or not entry["shards"]:
            have = [s for s, e in m["splits"].items() if e["shards"]]
            raise UserError(f"{manifest_path}: no {split!r} split (the data has: {', '.join(have) or 'none'}); "
                            "run `nanolm prepare` with more documents or --val-fraction > 0 for a val split")
        self.shards: list[np.memmap] = []
        self.offsets: list[np.memmap] = []
        for s in entry["shards"]:
            self.shards.append(self._map(s["bin"], self.dtype, int(s["n_tokens"])))
            self.offsets.append(self._map(s["idx"], np.dtype(np.uint64), int(s["n_docs"]) + 1))
        self.n_tokens: int = sum(len(s) for s in self.shards)
        self.n_docs: int = int(entry["n_docs"])

    def _map(self, name: str, dtype: np.dtype, count: int) -> np.memmap:
        path = self.data_dir / name
        size = path.stat().st_size if path.is_file() else None
        if size != count * dtype.itemsize:
            found = "it is missing" if size is None else f"found {size}"
            raise UserError(f"{path}: expected {count * dtype.itemsize} bytes ({count} x {dtype.name}), {found}; "
                            "the data is damaged, run `nanolm prepare` again")
        return np.memmap(path, dtype=dtype, mode="r", shape=(count,))

    def n_windows(self, seq_len: int) -> np.ndarray:
        """Windows of seq_len + 1 tokens per shard."""
        return np.array([max(0, (len(s) - 1) // seq_len) for s in self.shards], dtype=np.int64)

    def gather(self, windows: np.ndarray, seq_len: int) -> np.ndarray:
        """Global window ids (B,) -> int64 tokens (B, seq_len + 1), by one fancy index per shard."""
        counts = self.n_windows(seq_len)
        starts = np.concatenate([[0], np.cumsum(counts)])
        shard = np.searchsorted(starts, windows, side="right") - 1
        out = np.empty((len(windows), seq_len + 1), dtype=np.int64)
        cols = np.arange(seq_len + 1)
        for s in np.unique(shard):
            rows = np.nonzero(shard == s)[0]
            local = windows[rows] - starts[s]
            out[rows] = self.shards[s][local[:, None] * seq_len + cols]  # (b, T+1)
        return out


def _check_positive(**kw: int) -> None:
    for name, v in kw.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise UserError(f"{name}={v!r}: must be a positive integer")


def _to_torch(tokens: np.ndarray, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.from_numpy(np.ascontiguousarray(tokens[:, :-1]))
    y = torch.from_numpy(np.ascontiguousarray(tokens[:, 1:]))
    if pin:
        x, y = x.pin_memory(), y.pin_memory()
    return x, y


class Loader:
    """Shuffled packed batches for one rank, from the global window stream (see module doc)."""

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
        self.epoch_windows: int = int(data.n_windows(seq_len).sum())
        self.tokens_per_epoch: int = self.epoch_windows * seq_len  # targets per epoch
        step = batch_size * world_size
        if self.epoch_windows < step:
            # One shard needs step windows of seq_len tokens, plus the first input token.
            raise UserError(
                f"{data.data_dir} ({data.split}): {data.n_tokens} tokens make {self.epoch_windows} windows of "
                f"seq_len+1 = {seq_len + 1} tokens, but a step takes batch_size x world_size = {step}; it needs at "
                f"least {step * seq_len + 1} tokens: prepare more text, or lower batch_size or seq_len")
        self.epoch = 0
        self.cursor = 0  # position in this epoch's permutation of the next step's first window
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {e: p for e, p in self._perms.items() if e >= self.epoch}  # keep at most two epochs
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.epoch_windows)
        return self._perms[epoch]

    def _stream(self, start: int, count: int) -> np.ndarray:
        """Window ids at positions start .. start+count-1 of the stream from (self.epoch, 0)."""
        n = self.epoch_windows
        first = self._perm(self.epoch)[start:start + count]
        if start + count <= n:
            return first
        return np.concatenate([first, self._perm(self.epoch + 1)[: start + count - n]])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y): int64 (batch_size, seq_len) inputs and next-token targets for this rank."""
        b = self.batch_size
        windows = self._stream(self.cursor + self.rank * b, b)
        self.cursor += b * self.world_size
        if self.cursor >= self.epoch_windows:
            self.cursor -= self.epoch_windows
            self.epoch += 1
        return _to_torch(self.data.gather(windows, self.seq_len), self.pin_memory)

    def state_dict(self) -> dict[str, Any]:
        """The global stream position (identical on every rank), JSON-serialisable."""
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "seq_len": self.seq_len,
                "epoch_windows": self.epoch_windows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream saved by `state_dict` (from any number of ranks, any batch size)."""
        if state.get("seq_len") != self.seq_len or state.get("epoch_windows") != self.epoch_windows:
            raise UserError(f"the saved data position is for {state.get('epoch_windows')} windows of seq_len "
                            f"{state.get('seq_len')}, but {self.data.data_dir} ({self.data.split}) has "
                            f"{self.epoch_windows} windows of seq_len {self.seq_len}; resume with the same prepared "
                            "data and seq_len, or start a new run")
        cursor, epoch = int(state["cursor"]), int(state["epoch"])
        if not (0 <= cursor < self.epoch_windows and epoch >= 0):
            raise UserError(f"the saved data position (epoch {epoch}, cursor {cursor}) is out of range; "
                            "the checkpoint's state is damaged")
        self.seed = int(state["seed"])  # the stream is defined by the seed it started with
        self.epoch, self.cursor = epoch, cursor
        self._perms = {}


def iter_eval_batches(data: PackedData, batch_size: int, seq_len: int,
                      max_batches: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The split's windows in order, batch_size at a time; the same batches on every call.

    The last batch holds the remaining windows and may be smaller, so weight a
    mean by batch size. max_batches stops early (the first batches, always).
    """
    _check_positive(batch_size=batch_size, seq_len=seq_len)
    n = int(data.n_windows(seq_len).sum())
    if n == 0:
        raise UserError(f"{data.data_dir} ({data.split}): {data.n_tokens} tokens, fewer than one window of "
                        f"seq_len+1 = {seq_len + 1} in any shard; prepare more text or lower seq_len")
    pin = torch.cuda.is_available()
    for i, start in enumerate(range(0, n, batch_size)):
        if max_batches is not None and i >= max_batches:
            return
        windows = np.arange(start, min(start + batch_size, n), dtype=np.int64)
        yield _to_torch(data.gather(windows, seq_len), pin)
