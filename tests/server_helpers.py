"""What the server tests share: a tiny random model, engines that replay a script or go slowly, and a
real uvicorn server on a free loopback port (`running`). Their fixtures (`engine`, `base`) are in
conftest.py."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest
import torch

from nanolm.config import ModelConfig
from nanolm.infer.engine import Engine
from nanolm.model.transformer import Transformer

uvicorn = pytest.importorskip("uvicorn")  # skips the module that imports this one, without the serve extra

CTX = 96


def tiny_model(vocab_size: int = 400) -> Transformer:
    # Untied, larger random weights: varied output (including split multi-byte characters), not one token repeated.
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=vocab_size, d_model=32, n_layer=1, n_head=4, n_kv_head=2, max_seq_len=CTX,
                                   tie_embeddings=False, init_std=0.2))


class ScriptedEngine(Engine):
    """Replays fixed token ids, `delay` s apart, then ends as the real engine does on a stop token; counts the
    tokens it gave and records when it is closed."""

    def __init__(self, script: list[int], delay: float = 0.0) -> None:
        super().__init__(tiny_model())
        self.script = script
        self.delay = delay
        self.tokens = 0
        self.closed = threading.Event()

    def generate(self, prompt, params, stop_ids=()):
        try:
            for tid in self.script[:params.max_new_tokens]:
                time.sleep(self.delay)
                self.tokens += 1
                yield tid
        finally:
            self.closed.set()


class SlowEngine(Engine):
    """The real engine, pausing `delay` s and waiting for `gate` before each token; records when it is closed."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__(tiny_model())
        self.delay = delay
        self.gate = threading.Event()
        self.gate.set()
        self.closed = threading.Event()
        self.tokens = 0

    def generate(self, prompt, params, stop_ids=()):
        try:
            for tid in super().generate(prompt, params, stop_ids):
                self.gate.wait()
                time.sleep(self.delay)
                self.tokens += 1
                yield tid
        finally:
            self.closed.set()


@contextmanager
def running(app):
    """Serve `app` on an ephemeral loopback port in a background thread; yields the base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
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

