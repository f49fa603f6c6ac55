"""The chat page's markup, one file for both pages that show it: `nanolm serve`'s and `nanolm export web`'s.

static/chat.html holds what the two pages share once; the lines only one of them has stand between a marker
line `<!-- serve only -->` or `<!-- web only -->` and the next marker (`<!-- / -->` returns to what both
share). Kept free of FastAPI, which `nanolm export web` does not need.
"""

from __future__ import annotations

from importlib.resources import files

PAGES = ("serve", "web")
_BOTH = "<!-- / -->"


def page_markup(page: str) -> str:
    """static/chat.html as `page` ("serve" or "web") shows it: what both share and its own lines, no marker."""
    if page not in PAGES:
        raise ValueError(f"page {page!r}: one of {', '.join(PAGES)}")
    markers = {f"<!-- {p} only -->": p for p in PAGES} | {_BOTH: None}
    text = (files(__package__) / "static" / "chat.html").read_text(encoding="utf-8")
    out, only = [], None
    for line in text.splitlines(keepends=True):
        if line.strip() in markers:
            only = markers[line.strip()]
        elif only in (None, page):
            out.append(line)
    return "".join(out)
