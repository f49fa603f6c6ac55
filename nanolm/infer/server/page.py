"""The chat web page of `nanolm serve`: `GET /` (static/chat.html's serve lines, `markup.page_markup`) and the
files it loads, shipped in static/.

Plain HTML, CSS and JavaScript with no build step and nothing fetched from anywhere else. The page is
a client of the same /v1 API as any other (it streams /v1/chat/completions, and has the server run calls of
its built-in tools through /v1/tools/run, never anything the model wrote as code); it needs no API key to be
loaded, and the user types the key, if the server has one, into the page. The Content-Security-Policy
lets the page load and connect to this server only and run no inline script, a second line of defence:
chat.js and chatui.js (what it shares with `nanolm export web`'s page) only ever set the model's output as
text, so it cannot run as code.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi.responses import Response
from starlette.exceptions import HTTPException

from nanolm.infer.server.markup import page_markup

# What the page may do: load this server's files and talk to this server, nothing inline, no <base> or
# form targets, and not be framed by another site.
CSP = "default-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}
# The files under /static/ and their content types; nothing else in the package is served.
STATIC_TYPES = {"chat.js": "text/javascript; charset=utf-8", "chatui.js": "text/javascript; charset=utf-8",
                "chat.css": "text/css; charset=utf-8"}


def _read(name: str) -> bytes:
    return (files(__package__) / "static" / name).read_bytes()


def chat_page() -> Response:
    return Response(page_markup("serve").encode("utf-8"), media_type="text/html; charset=utf-8", headers=HEADERS)


def static_file(name: str) -> Response:
    if name not in STATIC_TYPES:
        raise HTTPException(404, f"no static file {name!r}; the chat page's are {', '.join(STATIC_TYPES)}")
    return Response(_read(name), media_type=STATIC_TYPES[name], headers=HEADERS)
