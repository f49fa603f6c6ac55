"""What a data kind is: the `DataKind` class every kind of prepared data derives from, the registry of kinds,
what prepare gives a kind (`PrepareConfig`, `Chunk`) and what a kind gives the loader (`UnitKind`).

A kind is one class (nanolm/data/kinds/text.py, chat.py, pairs.py, prompts.py,
blocks.py): its name (`--format`, the manifest's `options.format` and the name
of its manifest section), how it reads and validates its records, encodes them
(in prepare's worker processes, for the kinds that stream), writes its shards,
its manifest section, its summary and its "empty" message, and how the loader
reads a split of it (`units`). The driver (nanolm/data/prepare.py) and the
loader (nanolm/data/loader.py) look a kind up by name (`get`) and never switch
on it; a new kind is one class and one `register` call.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Protocol, Sequence

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from nanolm.data.formats import iter_pieces
from nanolm.data.jsonl import ReadStats
from nanolm.data.provenance import val_every
from nanolm.data.shards import RENAMED_KINDS, Batch, Manifest, PackedData, SplitWriter, token_dtype
from nanolm.errors import UserError
from nanolm.progress import fmt_bytes, fmt_count, fmt_duration
from nanolm.tokenizer import Tokenizer

# What the batches of text windows and packed conversations are (`DataKind.mixes_as`): rows of next-token
# inputs and targets of seq_len, which a curriculum or mixture can take from either.
TOKEN_ROWS = "token rows"
DEFAULT_MAX_TOKENS = 1024  # conversations longer than this are truncated (chat and preference data)

Splits = dict[str, dict[str, Any]]  # the manifest's "splits": per split, what `SplitWriter.finish` gives and more


# --- the registry ------------------------------------------------------------------

_KINDS: dict[str, type[DataKind]] = {}


def register(kind: type[DataKind]) -> type[DataKind]:
    """Make `kind` known by its name (to `nanolm prepare --format`, the manifest reader and the loader)."""
    if not isinstance(getattr(kind, "name", None), str) or not kind.name or kind.name in RENAMED_KINDS:
        raise ValueError(f"{kind!r}: a data kind needs a name of its own")
    _KINDS[kind.name] = kind
    return kind


def names() -> list[str]:
    """The registered kinds' names, in the order they were registered."""
    return list(_KINDS)


def choices() -> list[str]:
    """What `--format` accepts: the kinds' names, then the old names still read as them."""
    return names() + [old for old, new in RENAMED_KINDS.items() if new in _KINDS]


def get(name: str, where: str = "") -> type[DataKind]:
    """The kind registered as `name` (or under its old name); UserError naming `where` (a manifest) if none is."""
    kind = _KINDS.get(RENAMED_KINDS.get(name, name))
    if kind is None:
        raise UserError(f"{where + ': ' if where else ''}unknown data kind {name!r} (this nanolm reads "
                        f"{', '.join(names())}); run `nanolm prepare` again")
    return kind


def kinds_help() -> str:
    """`--format`'s help: each kind's name and what it reads."""
    return "; ".join(f"{k.name}: {k.help}" for k in _KINDS.values())


def texts_help() -> str:
    """`nanolm tokenizer train --format`'s help: each kind's name and what a tokenizer trains on from it."""
    return "; ".join(f"{k.name}: {k.texts_help}" for k in _KINDS.values())


def iter_texts(files: Sequence[Path], *, format: str = "text", skip_bad: bool = False,
               stats: ReadStats | None = None) -> Iterator[str]:
    """What a tokenizer trains on from `files` of kind `format` (`DataKind.texts`), in order, in pieces of
    bounded size."""
    return get(format).texts(files, skip_bad=skip_bad, stats=stats)


def mix_refusal(a: type[DataKind], b: type[DataKind]) -> str:
    """Why data of kinds a and b cannot be the sets of one stream (a curriculum or mixture), and the fix; "" when
    they can (`DataKind.mixes_as`)."""
    if a.mixes_as and a.mixes_as == b.mixes_as:
        return ""
    for kind in sorted((a, b), key=lambda k: bool(k.mixes_as)):  # a kind that trains alone says why first
        if kind.mix_fix:
            return kind.mix_fix
    return f"{a.name} and {b.name} data cannot be mixed: train them in runs of their own"


def stream_kind(kinds: Sequence[type[DataKind]]) -> type[DataKind]:
    """The kind a stream of sets of these kinds (in order, mixable) trains as: their kind when they are one, else
    the first whose batches carry segments (a text/chat mix trains as chat data: its batches may carry
    segments, which the attention must keep apart), else the first."""
    if len(set(kinds)) == 1:
        return kinds[0]
    return next((k for k in kinds if k.segments), kinds[0])


# --- what prepare is given -----------------------------------------------------------

def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _positive(name: str, value: Any, what: str, least: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise UserError(f"{name}={value!r}: must be {'a positive integer' if least == 1 else f'an integer >= {least}'}"
                        f" ({what})")


@dataclass
class PrepareConfig:
    """What `nanolm prepare` makes, from what (its command-line options are generated from these fields).

    sources: .txt/.jsonl files or directories of them (built-in corpus names are resolved by the CLI); tokenizer:
    tokenizer.json or the directory holding it; out: the data directory, replaced whole; format: the data kind
    (`names()`; "dpo" is read as "pairs"); max_tokens: the longest conversation kept whole (chat and pairs; see
    nanolm/data/kinds/chat.py for the truncation policy) or prompt kept (prompts); block_len: the longest input
    and output of a block record (blocks); workers: tokenizer processes, one thread each (0 tokenizes in this
    process, on the thread pool of `tokenizers`); shard_tokens: tokens per shard file.
    """

    # On the command line, names of built-in corpora too (strings: the CLI resolves them to their files).
    sources: list[Path] = field(metadata={"positional": True, "nargs": "+", "type": str,
                                          "help": "built-in corpora and/or .txt/.jsonl files or directories"})
    tokenizer: Path = field(metadata={"help": "tokenizer directory (or tokenizer.json)"})
    out: Path = field(metadata={"help": "output directory for shards + manifest.json"})
    format: str = field(default="text", metadata={"choices": choices, "help": kinds_help})
    max_tokens: int = field(default=DEFAULT_MAX_TOKENS, metadata={
        "help": "chat: longest conversation kept; longer ones lose their oldest exchanges first (pairs: each "
                "conversation of a pair; prompts: the longest prompt kept)"})
    block_len: int = field(default=0, metadata={
        "help": "blocks: the longest input and output (longer records are refused; 0: any) and where a "
                "{\"text\": ...} record is cut into its input and output"})
    val_fraction: float = field(default=0.01, metadata={"help": "share of the documents held out for validation"})
    workers: int = field(default_factory=default_workers, metadata={"help": "tokenizer processes"})
    skip_bad: bool = field(default=False, metadata={"help": "skip malformed JSONL lines and report the count"})
    shard_tokens: int = field(default=100_000_000, metadata={"help": "tokens per shard file"})
    # SFT augmentations (chat), as MiniMind applies them: each conversation's own draw from `seed` and its place
    # in the input, so the data written does not depend on the workers.
    system_ratio: float = field(default=0.0, metadata={
        "help": "chat: share of the conversations without a system message given one of the built-in system "
                "prompts"})
    empty_think_ratio: float = field(default=0.0, metadata={
        "help": "chat: share of the conversations whose replies without reasoning train on their empty think "
                "block too"})
    seed: int = field(default=0, metadata={"help": "chat: the augmentations' seed"})
    quiet: bool = field(default=False, metadata={"help": "print nothing but errors"})

    def __post_init__(self) -> None:
        self.sources = [Path(s) for s in self.sources]
        self.tokenizer, self.out = Path(self.tokenizer), Path(self.out)
        val_every(self.val_fraction)  # checks it
        if self.format not in choices():
            raise UserError(f"format={self.format!r}: must be one of {', '.join(names())} ("
                            + "; ".join(f"{k.name}: {k.about}" for k in _KINDS.values()) + ")")
        self.format = get(self.format).name
        _positive("workers", self.workers, "0 tokenizes in the main process", least=0)
        _positive("shard_tokens", self.shard_tokens, "tokens per shard file")
        _positive("max_tokens", self.max_tokens, "the longest conversation kept whole, in tokens; at most the "
                  "training seq_len + 1")
        _positive("block_len", self.block_len, "0: no limit at prepare", least=0)
        for name in ("system_ratio", "empty_think_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise UserError(f"{name}={value!r}: must be a share from 0 to 1 (0: off)")
        _positive("seed", self.seed, "the augmentations' seed", least=0)


@dataclass
class Chunk:
    """Records read in order and sent to a worker as one job: text pieces, conversations or preference pairs."""

    items: list = field(default_factory=list)
    lasts: list[bool] = field(default_factory=list)  # per item: whether it ends a document
    is_val: list[bool] = field(default_factory=list)  # per document (a pair counts as one)
    chars: int = 0
    nbytes: int = 0


# What a kind's reader yields per item: (item, ends a document, characters, bytes read, split), split None for
# the document rule (i % k == 1), else "train" or "val" (a part of a long document split by position).
Record = tuple[Any, bool, int, int, "str | None"]


# --- the worker side of the kinds that stream ------------------------------------------

def load_state(tokenizer_file: str, dtype: str, eot: int) -> dict[str, Any]:
    """What a worker's encode function is given: the tokenizer ("tok"), its file, the token dtype and the id
    that ends a document (`Tokenizer.eot_id`: <|endoftext|>, or what plays its part, Llama 3's <|end_of_text|>)."""
    return {"tok": HFTokenizer.from_file(tokenizer_file), "file": tokenizer_file, "dtype": np.dtype(dtype),
            "eot": eot}


def encode_batch(tok: HFTokenizer, texts: list[str]) -> list[list[int]]:
    """The ids of each text, in one batch."""
    # encode_batch_fast (tokenizers >= 0.21) skips character offsets we never use.
    encode = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
    return [e.ids for e in encode(texts, add_special_tokens=False)]


# --- what the loader is given -------------------------------------------------------------

class Order(Protocol):
    """An epoch's units in their order: len() is how many there are (the epoch's count), and a contiguous
    slice [lo:hi] gives what `UnitKind.batch` takes for those units."""

    def __len__(self) -> int: ...

    def __getitem__(self, s: slice) -> Any: ...


class UnitKind(Protocol):
    """One kind of unit the Loader streams (see nanolm/data/loader.py): what it needs to know of the kind.

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


def pinned(batch: Batch, pin: bool) -> Batch:
    return batch.pin_memory() if pin else batch


class CountedUnits:
    """The loader's phrases for units counted one by one whatever seq_len is (block records, RL prompts): the
    count in `name` (the UnitKind's), and `held`: what `holds` calls them."""

    name: str
    held: str

    def holds(self, n_units: int) -> str:
        return f"{n_units} {self.held}"

    def needs(self, step: int) -> str:
        return f"{step} {self.name}; prepare more {self.name}, or lower batch_size"

    def amount(self, count: Any, seq_len: Any, again: bool = False) -> str:
        return f"{count} {self.name}"


# --- the kind ----------------------------------------------------------------------------

class DataKind:
    """One kind of prepared data. An instance prepares one directory of it (it holds the run's counts); the
    class reads a split of it for the loader (`units`).

    The driver calls, in order: `check_sources`, `check_tokenizer`, `options` (what makes the data what it is:
    a re-run with the same options, sources and tokenizer does nothing), `plan`; then, for a kind that streams,
    `records` per file, `job` per chunk (run in a worker) and `consume` per result, in input order; for one
    that does not, `write`; then `finish_splits`, `empty` (when no document was made), and the manifest's parts
    (`skipped`, `split_policy`, `section`) and the summary (`summary`).
    """

    name: ClassVar[str]  # --format, the manifest's options.format and the name of its section
    about: ClassVar[str]  # what it is, in a few words ("documents for pretraining")
    help: ClassVar[str]  # what its records look like, for `nanolm prepare --help`
    unit: ClassVar[str] = "document"  # what the split rule counts, in words
    rule_unit: ClassVar[str] = "document"  # ... as the manifest's split rule names it
    noun: ClassVar[str] = "documents"  # what the summary counts
    streams: ClassVar[bool] = True  # encoded by prepare's worker processes (else in this process, by `write`)
    masked: ClassVar[bool] = False  # its shards carry a loss mask
    group: ClassVar[int] = 1  # documents one record becomes, kept in one shard
    records_throughput: ClassVar[bool] = True  # the manifest records the run's throughput
    jsonl_only: ClassVar[str] = ""  # what its files must hold, when only .jsonl files can
    augments: ClassVar[bool] = False  # takes the SFT augmentations (system_ratio, empty_think_ratio)
    # Its batches pack several documents in a row, each a segment (Batch.pos and .seg): attention keeps them apart.
    segments: ClassVar[bool] = False
    # What its batches are: kinds with the same value can be the sets of one curriculum or mixture ("": the kind
    # trains alone); `mix_fix`: why it mixes with no other kind, and the fix, where it does not mix as TOKEN_ROWS.
    mixes_as: ClassVar[str] = TOKEN_ROWS
    mix_fix: ClassVar[str] = ""
    unscorable: ClassVar[str] = ""  # why `nanolm eval` cannot score its data as text, and the fix ("": it can)
    texts_help: ClassVar[str] = "the documents"  # what a tokenizer trains on from its files (`texts`)
    # The PrepareConfig fields that `options` records after the format, in the manifest's order.
    option_fields: ClassVar[tuple[str, ...]] = ("max_tokens", "val_fraction", "skip_bad", "shard_tokens")
    # What `texts` reads: a reader of one of its files giving (record, bytes read) per record, as
    # `formats.iter_chat_records` does, and the texts of one such record (both staticmethods); no reader: the
    # documents of .txt and {"text": ...} .jsonl files.
    read_records: ClassVar[Callable[..., Iterator[tuple[Any, int]]] | None] = None
    record_texts: ClassVar[Callable[[Any], Iterator[str]]]

    def __init__(self, cfg: PrepareConfig, tok: Tokenizer) -> None:
        for name in ("system_ratio", "empty_think_ratio"):
            if getattr(cfg, name) and not self.augments:
                raise UserError(f"{name}={getattr(cfg, name):g} augments conversations for fine-tuning, not "
                                f"{self.name} data; drop it")
        self.cfg, self.tok = cfg, tok
        self.dtype = token_dtype(tok.vocab_size)
        self.stats = ReadStats()

    # --- the loader side

    @classmethod
    def units(cls, data: PackedData, seq_len: int) -> UnitKind:
        """The units the loader streams from a split of this kind, at seq_len."""
        raise NotImplementedError

    # --- the tokenizer side

    @classmethod
    def texts(cls, files: Sequence[Path], *, skip_bad: bool = False, stats: ReadStats | None = None
              ) -> Iterator[str]:
        """What a tokenizer for this kind trains on from `files`, in order, in pieces of bounded size: the texts
        of each record `read_records` gives (`record_texts`), or the documents of .txt and {"text": ...} .jsonl
        files."""
        for f in files:
            if cls.read_records is None:
                yield from (piece.text for piece in iter_pieces(f, skip_bad=skip_bad, stats=stats))
            else:
                for record, _ in cls.read_records(f, skip_bad=skip_bad, stats=stats):
                    yield from cls.record_texts(record)

    # --- the prepare side

    @classmethod
    def check_sources(cls, files: list[Path]) -> None:
        """UserError for a file this kind cannot read (before the tokenizer loads)."""
        if cls.jsonl_only:
            for f in files:
                if f.suffix.lower() != ".jsonl":
                    raise UserError(f"{f}: {cls.jsonl_only}; leave this file out, or prepare it with --format text")

    def check_tokenizer(self) -> None:
        """Warn of what the tokenizer lacks for this kind."""

    def options(self) -> dict[str, Any]:
        """The manifest's "options": what makes the data what it is (beside the sources and the tokenizer): here
        the kind's name as "format", then its `option_fields` of the PrepareConfig."""
        return {"format": self.name, **{name: getattr(self.cfg, name) for name in self.option_fields}}

    def plan(self) -> str:
        """What is made, for the line prepare starts with: "chat, max 1024 tokens per conversation, "."""
        return ""

    def intact(self, out_dir: Path) -> bool:
        """Whether the files the kind writes beside the shards are in out_dir (an up-to-date check)."""
        return True

    def records(self, path: Path) -> Iterator[Record]:
        """The file's items in order (a kind that streams)."""
        raise NotImplementedError

    def job(self, chunk: Chunk) -> tuple[Callable[..., Any], tuple]:
        """(function, args) to run on a chunk in a worker, called as function(load_state(...), *args)."""
        raise NotImplementedError

    def consume(self, writers: dict[str, SplitWriter], chunk: Chunk, *result: Any) -> None:
        """Write a job's result (a kind that streams)."""
        raise NotImplementedError

    def write(self, tmp: Path, files: list[Path], writers: dict[str, SplitWriter]) -> None:
        """Read, encode and write every record (a kind that does not stream)."""
        raise NotImplementedError

    def finish_splits(self, splits: Splits) -> None:
        """Add the kind's counts to the manifest's splits."""

    def empty(self, files: list[Path]) -> str:
        """The error when no document was made."""
        return (f"no documents in {', '.join(map(str, files))} (all empty or skipped); check that the files hold "
                "text")

    def skipped(self) -> dict[str, Any]:
        """The manifest's "skipped"."""
        return {"bad_lines": self.stats.bad_lines, "examples": self.stats.examples,
                "empty_docs": self.stats.empty_docs}

    def position_policy(self) -> dict[str, Any]:
        """The split rule by position, where a kind has one (text)."""
        return {}

    def by_position(self) -> int:
        """Documents split by position."""
        return 0

    def split_policy(self, k: int, n_docs: int) -> dict[str, Any]:
        """The manifest's "split_policy": the rules and how many documents each took; `summary` is the line
        `nanolm prepare` and `nanolm train` print."""
        unit, by_position, val_fraction = self.unit, self.by_position(), self.cfg.val_fraction
        policy: dict[str, Any] = {"val_every": k,
                                  "rule": f"{self.rule_unit} i goes to val when val_every > 0 and i % val_every == 1"}
        policy.update(self.position_policy())
        long_chars = policy.get("long_doc_chars", 0)  # by_position > 0 only where the kind has a position rule
        if k == 0:
            summary = "none (val_fraction 0)"
        elif by_position and by_position == n_docs - by_position:  # each long document counts as its two parts
            summary = (f"by position: the last {val_fraction:.0%} of each of {by_position} long {unit}(s) "
                       f"(>= {long_chars:,} characters)")
        else:
            summary = f"by {unit}: 1 in {k} ({unit} i when i % {k} == 1)"
            if by_position:
                summary += (f"; by position: the last {val_fraction:.0%} of each of {by_position} long {unit}(s) "
                            f"(>= {long_chars:,} characters)")
        policy["summary"] = summary
        return policy

    def section(self, splits: Splits, n_docs: int) -> dict[str, Any] | None:
        """The kind's section of the manifest (stored under its name), if it has one."""
        return None

    def fitting(self, manifest: Manifest) -> list[str]:
        """Summary lines on what was cut or left out to fit, and what trains."""
        return []

    def summary(self, manifest: Manifest, seconds: float) -> list[str]:
        """The lines prepare ends with."""
        tr, va = manifest.splits["train"], manifest.splits["val"]
        n_docs, n_tokens, total = manifest.totals["n_docs"], manifest.totals["n_tokens"], manifest.totals["bytes"]
        lines = [f"prepared {fmt_count(n_docs // self.group)} {self.noun}, {fmt_count(n_tokens)} tokens "
                 f"(train {fmt_count(tr['n_tokens'])} in {len(tr['shards'])} shard(s), "
                 f"val {fmt_count(va['n_tokens'])} in {len(va['shards'])}) from {fmt_bytes(total)} in "
                 f"{fmt_duration(seconds)}: {total / 1e6 / max(seconds, 1e-9):.2f} MB/s of text, "
                 f"{fmt_count(n_tokens / max(seconds, 1e-9))} tokens/s",
                 *self.fitting(manifest),
                 f"validation split: {manifest.split_policy['summary']}"]
        if manifest.split_policy["val_every"] and va["n_docs"] == 0:
            lines.append(f"note: only one {self.unit}, so there is no validation split; give more {self.noun} for "
                         "one")
        if self.stats.bad_lines:
            lines.append(f"skipped {self.stats.bad_lines} bad line(s) (--skip-bad), first: "
                         + " | ".join(self.stats.examples))
        if self.stats.empty_docs:
            lines.append(f"skipped {self.stats.empty_docs} empty document(s)")
        return lines
