"""Text data (`nanolm prepare --format text`, the default): documents for pretraining, and the windows the
loader cuts them into.

Prepare: each document's tokens are followed by one `<|endoftext|>` (id 0),
no loss mask. The records are those of `nanolm.data.formats.iter_pieces`:
`.txt` files (one document each, read in pieces when large) and `.jsonl` lines
`{"text": ...}`. A short document goes to val by the document rule (see
nanolm/data/prepare.py). A text document of at least `LONG_DOC_CHARS`
characters (a few training windows) is split by position instead, as nanoGPT
splits its one file: of its n characters (as read: BOM dropped, line ends LF),
the first int(n * (1 - val_fraction)) go to train and the rest to val, each
part ending with `<|endoftext|>`, so one big file gets a held-out split. A
.txt file in several pieces is counted once ahead (a read of the file, no
tokenizing) to find where that cut falls. The manifest's "split_policy" says
which rule applied to how many documents.

Loader (`Windows`). A split's shards are cut into windows of seq_len + 1 tokens at
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
`os.pread` from the shard files (`PackedData.gather`; nanolm/data/shards.py says why).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from nanolm.data.formats import iter_pieces
from nanolm.data.jsonl import ReadStats
from nanolm.data.kinds.base import Chunk, DataKind, Order, Record, encode_batch, pinned
from nanolm.data.shards import Batch, PackedData, SplitWriter, write_splits

# A text document at least this long (in characters, ~16 windows of 512 tokens) gives its tail to validation.
LONG_DOC_CHARS = 1 << 15
# Text epochs of more than this many windows are shuffled in two levels (see the module doc);
# at or below it, one permutation of the epoch (8 bytes a window: 8 MiB at the threshold).
SHUFFLE_BLOCK = 1 << 20


class TextKind(DataKind):
    """Documents for pretraining: windows of packed text."""

    name = "text"
    about = "documents for pretraining"
    help = "{\"text\": ...} lines / .txt files"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.split_counts = {"by_position": 0}
        self._read = text_records(self.cfg.skip_bad, self.stats, self.cfg.val_fraction, self.split_counts)

    @classmethod
    def units(cls, data: PackedData, seq_len: int) -> Windows:
        return Windows(data, seq_len)

    def options(self) -> dict[str, Any]:
        # The split rule of long documents is part of what was made.
        return {"val_fraction": self.cfg.val_fraction, "skip_bad": self.cfg.skip_bad,
                "shard_tokens": self.cfg.shard_tokens, "long_doc_chars": LONG_DOC_CHARS}

    def records(self, path: Path) -> Iterator[Record]:
        return self._read(path)

    def job(self, chunk: Chunk) -> tuple[Callable[..., Any], tuple]:
        return encode_pieces, (chunk.items, chunk.lasts)

    def consume(self, writers: dict[str, SplitWriter], chunk: Chunk, tokens: np.ndarray, lens: np.ndarray) -> None:
        write_splits(writers, np.array(chunk.is_val, dtype=bool), tokens, lens, np.array(chunk.lasts, dtype=bool))

    def by_position(self) -> int:
        return self.split_counts["by_position"]

    def position_policy(self) -> dict[str, Any]:
        return {"long_doc_chars": LONG_DOC_CHARS, "by_position": self.by_position(),
                "position_rule": f"a document of at least {LONG_DOC_CHARS} characters gives its last "
                                 f"val_fraction ({self.cfg.val_fraction:g}) of characters to val"}


def text_records(skip_bad: bool, stats: ReadStats, val_fraction: float,
                 split_counts: dict[str, int]) -> Callable[[Path], Iterator[Record]]:
    """Text pieces (a long .txt document comes in several), a long document's cut into its train head and val
    tail by position (see the module doc); split_counts["by_position"] counts those documents."""
    def records(path: Path) -> Iterator[Record]:
        pieces = iter_pieces(path, skip_bad=skip_bad, stats=stats)
        whole = True  # the next piece starts a document
        total = start = cut = 0
        for piece in pieces:
            text = piece.text
            if whole:
                # The document's length: this piece's when it is the whole document, else the file's, counted ahead.
                total = len(text) if piece.last else sum(
                    len(p.text) for p in iter_pieces(path, skip_bad=skip_bad, stats=ReadStats()))
                start, by_position = 0, val_fraction > 0 and total >= LONG_DOC_CHARS
                cut = int(total * (1 - val_fraction)) if by_position else -1
                split_counts["by_position"] += by_position
            whole = piece.last
            end = start + len(text)
            if cut < 0:
                yield text, piece.last, len(text), piece.nbytes, None
            elif end <= cut:  # the head; the piece that reaches the cut ends the train part
                yield text, end == cut, len(text), piece.nbytes, "train"
            elif start >= cut:
                yield text, piece.last, len(text), piece.nbytes, "val"
            else:
                c = cut - start
                yield text[:c], True, c, piece.nbytes, "train"
                yield text[c:], piece.last, len(text) - c, 0, "val"
            start = end
    return records


def encode_pieces(state: dict[str, Any], texts: list[str], lasts: list[bool]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of the pieces, concatenated, with EOT after each piece that ends a document,
    and each piece's length (EOT included): (tokens [sum(lens)], lens [len(texts)] int64)."""
    ids = encode_batch(state["tok"], texts)
    lens = np.fromiter((len(x) + last for x, last in zip(ids, lasts)), dtype=np.int64, count=len(ids))
    out = np.empty(int(lens.sum()), dtype=state["dtype"])
    pos = 0
    for x, last in zip(ids, lasts):
        out[pos:pos + len(x)] = x
        pos += len(x)
        if last:
            out[pos] = state["eot"]
            pos += 1
    return out, lens


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
        return pinned(Batch(x, y), pin)

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
