"""The on-disk format of prepared token data: the shard files, their manifest, writing and reading them.

A prepared data directory (what `nanolm prepare` writes and training reads) holds:

- `train-00000.bin`, `train-00001.bin`, ... and `val-00000.bin`, ...: flat
  arrays of token ids, uint16 when the vocabulary fits (<= 65536 ids), else
  uint32 (`token_dtype`). Each document's tokens are followed by one
  `<|endoftext|>` (id 0). A shard is closed at the first document end at or
  past `shard_tokens` tokens, so no document spans two shards.
- `<shard>.idx`: uint64 start offsets of the shard's documents into its .bin,
  n_docs + 1 entries, the first 0 and the last the .bin's length.
- `<shard>.mask` (chat and preference data only): one uint8 per token of the
  .bin: bit 0 (`chat.TARGET`) set where the token is a training target,
  bit 1 (`chat.EXCHANGE`) where an exchange starts, which truncation cuts at
  (see nanolm/chat/encoding.py for which tokens those are).
- `train.records.jsonl`, `val.records.jsonl` (RL prompts only, `format="prompts"`):
  one JSON line per document of the split, in order: the prompt's messages,
  tools and the record as the user gave it (reference answers for rewards);
  the shards hold each prompt's conversation rendered without a generation
  prompt (see nanolm/data/kinds/prompts.py).
- `manifest.json`: the format version, the tokenizer's fingerprint and vocab
  size, the dtype, and per split its shards with their token and document
  counts and the CRC-32 of each of their files (`crc32`: {"bin", "idx",
  "mask"}, computed as they are written); `nanolm prepare` adds what was made from what (sources, options,
  skipped lines, throughput) and the data kind's own section, under the kind's
  name (nanolm/data/kinds/). It is written last: a directory without it is
  not prepared data. `Manifest` is its one reader (`Manifest.read`, which
  checks every field it gives) and its one writer (`Manifest.write`); the
  kind is `options.format` ("text" when absent), and the old name of a renamed
  kind (`RENAMED_KINDS`: preference pairs were "dpo") reads as today's.

`SplitWriter` writes one split's shards; `PackedData` maps one split's shards
read-only, after checking the manifest and the files' sizes against it, and
each file's CRC-32 against the manifest's, once per file (and size and
modification time) in a process: a flipped byte is a one-line error naming the
file, never data trained on. Data prepared before checksums were recorded
loads without that check.
Training reads text windows with `os.pread` from the shard files
(`PackedData.gather`), not through the memory maps: pages touched through a
map stay in the process's resident set (they are counted in its peak RSS, and
a random read faults in the pages around it too), so reading a multi-GB shard
at random through its map grows the RSS to the size of the data, while pread
leaves them in the kernel's page cache only.

A batch of the data is a `Batch`, whatever the data's kind; a target equal to
`IGNORE_INDEX` takes no loss.
"""

from __future__ import annotations

import collections
import json
import os
import re
import weakref
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from nanolm.chat import TARGET
from nanolm.errors import UserError
from nanolm.io import check_crc32, crc32_checked, write_json_atomic

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
# The name of every file a SplitWriter makes (shard_name + suffix): what `nanolm prepare` may replace.
SHARD_FILE = re.compile(r"^(train|val)-\d{5}\.(bin|idx|mask)$|^(train|val)\.records\.jsonl$")
# Shard files PackedData keeps open for reading windows (the least recently read closes first).
MAX_OPEN_SHARDS = 64
IGNORE_INDEX = -1  # a Batch target equal to this contributes no loss (a masked or padding position)
# The kind of data whose manifest gives no options.format: pretraining text, as nanolm wrote it first.
DEFAULT_KIND = "text"
# Kinds renamed since data was first written: the old name (a manifest's options.format and section) -> today's.
RENAMED_KINDS = {"dpo": "pairs"}


def shard_name(split: str, index: int) -> str:
    """File stem of a shard: train-00000."""
    return f"{split}-{index:05d}"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@dataclass
class Batch:
    """One rank's micro-batch, for every kind of data (text, chat, preference pairs).

    x: (B, T) int64 input ids. y: (B, T) int64 next-token targets, IGNORE_INDEX
    (-1) where no loss is taken. pos: (B, T) int64 position of each token within
    its conversation, seg: (B, T) int64 segment id of each token within its row
    (a token attends only to earlier tokens of its own segment); both None for
    text data, where every row is one causal sequence at positions 0..T-1.
    pairs: True for preference data, whose rows come in pairs: row 2i is the
    chosen conversation of pair i, row 2i + 1 its rejected one (pos and seg
    None: one conversation per row, padded at the end).
    """

    x: torch.Tensor
    y: torch.Tensor
    pos: torch.Tensor | None = None
    seg: torch.Tensor | None = None
    pairs: bool = False

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return Batch(move(self.x), move(self.y), move(self.pos), move(self.seg), self.pairs)

    def pin_memory(self) -> "Batch":
        pin = lambda t: None if t is None else t.pin_memory()  # noqa: E731
        return Batch(pin(self.x), pin(self.y), pin(self.pos), pin(self.seg), self.pairs)


class SplitWriter:
    """Appends one split's tokens (and loss mask) to its shards, rolling to a new shard at a document end.

    group: documents that stay in one shard (2 for preference data: a pair's two conversations);
    every `append` gives whole groups.
    """

    def __init__(self, tmp_dir: Path, split: str, dtype: np.dtype, shard_tokens: int, with_mask: bool = False,
                 group: int = 1) -> None:
        self.tmp_dir = tmp_dir
        self.group = group
        self.split = split
        self.dtype = dtype
        self.shard_tokens = shard_tokens
        self.with_mask = with_mask
        self.shards: list[dict[str, Any]] = []  # manifest entries of the closed shards
        self._bin: BinaryIO | None = None
        self._idx: BinaryIO | None = None
        self._mask: BinaryIO | None = None
        self._crc: dict[str, int] = {}  # CRC-32 of each open shard file's bytes so far
        self._n = 0  # tokens in the open shard
        self.written = 0  # bytes handed to the shard files so far
        self._docs = 0  # complete documents in the open shard
        self._trainable = 0  # mask ones in the open shard

    def _files(self) -> list[BinaryIO]:
        return [f for f in (self._bin, self._idx, self._mask) if f is not None]

    def _open(self) -> None:
        stem = shard_name(self.split, len(self.shards))
        self._bin = open(self.tmp_dir / f"{stem}.bin", "wb")
        self._idx = open(self.tmp_dir / f"{stem}.idx", "wb")
        if self.with_mask:
            self._mask = open(self.tmp_dir / f"{stem}.mask", "wb")
        self.written += 8
        self._crc = dict.fromkeys(("bin", "idx", "mask") if self.with_mask else ("bin", "idx"), 0)
        self._put("idx", np.zeros(1, dtype=np.uint64))
        self._n = self._docs = self._trainable = 0

    def _close(self) -> None:
        for f in self._files():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        stem = shard_name(self.split, len(self.shards))
        entry: dict[str, Any] = {"bin": f"{stem}.bin", "idx": f"{stem}.idx"}
        if self.with_mask:
            entry["mask"] = f"{stem}.mask"
        entry.update(n_tokens=self._n, n_docs=self._docs)
        if self.with_mask:
            entry["n_trainable"] = self._trainable
        entry["crc32"] = {k: f"{v:08x}" for k, v in self._crc.items()}
        self.shards.append(entry)
        self._bin = self._idx = self._mask = None

    def _write(self, tokens: np.ndarray, doc_ends: np.ndarray, mask: np.ndarray | None) -> None:
        """tokens of the open shard; doc_ends: end offsets, relative to tokens[0], of the documents they complete."""
        assert self._bin is not None and self._idx is not None
        self.written += tokens.nbytes + 8 * len(doc_ends) + (len(tokens) if self._mask is not None else 0)
        self._put("bin", np.ascontiguousarray(tokens))
        self._put("idx", (doc_ends + self._n).astype(np.uint64))
        if self._mask is not None:
            assert mask is not None and len(mask) == len(tokens)
            self._put("mask", np.ascontiguousarray(mask, dtype=np.uint8))
            self._trainable += int(np.count_nonzero(mask & TARGET))
        self._n += len(tokens)
        self._docs += len(doc_ends)

    def append_documents(self, docs: list[list[int]], eot_id: int) -> None:
        """Append whole documents (token ids), each followed by the end-of-text id, without a loss mask."""
        if docs:
            arrays = [np.array(d + [eot_id], dtype=self.dtype) for d in docs]
            self.append(np.concatenate(arrays), np.array([len(a) for a in arrays]), np.ones(len(arrays), dtype=bool))

    def _put(self, key: str, array: np.ndarray) -> None:
        """Write the array's bytes to the open shard's file `key`, adding them to its CRC-32."""
        data = array.data
        {"bin": self._bin, "idx": self._idx, "mask": self._mask}[key].write(data)  # type: ignore[union-attr]
        self._crc[key] = zlib.crc32(data, self._crc[key])

    def append(self, tokens: np.ndarray, piece_lens: np.ndarray, piece_last: np.ndarray,
               mask: np.ndarray | None = None) -> None:
        ends = np.cumsum(piece_lens)[piece_last]  # document ends, relative to tokens[0]
        cuts = ends[self.group - 1::self.group]  # where a shard may end
        start, j = 0, 0
        while start < len(tokens):
            if self._bin is None:
                self._open()
            # The first group end at which the open shard reaches shard_tokens.
            i = int(np.searchsorted(cuts, start + self.shard_tokens - self._n, side="left"))
            if i >= len(cuts):
                self._write(tokens[start:], ends[j:] - start, None if mask is None else mask[start:])
                return
            stop, last = int(cuts[i]), (i + 1) * self.group
            self._write(tokens[start:stop], ends[j:last] - start, None if mask is None else mask[start:stop])
            self._close()
            start, j = stop, last

    def discard(self) -> None:
        """Close the open shard's files after a failure (the temp directory is removed anyway)."""
        for f in self._files():
            try:
                f.close()
            except OSError:  # flushing the rest failed too (a full disk): the file is dropped anyway
                pass
        self._bin = self._idx = self._mask = None

    def finish(self) -> dict[str, Any]:
        if self._bin is not None:
            self._close()
        out = {"shards": self.shards, "n_tokens": sum(s["n_tokens"] for s in self.shards),
               "n_docs": sum(s["n_docs"] for s in self.shards)}
        if self.with_mask:
            out["n_trainable"] = sum(s["n_trainable"] for s in self.shards)
        return out


def write_splits(writers: dict[str, SplitWriter], is_val: np.ndarray, tokens: np.ndarray, lens: np.ndarray,
                 lasts: np.ndarray, mask: np.ndarray | None = None) -> None:
    """Append pieces to the train or val writer by is_val (per piece): tokens and mask of the pieces in order,
    lens their lengths, lasts whether each ends a document (the `SplitWriter.append` arguments)."""
    for split, sel in (("train", ~is_val), ("val", is_val)):
        if sel.all():
            writers[split].append(tokens, lens, lasts, mask)
        elif sel.any():
            keep = np.repeat(sel, lens)
            writers[split].append(tokens[keep], lens[sel], lasts[sel], None if mask is None else mask[keep])


def shards_intact(out_dir: Path, manifest: Manifest) -> bool:
    """Whether every shard file the manifest lists is in out_dir at the size the manifest gives it."""
    itemsize = np.dtype(manifest.dtype).itemsize
    for split in manifest.splits.values():
        for s in split["shards"]:
            b, i = out_dir / s["bin"], out_dir / s["idx"]
            if not (b.is_file() and i.is_file()):
                return False
            if b.stat().st_size != s["n_tokens"] * itemsize or i.stat().st_size != (s["n_docs"] + 1) * 8:
                return False
            if "mask" in s and not ((out_dir / s["mask"]).is_file()
                                    and (out_dir / s["mask"]).stat().st_size == s["n_tokens"]):
                return False
    return True


class _ShardFiles:
    """Shard files opened for reading on first use, at most MAX_OPEN_SHARDS at a time.

    Plain file descriptors read with os.pread (no file position), so a forked
    process can share them; closed when this object is collected. One thread
    at a time: another could find its descriptor closed to make room.
    """

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths
        self._fds: collections.OrderedDict[int, int] = collections.OrderedDict()  # shard -> fd, oldest first
        weakref.finalize(self, _close_fds, self._fds)

    def read_into(self, shard: int, offset: int, out: np.ndarray, nbytes: int) -> None:
        """Fill `out` (contiguous, nbytes long) with the shard's bytes from `offset`."""
        fd = self._fds.get(shard)
        if fd is None:
            if len(self._fds) >= MAX_OPEN_SHARDS:
                os.close(self._fds.popitem(last=False)[1])
            fd = self._fds[shard] = os.open(self.paths[shard], os.O_RDONLY)
        else:
            self._fds.move_to_end(shard)
        view = memoryview(out).cast("B")
        got = 0
        while got < nbytes:  # pread may return less than asked (signals, network file systems)
            chunk = os.pread(fd, nbytes - got, offset + got)
            if not chunk:
                raise UserError(f"{self.paths[shard]}: ends before byte {offset + nbytes}; it changed after "
                                "it was opened, or the data is damaged: run `nanolm prepare` again")
            view[got:got + len(chunk)] = chunk
            got += len(chunk)


def _close_fds(fds: dict[int, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()


@dataclass(frozen=True)
class TokenizerRef:
    """The tokenizer a manifest's data was made with (its "tokenizer" field); path and eot_id are absent from
    data made by hand in tests."""

    fingerprint: str
    vocab_size: int
    path: str | None = None
    eot_id: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "fingerprint": self.fingerprint, "vocab_size": self.vocab_size,
                "eot_id": self.eot_id}


@dataclass
class Manifest:
    """A prepared data directory's `manifest.json` (module doc), field by field as it is on disk.

    kind: the data kind (options.format, DEFAULT_KIND when absent, an old name read as today's); section: the
    kind's own section, stored under the kind's name; throughput: None for the kinds written in-process.
    splits: per split {"shards": [{"bin", "idx", "mask"?, "n_tokens", "n_docs", "n_trainable"?, "crc32"}],
    "n_tokens", "n_docs", ...} as `SplitWriter.finish` gives it, and what the kind adds.
    """

    kind: str
    tokenizer: TokenizerRef
    dtype: str
    splits: dict[str, dict[str, Any]]
    options: dict[str, Any] = field(default_factory=dict)
    totals: dict[str, Any] = field(default_factory=dict)
    sources: list[dict[str, Any]] = field(default_factory=list)
    split_policy: dict[str, Any] = field(default_factory=dict)
    skipped: dict[str, Any] = field(default_factory=dict)
    throughput: dict[str, Any] | None = None
    section: dict[str, Any] | None = None
    created: str = ""
    version: int = FORMAT_VERSION

    @classmethod
    def read(cls, data_dir: Path) -> Manifest:
        """The manifest of data_dir, every field checked: a UserError naming the file and the field otherwise."""
        data_dir = Path(data_dir)
        path = data_dir / MANIFEST
        if not data_dir.is_dir():
            raise UserError(f"{data_dir}: no such data directory; run `nanolm prepare` to make it")
        if not path.is_file():
            raise UserError(f"{path}: not found, so {data_dir} holds no prepared data; run `nanolm prepare` to make it")
        try:
            m = json.loads(path.read_text(encoding="utf-8"))
            version = m.get("version")
        except (ValueError, AttributeError, RecursionError):
            raise UserError(f"{path}: not a nanolm manifest; run `nanolm prepare` again") from None
        except OSError as e:
            raise UserError(f"{path}: cannot be read ({e.strerror or e}); check its permissions") from None
        if version != FORMAT_VERSION:
            raise UserError(f"{path}: data format version {version!r}, this nanolm reads version "
                            f"{FORMAT_VERSION}; run `nanolm prepare` again")
        _check_manifest(m, path)
        options = m.get("options", {})
        stored = options.get("format", DEFAULT_KIND)
        kind = RENAMED_KINDS.get(stored, stored)
        if "format" in options:
            options = {k: kind if k == "format" else v for k, v in options.items()}
        tok = m["tokenizer"]
        return cls(kind=kind, tokenizer=TokenizerRef(tok["fingerprint"], tok["vocab_size"], tok.get("path"),
                                                     tok.get("eot_id")),
                   dtype=m["dtype"], splits=m["splits"], options=options, totals=m.get("totals", {}),
                   sources=m.get("sources", []), split_policy=m.get("split_policy", {}),
                   skipped=m.get("skipped", {}), throughput=m.get("throughput"), section=m.get(stored),
                   created=m.get("created", ""), version=version)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object on disk."""
        out: dict[str, Any] = {
            "format": "nanolm-tokens", "version": self.version, "created": self.created,
            "tokenizer": self.tokenizer.to_dict(), "dtype": self.dtype, "splits": self.splits, "totals": self.totals,
            "sources": self.sources, "options": self.options, "split_policy": self.split_policy,
            "skipped": self.skipped}
        if self.throughput is not None:
            out["throughput"] = self.throughput
        if self.section is not None:
            out[self.kind] = self.section
        return out

    def write(self, data_dir: Path) -> None:
        """Write data_dir/manifest.json (atomically)."""
        write_json_atomic(Path(data_dir) / MANIFEST, self.to_dict())


def _check_manifest(m: dict[str, Any], path: Path) -> None:
    """UserError naming the first field of a manifest that is missing or of the wrong type (a damaged file)."""
    def need(ok: bool, field: str, want: str) -> None:
        if not ok:
            raise UserError(f"{path}: {field} is missing or not {want}; the manifest is damaged, run `nanolm "
                            "prepare` again")

    def count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    def optional(key: str, typ: type, want: str) -> None:
        need(m.get(key) is None or isinstance(m[key], typ), key, want)

    tok, splits = m.get("tokenizer"), m.get("splits")
    need(isinstance(tok, dict) and count(tok.get("vocab_size")) and tok["vocab_size"] > 0, "tokenizer.vocab_size",
         "a positive integer")
    need(isinstance(tok.get("fingerprint"), str), "tokenizer.fingerprint", "a string")
    need(tok.get("path") is None or isinstance(tok["path"], str), "tokenizer.path", "a string")
    need(tok.get("eot_id") is None or count(tok["eot_id"]), "tokenizer.eot_id", "an integer >= 0")
    need(m.get("dtype") in ("uint16", "uint32"), "dtype", "uint16 or uint32")
    need(isinstance(m.get("options", {}), dict), "options", "an object")
    kind = m.get("options", {}).get("format", DEFAULT_KIND)
    need(isinstance(kind, str) and kind != "", "options.format", "a data kind's name")
    need(m.get(kind) is None or isinstance(m[kind], dict), kind, "an object")
    for key in ("totals", "split_policy", "skipped", "throughput"):
        optional(key, dict, "an object")
    optional("sources", list, "a list")
    optional("created", str, "a string")
    need(isinstance(splits, dict) and set(splits) <= set(SPLITS), "splits", "an object of train and val")
    for name, e in splits.items():
        need(isinstance(e, dict) and count(e.get("n_docs")), f"splits.{name}.n_docs", "an integer >= 0")
        need(isinstance(e.get("shards"), list), f"splits.{name}.shards", "a list")
        for i, s in enumerate(e["shards"]):
            where = f"splits.{name}.shards[{i}]"
            need(isinstance(s, dict), where, "an object")
            for key in ("n_tokens", "n_docs"):
                need(count(s.get(key)), f"{where}.{key}", "an integer >= 0")
            for key in ("bin", "idx", "mask"):  # file names beside the manifest; mask for masked kinds
                v = s.get(key)
                need((key == "mask" and v is None) or (isinstance(v, str) and v == Path(v).name and v[:1] != "."),
                     f"{where}.{key}", "a file name")
            crc = s.get("crc32")  # absent in data prepared before checksums were recorded
            need(crc is None or (isinstance(crc, dict) and all(
                k in ("bin", "idx", "mask") and isinstance(v, str) and re.fullmatch(r"[0-9a-f]{8}", v)
                for k, v in crc.items())), f"{where}.crc32", "an object of 8-hex-digit CRC-32s of bin, idx, mask")


def _verify(files: list[tuple[Path, str]], manifest_path: Path) -> None:
    """Check shard files' CRC-32s against the manifest's, once per file as it stands (module doc), on a thread
    per core (zlib computes without the GIL); the first file that differs is the error."""
    todo = [(path, want) for path, want in files if not crc32_checked(path, want)]
    if not todo:
        return

    def check(item: tuple[Path, str]) -> None:
        check_crc32(item[0], item[1], str(manifest_path), "run `nanolm prepare` again to rewrite the data")
    with ThreadPoolExecutor(min(len(todo), os.cpu_count() or 1)) as pool:
        list(pool.map(check, todo))


class PackedData:
    """The shards of one split of a prepared data directory, memory-mapped read-only.

    shards[i] is a 1-D memmap of token ids (`gather` reads text windows from the files instead, see the
    module doc); offsets[i] the uint64 document starts;
    masks[i] (data whose shards carry a loss mask: chat and preference pairs; else None) the uint8 loss mask of
    shards[i]. manifest: the directory's `Manifest`; kind: its data kind's name (nanolm/data/kinds/, whose class
    reads the split's documents as the units the loader streams, and checks what only it knows).
    """

    def __init__(self, data_dir: Path, split: str = "train", *, tokenizer_fingerprint: str | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.split = split
        manifest_path = self.data_dir / MANIFEST
        m = self.manifest = Manifest.read(self.data_dir)
        self.vocab_size: int = m.tokenizer.vocab_size
        self.dtype = np.dtype(m.dtype)
        self.kind: str = m.kind
        fingerprint = m.tokenizer.fingerprint
        if tokenizer_fingerprint is not None and tokenizer_fingerprint != fingerprint:
            raise UserError(f"{manifest_path}: data was tokenized with tokenizer {fingerprint[:16]} "
                            f"({m.tokenizer.path}) but the tokenizer in use is {tokenizer_fingerprint[:16]}; "
                            "use that tokenizer, or run `nanolm prepare` again with this one")
        entry = m.splits.get(split)
        if not entry or not entry["shards"]:
            have = [s for s, e in m.splits.items() if e["shards"]]
            raise UserError(f"{manifest_path}: no {split!r} split (the data has: {', '.join(have) or 'none'}); "
                            "run `nanolm prepare` with more documents or --val-fraction > 0 for a val split")
        self.shards: list[np.memmap] = []
        self.offsets: list[np.memmap] = []
        # A split's shards all carry a loss mask or none does (the kind says whether it needs one).
        masked = any(s.get("mask") is not None for s in entry["shards"])
        self.masks: list[np.memmap] | None = [] if masked else None
        checks: list[tuple[Path, str]] = []  # (file, its recorded CRC-32)
        for s in entry["shards"]:
            n = int(s["n_tokens"])
            self.shards.append(self._map(s["bin"], self.dtype, n))
            self.offsets.append(self._map(s["idx"], np.dtype(np.uint64), int(s["n_docs"]) + 1))
            if self.masks is not None:
                if s.get("mask") is None:
                    raise UserError(self.no_mask(s["bin"]))
                self.masks.append(self._map(s["mask"], np.dtype(np.uint8), n))
            checks += [(self.data_dir / s[key], want) for key, want in s.get("crc32", {}).items() if key in s]
        _verify(checks, manifest_path)  # the sizes are right: now the bytes
        self.n_tokens: int = sum(len(s) for s in self.shards)
        self.n_docs: int = int(entry["n_docs"])  # for preference data: conversations, two per pair
        self._files = _ShardFiles([self.data_dir / s["bin"] for s in entry["shards"]])

    def shard_entries(self) -> list[dict[str, Any]]:
        """The manifest's entries of this split's shards."""
        return self.manifest.splits[self.split]["shards"]

    def no_mask(self, shard: str) -> str:
        """The message for a shard of data that needs a loss mask but lists no mask file."""
        return (f"{self.data_dir / MANIFEST}: {self.kind} shard {shard} lists no loss mask file; the data is "
                f"damaged, run `nanolm prepare --format {self.kind}` again")

    def _map(self, name: str, dtype: np.dtype, count: int) -> np.memmap:
        path = self.data_dir / name
        size = path.stat().st_size if path.is_file() else None
        if size != count * dtype.itemsize:
            found = "it is missing" if size is None else f"found {size}"
            raise UserError(f"{path}: expected {count * dtype.itemsize} bytes ({count} x {dtype.name}), {found}; "
                            "the data is damaged, run `nanolm prepare` again")
        if count == 0:  # numpy cannot map an empty file
            return np.zeros(0, dtype=dtype)  # type: ignore[return-value]
        return np.memmap(path, dtype=dtype, mode="r", shape=(count,))

    def n_windows(self, seq_len: int) -> np.ndarray:
        """Windows of seq_len + 1 tokens per shard."""
        return np.array([max(0, (len(s) - 1) // seq_len) for s in self.shards], dtype=np.int64)

    def gather(self, windows: np.ndarray, seq_len: int) -> np.ndarray:
        """Global window ids (B,) -> int64 tokens (B, seq_len + 1).

        Each window is one `os.pread` from its shard's file into a (B, seq_len + 1)
        buffer of the shard dtype, so no page of the data is mapped into the process
        (see the module doc); where os.pread is missing (Windows), one fancy index
        per shard into the memory maps.
        """
        counts = self.n_windows(seq_len)
        starts = np.concatenate([[0], np.cumsum(counts)])
        windows = np.asarray(windows, dtype=np.int64)
        shard = np.searchsorted(starts, windows, side="right") - 1
        local = windows - starts[shard]  # window index within its shard
        if not hasattr(os, "pread"):
            out = np.empty((len(windows), seq_len + 1), dtype=np.int64)
            cols = np.arange(seq_len + 1)
            for s in np.unique(shard):
                rows = np.nonzero(shard == s)[0]
                out[rows] = self.shards[s][local[rows, None] * seq_len + cols]  # (b, T+1)
            return self.check_ids(out, shard)
        buf = np.empty((len(windows), seq_len + 1), dtype=self.dtype)  # (B, T+1)
        row_bytes = buf.shape[1] * self.dtype.itemsize
        for i, (s, w) in enumerate(zip(shard.tolist(), local.tolist())):
            self._files.read_into(s, w * seq_len * self.dtype.itemsize, buf[i], row_bytes)
        return self.check_ids(buf.astype(np.int64), shard)

    def check_ids(self, ids: np.ndarray, shard: np.ndarray | int) -> np.ndarray:
        """ids (rows read from shard[row], or all from one shard), after checking that each is in the
        vocabulary: a damaged shard would otherwise index past the embedding (on CUDA, a device-side assert)."""
        if ids.size and ids.max() >= self.vocab_size:
            row = np.argwhere(ids >= self.vocab_size)[0]
            s = shard if isinstance(shard, int) else int(shard[row[0]])
            name = self.shard_entries()[s]["bin"]
            raise UserError(f"{self.data_dir / name}: holds token id {int(ids[tuple(row)])}, outside the vocabulary "
                            f"of {self.vocab_size} tokens ({MANIFEST}); the data is damaged, run `nanolm prepare` "
                            "again")
        return ids

    def doc_ids(self, shard: int, start: int, length: int) -> np.ndarray:
        """The int64 ids of one document (`documents` gives where each is), checked to be in the vocabulary."""
        return self.check_ids(np.asarray(self.shards[shard][start:start + length], dtype=np.int64), shard)

    def documents(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, start, length) of every document in split order, int64 each; length without the EOT."""
        shards, starts, lengths = [], [], []
        for i, o in enumerate(self.offsets):
            o = np.asarray(o, dtype=np.int64)
            sizes = np.diff(o)  # each document holds at least its EOT
            if len(o) == 0 or o[0] != 0 or o[-1] != len(self.shards[i]) or (sizes < 1).any():
                name = self.shard_entries()[i]["idx"]
                raise UserError(f"{self.data_dir / name}: document offsets do not run from 0 up to the shard's "
                                f"{len(self.shards[i])} tokens; the data is damaged, run `nanolm prepare` again")
            shards.append(np.full(len(sizes), i, dtype=np.int64))
            starts.append(o[:-1])
            lengths.append(sizes - 1)
        return np.concatenate(shards), np.concatenate(starts), np.concatenate(lengths)
