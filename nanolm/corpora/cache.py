"""The corpus cache on disk: where a corpus is kept, whether the copy there is intact, and writing it.

    cache_dir()/corpora/<name>/<name>.jsonl   one record per line, UTF-8
    cache_dir()/corpora/<name>/SOURCE.json    package, version, members, licence, checksums, counts
    cache_dir()/corpora/<name>/LICENSE        the licence file the archive carries, if any
    cache_dir()/corpora/<name>/<archive>      an archive the user put there by hand (used, never deleted)

This module is the one writer and reader of SOURCE.json. It is written last,
so its presence marks a complete, verified corpus directory.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Mapping, Sequence

from nanolm import __version__
from nanolm.corpora.registry import Corpus, PinnedArchive
from nanolm.errors import UserError
from nanolm.io import write_bytes_atomic


def cache_dir() -> Path:
    """$NANOLM_CACHE, else $XDG_CACHE_HOME/nanolm, else ~/.cache/nanolm (read at each call)."""
    env = os.environ.get("NANOLM_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "nanolm"
    return Path.home() / ".cache" / "nanolm"


def corpus_dir(name: str) -> Path:
    return cache_dir() / "corpora" / name


def jsonl_path(name: str) -> Path:
    """The cached .jsonl of corpus `name` (there or not)."""
    return corpus_dir(name) / f"{name}.jsonl"


def by_hand_path(entry: PinnedArchive) -> Path:
    """Where an archive a user downloads by hand goes, under its own file name; it is used instead of downloading.
    (A corpus's or a model's: `cache_dir()/<kind>/<name>/<archive>`.)"""
    return cache_dir() / entry.kind / entry.name / entry.archive


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_cached_file(entry: PinnedArchive, path: Path, fetch_again: str) -> Path:
    """`path`, the cached file of `entry`, if it has the pinned `entry.sha256`; else a UserError saying to delete
    the entry's folder and `fetch_again` (the words or command that fetch it anew)."""
    digest = sha256_file(path)
    if digest != entry.sha256:
        raise UserError(f"{path}: sha256 is {digest}, expected {entry.sha256} ({entry.package} {entry.version}); "
                        f"the cached file was edited or damaged: delete {cache_dir() / entry.kind / entry.name} "
                        f"and {fetch_again}")
    return path


def is_complete(name: str) -> bool:
    """True when corpus `name` has been fetched (its SOURCE.json is there); nothing is verified."""
    return (corpus_dir(name) / "SOURCE.json").is_file()


def is_cached(corpus: Corpus) -> bool:
    """True when the corpus is cached and intact; False when absent or from another registry entry."""
    out_dir = corpus_dir(corpus.name)
    jsonl = jsonl_path(corpus.name)
    source_path = out_dir / "SOURCE.json"
    if not (jsonl.is_file() and source_path.is_file()):
        return False
    try:
        source = json.loads(source_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    if not isinstance(source, dict):  # damaged: fetch anew
        return False
    # Written by another nanolm whose registry pinned something else: fetch anew.
    if (source.get("package"), source.get("version"), source.get("sha256")) != \
            (corpus.package, corpus.version, corpus.sha256):
        return False
    check_cached_file(corpus, jsonl, "fetch again")
    return True


def save(corpus: Corpus, data: bytes, licence: bytes | None, *, members: Sequence[str], n_docs: int,
         n_chars: int, skipped: Mapping[str, int]) -> None:
    """Write a verified corpus: `data` is its .jsonl (sha256 `corpus.sha256`), `licence` its LICENSE.

    `members` are the archive members read, `skipped` what the extractor left
    out (reason -> count); both are recorded in SOURCE.json, written last.
    """
    out_dir = corpus_dir(corpus.name)
    jsonl = jsonl_path(corpus.name)
    write_bytes_atomic(jsonl, data)
    if licence is not None:
        write_bytes_atomic(out_dir / "LICENSE", licence)
    source = {
        "name": corpus.name,
        "description": corpus.description,
        "language": corpus.language,
        "records": corpus.records,
        "package": corpus.package,
        "version": corpus.version,
        "archive": corpus.archive,
        "archive_sha256": corpus.archive_sha256,
        "members": sorted(members),
        "licence": corpus.licence,
        "licence_file": "LICENSE" if licence is not None else None,
        "licence_member": corpus.licence_member,
        "file": jsonl.name,
        "sha256": corpus.sha256,
        "n_docs": n_docs,
        "n_chars": n_chars,
        "skipped": dict(sorted(skipped.items())),
        "fetched_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "nanolm_version": __version__,
    }
    text = json.dumps(source, ensure_ascii=False, indent=2) + "\n"
    write_bytes_atomic(out_dir / "SOURCE.json", text.encode("utf-8"))
