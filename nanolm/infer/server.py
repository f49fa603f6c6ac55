"""An OpenAI-compatible HTTP API over the generation engine: `nanolm serve`.

Endpoints: `GET /v1/models`, `POST /v1/chat/completions` (messages rendered
with the tokenizer's ChatML template) and `POST /v1/completions` (a prompt
continued), each streaming (server-sent events in OpenAI's chunk shapes) or
not, so the official `openai` client and tools built on it work unchanged.

One model serves every client, so generation is serialised: a single worker
thread runs one request at a time (each with its own KV cache), while the
event loop keeps accepting requests and hands each one's text over an asyncio
queue. At most `max_queue` requests are admitted at once (the one generating
included); the next gets 429. A client that goes away, mid-stream or while
waiting, cancels its request, which frees its place after at most one token.

Every failure a client causes is a 4xx with OpenAI's error body
`{"error": {"message", "type", "param", "code"}}`, never a 500. What one
request may cost is bounded before any work is done for it: a body over
`max_body_bytes` gets 413 without being read into memory, one that does not
arrive within `body_timeout_s` gets 408, a prompt whose
byte count alone shows it cannot fit the context is refused untokenized, and
at most MAX_STOPS stop strings are checked per token. `GET /health` (no API
key) says whether the server is up and how many requests it has admitted.
FastAPI and uvicorn are the `serve` extra, imported only when a server is built.
"""

# No `from __future__ import annotations` here: FastAPI reads the handlers'
# annotations at run time, and `Request` is imported inside `create_app`, out
# of reach of string annotations resolved against this module's globals.

import asyncio
import functools
import hmac
import json
import queue
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import Executor, Future
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Sequence

from nanolm.data.chatml import ROLE_NAMES, render_chat
from nanolm.errors import UserError
from nanolm.infer.engine import Engine, SamplingParams
from nanolm.infer.generate import check_vocab
from nanolm.infer.text import TextStream
from nanolm.tokenizer import Tokenizer

if TYPE_CHECKING:
    from fastapi import FastAPI

# How often a request that waits for tokens checks whether its client is still there.
DISCONNECT_POLL_S = 0.25
# A completion without max_tokens stops after this many tokens, as OpenAI's /v1/completions does;
# a chat reply without it may run to the end of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Every stop string is looked for after every token; OpenAI takes up to 4, so 16 leaves room and keeps
# that check from multiplying the worker's time per token (20 000 stop strings made it 50x slower).
MAX_STOPS = 16
# The default request size limit: a whole context of text, JSON-escaped, is far less for nanolm's models.
MAX_BODY_BYTES = 1 << 20
# A request body must arrive within this many seconds of its headers; a client that stops sending gets 408
# instead of holding its connection open for good.
BODY_TIMEOUT_S = 30.0


def _require_extra(*modules: str) -> None:
    for name in modules:
        try:
            __import__(name)
        except ImportError:
            raise UserError(f"nanolm serve needs FastAPI and uvicorn, and {name} is not installed; "
                            "pip install 'nanolm[serve]'") from None


# --- one generation request, run on the worker thread ----------------------------------------------

class _Job:
    """One request's generation: runs on the worker thread, posts events to its client's asyncio queue.

    Events: ("text", piece), then ("end", finish_reason, completion_tokens) or ("error", message).
    """

    def __init__(self, engine: Engine, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams,
                 stops: Sequence[str]) -> None:
        self.engine = engine
        self.tok = tokenizer
        self.prompt_ids = prompt_ids
        self.params = params
        self.stops = list(stops)
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()  # set when the client is gone or the server stops

    def _post(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancel.set()

    def run(self) -> None:
        try:
            if self.cancel.is_set() or not self._generate():
                self._post(("error", "the request was cancelled: the client went away or the server is stopping"))
        except Exception as e:  # reported to the client instead of dying silently in the thread
            self._post(("error", f"generation failed: {type(e).__name__}: {e}"))

    def _generate(self) -> bool:
        """Generate and post the events; False if cancelled before the end."""
        # The engine's own budget: it stops at max_new_tokens or the end of the context, or earlier at a stop
        # token (not yielded). Fewer tokens than the budget therefore means a stop token ended the reply.
        budget = min(self.params.max_new_tokens, self.engine.max_seq_len - len(self.prompt_ids))
        stop_ids = (self.tok.im_end_id, self.tok.eot_id)
        text = TextStream(self.tok, self.stops)
        n = 0  # tokens generated
        gen = self.engine.generate(self.prompt_ids, self.params, stop_ids)
        try:
            for tid in gen:
                n += 1
                self._emit(text.push(tid))
                if text.stopped:
                    self._post(("end", "stop", n))
                    return True
                if self.cancel.is_set():
                    return False
        finally:
            gen.close()  # frees the KV cache now, also when we leave early
        self._emit(text.finish())
        self._post(("end", "stop" if text.stopped or n < budget else "length", n))
        return True

    def _emit(self, piece: str) -> None:
        if piece:
            self._post(("text", piece))


class _DaemonThreadExecutor(Executor):
    """One daemon thread running submitted calls in order.

    ThreadPoolExecutor's threads are joined at interpreter exit, so a generation
    stuck behind a client that vanished could keep the process alive after the
    server is gone; a daemon thread cannot.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args, kwargs = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # handed to the awaiting coroutine
                fut.set_exception(e)

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Future:
        fut: Future = Future()
        self._queue.put((fut, fn, args, kwargs))
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._queue.put(None)
        if wait:
            self._thread.join(timeout=30)


class _Worker:
    """Runs jobs one at a time on a single thread; admits at most `max_queue` at once.

    Touched only from the event loop's thread, so the counter needs no lock.
    """

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.admitted = 0
        self.jobs: set[_Job] = set()
        self._executor: _DaemonThreadExecutor | None = None

    def submit(self, job: _Job) -> bool:
        """Queue the job; False when the queue is full."""
        if self.admitted >= self.max_queue:
            return False
        if self._executor is None:
            self._executor = _DaemonThreadExecutor("nanolm-generate")
        self.admitted += 1
        self.jobs.add(job)
        fut = job.loop.run_in_executor(self._executor, job.run)
        fut.add_done_callback(lambda _: self._release(job))
        return True

    def _release(self, job: _Job) -> None:
        self.admitted -= 1
        self.jobs.discard(job)

    def close(self) -> None:
        for job in list(self.jobs):
            job.cancel.set()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None


async def _events(request: Any, job: _Job) -> AsyncIterator[tuple]:
    """The job's events until its end; stops early, cancelling the job, when the client disconnects.

    The client is looked for every DISCONNECT_POLL_S, whether it waits in the queue or tokens flow (a
    non-streaming request has no other way to notice). A streaming response is also cancelled by the
    server when its client goes away; either way the `finally` tells the worker to stop.
    """
    checked = time.monotonic()
    try:
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), timeout=DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                event = None
            if time.monotonic() - checked >= DISCONNECT_POLL_S:
                if await request.is_disconnected():
                    return
                checked = time.monotonic()
            if event is None:
                continue
            yield event
            if event[0] != "text":
                return
    finally:
        job.cancel.set()


# --- request schemas ---------------------------------------------------------------------------------

@functools.cache
def _schemas() -> Any:
    """The request models, built on first use because pydantic comes with the serve extra."""
    from pydantic import BaseModel, ConfigDict, Field, field_validator

    class _Strict(BaseModel):
        # strict: "0.5" is not a number and 1 is not a bool; unknown OpenAI fields are ignored.
        model_config = ConfigDict(strict=True, extra="ignore")

    class StreamOptions(_Strict):
        include_usage: bool = False

    class Common(_Strict):
        model: str | None = None  # any name is accepted; responses carry the served model's name
        stream: bool = False
        stream_options: StreamOptions | None = None
        temperature: float = Field(1.0, ge=0, le=2)
        top_p: float = Field(1.0, gt=0, le=1)
        top_k: int = Field(0, ge=0)  # not OpenAI's; vLLM and others take it too (0 = off)
        max_tokens: int | None = Field(None, ge=1)
        stop: list[str] = []
        seed: int | None = Field(None, ge=-2**63, lt=2**64)  # what torch.Generator.manual_seed takes
        n: int = 1

        @field_validator("stop", mode="before")
        @classmethod
        def _stop_as_list(cls, v: Any) -> Any:
            return [] if v is None else [v] if isinstance(v, str) else v

        @field_validator("stop")
        @classmethod
        def _stop_not_empty(cls, v: list[str]) -> list[str]:
            if any(s == "" for s in v):
                raise ValueError("stop strings must not be empty")
            if len(v) > MAX_STOPS:
                raise ValueError(f"at most {MAX_STOPS} stop strings are allowed, got {len(v)}")
            return v

        @field_validator("n")
        @classmethod
        def _one_choice(cls, v: int) -> int:
            if v != 1:
                raise ValueError(f"nanolm returns one choice per request; n must be 1, got {v}")
            return v

    class Message(_Strict):
        role: str
        content: Any  # a string, or OpenAI's list of {"type": "text", "text": ...} parts

        @field_validator("role")
        @classmethod
        def _known_role(cls, v: str) -> str:
            if v not in ROLE_NAMES:
                raise ValueError(f"unknown role {v!r}; use one of {', '.join(ROLE_NAMES)}")
            return v

        @field_validator("content")
        @classmethod
        def _text(cls, v: Any) -> str:
            if isinstance(v, str):
                return v
            if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                            and isinstance(p.get("text"), str) for p in v):
                return "".join(p["text"] for p in v)
            raise ValueError('must be a string or a list of {"type": "text", "text": "..."} parts')

    class ChatRequest(Common):
        messages: list[Message]
        max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
        logprobs: bool | None = None

        @field_validator("messages")
        @classmethod
        def _not_empty(cls, v: list) -> list:
            if not v:
                raise ValueError("must hold at least one message")
            return v

        @field_validator("logprobs")
        @classmethod
        def _no_logprobs(cls, v: bool | None) -> bool | None:
            if v:
                raise ValueError("log probabilities are not supported")
            return v

    class CompletionRequest(Common):
        prompt: str
        echo: bool = False
        logprobs: int | None = None
        suffix: str | None = None

        @field_validator("echo", "logprobs", "suffix")
        @classmethod
        def _unsupported(cls, v: Any) -> Any:
            if v:
                raise ValueError("not supported")
            return v

    return ChatRequest, CompletionRequest


# --- responses ---------------------------------------------------------------------------------------

def _error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
                code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _param_name(loc: Sequence[Any]) -> str | None:
    """("messages", 0, "role") -> "messages[0].role"."""
    name = ""
    for part in loc:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name or None


def _validation_error(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """The first error as (message, param): one line a client can act on."""
    e = errors[0]
    loc = [p for p in e.get("loc", ()) if p != "body"]  # FastAPI puts request bodies under "body"
    param = _param_name(loc)
    msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else f"request body: {msg}"), param


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n".encode("utf-8")


class _Sizes:
    """A request's token counts, for the usage field."""

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


# --- the app -----------------------------------------------------------------------------------------

def max_token_bytes(tokenizer: Tokenizer) -> int:
    """The most UTF-8 bytes of text one token can stand for: a special token's name or the longest BPE token."""
    from nanolm.tokenizer import SPECIAL_TOKENS

    return max(int(tokenizer.token_byte_lengths().max()), *(len(s.encode("utf-8")) for s in SPECIAL_TOKENS))


def create_app(engine: Engine, tokenizer: Tokenizer, *, model_name: str, api_key: str | None = None,
               max_queue: int = 64, max_body_bytes: int = MAX_BODY_BYTES,
               body_timeout_s: float = BODY_TIMEOUT_S) -> "FastAPI":
    """The FastAPI app serving `engine` as `model_name`; with `api_key`, /v1 needs `Authorization: Bearer <key>`.

    At most `max_queue` requests are admitted at once (the next gets 429), a request body over
    `max_body_bytes` gets 413, and one that takes longer than `body_timeout_s` to arrive gets 408.
    """
    _require_extra("fastapi")
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from pydantic import ValidationError
    from starlette.exceptions import HTTPException

    if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
        raise UserError(f"max_queue={max_queue!r}: must be an integer >= 1 (requests admitted at once)")
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise UserError(f"max_body_bytes={max_body_bytes!r}: must be an integer >= 1 (the largest request body)")
    if not (isinstance(body_timeout_s, (int, float)) and body_timeout_s > 0):
        raise UserError(f"body_timeout_s={body_timeout_s!r}: must be a number of seconds > 0")
    # Refused at start, not as a failure inside the first request.
    check_vocab(tokenizer, engine.model.config.vocab_size)
    # A text of n UTF-8 bytes is at least n / max_token_bytes tokens long. Tokenizing is linear but not
    # cheap (1 MiB of text took 1.1 s of the event loop and 230 MiB that stayed resident), so a prompt
    # sure to overflow the context is refused by its length. The factor 4 leaves room for a tokenizer
    # whose normalizer shrinks text (NFKC maps a 4-byte letter to 1 byte); nanolm's have none.
    max_prompt_bytes = 4 * max_token_bytes(tokenizer) * engine.max_seq_len
    chat_model, completion_model = _schemas()
    worker = _Worker(max_queue)
    created = int(time.time())

    class _ApiError(Exception):
        def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                     type_: str = "invalid_request_error") -> None:
            super().__init__(message)
            self.status, self.body = status, _error_body(message, type_, param, code)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        worker.close()

    app = FastAPI(title="nanolm", summary=f"OpenAI-compatible API serving {model_name}", lifespan=lifespan)

    if api_key is not None:
        app.add_middleware(_BearerAuth, api_key=api_key)

    @app.exception_handler(_ApiError)
    async def _api_error(_request: Request, exc: _ApiError) -> JSONResponse:
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body, status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_error(list(exc.errors()))
        return JSONResponse(_error_body(message, param=param), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(_error_body(str(exc.detail), code="not_found" if exc.status_code == 404 else None),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(_request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(_error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"),
                            status_code=500)

    def too_large(size: int | None) -> _ApiError:
        what = f"is {size} bytes, over" if size is not None else "passes"
        return _ApiError(413, f"the request body {what} this server's limit of {max_body_bytes} bytes; "
                              "shorten the prompt or the conversation", None, "request_too_large")

    async def read_body(request: Request) -> bytes:
        """The body, refused as soon as it is known to pass max_body_bytes: by its declared length, before
        reading any of it, else while it arrives. uvicorn discards the unread rest after the response."""
        declared = request.headers.get("content-length", "")
        if declared.isascii() and declared.isdigit() and int(declared) > max_body_bytes:
            raise too_large(int(declared))
        body = bytearray()

        async def receive() -> None:
            async for part in request.stream():
                body.extend(part)
                if len(body) > max_body_bytes:
                    raise too_large(None)

        try:
            await asyncio.wait_for(receive(), body_timeout_s)
        except asyncio.TimeoutError:
            raise _ApiError(408, f"the request body did not arrive within {body_timeout_s:g} s of its headers "
                                 f"({len(body)} bytes came); send the whole request at once", None,
                            "request_timeout") from None
        return bytes(body)

    async def parse(request: Request, schema: Any) -> Any:
        body = await read_body(request)
        try:
            return schema.model_validate_json(body)
        except ValidationError as e:
            message, param = _validation_error(e.errors(include_url=False))
            raise _ApiError(400, message, param) from None

    def encode_prompt(text: str, req: Any) -> list[int]:
        """The prompt's token ids; a prompt too long by its byte count alone is refused before tokenizing."""
        size = len(text.encode("utf-8"))
        if size > max_prompt_bytes:
            raise _ApiError(400, f"the prompt is {size} bytes long, more tokens than the model's context of "
                                 f"{engine.max_seq_len} tokens can hold; shorten the prompt or the conversation",
                            "messages" if isinstance(req, chat_model) else "prompt", "context_length_exceeded")
        return tokenizer.encode(text)

    def start(prompt_ids: list[int], req: Any, max_tokens: int | None) -> _Job:
        if len(prompt_ids) >= engine.max_seq_len:
            raise _ApiError(400, f"the prompt is {len(prompt_ids)} tokens long and the model's context is "
                                 f"{engine.max_seq_len} tokens, which leaves no room for a reply; "
                                 "shorten the prompt or the conversation",
                            "messages" if isinstance(req, chat_model) else "prompt", "context_length_exceeded")
        params = SamplingParams(max_new_tokens=engine.max_seq_len if max_tokens is None else max_tokens,
                                temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed)
        job = _Job(engine, tokenizer, prompt_ids, params, req.stop)
        if not worker.submit(job):
            raise _ApiError(429, f"the server is busy: {worker.max_queue} requests are already queued; "
                                 "retry shortly", None, "queue_full", "rate_limit_error")
        return job

    async def collect(request: Request, job: _Job, sizes: _Sizes) -> tuple[str, str] | None:
        """(text, finish_reason) of a whole generation; None when the client went away."""
        pieces = []
        async with aclosing(_events(request, job)) as events:
            async for event in events:
                if event[0] == "text":
                    pieces.append(event[1])
                elif event[0] == "end":
                    sizes.completion_tokens = event[2]
                    return "".join(pieces), event[1]
                else:
                    raise _ApiError(500, event[1], type_="server_error")
        return None

    def stream(request: Request, job: _Job, sizes: _Sizes, first: list[dict], chunk: Any,
               include_usage: bool) -> StreamingResponse:
        """Server-sent events: the `first` chunks, one per text piece, one with the finish reason,
        a usage chunk if asked for, then [DONE]."""
        async def body() -> AsyncIterator[bytes]:
            for c in first:
                yield _sse(c)
            async with aclosing(_events(request, job)) as events:
                async for event in events:
                    if event[0] == "text":
                        yield _sse(chunk(event[1], None))
                    elif event[0] == "end":
                        sizes.completion_tokens = event[2]
                        yield _sse(chunk(None, event[1]))
                        if include_usage:
                            last = chunk(None, None)
                            last["choices"], last["usage"] = [], sizes.usage()
                            yield _sse(last)
                        yield b"data: [DONE]\n\n"
                    else:
                        yield _sse(_error_body(event[1], "server_error"))

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "nanolm"}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        # Outside /v1, so no API key: for load balancers and monitors. `admitted` counts requests
        # generating or waiting for the worker; it returns to 0 when the server is idle.
        return {"status": "ok", "model": model_name, "admitted": worker.admitted, "max_queue": worker.max_queue}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model}")
    async def get_model(model: str) -> dict[str, Any]:
        if model != model_name:
            raise _ApiError(404, f"model {model!r} not found; this server serves {model_name!r}", "model",
                            "model_not_found")
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await parse(request, chat_model)
        messages = [{"role": ROLE_NAMES[m.role], "content": m.content} for m in req.messages]
        prompt_ids = encode_prompt(render_chat(messages, add_generation_prompt=True), req)
        sizes = _Sizes(len(prompt_ids))
        job = start(prompt_ids, req, req.max_completion_tokens or req.max_tokens)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(content: str | None, finish: str | None, delta: dict | None = None) -> dict[str, Any]:
            delta = delta if delta is not None else ({} if content is None else {"content": content})
            c = {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name,
                 "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
            if include_usage:
                c["usage"] = None
            return c

        if req.stream:
            first = chunk(None, None, {"role": "assistant", "content": ""})
            return stream(request, job, sizes, [first], chunk, include_usage)
        done = await collect(request, job, sizes)
        if done is None:
            return Response(status_code=499)  # nobody is there to read it
        text, finish = done
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": now, "model": model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish}],
            "usage": sizes.usage()})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse(request, completion_model)
        # An empty prompt starts a fresh document, as after an end-of-text token.
        prompt_ids = encode_prompt(req.prompt, req) or [tokenizer.eot_id]
        sizes = _Sizes(len(prompt_ids))
        job = start(prompt_ids, req, COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens)
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(text: str | None, finish: str | None) -> dict[str, Any]:
            c = {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                 "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]}
            if include_usage:
                c["usage"] = None
            return c

        if req.stream:
            return stream(request, job, sizes, [], chunk, include_usage)
        done = await collect(request, job, sizes)
        if done is None:
            return Response(status_code=499)
        text, finish = done
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": now, "model": model_name,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            "usage": sizes.usage()})

    return app


class _BearerAuth:
    """ASGI middleware: paths under /v1 need `Authorization: Bearer <api_key>`.

    Checked before anything else (even before a malformed body is parsed), so a client without
    the key learns nothing but that it needs one.
    """

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode("utf-8")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                from fastapi.responses import JSONResponse
                what = "a wrong API key" if given else "no API key"
                body = _error_body(f"this server needs an API key and the request has {what}; "
                                   "send the header `Authorization: Bearer <key>`", code="invalid_api_key")
                await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


# --- `nanolm serve` ----------------------------------------------------------------------------------

def default_model_name(ckpt_dir: Path) -> str:
    """The run's directory name for a checkpoint inside `<run>/checkpoints/`, else the directory's own name."""
    ckpt_dir = Path(ckpt_dir).resolve()
    return ckpt_dir.parent.parent.name if ckpt_dir.parent.name == "checkpoints" else ckpt_dir.name


def _bind(host: str, port: int) -> socket.socket:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise UserError(f"--port {port!r}: must be an integer from 0 to 65535 (0 picks a free port)")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise UserError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e}); "
                        "pick another --port, or stop the process that uses it") from None
    return sock


def serve(checkpoint: str | Path, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          adapter: str | Path | None = None, which: str = "best", device: str = "auto",
          model_name: str | None = None, max_queue: int = 64, max_body_bytes: int = MAX_BODY_BYTES,
          body_timeout_s: float = BODY_TIMEOUT_S) -> None:
    """Load a checkpoint and serve it until interrupted. Listens on loopback unless `host` says otherwise."""
    _require_extra("fastapi", "uvicorn")
    import uvicorn

    from nanolm.runtime import resolve_device
    from nanolm.checkpoint import load_model

    sock = _bind(host, port)  # first, so a busy port fails before the model loads
    try:
        dev = resolve_device(device)
        model, src = load_model(checkpoint, which, dev, adapter=adapter)
        name = model_name or default_model_name(Path(adapter) if adapter is not None else src)
        app = create_app(Engine(model, dev), Tokenizer.load(src), model_name=name, api_key=api_key,
                         max_queue=max_queue, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
        bound_host, bound_port = sock.getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        print(f"[{src}{' + adapter ' + str(adapter) if adapter else ''}]", file=sys.stderr)
        if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
            print(f"warning: serving on {host} without an API key: anyone who can reach this port can use the "
                  "model; pass --api-key", file=sys.stderr)
        print(f"serving {name!r} at http://{shown}:{bound_port}/v1 (OpenAI-compatible; Ctrl+C stops)",
              file=sys.stderr, flush=True)
        # A short graceful shutdown: streams still open after it are cancelled, which stops their generation.
        config = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=3)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
