"""An OpenAI-compatible HTTP API over the generation engine: `nanolm serve`.

Endpoints: `GET /v1/models`, `POST /v1/chat/completions` (messages rendered
in the tokenizer's chat format, nanolm/chat/, with `tools`,
`tool_choice`, assistant `tool_calls`, `tool` results and thinking switched by
`chat_template_kwargs.enable_thinking`; replies read back into `content`,
`reasoning_content` and `tool_calls`, `choices`) and `POST /v1/completions`
(a prompt continued), each streaming (server-sent events in OpenAI's chunk
shapes) or not, so the official `openai` client and tools built on it work
unchanged.
`GET /` is a chat web page (`page`, files in static/) that streams its
replies from the same API; for its tool picker, `GET /v1/tools/builtin` lists
the built-in tools and `POST /v1/tools/run` runs one call of them (nothing
else) as `nanolm chat --tools builtin` does.

In parts: `worker` decodes every admitted request together on one thread
(continuous batching: requests join and leave the engine's batch between
decode steps, at most `max_batch` rows at once, the others waiting) and
admits at most `max_queue` requests at once (the next gets 429); a client
that goes away, mid-stream or while waiting, cancels its request, which frees
its rows at the next step. `schemas` is the wire format: the request
models and OpenAI's error body `{"error": {"message", "type", "param",
"code"}}`, which every failure a client causes gets with a 4xx, never a 500.
`choices` reads each choice's reply into OpenAI's message or stream deltas.
`routes` is the FastAPI app: the routes are plain functions over one shared
`ServerState`. What one request may cost is bounded before any work is done
for it: a body over `max_body_bytes` gets 413 without being read into memory,
one that does not arrive within `body_timeout_s` gets 408, a prompt whose
byte count alone shows it cannot fit the context is refused untokenized, and
at most `schemas.MAX_STOPS` stop strings are checked per token. `GET /health`
(no API key) says whether the server is up and how many requests it has
admitted. FastAPI and uvicorn are the `serve` extra, imported only when a
server is built (`create_app`, `serve`).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nanolm.config.sampling import SamplingParams
from nanolm.config.serve import ServeConfig
from nanolm.errors import UserError
from nanolm.infer.engine import Engine
from nanolm.tokenizer import Tokenizer

if TYPE_CHECKING:
    from fastapi import FastAPI


def _require_extra(*modules: str) -> None:
    for name in modules:
        try:
            __import__(name)
        except ImportError:
            raise UserError(f"nanolm serve needs FastAPI and uvicorn, and {name} is not installed; "
                            "pip install 'nanolm[serve]'") from None


def create_app(engine: Engine, tokenizer: Tokenizer, config: ServeConfig,
               sampling: SamplingParams | None = None) -> FastAPI:
    """The FastAPI app serving `engine` as `config.model_name`, within `config`'s limits; with `config.api_key`,
    /v1 needs `Authorization: Bearer <key>`. `sampling` (default: SamplingParams()) fills the sampling fields
    a request leaves out. (`config.host` and `config.port` are `serve`'s business.)"""
    _require_extra("fastapi")
    from nanolm.infer.server.routes import ServerState, build_app

    return build_app(ServerState(engine, tokenizer, config, sampling if sampling is not None else SamplingParams()))


# --- `nanolm serve` ----------------------------------------------------------------------------------

def http_config(app: FastAPI, config: ServeConfig, **kw: Any) -> Any:
    """uvicorn's config for `app`, its connections held to `config`'s limits: one that has not sent a whole
    request's headers within header_timeout_s is closed (uvicorn's keep-alive time-out starts only after a
    response, so a socket that sends half its headers, or nothing, would stay open for good), and a connection
    beyond max_connections open at once is closed as it arrives."""
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Guarded(H11Protocol):
        _headers_due: Any = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > config.max_connections:
                transport.close()
                return
            self._await_headers()

        def _await_headers(self) -> None:
            self._headers_due = self.loop.call_later(config.header_timeout_s, self._headers_late)

        def _headers_late(self) -> None:
            """No request under way (none yet, or the last one answered) when the time-out ends: close."""
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._headers_due is not None:
                self._headers_due.cancel()
            if not self.transport.is_closing():
                self._await_headers()  # the next request's headers are due in time too

        def connection_lost(self, exc: Exception | None) -> None:
            if self._headers_due is not None:
                self._headers_due.cancel()
            super().connection_lost(exc)

    return uvicorn.Config(app, http=Guarded, **kw)


def _bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise UserError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e}); "
                        "pick another --port, or stop the process that uses it") from None
    return sock


def decode_threads(threads: int, cores: int | None = None) -> int:
    """The server's decoding threads on a CPU: `threads`, or for 0 one fewer than the cores (at least 1, at most
    torch's default, which honours OMP_NUM_THREADS)."""
    if threads:
        return threads
    cores = cores if cores is not None else (os.cpu_count() or 1)
    return max(1, min(cores - 1, torch.get_num_threads()))


def serve(checkpoint: str | Path, config: ServeConfig | None = None, *, sampling: SamplingParams | None = None,
          adapter: str | Path | None = None, which: str = "best", device: str = "auto",
          yarn: float | None = None, dtype: str = "auto") -> None:
    """Load a checkpoint and serve it until interrupted, with `config`'s settings (default: ServeConfig(), which
    listens on loopback only) and `sampling`'s defaults for what a request leaves out; `yarn` stretches its
    context that many times (see `load_model`); `dtype`: the weights' dtype while decoding (`decode_dtype`)."""
    _require_extra("fastapi", "uvicorn")
    import uvicorn

    from nanolm.runtime import decode_dtype, resolve_device
    from nanolm.checkpoint import load_model, run_name

    config = config if config is not None else ServeConfig()
    sock = _bind(config.host, config.port)  # first, so a busy port fails before the model loads
    try:
        dev = resolve_device(device)
        model, src = load_model(checkpoint, which, dev, adapter=adapter, yarn=yarn)
        if not config.model_name:
            config = dataclasses.replace(config, model_name=run_name(Path(adapter) if adapter is not None else src))
        if dev.type == "cpu":
            torch.set_num_threads(decode_threads(config.threads))  # first: auto times a product on these threads
        weights, why = decode_dtype(dtype, dev, model.config, many_rows=True)
        if dev.type == "cpu":
            why += f"; {torch.get_num_threads()} decoding thread{'s' if torch.get_num_threads() > 1 else ''}"
        engine = Engine(model, dev, weights)
        if dev.type == "cpu":
            why += f"; {engine.time_products()}"  # the form of the few-row products this CPU runs faster
        if config.compile:  # after the products' form, which the compiled graph takes as it is
            from nanolm.infer.server.routes import max_batch
            why += f"; {engine.compile_decode(max_batch(config, dev))}"
        app = create_app(engine, Tokenizer.load(src), config, sampling)
        bound_host, bound_port = sock.getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        print(f"[{src}{' + adapter ' + str(adapter) if adapter else ''}; decoding in "
              f"{str(weights).removeprefix('torch.')}: {why}]", file=sys.stderr)
        if config.api_key is None and not config.loopback:
            print(f"warning: serving on {config.host} without an API key: anyone who can reach this port can use "
                  "the model; pass --api-key", file=sys.stderr)
        print(f"chat page: http://{shown}:{bound_port}/", file=sys.stderr)
        print(f"serving {config.model_name!r} at http://{shown}:{bound_port}/v1 (OpenAI-compatible; Ctrl+C stops)",
              file=sys.stderr, flush=True)
        # A short graceful shutdown: streams still open after it are cancelled, which stops their generation.
        server = http_config(app, config, log_level="info", timeout_graceful_shutdown=3)
        try:
            uvicorn.Server(server).run(sockets=[sock])
        except KeyboardInterrupt:  # newer uvicorn (0.54 here) raises Ctrl+C again once it has shut down: a clean stop
            pass
    finally:
        sock.close()
