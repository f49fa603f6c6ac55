r"""Tokenize text files into the token shards training reads (`nanolm prepare`): one driver over every kind of
data.

Output, in `out`: the token shards and `manifest.json` of
nanolm/data/shards.py (which owns the format and writes the shards), the
manifest telling what was made from what: the source files with size, mtime
and sha256, the options, skipped lines, throughput, and the kind's own
section. What is made of the records (documents for pretraining,
conversations with a loss mask, preference pairs, RL prompts, input and output
blocks) is the data kind's, named by `PrepareConfig.format`: one class each in
nanolm/data/kinds/, which reads and validates its records, encodes them, and
says what goes in the manifest and the summary. This module holds no kind's
name and asks no kind what it is.

Train/validation split: the records are numbered 0, 1, 2, ... across all
sources in order, and with k = max(2, round(1 / val_fraction)) record i goes
to val when i % k == 1, to train otherwise. So record 0 is always training
data and any corpus of two or more records has a validation record. What a
record is, is the kind's (a document, a conversation, a pair of them, a
prompt); text also splits a long document by position
(nanolm/data/kinds/text.py). The split is deterministic; the manifest's
"split_policy" says which rule applied to how many records. val_fraction=0
means no validation split.

Tokenization streams, for the kinds that can (text, chat, pairs): the main
process reads pieces of records (the kind's `records`), sends them in chunks
to `workers` spawned processes (each loads the tokenizer once) and writes
results in input order, with at most a few chunks in flight per worker, so
memory stays flat however large the input. The bytes written do not depend on
the number of workers. The kinds whose sets are small (prompts, blocks) are
read and tokenized in this process (the kind's `write`), through the same
driver.

The whole directory, manifest included, is written anew beside out
(`nanolm.io.atomic_directory`: `.tmp-<name>-<pid>`) and takes out's place
in one rename at the end, so an interrupted run leaves the previous data
untouched, or the new data whole, never a manifest that points at partial
shards; a failed write (a full disk) leaves out as it was and says how
much space the data needs. What a killed run left is cleared by the next one
(a run killed between moving the old data aside and the new into place puts
the old data back). Since out is replaced whole, it may hold nothing but
prepared data: another file in it is refused, named, before any work. Running
again with the same inputs (path, size, mtime and sha256 of every source),
tokenizer and options does nothing and says so.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from nanolm.corpora import expand_sources
from nanolm.data import kinds
from nanolm.data.kinds.base import Chunk, DataKind, PrepareConfig, Record, load_state
from nanolm.data.provenance import check_replaceable, sha256_of, source_stat, val_every
from nanolm.data.shards import MANIFEST, SPLITS, Manifest, SplitWriter, TokenizerRef, shards_intact
from nanolm.errors import UserError
from nanolm.io import atomic_directory, remove_leftovers, space_note, write_failure
from nanolm.progress import Progress, fmt_bytes
from nanolm.tokenizer import Tokenizer

__all__ = ["PrepareConfig", "prepare", "run", "val_every"]

BATCH_CHARS = 1 << 20  # characters of text per chunk sent to a worker
BATCH_PIECES = 4096  # ... or this many pieces, whichever comes first
INFLIGHT_PER_WORKER = 2  # chunks queued per worker: keeps workers busy, memory bounded


def prepare(sources: Sequence[Path], tokenizer_path: Path, out_dir: Path, **options: Any) -> Manifest:
    """Tokenize `sources` (.txt/.jsonl files or directories of them) into shards in out_dir:
    `run(PrepareConfig(sources, tokenizer_path, out_dir, **options))`, options being PrepareConfig's other
    fields (format, max_tokens, block_len, val_fraction, workers, skip_bad, shard_tokens, quiet)."""
    return run(PrepareConfig(list(sources), tokenizer_path, out_dir, **options))


def run(cfg: PrepareConfig) -> Manifest:
    """Prepare cfg.out from cfg.sources as the kind cfg.format (module doc). Returns the manifest; when cfg.out is
    already up to date, returns the existing manifest without doing anything."""
    k = val_every(cfg.val_fraction)
    out_dir = cfg.out
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir}: exists and is not a directory; choose another output directory")
    files = expand_sources(cfg.sources)
    kind_class = kinds.get(cfg.format)
    kind_class.check_sources(files)
    tok = Tokenizer.load(cfg.tokenizer)
    kind = kind_class(cfg, tok)
    kind.check_tokenizer()
    before = [source_stat(f) for f in files]
    log = (lambda msg: None) if cfg.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    if out_dir.parent.is_dir():
        remove_leftovers(out_dir.parent, out_dir.name)  # a killed run's new directory, or its old one put back
    old = _read_manifest(out_dir)
    if _up_to_date(old, kind, before):
        log(f"{out_dir}: up to date (same sources, tokenizer and options); nothing to do")
        return old  # type: ignore[return-value]
    check_replaceable(out_dir)
    how = f"{cfg.workers} worker(s)" if kind.streams else "in this process"
    log(f"prepare: {len(files)} file(s), {fmt_bytes(sum(s['size'] for s in before))}, {kind.plan()}tokenizer vocab "
        f"{tok.vocab_size} ({kind.dtype.name}), {how} -> {out_dir}")
    manifest, seconds = _write(kind, files, before, k)
    for line in kind.summary(manifest, seconds):
        log(line)
    return manifest


def _write(kind: DataKind, files: list[Path], before: list[dict[str, Any]], k: int) -> tuple[Manifest, float]:
    """Write the kind's data and its manifest into a new directory that then takes cfg.out's place (module doc);
    (the manifest, seconds spent encoding). A failed write is a UserError saying how much space the data needs."""
    cfg, out_dir = kind.cfg, kind.cfg.out
    sizes = [s["size"] for s in before]
    total = sum(sizes)
    # Hash the sources on a thread while tokenizing (hashlib and file reads release the GIL).
    hasher, stop_hashing = ThreadPoolExecutor(1), threading.Event()
    writers: dict[str, SplitWriter] = {}  # per split, writing into the new directory (below)
    consumed = [0]  # input bytes whose tokens went to the writers: sizes the data if a write fails

    def consume(chunk: Chunk, *result: Any) -> None:
        """The kind's `consume`, with a failed write (a full disk) told apart from a failed read of the sources."""
        consumed[0] += chunk.nbytes
        try:
            kind.consume(writers, chunk, *result)
        except OSError as e:
            raise _WriteError("the token shards", e) from e
        progress.update(chunk.nbytes)

    try:
        with atomic_directory(out_dir, replace=True) as tmp:
            writers.update({split: SplitWriter(tmp, split, kind.dtype, cfg.shard_tokens, with_mask=kind.masked,
                                               group=kind.group) for split in SPLITS})
            hashes_future = hasher.submit(lambda: [sha256_of(f, stop_hashing) for f in files])
            start = time.perf_counter()
            if kind.streams:
                with Progress(total, "tokenizing", unit="B", scale_bytes=True, enabled=not cfg.quiet) as progress:
                    _tokenize(_batches(files, sizes, k, kind.records), kind.job, consume, kind.tok, kind.dtype,
                              cfg.workers)
            else:
                kind.write(tmp, files, writers)
            seconds = time.perf_counter() - start
            try:
                splits = {split: w.finish() for split, w in writers.items()}
            except OSError as e:
                raise _WriteError("the token shards", e) from e
            hashes = hashes_future.result()
            for f, b in zip(files, before):
                if source_stat(f) != b:
                    raise UserError(f"{f}: changed while prepare was reading it; run `nanolm prepare` again "
                                    "once nothing writes to it")
            manifest = _manifest(kind, files, splits, [{**b, "sha256": h} for b, h in zip(before, hashes)], k,
                                 seconds)
            try:
                manifest.write(tmp)
            except OSError as e:
                raise _WriteError(MANIFEST, e) from e
    except _WriteError as e:
        for w in writers.values():
            w.discard()  # (the new directory is already removed, before the free space is measured)
        # The shards' size, extrapolated from what was written for the input consumed so far; plus the manifest.
        written = sum(w.written for w in writers.values())
        needed = (written * total // consumed[0] if consumed[0] else written) + (1 << 16)
        raise UserError(f"{out_dir}: could not write {e.part} ({write_failure(e.err)}); "
                        f"{space_note(out_dir.parent, needed)}; {out_dir} is left as it was; free some space and run "
                        "`nanolm prepare` again") from None
    finally:
        stop_hashing.set()
        hasher.shutdown(wait=True)
        for w in writers.values():
            w.discard()
    return manifest, seconds


def _manifest(kind: DataKind, files: list[Path], splits: dict[str, dict[str, Any]], sources: list[dict[str, Any]],
              k: int, seconds: float) -> Manifest:
    """The manifest of what the kind wrote from `files` (UserError when that is no document at all)."""
    kind.finish_splits(splits)
    n_tokens = sum(s["n_tokens"] for s in splits.values())
    n_docs = sum(s["n_docs"] for s in splits.values())
    if n_docs == 0:
        raise UserError(kind.empty(files))
    total, tok = sum(s["size"] for s in sources), kind.tok
    throughput = {"seconds": round(seconds, 3), "workers": kind.cfg.workers,
                  "mb_per_s": round(total / 1e6 / seconds, 3) if seconds > 0 else None,
                  "tokens_per_s": round(n_tokens / seconds, 1) if seconds > 0 else None}
    return Manifest(kind=kind.name, tokenizer=TokenizerRef(tok.fingerprint, tok.vocab_size, str(tok.path), tok.eot_id),
                    dtype=kind.dtype.name, splits=splits, options=kind.options(),
                    totals={"n_tokens": n_tokens, "n_docs": n_docs, "bytes": total}, sources=sources,
                    split_policy=kind.split_policy(k, n_docs), skipped=kind.skipped(),
                    throughput=throughput if kind.records_throughput else None,
                    section=kind.section(splits, n_docs),
                    created=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def _read_manifest(out_dir: Path) -> Manifest | None:
    try:
        return Manifest.read(out_dir)
    except UserError:
        return None


def _up_to_date(old: Manifest | None, kind: DataKind, stats: list[dict[str, Any]]) -> bool:
    """Whether the output directory already holds exactly what this run would write."""
    out_dir = kind.cfg.out
    try:
        same = (old is not None and old.tokenizer.fingerprint == kind.tok.fingerprint
                and old.options == kind.options()
                and [{k: s[k] for k in ("path", "size", "mtime_ns")} for s in old.sources] == stats
                and shards_intact(out_dir, old) and kind.intact(out_dir))
        # size and mtime can stay the same across an edit; the content hash cannot.
        return same and all(s["sha256"] == sha256_of(Path(s["path"])) for s in old.sources)  # type: ignore[union-attr]
    except (AttributeError, KeyError, TypeError, ValueError, OSError):
        return False


# --- the streaming worker pool -----------------------------------------------------

_worker: dict[str, Any] = {}


def _init_worker(tokenizer_file: str, dtype: str, eot: int) -> None:
    # Ctrl-C goes to the whole process group; only the parent handles it (it
    # terminates the pool), so the terminal is not flooded with worker tracebacks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # One thread per worker: the worker processes are the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker.update(load_state(tokenizer_file, dtype, eot))


def _run_in_worker(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(_worker, *args)


def _batches(files: list[Path], sizes: list[int], k: int,
             records: Callable[[Path], Iterator[Record]]) -> Iterator[Chunk]:
    """The items of all files in order, grouped into chunks, each tagged with its document's split."""
    doc = 0
    batch = Chunk()
    for path, size in zip(files, sizes):
        read = 0
        for item, last, chars, nbytes, split in records(path):
            batch.items.append(item)
            batch.lasts.append(last)
            batch.is_val.append(k > 0 and doc % k == 1 if split is None else split == "val")
            batch.chars += chars
            batch.nbytes += nbytes
            read += nbytes
            doc += last and split != "train"  # a long document's train head and val tail are one document
            if batch.chars >= BATCH_CHARS or len(batch.items) >= BATCH_PIECES:
                yield batch
                batch = Chunk()
        batch.nbytes += size - read  # trailing blank or skipped lines, so progress ends at 100%
    if batch.items or batch.nbytes:
        yield batch


class _WriteError(Exception):
    """A write into the output failed (e.g. a full disk), told apart from a failed read of the sources."""

    def __init__(self, part: str, err: OSError) -> None:
        super().__init__(f"{part}: {err}")
        self.part, self.err = part, err


def _tokenize(batches: Iterator[Chunk], job: Callable[[Chunk], tuple], consume: Callable[..., None],
              tok: Tokenizer, dtype: np.dtype, workers: int) -> None:
    """Run `job(chunk)` = (function, args) on every chunk and `consume(chunk, *result)`, in input order.

    The function is called as function(state, *args), state holding the loaded tokenizer (`load_state`).
    """
    if workers == 0:
        state = load_state(str(tok.path), dtype.str, tok.eot_id)
        for batch in batches:
            fn, args = job(batch)
            consume(batch, *fn(state, *args))
        return
    # spawn, not fork: a forked child would inherit the parent's tokenizers
    # thread pool and torch state; spawn is also what macOS and Windows use.
    # ProcessPoolExecutor rather than Pool: if a worker dies (or its initializer
    # fails) it raises BrokenProcessPool where Pool would respawn workers forever.
    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                               initargs=(str(tok.path), dtype.str, tok.eot_id))
    try:
        # Submitting everything up front (or Pool.imap) would read the whole
        # input ahead; a bounded queue of futures keeps memory flat and the
        # output in input order.
        pending: collections.deque = collections.deque()
        for batch in batches:
            if len(pending) >= INFLIGHT_PER_WORKER * workers:
                done, future = pending.popleft()
                consume(done, *future.result())
            fn, args = job(batch)
            pending.append((batch, pool.submit(_run_in_worker, fn, *args)))
            # The submitted call holds the lists until they are sent; free them after.
            batch.items = []
        while pending:
            done, future = pending.popleft()
            consume(done, *future.result())
    except BrokenProcessPool:
        raise UserError("a tokenizer worker process died (its error is printed above); when calling prepare() "
                        "from your own script, call it under `if __name__ == \"__main__\":`, "
                        "or pass workers=0") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
