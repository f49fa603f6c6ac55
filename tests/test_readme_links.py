"""The READMEs' links resolve: a relative link names a file of the repository (and its #anchor a heading of
it); the files, commands' scripts and tests they name in backquotes exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "README_zh.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH = re.compile(r"`((?:bench|tests|nanolm|recipes)/[\w/.-]+\.(?:py|sh|toml))`")


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    out = set()
    for line in text.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return out


def test_every_relative_link_and_named_file_of_the_readmes_exists():
    seen = 0
    for doc in DOCS:
        text = (ROOT / doc).read_text(encoding="utf-8")
        for target in LINK.findall(text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = ROOT / path if path else ROOT / doc
            assert file.exists(), f"{doc}: link to {target}, which does not exist"
            if anchor and file.suffix == ".md":
                assert anchor in anchors(file.read_text(encoding="utf-8")), f"{doc}: no heading for #{anchor}"
            seen += 1
        for path in PATH.findall(text):
            assert (ROOT / path).exists(), f"{doc}: names {path}, which does not exist"
            seen += 1
    assert seen > 10


def test_a_broken_link_would_be_found(tmp_path):
    assert not (ROOT / "README_missing.md").exists()
    assert "a-heading" in anchors("## A heading\ntext")
