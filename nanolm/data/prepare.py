r"""Tokenize text files into the token shards training reads (`nanolm prepare`).

Output, in `out_dir`: the token shards and `manifest.json` of
nanolm/data/shards.py (which owns the format and writes the shards), the
manifest telling what was made from what: the source files with size, mtime
and sha256, the options, skipped lines, throughput. Each document's tokens
are followed by one `<|endoftext|>` (id 0); chat and preference data carry a
loss mask (see "Chat data" and "Preference data" below).

Train/validation split, by document or by position: documents are numbered
0, 1, 2, ... across all sources in order, and with k = max(2, round(1 /
val_fraction)) a short document i goes to val when i % k == 1, to train
otherwise. So document 0 is always training data and any corpus of two or
more documents has a validation document. A text document of at least
`LONG_DOC_CHARS` characters (a few training windows) is split by position
instead, as nanoGPT splits its one file: of its n characters (as read: BOM
dropped, line ends LF), the first int(n * (1 - val_fraction)) go to train and
the rest to val, each part ending with `<|endoftext|>`, so one big file gets
a held-out split. A .txt file in several pieces is counted once ahead (a read
of the file, no tokenizing) to find where that cut falls. The split is
deterministic; the manifest's "split_policy" says which rule applied to how
many documents. val_fraction=0 means no validation split.

Tokenization streams: the main process reads pieces of documents
(`nanolm.data.formats`), sends them in batches to `workers` spawned processes
(each loads the tokenizer once) and writes results in input order, with at
most a few batches in flight per worker, so memory stays flat however large
the input. The bytes written do not depend on the number of workers.

Chat data (`format="chat"`): each conversation (read by `iter_chat_records`
of nanolm.data.formats) becomes one document: its ids and loss mask in the
tokenizer's chat layout (`nanolm.data.chatml.encode_chats`: exactly the ids of
`tok.encode(fmt.render(messages, tools))`, the mask on the assistant turns), then
`<|endoftext|>` (mask 0). A conversation longer than `max_tokens` tokens is
cut by ChatML's truncation policy (`fit_conversation`), or skipped when no
target would be left; both are counted in the manifest.

Preference data (`format="dpo"`): each pair (read by `iter_preferences`)
becomes two adjacent documents, its chosen conversation then its rejected
one, rendered as chat data is, but with the mask on the final reply only
(DPO compares the log-probabilities of the two final replies). The split is
by pair (pair i goes to val when i % k == 1), a shard ends only after a
pair's second conversation, and `max_tokens` applies to each conversation,
both cut by `fit_pair` (the same old turns dropped from both); a pair is
skipped when either would keep no target. The manifest gives
`options.format = "dpo"` and a "dpo" section with the number of pairs.

The whole directory, manifest included, is written anew beside out_dir
(`nanolm.io.atomic_directory`: `.tmp-<name>-<pid>`) and takes out_dir's place
in one rename at the end, so an interrupted run leaves the previous data
untouched, or the new data whole, never a manifest that points at partial
shards; a failed write (a full disk) leaves out_dir as it was and says how
much space the data needs. What a killed run left is cleared by the next one
(a run killed between moving the old data aside and the new into place puts
the old data back). Since out_dir is replaced whole, it may hold nothing but
prepared data: another file in it is refused, named, before any work. Running
again with the same inputs (path, size, mtime and sha256 of every source),
tokenizer and options does nothing and says so.
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
import warnings
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from nanolm.data.chatml import EOT, Conversation, Span, check_spelling, encode_chats, fit_conversation, fit_pair
from nanolm.data.provenance import check_replaceable, manifest_head, sha256_of, source_stat, val_every
from nanolm.data.formats import ReadStats, expand_sources, iter_chat_records, iter_pieces, iter_preference_records
from nanolm.data.shards import (FORMAT_VERSION, MANIFEST, SPLITS, SplitWriter, shards_intact, token_dtype,
                                write_splits)
from nanolm.errors import UserError
from nanolm.io import atomic_directory, remove_leftovers, space_note, write_failure, write_json_atomic
from nanolm.progress import Progress, fmt_bytes, fmt_count, fmt_duration
from nanolm.tokenizer import Tokenizer

FORMATS = ("text", "chat", "dpo", "prompts", "blocks")
DEFAULT_MAX_TOKENS = 1024  # conversations longer than this are truncated (chat and preference data)

BATCH_CHARS = 1 << 20  # characters of text per batch sent to a worker
BATCH_PIECES = 4096  # ... or this many pieces, whichever comes first
INFLIGHT_PER_WORKER = 2  # batches queued per worker: keeps workers busy, memory bounded


# A text document at least this long (in characters, ~16 windows of 512 tokens) gives its tail to validation.
LONG_DOC_CHARS = 1 << 15


def split_policy(k: int, val_fraction: float, by_position: int, n_docs: int, dpo: bool = False,
                 chat: bool = False) -> dict[str, Any]:
    """The manifest's "split_policy": the rules and how many documents each took; `summary` is the line
    `nanolm prepare` and `nanolm train` print."""
    unit = "pair" if dpo else "conversation" if chat else "document"
    policy: dict[str, Any] = {"val_every": k, "rule": f"{'pair' if dpo else 'document'} i goes to val when val_every > "
                              "0 and i % val_every == 1"}
    if not (chat or dpo):
        policy.update(long_doc_chars=LONG_DOC_CHARS, by_position=by_position,
                      position_rule=f"a document of at least {LONG_DOC_CHARS} characters gives its last "
                                    f"val_fraction ({val_fraction:g}) of characters to val")
    if k == 0:
        summary = "none (val_fraction 0)"
    elif by_position and by_position == n_docs - by_position:  # each long document counts as its two parts
        summary = (f"by position: the last {val_fraction:.0%} of each of {by_position} long {unit}(s) "
                   f"(>= {LONG_DOC_CHARS:,} characters)")
    else:
        summary = f"by {unit}: 1 in {k} ({unit} i when i % {k} == 1)"
        if by_position:
            summary += (f"; by position: the last {val_fraction:.0%} of each of {by_position} long {unit}(s) "
                        f"(>= {LONG_DOC_CHARS:,} characters)")
    policy["summary"] = summary
    return policy


# --- worker side ---------------------------------------------------------------

_worker: dict[str, Any] = {}


def _init_worker(tokenizer_file: str, dtype: str) -> None:
    # Ctrl-C goes to the whole process group; only the parent handles it (it
    # terminates the pool), so the terminal is not flooded with worker tracebacks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # One thread per worker: the worker processes are the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker.update(_load_state(tokenizer_file, dtype))


def _load_state(tokenizer_file: str, dtype: str) -> dict[str, Any]:
    tok = HFTokenizer.from_file(tokenizer_file)
    return {"tok": tok, "file": tokenizer_file, "dtype": np.dtype(dtype), "eot": tok.token_to_id(EOT)}


def _run_in_worker(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(_worker, *args)


def _encode_pieces(state: dict[str, Any], texts: list[str], lasts: list[bool]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of the pieces, concatenated, with EOT after each piece that ends a document,
    and each piece's length (EOT included): (tokens [sum(lens)], lens [len(texts)] int64)."""
    ids = _encode(state["tok"], texts)
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


def _encode(tok: HFTokenizer, texts: list[str]) -> list[list[int]]:
    # encode_batch_fast (tokenizers >= 0.21) skips character offsets we never use.
    encode = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
    return [e.ids for e in encode(texts, add_special_tokens=False)]


def _encode_chats(state: dict[str, Any], convs: list[Conversation],
                  max_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """Ids and mask of each conversation (each followed by EOT, mask 0), fitted to max_tokens.

    Returns (tokens, mask, lens, n_truncated, n_too_long); lens[i] is conversation i's
    length with its EOT, 0 for one skipped as too long.
    """
    fmt = _chat_state(state).chat_format
    rendered = _encode_spans(state, [fmt.spans(c.messages, c.tools) for c in convs])
    out = _Documents(len(convs), state["dtype"], state["eot"])
    for i, (ids, mask) in enumerate(rendered):
        if len(ids) > max_tokens:
            fitted = fit_conversation(ids, mask, max_tokens)
            if fitted is None:
                out.too_long += 1
                continue
            out.truncated += 1
            ids, mask = fitted
        out.add(i, ids, mask)
    return out.result()


def _encode_pairs(state: dict[str, Any], pairs: list[tuple[Conversation, Conversation]],
                  max_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """Ids and mask of each pair's chosen and rejected conversation (each followed by EOT, mask 0), the
    mask on the final reply only, fitted to max_tokens together (`fit_pair`).

    Returns (tokens, mask, lens, n_truncated, n_too_long); lens[2i], lens[2i + 1] are the lengths of pair i's
    conversations with their EOT, both 0 for a pair skipped as too long.
    """
    fmt = _chat_state(state).chat_format
    # Earlier replies are context here: the loss (the sequence log-probability) is on the last one.
    rendered = _encode_spans(state, [fmt.spans(c.messages, c.tools, final_only=True) for pair in pairs for c in pair])
    out = _Documents(2 * len(pairs), state["dtype"], state["eot"])
    for i in range(len(pairs)):
        chosen, rejected = rendered[2 * i], rendered[2 * i + 1]
        if max(len(chosen[0]), len(rejected[0])) > max_tokens:
            fitted = fit_pair(chosen, rejected, max_tokens)
            if fitted is None:
                out.too_long += 1
                continue
            out.truncated += 1
            chosen, rejected = fitted
        out.add(2 * i, *chosen)
        out.add(2 * i + 1, *rejected)
    return out.result()


def _chat_state(state: dict[str, Any]) -> Tokenizer:
    """The worker's nanolm Tokenizer (its chat layout, the bytes of its tokens), loaded on first use."""
    if "tokenizer" not in state:
        state["tokenizer"] = Tokenizer.load(state["file"])
        state["lengths"] = state["tokenizer"].spelled_lengths()
    return state["tokenizer"]


def _encode_spans(state: dict[str, Any], spans: list[list[Span]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """`chatml.encode_chats` of the conversations' spans, the texts encoded in one batch; the first one is also
    checked to be spelled byte for byte by its tokens (`chatml.check_spelling`)."""
    texts = ["".join(s.text for s in sp) for sp in spans]
    ids = _encode(state["tok"], texts)
    if texts:
        check_spelling(texts[0], ids[0], _chat_state(state).token_bytes(), state["file"])
    return encode_chats(spans, ids, state["lengths"], state["file"])


class _Documents:
    """The documents a chat or pair job gives back: each one's ids and mask followed by EOT (mask 0), and
    how many were truncated or skipped as too long."""

    def __init__(self, n: int, dtype: np.dtype, eot: int) -> None:
        self.dtype = dtype
        self.eot = np.array([eot], dtype=np.int64)
        self.ids: list[np.ndarray] = []
        self.mask: list[np.ndarray] = []
        self.lens = np.zeros(n, dtype=np.int64)  # 0 for a document left out
        self.truncated = self.too_long = 0

    def add(self, i: int, ids: np.ndarray, mask: np.ndarray) -> None:
        self.ids += [ids, self.eot]
        self.mask += [mask, np.zeros(1, dtype=np.uint8)]
        self.lens[i] = len(ids) + 1

    def result(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
        """(tokens, mask, lens, n_truncated, n_too_long)."""
        if not self.ids:
            return np.zeros(0, dtype=self.dtype), np.zeros(0, dtype=np.uint8), self.lens, self.truncated, self.too_long
        return (np.concatenate(self.ids).astype(self.dtype), np.concatenate(self.mask), self.lens,
                self.truncated, self.too_long)


# --- main side -------------------------------------------------------------------

@dataclass
class _Batch:
    # Text pieces, conversations ((role, content)s) or preference pairs ((prompt, chosen, rejected)).
    items: list = field(default_factory=list)
    lasts: list[bool] = field(default_factory=list)  # per item: whether it ends a document
    is_val: list[bool] = field(default_factory=list)  # per document (a pair counts as one)
    chars: int = 0
    nbytes: int = 0


# What a reader yields per item: (item, ends a document, characters, bytes read, split), split None for the
# document rule (i % k == 1), else "train" or "val" (a part of a long document split by position).
Record = tuple[Any, bool, int, int, "str | None"]


def _batches(files: list[Path], sizes: list[int], k: int,
             records: Callable[[Path], Iterator[Record]]) -> Iterator[_Batch]:
    """The items of all files in order, grouped into batches, each tagged with its document's split."""
    doc = 0
    batch = _Batch()
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
                batch = _Batch()
        batch.nbytes += size - read  # trailing blank or skipped lines, so progress ends at 100%
    if batch.items or batch.nbytes:
        yield batch


def _text_records(skip_bad: bool, stats: ReadStats, val_fraction: float,
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


def _chars(conv: Conversation) -> int:
    return sum(len(m.content) + len(m.reasoning) + sum(len(c.arguments) for c in m.tool_calls)
               for m in conv.messages) + sum(map(len, conv.tools))


def _chat_records(skip_bad: bool, stats: ReadStats, tok: Tokenizer) -> Callable[[Path], Iterator[Record]]:
    """Conversations, each one that the tokenizer's chat layout can render."""
    def records(path: Path) -> Iterator[Record]:
        for conv, nbytes in iter_chat_records(path, skip_bad=skip_bad, stats=stats, fmt=tok.chat_format,
                                              tokenizer=str(tok.path)):
            yield conv, True, _chars(conv), nbytes, None
    return records


def _pair_records(skip_bad: bool, stats: ReadStats, tok: Tokenizer) -> Callable[[Path], Iterator[Record]]:
    """Preference pairs as (chosen, rejected) conversations; a pair is one item and one split entry."""
    def records(path: Path) -> Iterator[Record]:
        for pair, nbytes in iter_preference_records(path, skip_bad=skip_bad, stats=stats, fmt=tok.chat_format,
                                                    tokenizer=str(tok.path)):
            yield pair, True, _chars(pair[0]) + len(pair[1].messages[-1].content), nbytes, None
    return records


def _read_manifest(out_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out_dir / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _up_to_date(old: dict[str, Any] | None, out_dir: Path, fingerprint: str, options: dict[str, Any],
                stats: list[dict[str, Any]]) -> bool:
    """Whether out_dir already holds exactly what this run would write."""
    try:
        same = (old is not None and old.get("version") == FORMAT_VERSION
                and old["tokenizer"]["fingerprint"] == fingerprint and old["options"] == options
                and [{k: s[k] for k in ("path", "size", "mtime_ns")} for s in old["sources"]] == stats
                and shards_intact(out_dir, old))
        # size and mtime can stay the same across an edit; the content hash cannot.
        return same and all(s["sha256"] == sha256_of(Path(s["path"])) for s in old["sources"])  # type: ignore[index]
    except (AttributeError, KeyError, TypeError, ValueError, OSError):
        return False


class _WriteError(Exception):
    """A write into the output failed (e.g. a full disk), told apart from a failed read of the sources."""

    def __init__(self, part: str, err: OSError) -> None:
        super().__init__(f"{part}: {err}")
        self.part, self.err = part, err


def _tokenize(batches: Iterator[_Batch], job: Callable[[_Batch], tuple], consume: Callable[..., None],
              tokenizer_file: Path, dtype: np.dtype, workers: int) -> None:
    """Run `job(batch)` = (function, args) on every batch and `consume(batch, *result)`, in input order.

    The function is called as function(state, *args), state holding the loaded tokenizer.
    """
    if workers == 0:
        state = _load_state(str(tokenizer_file), dtype.str)
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
                               initargs=(str(tokenizer_file), dtype.str))
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


def prepare(sources: Sequence[Path], tokenizer_path: Path, out_dir: Path, *, format: str = "text",
            max_tokens: int = DEFAULT_MAX_TOKENS, val_fraction: float = 0.01, workers: int = 2,
            skip_bad: bool = False, shard_tokens: int = 100_000_000, block_len: int = 0,
            quiet: bool = False) -> dict[str, Any]:
    """Tokenize `sources` (.txt/.jsonl files or directories of them) into shards in out_dir.

    tokenizer_path: tokenizer.json or the directory holding it. format: "text"
    (pretraining documents), "chat" (conversations, .jsonl only, stored with a
    loss mask) or "dpo" (preference pairs, .jsonl only, each stored as its two
    conversations with a mask on their final replies) or "prompts" (RL prompts
    with their records, nanolm/data/prompts.py) or "blocks" (input and output
    blocks for --stage blocks, nanolm/data/blocks.py; block_len: the longest
    input and output, and where Nano's one-sequence records are cut). max_tokens: the longest
    conversation kept whole (chat and dpo; see the module doc for the truncation
    policy). workers: tokenizer processes, one
    thread each (0 tokenizes in this process, on the thread pool of `tokenizers`).
    Returns the manifest; when out_dir is already up to date, returns the
    existing manifest without doing anything.
    """
    k = val_every(val_fraction)
    if format not in FORMATS:
        raise UserError(f"format={format!r}: must be one of {', '.join(FORMATS)} "
                        "(text: documents for pretraining; chat: conversations for fine-tuning; "
                        "dpo: preference pairs; prompts: RL prompts for --stage grpo; blocks: input and output "
                        "blocks for --stage blocks)")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise UserError(f"workers={workers!r}: must be an integer >= 0 (0 tokenizes in the main process)")
    if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise UserError(f"shard_tokens={shard_tokens!r}: must be a positive integer (tokens per shard file)")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise UserError(f"max_tokens={max_tokens!r}: must be a positive integer (the longest conversation kept "
                        "whole, in tokens; at most the training seq_len + 1)")
    if format == "prompts":  # RL prompts: small sets, validated and tokenized in this process
        from nanolm.data.prompts import prepare_prompts
        return prepare_prompts(sources, tokenizer_path, out_dir, max_tokens=max_tokens, val_fraction=val_fraction,
                               skip_bad=skip_bad, shard_tokens=shard_tokens, quiet=quiet)
    if format == "blocks":  # input/output records: small sets, tokenized in this process
        from nanolm.data.blocks import prepare_blocks
        return prepare_blocks(sources, tokenizer_path, out_dir, block_len=block_len, val_fraction=val_fraction,
                              skip_bad=skip_bad, shard_tokens=shard_tokens, quiet=quiet)
    chat, dpo = format == "chat", format == "dpo"
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir}: exists and is not a directory; choose another output directory")
    files = expand_sources(sources)
    if chat or dpo:
        for f in files:
            if f.suffix.lower() != ".jsonl":
                what = "chat data must be .jsonl (one conversation per line)" if chat else \
                    "preference data must be .jsonl (one pair per line)"
                raise UserError(f"{f}: {what}; leave this file out, or prepare it with --format text")
    tok = Tokenizer.load(tokenizer_path)
    if (chat or dpo) and tok.chat_format.tools and tok.missing_tags():
        warnings.warn(f"{tok.path}: lacks {', '.join(tok.missing_tags())} as added tokens; the chat template writes "
                      "them, so each is spelled in several tokens (longer sequences, a tag the model must learn to "
                      "spell). Add them to the tokenizer (tokenizers' add_tokens, then resize the model's "
                      "embeddings) or train one with `nanolm tokenizer train`", stacklevel=2)
    dtype = token_dtype(tok.vocab_size)
    options: dict[str, Any] = {"val_fraction": val_fraction, "skip_bad": skip_bad, "shard_tokens": shard_tokens}
    if chat or dpo:
        options = {"format": format, "max_tokens": max_tokens, **options}
    else:  # text: the split rule of long documents is part of what was made
        options["long_doc_chars"] = LONG_DOC_CHARS
    split_counts = {"by_position": 0}
    before = [source_stat(f) for f in files]
    log = (lambda msg: None) if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    if out_dir.parent.is_dir():
        remove_leftovers(out_dir.parent, out_dir.name)  # a killed run's new directory, or its old one put back

    if _up_to_date(_read_manifest(out_dir), out_dir, tok.fingerprint, options, before):
        log(f"{out_dir}: up to date (same sources, tokenizer and options); nothing to do")
        return _read_manifest(out_dir)  # type: ignore[return-value]
    check_replaceable(out_dir)

    sizes = [s["size"] for s in before]
    total = sum(sizes)
    what = f"chat, max {max_tokens} tokens per conversation, " if chat else \
        f"preference pairs, max {max_tokens} tokens per conversation, " if dpo else ""
    log(f"prepare: {len(files)} file(s), {fmt_bytes(total)}, {what}tokenizer vocab {tok.vocab_size} ({dtype.name}), "
        f"{workers} worker(s) -> {out_dir}")
    # Hash the sources on a thread while tokenizing (hashlib and file reads release the GIL).
    hasher, stop_hashing = ThreadPoolExecutor(1), threading.Event()
    stats = ReadStats()
    fitting = {"truncated": 0, "too_long": 0}
    writers: dict[str, SplitWriter] = {}  # per split, writing into the new directory (below)

    def consume_text(batch: _Batch, tokens: np.ndarray, lens: np.ndarray) -> None:
        write_splits(writers, np.array(batch.is_val, dtype=bool), tokens, lens, np.array(batch.lasts, dtype=bool))
        progress.update(batch.nbytes)

    def consume_chat(batch: _Batch, tokens: np.ndarray, mask: np.ndarray, lens: np.ndarray, truncated: int,
                     too_long: int) -> None:
        kept = lens > 0  # conversations skipped as too long have no tokens
        write_splits(writers, np.array(batch.is_val, dtype=bool)[kept], tokens, lens[kept],
                      np.ones(int(kept.sum()), dtype=bool), mask)
        fitting["truncated"] += truncated
        fitting["too_long"] += too_long
        progress.update(batch.nbytes)

    def consume_pairs(batch: _Batch, tokens: np.ndarray, mask: np.ndarray, lens: np.ndarray, truncated: int,
                      too_long: int) -> None:
        kept = lens > 0  # both conversations of a pair skipped as too long have no tokens
        is_val = np.repeat(np.array(batch.is_val, dtype=bool), 2)[kept]
        write_splits(writers, is_val, tokens, lens[kept], np.ones(int(kept.sum()), dtype=bool), mask)
        fitting["truncated"] += truncated
        fitting["too_long"] += too_long
        progress.update(batch.nbytes)

    consumed = [0]  # input bytes whose tokens went to the writers: sizes the data if a write fails

    def writing(consume: Callable[..., None]) -> Callable[..., None]:
        """`consume`, with a failed write (a full disk) told apart from a failed read of the sources."""
        def run(batch: _Batch, *result: Any) -> None:
            consumed[0] += batch.nbytes
            try:
                consume(batch, *result)
            except OSError as e:
                raise _WriteError("the token shards", e) from e
        return run

    try:
        # The whole directory is written anew beside out_dir and takes its place in one rename at the end.
        with atomic_directory(out_dir, replace=True) as tmp:
            writers.update({split: SplitWriter(tmp, split, dtype, shard_tokens, with_mask=chat or dpo,
                                               group=1 + dpo) for split in SPLITS})
            hashes_future = hasher.submit(lambda: [sha256_of(f, stop_hashing) for f in files])
            start = time.perf_counter()
            with Progress(total, "tokenizing", unit="B", scale_bytes=True, enabled=not quiet) as progress:
                if chat:
                    _tokenize(_batches(files, sizes, k, _chat_records(skip_bad, stats, tok)),
                              lambda b: (_encode_chats, (b.items, max_tokens)), writing(consume_chat), tok.path,
                              dtype, workers)
                elif dpo:
                    _tokenize(_batches(files, sizes, k, _pair_records(skip_bad, stats, tok)),
                              lambda b: (_encode_pairs, (b.items, max_tokens)), writing(consume_pairs), tok.path,
                              dtype, workers)
                else:
                    _tokenize(_batches(files, sizes, k, _text_records(skip_bad, stats, val_fraction, split_counts)),
                              lambda b: (_encode_pieces, (b.items, b.lasts)), writing(consume_text), tok.path,
                              dtype, workers)
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
            n_tokens = sum(s["n_tokens"] for s in splits.values())
            n_docs = sum(s["n_docs"] for s in splits.values())
            if dpo:
                for split in splits.values():
                    split["n_pairs"] = split["n_docs"] // 2
            if n_docs == 0:
                if dpo:
                    raise UserError(f"no preference pairs in {', '.join(map(str, files))} ({stats.bad_lines} bad "
                                    f"line(s) skipped, {fitting['too_long']} with a conversation longer than "
                                    f"max_tokens={max_tokens}); check the files, or raise --max-tokens")
                if chat:
                    raise UserError(f"no conversations in {', '.join(map(str, files))} ({stats.bad_lines} bad line(s) "
                                    f"skipped, {fitting['too_long']} longer than max_tokens={max_tokens}); check the "
                                    "files, or raise --max-tokens")
                raise UserError(f"no documents in {', '.join(map(str, files))} (all empty or skipped); "
                                "check that the files hold text")
            manifest: dict[str, Any] = {
                **manifest_head(tok, dtype, splits, n_docs, [{**b, "sha256": h} for b, h in zip(before, hashes)],
                                options, split_policy(k, val_fraction, split_counts["by_position"], n_docs, dpo,
                                                      chat)),
                "skipped": {"bad_lines": stats.bad_lines, "examples": stats.examples, "empty_docs": stats.empty_docs},
                "throughput": {"seconds": round(seconds, 3), "workers": workers,
                               "mb_per_s": round(total / 1e6 / seconds, 3) if seconds > 0 else None,
                               "tokens_per_s": round(n_tokens / seconds, 1) if seconds > 0 else None},
            }
            if chat:
                n_trainable = sum(s["n_trainable"] for s in splits.values())
                manifest["chat"] = {"template": tok.chat_format.name, "mask": True, "max_tokens": max_tokens,
                                    "n_trainable": n_trainable, "truncated": fitting["truncated"],
                                    "skipped_too_long": fitting["too_long"]}
            if dpo:
                n_trainable = sum(s["n_trainable"] for s in splits.values())
                manifest["dpo"] = {"template": tok.chat_format.name, "mask": "final reply", "max_tokens": max_tokens,
                                   "n_pairs": n_docs // 2, "n_trainable": n_trainable,
                                   "truncated": fitting["truncated"], "skipped_too_long": fitting["too_long"]}
            try:
                write_json_atomic(tmp / MANIFEST, manifest)
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

    tr, va = splits["train"], splits["val"]
    docs = "conversations" if chat else "preference pairs" if dpo else "documents"
    log(f"prepared {fmt_count(n_docs // 2 if dpo else n_docs)} {docs}, {fmt_count(n_tokens)} tokens "
        f"(train {fmt_count(tr['n_tokens'])} in {len(tr['shards'])} shard(s), "
        f"val {fmt_count(va['n_tokens'])} in {len(va['shards'])}) from {fmt_bytes(total)} in {fmt_duration(seconds)}: "
        f"{total / 1e6 / max(seconds, 1e-9):.2f} MB/s of text, {fmt_count(n_tokens / max(seconds, 1e-9))} tokens/s")
    if chat:
        log(f"trainable (assistant) tokens: {fmt_count(n_trainable)} = {100 * n_trainable / n_tokens:.1f}% of all; "
            f"truncated {fitting['truncated']} conversation(s) longer than {max_tokens} tokens, skipped "
            f"{fitting['too_long']} that could not be cut to fit")
    if dpo:
        log(f"trainable (final reply) tokens: {fmt_count(n_trainable)} = {100 * n_trainable / n_tokens:.1f}% of all; "
            f"truncated {fitting['truncated']} pair(s) with a conversation longer than {max_tokens} tokens, skipped "
            f"{fitting['too_long']} that could not be cut to fit")
    log(f"validation split: {manifest['split_policy']['summary']}")
    if k and va["n_docs"] == 0:
        one = "pair" if dpo else docs[:-1]
        log(f"note: only one {one}, so there is no validation split; give more {docs} for one")
    if stats.bad_lines:
        log(f"skipped {stats.bad_lines} bad line(s) (--skip-bad), first: " + " | ".join(stats.examples))
    if stats.empty_docs:
        log(f"skipped {stats.empty_docs} empty document(s)")
    return manifest
