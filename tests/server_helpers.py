"""What the server tests share: a tiny random model, engines that replay a script or go slowly, and a
real uvicorn server on a free loopback port (`running`). Their fixtures (`engine`, `base`) are in
conftest.py."""

from __future__ import annotations

import collections
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from nanolm.config import ModelConfig
from nanolm.infer.engine import Engine
from nanolm.model.transformer import Transformer

from engine_doubles import ScriptBatch, SlowBatch, Watched

uvicorn = pytest.importorskip("uvicorn")  # skips the module that imports this one, without the serve extra

CTX = 96


def tiny_model(vocab_size: int = 400, max_seq_len: int = CTX) -> Transformer:
    # Untied, larger random weights: varied output (including split multi-byte characters), not one token repeated.
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=vocab_size, d_model=32, n_layer=1, n_head=4, n_kv_head=2,
                                   max_seq_len=max_seq_len, tie_embeddings=False, init_std=0.2))


class ScriptedEngine(Watched, Engine):
    """Every row replays fixed token ids, one step each `delay` s, then ends as the real engine does on a stop
    token; `tokens` counts what it gave, `closed` is set when a row leaves, `prompts` holds each row's prompt.
    With `replies` (scripts), row k replays the k-th of them (then `script`): a conversation's replies in turn."""

    def __init__(self, script: list[int], delay: float = 0.0, replies: list[list[int]] | None = None,
                 max_seq_len: int = CTX) -> None:
        super().__init__(tiny_model(max_seq_len=max_seq_len))
        self.script = script
        self.delay = delay
        self.replies = collections.deque(replies or [])
        self.watch()

    @property
    def prompts(self) -> list[list[int]]:
        return self.signals.prompts

    def batch(self) -> ScriptBatch:
        return ScriptBatch(self.script, self.signals, self.delay, self.replies)


class SlowEngine(Watched, Engine):
    """The real engine, pausing `delay` s and waiting for `gate` before each step; `closed` is set when its batch
    empties, `tokens` counts what it made."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__(tiny_model())
        self.delay = delay
        self.watch()

    def batch(self) -> SlowBatch:
        return SlowBatch(self, self.signals, self.delay)


@contextmanager
def running(app):
    """Serve `app` on an ephemeral loopback port in a background thread, as `nanolm serve` serves it (its
    connection limits included); yields the base URL."""
    from nanolm.infer.server import http_config
    server = uvicorn.Server(http_config(app, app.state.nanolm.config, host="127.0.0.1", port=0, log_level="warning",
                                        timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(20)
        assert not thread.is_alive(), "the server did not stop"

