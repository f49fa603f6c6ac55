"""What answers a request before a route, or instead of one: the API-key and same-origin middleware, and the
exception handlers that turn every failure into OpenAI's error body (`ApiError`: one a route raises on purpose;
a bug: 500, its traceback in the server's log only). Imported only when a server is built (the `serve` extra)."""

from __future__ import annotations

import hmac
import sys
import traceback
import uuid
from typing import Any, Callable

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from nanolm.infer.server.schemas import error_body, validation_error


class ApiError(Exception):
    """A failure to answer with `status` and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", unread: bool = False) -> None:
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)
        self.unread = unread  # answered before the body was read whole: the connection closes after it


async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status == 429 else {}
    if exc.unread:  # rather than reading and discarding the rest of a body refused part-way
        headers["Connection"] = "close"
    return JSONResponse(exc.body, status_code=exc.status, headers=headers or None)


async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = validation_error(list(exc.errors()))
    return JSONResponse(error_body(message, param=param), status_code=400)


async def _http_error(_request: Request, exc: HTTPException) -> JSONResponse:
    return JSONResponse(error_body(str(exc.detail), code="not_found" if exc.status_code == 404 else None),
                        status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def _bug(request: Request, exc: Exception) -> JSONResponse:
    """A bug: its traceback goes to the server's log, the client learns only that there was one (an exception's
    text can hold paths and internals)."""
    ref = uuid.uuid4().hex[:12]
    print(f"nanolm serve: internal error {ref} on {request.method} {request.url.path}:\n"
          + "".join(traceback.format_exception(exc)), file=sys.stderr, flush=True)
    return JSONResponse(error_body(f"internal error {ref}; the server's log has the details", "server_error"),
                        status_code=500)


ERROR_HANDLERS: list[tuple[type[Exception], Callable[..., Any]]] = [
    (ApiError, _api_error), (RequestValidationError, _invalid), (HTTPException, _http_error), (Exception, _bug)]


class BearerAuth:
    """ASGI middleware: paths under /v1 need `Authorization: Bearer <api_key>`.

    Checked before anything else (even before a malformed body is parsed), so a client without
    the key learns nothing but that it needs one.
    """

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode("utf-8")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            # The scheme's name is case-insensitive (RFC 9110, 11.1): `bearer KEY` is `Bearer KEY`.
            scheme, _, key = given.partition(b" ")
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(b" "), self.expected)):
                what = "a wrong API key" if given else "no API key"
                body = error_body(f"this server needs an API key and the request has {what}; "
                                  "send the header `Authorization: Bearer <key>`", code="invalid_api_key")
                await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


def _host_name(host: str) -> str:
    """The name of a Host header value or of an origin's host[:port], without the port."""
    if host.startswith("["):
        return host[:host.index("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class SameOrigin:
    """ASGI middleware: a web page the user visits may not drive the server.

    A request carrying an `Origin` (browsers send one with every cross-origin request, and with same-origin
    POSTs) must come from the server's own origin: its scheme-less host and port equal the request's `Host`;
    otherwise 403, before the body is read. A server listening on loopback also answers only requests
    addressed to a loopback name (`Host` localhost, 127.0.0.1 or [::1]), so a page cannot reach it through a
    name of its own that resolves to 127.0.0.1 (DNS rebinding). Clients that send no Origin (SDKs, curl) pass.
    """

    def __init__(self, app: Any, loopback: bool) -> None:
        self.app, self.loopback = app, loopback

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            host = headers.get(b"host", b"").decode("latin-1").strip().lower()
            origin = headers.get(b"origin", b"").decode("latin-1").strip().lower()
            problem = None
            if self.loopback and _host_name(host) not in LOOPBACK_HOSTS:
                problem = (f"this server listens on loopback and answers only requests to localhost, 127.0.0.1 or "
                           f"[::1], not to {host or 'no host'!r}; use one of those names")
            elif origin and origin.partition("://")[2] != host:
                problem = (f"a page from {origin} may not use this server (cross-origin request refused); call it "
                           "from its own page or from a program, which sends no Origin")
            if problem is not None:
                body = error_body(problem, code="forbidden")
                await JSONResponse(body, status_code=403)(scope, receive, send)
                return
        await self.app(scope, receive, send)
