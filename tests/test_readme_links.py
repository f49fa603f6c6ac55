"""The documentation's links resolve: a relative link names a file of the repository (and its #anchor a
heading of it); the files, commands' scripts and tests it names in backquotes exist. Covers the READMEs,
every page under docs/ and bench/RESULTS.md; the README names the test command CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
READMES = ["README.md", "README_zh.md"]
PAGES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))
RESULTS = ["bench/RESULTS.md"]
DOCS = READMES + PAGES + RESULTS
LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH = re.compile(r"`((?:bench|tests|nanolm|recipes|docs)/[\w/.-]+\.(?:py|sh|toml|md))`")


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    out = set()
    for line in text.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return out


def checked(doc: str) -> int:
    """Check one file's relative links (resolved from its own directory, as GitHub does) and the files it
    names in backquotes (from the repository root); return how many were checked."""
    seen = 0
    source = ROOT / doc
    text = source.read_text(encoding="utf-8")
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (source.parent / path).resolve() if path else source
        assert file.exists(), f"{doc}: link to {target}, which does not exist"
        assert file.is_relative_to(ROOT), f"{doc}: link to {target}, outside the repository"
        if anchor and file.suffix == ".md":
            assert anchor in anchors(file.read_text(encoding="utf-8")), f"{doc}: no heading for {target}"
        seen += 1
    for path in PATH.findall(text):
        assert (ROOT / path).exists(), f"{doc}: names {path}, which does not exist"
        seen += 1
    return seen


def test_every_relative_link_and_named_file_of_the_docs_exists():
    assert len(PAGES) >= 8, f"docs/ holds {PAGES}"
    seen = {doc: checked(doc) for doc in DOCS}
    assert sum(seen[d] for d in READMES) > 10, seen
    assert sum(seen[d] for d in PAGES) > 10 * len(PAGES) // 2, seen
    assert seen["bench/RESULTS.md"] > 10, seen
    for page in PAGES:
        assert seen[page] >= 3, f"{page}: only {seen[page]} links or named files"


def test_every_docs_page_links_back_to_the_readme_and_the_readme_to_every_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for page in PAGES + RESULTS:
        assert "](../README.md)" in (ROOT / page).read_text(encoding="utf-8"), f"{page}: no link to the README"
        assert f"]({page})" in readme, f"README.md: no link to {page}"
        assert f"]({page})" in (ROOT / "README_zh.md").read_text(encoding="utf-8"), f"README_zh.md: no link to {page}"


def test_the_readme_names_the_test_command_ci_runs():
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"^test:", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M)
    assert "make test" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_a_broken_link_would_be_found(tmp_path):
    assert not (ROOT / "README_missing.md").exists()
    assert "a-heading" in anchors("## A heading\ntext")
