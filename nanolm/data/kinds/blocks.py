"""Input and output blocks (`nanolm prepare --format blocks`): the data of `--stage blocks`, written and read here.

bd4sur's Nano trains, besides the usual causal language model, a model that
reads a whole block and writes the next block (`model.causal false`): sorting
or reversing digit strings, arithmetic laid out position by position. A block
record is a line of a .jsonl file:

- `{"input": "...", "output": "..."}`: the two blocks' texts;
- `{"text": "..."}` (Nano's layout of one sequence): its tokens cut at
  `block_len` (`--block-len`, required for this layout): the first block_len
  tokens are the input, the rest (at most block_len) the output.

Each record becomes two adjacent documents of a split, its input's ids then
its output's (no mask file: every output token is a target), kept in one
shard; record i goes to val when i % k == 1, as prepare splits documents.
With `block_len`, a record whose input or output is longer is refused
(`file:line: what is wrong`; `--skip-bad` skips it and counts it).

The unit the loader streams (`Blocks`) is a record. At train.seq_len T, a
record's input block is its ids padded to T with the end-of-text id, and its
output block its ids, then one end-of-text when it is shorter than T (so the
model learns where an output ends), padded likewise; a record whose input or
output does not fit is left out and counted. A batch's rows are the two
blocks side by side, x (B, 2T) = [input block | output block], with
next-token targets y (B, 2T): y[:, T - 1 + i] is output token i (its
end-of-text included), IGNORE_INDEX elsewhere and on the padding after it.
So the same batch trains either kind of model (`block_views`): a causal one
reads x[:, :-1] and predicts the output block token by token after the
input; a non-causal one reads the input block x[:, :T] alone and predicts
every output position at once, its logits at position i against
y[:, T - 1 + i].
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from nanolm.data.formats import iter_block_records
from nanolm.data.kinds.base import CountedUnits, DataKind, Splits
from nanolm.data.provenance import val_every
from nanolm.data.shards import IGNORE_INDEX, MANIFEST, SPLITS, Batch, Manifest, PackedData, SplitWriter
from nanolm.errors import UserError


class BlocksKind(DataKind):
    """Input and output blocks, for --stage blocks (module doc)."""

    name = "blocks"
    about = "input and output blocks for --stage blocks"
    help = ("input and output blocks for --stage blocks ({\"input\": ..., \"output\": ...}, or {\"text\": ...} "
            "cut at --block-len)")
    unit = rule_unit = "record"
    noun = "block records"
    group = 2  # a record's input and output stay in one shard
    streams = records_throughput = False
    mixes_as = ""  # rows of two blocks, read apart by a non-causal model
    mix_fix = "block data trains alone: give it as the one data set of its run"
    texts_help = "the inputs and outputs of block records (or their texts)"
    option_fields = ("block_len", "val_fraction", "skip_bad", "shard_tokens")

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.counts = dict.fromkeys(SPLITS, 0)  # records per split
        self.longest = [0, 0]  # the longest input and output, in tokens

    @classmethod
    def units(cls, data: PackedData, seq_len: int) -> Blocks:
        return Blocks(data, seq_len)

    read_records = staticmethod(iter_block_records)
    record_texts = staticmethod(lambda record: (t for t in record if t is not None))  # (input, output), (text, None)

    def plan(self) -> str:
        return f"input and output blocks of at most {self.cfg.block_len or 'any number of'} tokens, "

    def write(self, tmp: Path, files: list[Path], writers: dict[str, SplitWriter]) -> None:
        """block_len: the longest input and output kept (0: any; the loader leaves out what does not fit its
        seq_len)."""
        k = val_every(self.cfg.val_fraction)
        per_split: dict[str, list[tuple[list[int], list[int]]]] = {s: [] for s in SPLITS}
        i = 0
        for path in files:
            for pair, _ in iter_block_records(path, skip_bad=self.cfg.skip_bad, stats=self.stats,
                                              encode=self.tok.encode, block_len=self.cfg.block_len):
                per_split["val" if k and i % k == 1 else "train"].append(pair)
                i += 1
        for split, pairs in per_split.items():
            writers[split].append_documents([ids for pair in pairs for ids in pair], self.tok.eot_id)
            self.counts[split] = len(pairs)
        self.longest = [max((len(p[j]) for ps in per_split.values() for p in ps), default=0) for j in (0, 1)]

    def finish_splits(self, splits: Splits) -> None:
        for split, entry in splits.items():
            entry["n_records"] = self.counts[split]

    def empty(self, files: list[Path]) -> str:
        return (f"no block records to train on in {', '.join(map(str, files))} ({self.stats.bad_lines} bad "
                "line(s) skipped); check the files")

    def skipped(self) -> dict[str, Any]:
        return {"bad_lines": self.stats.bad_lines, "examples": self.stats.examples}

    def split_policy(self, k: int, n_docs: int) -> dict[str, Any]:
        return {"val_every": k, "rule": "record i goes to val when val_every > 0 and i % val_every == 1"}

    def section(self, splits: Splits, n_docs: int) -> dict[str, Any] | None:
        return {"n_records": n_docs // 2, "train": self.counts["train"], "val": self.counts["val"],
                "longest_input": self.longest[0], "longest_output": self.longest[1]}

    def summary(self, manifest: Manifest, seconds: float) -> list[str]:
        bad, longest = self.stats.bad_lines, self.longest
        return [f"prepared {manifest.totals['n_docs'] // 2} block records (train {self.counts['train']}, val "
                f"{self.counts['val']}), {manifest.totals['n_tokens']} tokens -> {self.cfg.out}; the longest input "
                f"{longest[0]} tokens, output {longest[1]} (--train.seq_len must hold both, and the end-of-text "
                "after a shorter output)"
                + (f"; {bad} bad line(s) skipped (--skip-bad), first: {self.stats.examples[0]}" if bad else "")]


def block_views(batch: Batch, causal: bool) -> Batch:
    """What a model of this kind reads of a blocks batch (module doc): causal, the two blocks as one sequence;
    non-causal, the input block and the output block's targets at the same positions."""
    if causal:
        return Batch(batch.x[:, :-1], batch.y[:, :-1])
    T = batch.x.shape[1] // 2
    return Batch(batch.x[:, :T], batch.y[:, T - 1:-1])


class Blocks(CountedUnits):
    """Block records (`BlocksKind`): the unit is a record, a row its input and output blocks side by side
    (module doc). Epoch e's order of the records that fit is `np.random.default_rng([seed, e]).permutation(n)`."""

    name = "records"
    held = "block records"
    state_key = "n_records"

    def __init__(self, data: PackedData, seq_len: int) -> None:
        self.data, self.T = data, seq_len
        self.shard, self.start, self.length = data.documents()
        if len(self.length) % 2:
            raise UserError(f"{data.data_dir} ({data.split}): {len(self.length)} documents, not whole input/output "
                            "records; the data is damaged, run `nanolm prepare --format blocks` again")
        lengths = self.length.reshape(-1, 2)  # (records, 2): input, output
        self.n_state = len(lengths)
        self.kept = np.flatnonzero((lengths <= seq_len).all(axis=1))
        self.n_dropped = self.n_state - len(self.kept)
        if len(self.kept) == 0:
            raise UserError(f"{data.data_dir} ({data.split}): {self.empty()}")
        if data.manifest.tokenizer.eot_id is None:
            raise UserError(f"{data.data_dir / MANIFEST}: tokenizer.eot_id is missing, which block data pads "
                            "with; the manifest is damaged, run `nanolm prepare --format blocks` again")
        self.eot = data.manifest.tokenizer.eot_id
        out = lengths[self.kept, 1]
        self.n_targets = int(out.sum() + (out < seq_len).sum())  # output tokens and their end-of-text

    def _ids(self, doc: int) -> np.ndarray:
        shard, start, length = int(self.shard[doc]), int(self.start[doc]), int(self.length[doc])
        return self.data.doc_ids(shard, start, length)

    def order(self, seed: int, epoch: int) -> np.ndarray:
        return np.random.default_rng([seed, epoch]).permutation(len(self.kept))

    def file_order(self) -> np.ndarray:
        return np.arange(len(self.kept), dtype=np.int64)

    def batch(self, parts: list[np.ndarray], pin: bool) -> Batch:
        T = self.T
        records = self.kept[np.concatenate(parts)]
        x = np.full((len(records), 2 * T), self.eot, dtype=np.int64)
        y = np.full((len(records), 2 * T), IGNORE_INDEX, dtype=np.int64)
        for row, r in enumerate(records.tolist()):
            inp, out = self._ids(2 * r), self._ids(2 * r + 1)
            x[row, :len(inp)] = inp
            x[row, T:T + len(out)] = out
            n = min(len(out) + 1, T)  # the output, and the end-of-text that ends a shorter one
            y[row, T - 1:T - 1 + n] = x[row, T:T + n]
        batch = Batch(torch.from_numpy(x), torch.from_numpy(y))
        return batch.pin_memory() if pin else batch

    def tokens_per_epoch(self, order: np.ndarray) -> int:
        return len(order) * self.T

    def describe(self, order: np.ndarray, batch_size: int) -> str:
        return (f"{len(self.kept)} records as input and output blocks of seq_len {self.T} tokens "
                f"({self.n_targets:,} target tokens)"
                + (f"; {self.n_dropped} left out (an input or output longer than {self.T} tokens)"
                   if self.n_dropped else ""))

    def empty(self) -> str:
        return (f"none of its {self.n_state} records has an input and an output of at most seq_len {self.T} tokens; "
                "raise --seq-len to the longest of them (the manifest's \"blocks\" section gives it)")
