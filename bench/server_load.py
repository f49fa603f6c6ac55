"""`nanolm serve` under load: many concurrent clients, some streaming, some malformed, some leaving mid-stream.

One run:

1. Builds a tiny random-weight checkpoint (a byte-level BPE trained on a few
   built-in sentences, a 2-layer model) unless `--checkpoint` names one, and
   starts `serve()` on it in a subprocess listening on 127.0.0.1 (port 0).
2. Makes a plan of `--requests` requests drawn from a fixed set of templates:
   chat and completions, streaming or not, greedy or seeded sampling, stop
   strings, a max_tokens far past the context (clamped to it), ~10% malformed
   (bad JSON, wrong types, missing fields, unknown role, negative temperature,
   a prompt longer than the context, invalid UTF-8, deep nesting, an oversized
   body, a wrong path or method) and ~10% that leave mid-stream.
3. Sends every well-formed template alone, one at a time: its solo answer.
4. Runs the plan from `--clients` threads (one httpx client each) in a warm-up
   round and `--rounds` further rounds. A 429 (queue full) is retried with
   backoff until the request is admitted, and counted; it is "explained" when
   at least `max_queue` generating requests were open, or closed within the
   last 2 s (a freed slot is released just after the client sees its end).
5. Checks every answer: a well-formed request gets exactly its solo text,
   finish reason and token count (streams end with `[DONE]`), a malformed one
   its 4xx with an OpenAI error body, a client that left got a prefix of its
   solo text. After each round it waits until `GET /health` shows no request
   admitted (no leaked queue slot) and samples the server's resident memory
   (VmRSS in /proc/<pid>/status).

`--scaling 1,16` instead measures how requests decoded together scale: C completions sent at once
against one alone, and C kept in flight for `--scaling-seconds` (each client sending its next request as
soon as its last is answered) against one client doing the same.

Run from the repository root with nanolm installed with the serve and test
extras (`make install`):

    OMP_NUM_THREADS=1 python bench/server_load.py --requests 200 --clients 20 --rounds 3

stdout gets the report (requests/s, latency p50/p95, time to first token,
counts by status, RSS per round) and, as its last line, one JSON object with
every figure (`--json-out FILE` also writes it). The exit status is 1 when a
check failed. tests/test_server_load.py runs the same scenario at CI scale.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import queue
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
CHAT, COMPLETE = "/v1/chat/completions", "/v1/completions"
JSON_HEADERS = {"content-type": "application/json"}

EN = ["To be, or not to be, that is the question.", "All the world's a stage, and all the men and women merely players.",
      "We hold these truths to be self-evident, that all men are created equal.",
      "The quality of mercy is not strained; it droppeth as the gentle rain from heaven.",
      "My fellow citizens, the state of our union is strong."]
ZH = ["话说天下大势，分久必合，合久必分。", "滚滚长江东逝水，浪花淘尽英雄。", "是非成败转头空，青山依旧在，几度夕阳红。",
      "白发渔樵江渚上，惯看秋月春风。", "一壶浊酒喜相逢，古今多少事，都付笑谈中。"]
PROMPTS = ["To be", "你好", "The quality of mercy", "滚滚长江", "All the world", "话说天下", "We hold", "一壶浊酒",
           "My fellow citizens, the state", "是非成败"]


# --- the model and the server ------------------------------------------------------------------------

def build_checkpoint(out: Path, max_seq_len: int = 128, seed: int = 0) -> Path:
    """A random-weight run directory with its tokenizer: fast to serve, and its replies are varied text."""
    import torch

    from nanolm.config import Config, ModelConfig, TrainConfig
    from nanolm.model.transformer import Transformer
    from nanolm.tokenizer import train_tokenizer
    from nanolm.checkpoint import save_checkpoint

    rng = random.Random(seed)
    docs = [" ".join(rng.choice(ZH if i % 2 else EN) for _ in range(rng.randint(3, 12))) for i in range(120)]
    tok = train_tokenizer(docs, out / "tokenizer", vocab_size=400, quiet=True)
    torch.manual_seed(seed)
    # Untied, large random weights: the replies vary instead of repeating one token, and rarely end early.
    cfg = Config(model=ModelConfig(vocab_size=tok.vocab_size, d_model=64, n_layer=2, n_head=4, n_kv_head=2,
                                   max_seq_len=max_seq_len, tie_embeddings=False, init_std=0.2),
                 train=TrainConfig(seq_len=max_seq_len))
    run = out / "run"
    save_checkpoint(run, 0, Transformer(cfg.model), None, cfg, {}, tokenizer_dir=out / "tokenizer")
    return run


class ServerProcess:
    """`serve()` in a subprocess on an ephemeral loopback port; `url` is its base URL once started."""

    def __init__(self, checkpoint: Path, *, max_queue: int = 64, max_body_bytes: int | None = None,
                 threads: int = 1, compile: bool = False, dtype: str = "auto") -> None:
        limits = f"port=0, max_queue={max_queue}" + (f", max_body_bytes={max_body_bytes}" if max_body_bytes is not None else "")
        limits += ", compile=True" if compile else ""
        code = (f"from nanolm.config import ServeConfig; from nanolm.infer.server import serve; "
                f"serve({str(checkpoint)!r}, ServeConfig({limits}), device='cpu', dtype={dtype!r})")
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-c", code],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.log: list[str] = []
        lines: queue.Queue = queue.Queue()

        def read() -> None:
            for line in self.proc.stderr:
                self.log.append(line)
                lines.put(line)

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        self.url = ""
        try:
            deadline = time.monotonic() + (300 if compile else 120)
            while not self.url:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("the server did not start:\n" + "".join(self.log))
                try:
                    m = re.search(r" at (http://127\.0\.0\.1:\d+)/v1 ", lines.get(timeout=0.5))
                except queue.Empty:
                    continue
                self.url = m.group(1) if m else ""
            while True:  # uvicorn starts just after the line above
                try:
                    if httpx.get(self.url + "/health", timeout=5, trust_env=False).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("the server did not answer /health:\n" + "".join(self.log))
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise

    def rss_mib(self) -> float:
        """The server's resident set size now."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return kib / 1024

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int | None:
        """Ctrl+C, as a user stops it; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        return self.proc.returncode



@contextmanager
def serving(checkpoint: Path, **kw: Any) -> Iterator[ServerProcess]:
    """A ServerProcess (kw: its options), stopped on the way out."""
    server = ServerProcess(checkpoint, **kw)
    try:
        yield server
    finally:
        server.stop()


# --- the requests ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Req:
    """One template of the plan. kind: "ok" (well-formed), "bad" (malformed) or "drop" (leaves early)."""

    name: str
    kind: str
    path: str
    body: bytes = b""
    stream: bool = False
    want_status: int = 200
    method: str = "POST"
    drop_after: int = 0  # "drop": content pieces to read before leaving (0: leave on a read timeout)
    chunked: bool = False  # send the body in 64 KiB chunks without a Content-Length


@dataclass
class Result:
    req: Req
    status: int | None = None  # the final HTTP status; None when the client left before it
    text: str | None = None  # the reply text (for a client that left: what it had read)
    finish: str | None = None
    tokens: int | None = None  # usage.completion_tokens, where the response gives it
    error: dict | None = None  # the "error" object of a 4xx body
    problem: str | None = None  # a protocol fault seen while reading
    retries: int = 0  # 429s before admission
    unexplained_429: int = 0
    latency: float = 0.0  # from the first attempt to the end of the exchange, retries included
    ttft: float | None = None  # streaming: from the first attempt to the first text piece
    left: bool = False  # the client went away before the end


def _body(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8")


def ok_templates() -> list[Req]:
    """32 well-formed generation requests covering the API's options."""
    out = []
    for i in range(32):
        chat, stream = i % 2 == 0, i // 2 % 2 == 1
        prompt = PROMPTS[i % len(PROMPTS)]
        body: dict[str, Any] = {"model": "any", "max_tokens": [1, 4, 8, 16, 24, 32][i % 6]}
        if i % 3 == 0:
            body.update(temperature=0.9, top_p=0.9, seed=1000 + i)  # seeded sampling: reproducible too
        else:
            body["temperature"] = 0
        if i % 8 == 5:
            body["max_tokens"] = 10**9  # far past the context: the reply runs to the context's end
        if i % 8 == 7:
            body["stop"] = ["the", "，"] if i % 16 == 7 else "e"
        if i % 10 == 4 and chat:
            del body["max_tokens"]  # a chat reply without max_tokens may run to the end of the context
        if stream:
            body["stream"] = True
            if i % 4 == 3:
                body["stream_options"] = {"include_usage": True}
        if chat:
            messages = [{"role": "user", "content": prompt}]
            if i % 5 == 0:
                messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": "Hello."},
                            {"role": "user", "content": [{"type": "text", "text": prompt}]}]
            body["messages"] = messages
        else:
            body["prompt"] = prompt
        out.append(Req(f"ok-{i:02d}-{'chat' if chat else 'cmpl'}{'-stream' if stream else ''}", "ok",
                       CHAT if chat else COMPLETE, _body(body), stream))
    return out


TOOL = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                         "parameters": {"type": "object", "properties": {
                                             "expression": {"type": "string"}}, "required": ["expression"]}}}


def soak_templates() -> list[Req]:
    """The soak's further well-formed requests: n choices (each checked), tools offered (the reply's calls
    checked), a forced call (held to the schema by the guide), streaming and not."""
    user = [{"role": "user", "content": "What is 37 times 24?"}]
    bodies = [
        ("n3-cmpl", COMPLETE, {"prompt": "To be", "n": 3, "max_tokens": 12, "temperature": 0.9, "seed": 3}, False),
        ("n4-chat", CHAT, {"messages": user, "n": 4, "max_tokens": 10, "temperature": 1.0, "seed": 11}, False),
        ("tools-chat", CHAT, {"messages": user, "tools": [TOOL], "max_tokens": 24, "temperature": 0}, False),
        ("tools-chat-stream", CHAT, {"messages": user, "tools": [TOOL], "max_tokens": 24, "temperature": 0,
                                     "stream": True}, True),
        ("tools-required", CHAT, {"messages": user, "tools": [TOOL], "tool_choice": "required", "max_tokens": 40,
                                  "temperature": 0}, False),
    ]
    return [Req(f"soak-{name}", "ok", path, _body(body), stream) for name, path, body, stream in bodies]


def soak_bad_templates() -> list[Req]:
    """The hostile requests of the soak beyond bad_templates: each its 4xx."""
    user = [{"role": "user", "content": "hi"}]
    huge_enum = {"type": "function", "function": {"name": "pick", "parameters": {"type": "object", "properties": {
        "x": {"enum": [f"v{i}" for i in range(10_000)]}}}}}
    bad = [
        ("tools-huge-enum", {"messages": user, "tools": [huge_enum]}),
        ("tools-not-objects", {"messages": user, "tools": [1], "tool_choice": "none"}),
        ("tools-no-function", {"messages": user, "tools": [{"x": 1}], "tool_choice": "none"}),
        ("tools-unusable-names", {"messages": user, "tools": [{"type": "function", "function": {"name": 'a"b'}}]}),
        ("n-past-the-batch", {"messages": user, "n": 10_000}),
        ("messages-past-the-context", {"messages": [{"role": "user", "content": "x"}] * 20_000}),
    ]
    return [Req(f"soak-bad-{name}", "bad", CHAT, _body(body), want_status=400) for name, body in bad]


def drop_templates() -> list[Req]:
    """Clients that leave: mid-stream after some text, or a non-streaming one that stops waiting."""
    long = {"max_tokens": 10**9, "temperature": 0, "stream": True}
    return [
        Req("drop-chat-after-1", "drop", CHAT, _body({**long, "messages": [{"role": "user", "content": "To be"}]}),
            True, drop_after=1),
        Req("drop-chat-after-5", "drop", CHAT, _body({**long, "messages": [{"role": "user", "content": "你好"}]}),
            True, drop_after=5),
        Req("drop-cmpl-after-1", "drop", COMPLETE, _body({**long, "prompt": "话说天下"}), True, drop_after=1),
        Req("drop-cmpl-after-3", "drop", COMPLETE, _body({**long, "prompt": "We hold", "seed": 7,
                                                          "temperature": 0.8}), True, drop_after=3),
        Req("drop-cmpl-waiting", "drop", COMPLETE, _body({"prompt": "All the world", "max_tokens": 10**9,
                                                          "temperature": 0}), False, drop_after=0),
    ]


def bad_templates(max_body_bytes: int) -> list[Req]:
    """20 malformed requests and the 4xx each must get."""
    msg = [{"role": "user", "content": "hi"}]
    long_prompt = "To be, or not to be, that is the question. " * 60  # a few hundred tokens: past any tiny context
    bad = [
        ("bad-json", CHAT, b'{"messages": [', 400),
        ("empty-body", CHAT, b"", 400),
        ("missing-messages", CHAT, _body({"model": "m"}), 400),
        ("unknown-role", CHAT, _body({"messages": [{"role": "tool", "content": "x"}]}), 400),
        ("content-a-number", CHAT, _body({"messages": [{"role": "user", "content": 5}]}), 400),
        ("negative-temperature", CHAT, _body({"messages": msg, "temperature": -0.5}), 400),
        ("temperature-a-string", COMPLETE, _body({"prompt": "x", "temperature": "hot"}), 400),
        ("max-tokens-huge-float", CHAT, _body({"messages": msg, "max_tokens": 1e30}), 400),
        ("stream-a-string", CHAT, _body({"messages": msg, "stream": "yes"}), 400),
        ("n-zero", CHAT, _body({"messages": msg, "n": 0}), 400),
        ("prompt-a-list", COMPLETE, _body({"prompt": ["a", "b"]}), 400),
        ("prompt-past-the-context", CHAT, _body({"messages": [{"role": "user", "content": long_prompt}],
                                                 "stream": True}), 400),
        ("invalid-utf8", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),
        ("deep-nesting", CHAT, b'{"messages": ' + b"[" * 20000 + b"]" * 20000 + b"}", 400),
        # Valid JSON, so a server that reads it whole tokenizes a megabyte of text before refusing it.
        ("oversized-body", CHAT, _body({"messages": [{"role": "user", "content": "To be. " * (max_body_bytes // 6)}]}),
         413),
        # Within the size limit, yet far past any context: refused without tokenizing it all.
        ("prompt-far-past-the-context", COMPLETE, _body({"prompt": "To be. " * (max_body_bytes // 8)}), 400),
        ("too-many-stop-strings", COMPLETE, _body({"prompt": "x", "stop": [str(i) for i in range(1000)]}), 400),
        ("unknown-path", "/v1/embeddings", _body({"input": "x"}), 404),
    ]
    out = [Req(name, "bad", path, body, want_status=status) for name, path, body, status in bad]
    out.append(Req("oversized-chunked", "bad", COMPLETE, _body({"prompt": "x" * max_body_bytes}), want_status=413,
                   chunked=True))
    out.append(Req("wrong-method", "bad", CHAT, method="GET", want_status=405))
    return out


def make_plan(n: int, seed: int, max_body_bytes: int, bad_share: float = 0.1, drop_share: float = 0.1,
              soak: bool = False, offset: int = 0) -> list[Req]:
    """n requests: bad_share malformed, drop_share leaving early, the rest well-formed; each template in turn,
    from the offset-th plan's place on (soak: the soak's templates too; successive offsets take them all)."""
    n_bad, n_drop = round(n * bad_share), round(n * drop_share)
    ok, bad = ok_templates(), bad_templates(max_body_bytes)
    if soak:
        ok, bad = ok + soak_templates(), bad + soak_bad_templates()
    groups = [(ok, n - n_bad - n_drop), (bad, n_bad), (drop_templates(), n_drop)]
    plan = [templates[(offset * count + i) % len(templates)] for templates, count in groups for i in range(count)]
    random.Random(seed).shuffle(plan)
    return plan


# --- one exchange ------------------------------------------------------------------------------------

class Tracker:
    """Which generating requests are open, to tell whether a 429 came from a genuinely full queue."""

    def __init__(self, max_queue: int, grace_s: float = 2.0) -> None:
        self.max_queue = max_queue
        self.grace_s = grace_s
        self.lock = threading.Lock()
        self.open = 0
        self.closed: deque = deque()  # end times of recent exchanges

    def begin(self) -> None:
        with self.lock:
            self.open += 1

    def end(self, held_slot: bool) -> None:
        with self.lock:
            self.open -= 1
            if held_slot:
                self.closed.append(time.monotonic())

    def explains_429(self) -> bool:
        """At least max_queue others are open or only just closed (their slots may not be released yet).

        Open ones include some not admitted yet, so this errs on the side of explaining.
        """
        with self.lock:
            now = time.monotonic()
            while self.closed and now - self.closed[0] > self.grace_s:
                self.closed.popleft()
            return self.open + len(self.closed) >= self.max_queue


def _text_of(choice: dict, chat: bool, stream: bool) -> str:
    if chat:
        part = choice["delta"] if stream else choice["message"]
        calls = part.get("tool_calls") if not stream else None  # a whole reply's calls are part of what it says
        return (part.get("content") or "") + (json.dumps(calls, sort_keys=True) if calls else "")
    return choice["text"]


def _read_stream(r: httpx.Response, res: Result, chat: bool, t0: float) -> None:
    """The SSE events of a 200 stream: the text, finish reason and usage; leaves after drop_after pieces."""
    pieces, finish, done = [], None, False
    for line in r.iter_lines():
        if not line:
            continue
        if not line.startswith("data: "):
            res.problem = f"not an SSE data line: {line[:80]!r}"
            return
        payload = line[len("data: "):]
        if payload == "[DONE]":
            done = True
            continue
        if done:
            res.problem = "data after [DONE]"
            return
        event = json.loads(payload)
        if "error" in event:
            res.problem = f"error event: {event['error']}"
            return
        if event.get("usage"):
            res.tokens = event["usage"]["completion_tokens"]
        if event["choices"]:
            choice = event["choices"][0]
            piece = _text_of(choice, chat, True)
            if piece:
                if res.ttft is None:
                    res.ttft = time.monotonic() - t0
                pieces.append(piece)
            finish = choice["finish_reason"] or finish
        if res.req.kind == "drop" and len(pieces) >= res.req.drop_after:
            res.left, res.text = True, "".join(pieces)
            return  # closing the unread stream closes the connection: the server sees the client go
    res.text, res.finish = "".join(pieces), finish
    if not done:
        res.problem = "the stream ended without [DONE]"


def send(client: httpx.Client, base: str, req: Req, tracker: Tracker | None = None, give_up_s: float = 60.0) -> Result:
    """One request to its end; a 429 is retried with backoff for up to give_up_s (only generating requests get one)."""
    res = Result(req)
    chat = req.path == CHAT
    t0 = time.monotonic()
    backoff = 0.05
    generating = req.kind != "bad"
    while True:
        if generating and tracker is not None:
            tracker.begin()
        r = None
        try:
            timeout = httpx.Timeout(60.0, read=0.05) if req.kind == "drop" and not req.stream else 60.0
            content = req.body or None
            if req.chunked:
                content = (req.body[i:i + 65536] for i in range(0, len(req.body), 65536))
            with client.stream(req.method, base + req.path, content=content,
                               headers=JSON_HEADERS if req.body else None, timeout=timeout) as r:
                if r.status_code == 200 and req.stream:
                    _read_stream(r, res, chat, t0)
                else:
                    r.read()
        except httpx.ReadTimeout:
            if req.kind != "drop":
                raise
            res.left, res.text = True, ""  # gave up waiting: the server must notice and cancel
            res.latency = time.monotonic() - t0
            return res
        finally:
            if generating and tracker is not None:
                tracker.end(held_slot=r is None or r.status_code != 429)
        if r.status_code == 429 and generating:
            res.retries += 1
            if tracker is not None and not tracker.explains_429():
                res.unexplained_429 += 1
            if time.monotonic() - t0 > give_up_s:  # leaked queue slots look like this
                res.problem = f"still refused with 429 after {res.retries} tries in {give_up_s:.0f} s"
                break
            time.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, 0.5)
            continue
        break
    res.status = None if res.left else r.status_code
    res.latency = time.monotonic() - t0
    if res.left or (r.status_code == 200 and req.stream):
        return res
    try:
        body = r.json()
    except ValueError:
        res.problem = f"not JSON: {r.text[:80]!r}"
        return res
    if r.status_code == 200:
        choices = sorted(body["choices"], key=lambda c: c["index"])  # n > 1: every choice, in order
        res.text = "\x1e".join(_text_of(c, chat, False) for c in choices)
        res.finish = ",".join(str(c["finish_reason"]) for c in choices)
        res.tokens = body["usage"]["completion_tokens"]
    else:
        res.error = body.get("error") if isinstance(body, dict) else None
    return res


# --- checks ------------------------------------------------------------------------------------------

def solo_answers(base: str, plan: list[Req]) -> dict[Req, Result]:
    """Each distinct well-formed or leaving request, sent alone (a leaving one is read to its end)."""
    out = {}
    with httpx.Client(trust_env=False) as client:
        for req in dict.fromkeys(r for r in plan if r.kind != "bad"):
            full = Req(req.name, "ok", req.path, req.body, req.stream)
            out[req] = send(client, base, full)
            if out[req].status != 200 or out[req].problem:
                raise RuntimeError(f"{req.name}: alone it gets {out[req].status} {out[req].problem or ''} "
                                   f"{out[req].error or ''}")
    return out


def check(res: Result, solo: dict[Req, Result]) -> str | None:
    """What is wrong with one result, or None."""
    req = res.req
    if res.problem:
        return f"{req.name}: {res.problem}"
    if req.kind == "bad":
        if res.status != req.want_status:
            return f"{req.name}: HTTP {res.status}, expected {req.want_status}"
        if not (isinstance(res.error, dict) and set(res.error) == {"message", "type", "param", "code"}
                and isinstance(res.error["message"], str) and res.error["message"]):
            return f"{req.name}: HTTP {res.status} without an OpenAI error body"
        return None
    want = solo[req]
    if res.left:
        return None if want.text.startswith(res.text) else f"{req.name}: read {res.text!r}, not a prefix of the solo"
    if res.status != 200:
        return f"{req.name}: HTTP {res.status}"
    if (res.text, res.finish) != (want.text, want.finish):
        return f"{req.name}: got {(res.text, res.finish)!r}, alone {(want.text, want.finish)!r}"
    if res.tokens != want.tokens:
        return f"{req.name}: {res.tokens} completion tokens, alone {want.tokens}"
    return None


# --- a round -----------------------------------------------------------------------------------------

@dataclass
class Round:
    results: list[Result]  # in plan order
    wall: float  # seconds from the first request to the last answer
    health_s: list[float]  # latencies of GET /health polled through the round: is the event loop free?
    max_admitted: int  # the most requests /health saw admitted at once


def run_round(base: str, plan: list[Req], clients: int, max_queue: int, grace_s: float = 2.0,
              give_up_s: float = 60.0) -> Round:
    """The plan from `clients` threads at once, while another thread polls /health every 50 ms."""
    results: list[Result | None] = [None] * len(plan)
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for i in range(len(plan)):
        todo.put(i)
    tracker = Tracker(max_queue, grace_s)
    start = threading.Barrier(clients + 1)
    finished = threading.Event()
    health_s: list[float] = []
    admitted: list[int] = []

    def health_thread() -> None:
        with httpx.Client(trust_env=False, timeout=30) as client:
            while not finished.wait(0.05):
                t = time.monotonic()
                admitted.append(client.get(base + "/health").json()["admitted"])
                health_s.append(time.monotonic() - t)

    def client_thread() -> None:
        with httpx.Client(trust_env=False) as client:
            start.wait()
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    results[i] = send(client, base, plan[i], tracker, give_up_s)
                except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:  # a broken connection or body
                    results[i] = Result(plan[i], problem=f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=client_thread, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    prober = threading.Thread(target=health_thread, daemon=True)
    prober.start()
    start.wait()
    t0 = time.monotonic()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    finished.set()
    prober.join()
    return Round([r for r in results if r is not None], wall, health_s, max(admitted, default=0))


def wait_idle(base: str, timeout: float = 15.0) -> int:
    """Wait until the server has no request admitted; returns how many it still has at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        admitted = httpx.get(base + "/health", timeout=10, trust_env=False).json()["admitted"]
        if admitted == 0 or time.monotonic() > deadline:
            return admitted
        time.sleep(0.05)


def pct(xs: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank) of xs, or None when empty."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * len(xs)) - 1))]


def summarize(rnd: Round) -> dict[str, Any]:
    results, wall = rnd.results, rnd.wall
    ok = [r for r in results if r.req.kind == "ok"]
    statuses = Counter("left" if r.left else str(r.status) for r in results)

    def ms(xs: list[float], q: float) -> float | None:
        v = pct(xs, q)
        return None if v is None else round(1000 * v, 1)

    lat = {"nonstream": [r.latency for r in ok if not r.req.stream], "stream": [r.latency for r in ok if r.req.stream],
           "ttft": [r.ttft for r in ok if r.req.stream and r.ttft is not None],
           "malformed": [r.latency for r in results if r.req.kind == "bad"], "health": rnd.health_s}
    return {"requests": len(results), "wall_s": round(wall, 2), "requests_per_s": round(len(results) / wall, 1),
            "statuses": dict(sorted(statuses.items())), "retries_429": sum(r.retries for r in results),
            "unexplained_429": sum(r.unexplained_429 for r in results), "max_admitted": rnd.max_admitted,
            "latency_ms": {k: {"p50": ms(v, 0.5), "p95": ms(v, 0.95)} for k, v in lat.items()}}


def build_preset_checkpoint(out: Path, preset_name: str, seed: int = 0) -> Path:
    """A random-weight run of a preset's model (untied, large random weights, so replies rarely end early)."""
    import dataclasses

    import torch

    from nanolm.checkpoint import save_checkpoint
    from nanolm.config import preset
    from nanolm.model.transformer import Transformer
    from nanolm.tokenizer import train_tokenizer

    rng = random.Random(seed)
    docs = [" ".join(rng.choice(ZH if i % 2 else EN) for _ in range(rng.randint(3, 12))) for i in range(120)]
    tok = train_tokenizer(docs, out / "tokenizer", vocab_size=400, quiet=True)
    cfg = preset(preset_name)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=tok.vocab_size,
                                                             tie_embeddings=False, init_std=0.2))
    torch.manual_seed(seed)
    run = out / "run"
    save_checkpoint(run, 0, Transformer(cfg.model), None, cfg, {}, tokenizer_dir=out / "tokenizer")
    return run


def _levels(base: str, levels: list[int], repeats: int, measure: Callable[[list[Any], int], dict[str, Any]],
            say: Callable[[dict[str, Any]], str]) -> list[dict[str, Any]]:
    """For each level C: `measure(clients, r)` with C connected clients in round r, the best of `repeats` rounds by
    tokens/s, printed with `say`; each row's ratio to C=1 as x_one. One connected client per concurrent request,
    made before any clock starts (a new httpx client costs tens of milliseconds, which would be counted against
    the server)."""
    rows = []
    clients = [httpx.Client(timeout=300, trust_env=False) for _ in range(max(levels))]
    for client in clients:
        client.get(base + "/health")
    for c in levels:
        best = max((measure(clients[:c], r) for r in range(repeats)), key=lambda row: row["tokens_per_s"])
        rows.append(best)
        print(say(best), flush=True)
    for client in clients:
        client.close()
    one_alone = next((r for r in rows if r["concurrent"] == 1), None)
    for r in rows:
        r["x_one"] = r["tokens_per_s"] / one_alone["tokens_per_s"] if one_alone else None
    return rows


def _together(clients: list[Any], one: Callable[[int, float], None]) -> float:
    """Runs one(i, t0) on a thread per client, all released at once at t0 (perf_counter); the seconds from t0 to
    the last end."""
    start = threading.Barrier(len(clients) + 1)
    release = [0.0]

    def run(i: int) -> None:
        start.wait()
        one(i, release[0])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    release[0] = time.perf_counter()
    start.wait()
    for t in threads:
        t.join()
    return time.perf_counter() - release[0]


def scaling(base: str, levels: list[int], max_tokens: int, repeats: int) -> list[dict[str, Any]]:
    """Aggregate tokens/s of C concurrent non-streaming completions (different prompts, seeded sampling,
    max_tokens each), from the first send to the last answer; the best of `repeats` per C, and its ratio to C=1."""

    def measure(clients: list[Any], r: int) -> dict[str, Any]:
        results = [0] * len(clients)

        def one(i: int, _t0: float) -> None:
            body = {"prompt": f"{EN[i % len(EN)]} {i}", "max_tokens": max_tokens, "seed": 1000 * r + i}
            resp = clients[i].post(base + COMPLETE, json=body)
            resp.raise_for_status()
            results[i] = resp.json()["usage"]["completion_tokens"]

        wall = _together(clients, one)
        return {"concurrent": len(clients), "tokens": sum(results), "wall_s": wall,
                "tokens_per_s": sum(results) / wall}

    return _levels(base, levels, repeats, measure,
                   lambda b: f"{b['concurrent']:3d} concurrent: {b['tokens']} tokens in {b['wall_s']:.2f} s = "
                             f"{b['tokens_per_s']:.0f} tokens/s")


def sustained(base: str, levels: list[int], max_tokens: int, seconds: float, repeats: int) -> list[dict[str, Any]]:
    """Aggregate tokens/s with C requests in flight: C clients each send their next completion (a new prompt and
    seed, max_tokens each) as soon as their last one is answered, for `seconds`; the completion tokens of every
    answer over the time from the first send to the last answer. A row that ends early (a stop token) is
    replaced by the next request, as under steady load, where a burst of C requests thins out to its longest
    one. The best of `repeats` per C, and its ratio to C=1."""

    def measure(clients: list[Any], r: int) -> dict[str, Any]:
        tokens, requests = [0] * len(clients), [0] * len(clients)
        def one(i: int, t0: float) -> None:
            while time.perf_counter() < t0 + seconds:
                k = requests[i]
                body = {"prompt": f"{EN[(i + 7 * k) % len(EN)]} {i}.{k}", "max_tokens": max_tokens,
                        "seed": 100_000 * r + 1000 * k + i}
                resp = clients[i].post(base + COMPLETE, json=body)
                resp.raise_for_status()
                tokens[i] += resp.json()["usage"]["completion_tokens"]
                requests[i] += 1

        wall = _together(clients, one)
        return {"concurrent": len(clients), "requests": sum(requests), "tokens": sum(tokens), "wall_s": wall,
                "tokens_per_s": sum(tokens) / wall}

    return _levels(base, levels, repeats, measure,
                   lambda b: f"{b['concurrent']:3d} in flight: {b['requests']} requests, {b['tokens']} tokens in "
                             f"{b['wall_s']:.2f} s = {b['tokens_per_s']:.0f} tokens/s")


def hostile_cases() -> list[tuple[str, str, dict[str, str], bytes, int]]:
    """(name, path, extra headers, body, the status it must get) of each hostile request an adversarial probe
    sent (the reliability issue's list), each answered before any generation."""
    user = [{"role": "user", "content": "hi"}]
    enum = {"type": "function", "function": {"name": "pick", "parameters": {"type": "object", "properties": {
        "x": {"enum": [f"value {i}" for i in range(10_000)]}}}}}
    cases = [
        ("tool names all with a quote or backslash", {"messages": user, "tools": [
            {"type": "function", "function": {"name": 'say"hi'}}, {"type": "function", "function": {"name": "a\\b"}}]}),
        ("tools: [1] with tool_choice none", {"messages": user, "tools": [1], "tool_choice": "none"}),
        ('tools: [{"x": 1}] with tool_choice none', {"messages": user, "tools": [{"x": 1}], "tool_choice": "none"}),
        ("20,000 short messages (880 KB)", {"messages": [{"role": "user", "content": "hello there"}] * 20_000}),
        ("a tool enum of 10,000 values", {"messages": user, "tools": [enum]}),
        ("n past the batch", {"messages": user, "n": 10_000}),
        # the second probe's (issue 57): tool schemas checked whole, with tool_choice "required" too
        *((f"tool parameters {json.dumps(p)}", {"messages": user, "tool_choice": "required", "tools": [
            {"type": "function", "function": {"name": "f", "parameters": p}}]})
          for p in ("str", [1], 5, None)),
        *((f"tool property schema {json.dumps(x)}", {"messages": user, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"x": x}}}}]})
          for x in ({"enum": "xyz"}, {"type": "bogus"}, {"type": "array", "items": 1}, {"$ref": "#/$defs/a"},
                    {"anyOf": [{"enum": list(range(65))}]}, {"type": "array", "items": [{"enum": list(range(65))}]})),
        ("tool properties as a list", {"messages": user, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": [1]}}}]}),
        ('tool required: "a"', {"messages": user, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"a": {}}, "required": "a"}}}]}),
        ("additionalProperties enum of 65", {"messages": user, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "additionalProperties": {"enum": list(range(65))}}}}]}),
        ("user after user", {"messages": user * 2}),
        ("a system message after the first", {"messages": [*user, {"role": "system", "content": "x"}]}),
        ("a conversation starting with the assistant", {"messages": [{"role": "assistant", "content": "x"}, *user]}),
        ("logit_bias past the vocabulary", {"messages": user, "logit_bias": {"99999999": 5}}),
    ]
    out = [(name, CHAT, {}, _body(body), 400) for name, body in cases]
    # the same 20,000 messages with the role key spelt as an escape (the same JSON), or left out
    for name, spelt in (("20,000 messages, role spelt \\u0072ole", b'{"\\u0072ole": "user", "content": "hello there"}'),
                        ("20,000 messages without a role", b'{"content": "hello there"}')):
        out.append((name, CHAT, {}, b'{"messages": [' + b", ".join([spelt] * 20_000) + b"]}", 400))
    out.append(("temperature NaN", CHAT, {}, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
                400))
    simple = _body({"messages": user, "max_tokens": 8})
    out.append(("a cross-origin simple POST (text/plain)", CHAT, {"origin": "https://evil.example",
                                                                  "content-type": "text/plain"}, simple, 403))
    out.append(("a foreign Host", CHAT, {"host": "evil.example"}, simple, 403))
    return out


def hostile(base: str, repeats: int, clients: int, per_client: int, only: str = "") -> list[dict[str, Any]]:
    """Per hostile request: its status and latency alone (median of `repeats`); then a simple request's latency
    alone and when sent as `clients` clients each start sending the hostile request `per_client` times (the
    probe's burst; medians of `repeats` bursts), and their ratio. The first row is the control: `GET /health`
    sent the same way, the cost of such a burst itself on this machine (the clients run on its cores too).
    only: the cases whose name holds it (the control always)."""
    simple = {"prompt": "To be", "max_tokens": 16, "temperature": 0}

    def simple_s(client: httpx.Client) -> float:
        t = time.monotonic()
        r = client.post(base + COMPLETE, json=simple, timeout=60)
        assert r.status_code == 200, r.text
        return time.monotonic() - t
    cases = [("control: GET /health", "/health", {}, b"", 200)] + [c for c in hostile_cases() if only in c[0]]
    rows = []
    with httpx.Client(trust_env=False) as c:
        for _ in range(3):
            simple_s(c)  # warm-up
        for name, path, headers, body, want in cases:
            method = "GET" if not body else "POST"
            lat, statuses = [], set()
            for _ in range(repeats):
                t = time.monotonic()
                r = c.request(method, base + path, content=body or None, headers={**JSON_HEADERS, **headers},
                              timeout=60)
                lat.append(time.monotonic() - t)
                statuses.add(r.status_code)
            alone = statistics.median(simple_s(c) for _ in range(repeats))
            beside = []
            with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                attackers = [httpx.Client(trust_env=False) for _ in range(clients)]

                def burst(a: httpx.Client) -> None:
                    for _ in range(per_client):
                        a.request(method, base + path, content=body or None, headers={**JSON_HEADERS, **headers},
                                  timeout=60)
                for _ in range(repeats):  # each time: a burst, and the simple request sent as it starts
                    sent = [pool.submit(burst, a) for a in attackers]
                    time.sleep(0.005)
                    beside.append(simple_s(c))
                    for f in sent:
                        f.result()
                for a in attackers:
                    a.close()
            rows.append({"request": name, "status": sorted(statuses), "want": want,
                         "hostile_ms": round(1000 * statistics.median(lat), 1),
                         "simple_alone_ms": round(1000 * alone, 1),
                         "simple_beside_ms": round(1000 * statistics.median(beside), 1),
                         "ratio": round(statistics.median(beside) / alone, 2)})
            print(f"{name:45s} {rows[-1]['status']} (want {want}) {rows[-1]['hostile_ms']:7.1f} ms | a simple request "
                  f"alone {rows[-1]['simple_alone_ms']:.1f} ms, sent as {clients} clients send it {per_client} times each: "
                  f"{rows[-1]['simple_beside_ms']} ms (x{rows[-1]['ratio']})", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scaling", default=None, metavar="C,C,...",
                    help="instead of the load rounds: aggregate tokens/s of C concurrent completions against one "
                         "alone (e.g. 1,4,16), on a random-weight model of --preset")
    ap.add_argument("--preset", default="tiny", help="--scaling: the preset whose model is served")
    ap.add_argument("--max-tokens", type=int, default=128, help="--scaling: tokens per completion")
    ap.add_argument("--compile", action="store_true",
                    help="--scaling: serve with --compile (the decode step compiled at start-up, kept if faster)")
    ap.add_argument("--dtype", default="auto", help="--scaling: the server's --dtype (auto, float32, bfloat16)")
    ap.add_argument("--scaling-seconds", type=float, default=4.0,
                    help="--scaling: how long each level keeps C requests in flight (the sustained rows)")
    ap.add_argument("--soak", type=float, default=None, metavar="MINUTES",
                    help="rounds back to back for MINUTES (after the warm-up), with n, tools and hostile requests "
                         "mixed in: latency over time, errors by kind, memory at the start and end, slots at the end")
    ap.add_argument("--hostile", action="store_true",
                    help="each hostile request of the adversarial probe: its 4xx and time, and a simple request's "
                         "time alone against sent as 4 clients send it 3 times each")
    ap.add_argument("--only", default="", help="--hostile: only the requests whose name holds this text")
    ap.add_argument("--repeats", type=int, default=7, help="--hostile: times each is measured (medians)")
    ap.add_argument("--requests", type=int, default=200, help="requests per round")
    ap.add_argument("--clients", type=int, default=20, help="concurrent client threads")
    ap.add_argument("--rounds", type=int, default=3, help="rounds after the warm-up round")
    ap.add_argument("--max-queue", type=int, default=64,
                    help="the server's max_queue (default: serve's own); below --clients, 429s happen")
    ap.add_argument("--max-body-bytes", type=int, default=1 << 20, help="the server's request size limit")
    ap.add_argument("--checkpoint", type=Path, default=None, help="serve this run instead of a tiny random one")
    ap.add_argument("--threads", type=int, default=1, help="the server's OMP_NUM_THREADS")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args(argv)

    report: dict[str, Any] = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    if args.scaling:
        with tempfile.TemporaryDirectory(prefix="nanolm-load-") as tmp:
            ckpt = args.checkpoint or build_preset_checkpoint(Path(tmp), args.preset, args.seed)
            with serving(ckpt, max_queue=args.max_queue, threads=args.threads, compile=args.compile,
                         dtype=args.dtype) as server:
                started = next((line.strip() for line in server.log if "decoding in" in line), "")
                print(started, flush=True)
                report["server"] = started
                levels = [int(c) for c in args.scaling.split(",")]
                scaling(server.url, [1], 8, 1)  # warm-up
                report["scaling"] = scaling(server.url, levels, args.max_tokens, args.rounds)
                report["sustained"] = sustained(server.url, levels, args.max_tokens, args.scaling_seconds,
                                                args.rounds)
        for r in report["scaling"]:
            x = f"x{r['x_one']:.2f} one alone" if r["x_one"] is not None else ""
            print(f"{r['concurrent']:3d} sent at once: {r['tokens_per_s']:7.0f} tokens/s  {x}")
        for r in report["sustained"]:
            x = f"x{r['x_one']:.2f} one alone" if r["x_one"] is not None else ""
            print(f"{r['concurrent']:3d} kept in flight: {r['tokens_per_s']:7.0f} tokens/s  {x}")
        print(json.dumps(report, ensure_ascii=False))
        return 0
    if args.hostile:
        with tempfile.TemporaryDirectory(prefix="nanolm-load-") as tmp:
            ckpt = args.checkpoint or build_checkpoint(Path(tmp), max_seq_len=768)
            with serving(ckpt, max_queue=args.max_queue, threads=args.threads) as server:
                report["hostile"] = hostile(server.url, args.repeats, 4, 3, args.only)
        print(json.dumps(report, ensure_ascii=False))
        return 0 if all(r["status"] == [r["want"]] for r in report["hostile"]) else 1
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="nanolm-load-") as tmp:
        # the soak's tool requests render the tool list into the prompt (some 500 tokens of this tokenizer)
        ckpt = args.checkpoint or build_checkpoint(Path(tmp), max_seq_len=768 if args.soak is not None else 128)
        with serving(ckpt, max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                     threads=args.threads) as server:
            base = server.url
            plan = make_plan(args.requests, args.seed, args.max_body_bytes, soak=args.soak is not None)
            t0 = time.monotonic()
            solo = solo_answers(base, plan if args.soak is None else [  # every template the rounds may take
                r for k in range(64) for r in make_plan(args.requests, args.seed, args.max_body_bytes, soak=True,
                                                        offset=k)])
            report["solo"] = {"templates": len(solo), "wall_s": round(time.monotonic() - t0, 2)}
            report["rss_mib_start"] = round(server.rss_mib(), 1)
            rounds = []
            soak_start = None
            for k in range(10**9 if args.soak is not None else args.rounds + 1):
                if soak_start is not None and time.monotonic() - soak_start >= 60 * args.soak:
                    break
                if k == 1:
                    soak_start = time.monotonic()
                order = plan[:] if args.soak is None else make_plan(args.requests, args.seed, args.max_body_bytes,
                                                                    soak=True, offset=k % 64)
                random.Random(args.seed + k).shuffle(order)
                rnd = run_round(base, order, args.clients, args.max_queue)
                stuck = wait_idle(base)
                summary = summarize(rnd)
                summary["rss_mib"] = round(server.rss_mib(), 1)
                summary["admitted_after"] = stuck
                summary["mismatches"] = [p for p in (check(r, solo) for r in rnd.results) if p]
                summary["at_s"] = round(time.monotonic() - (soak_start or time.monotonic()), 1)
                rounds.append(summary)
                problems += summary["mismatches"][:10]
                if stuck:
                    problems.append(f"round {k}: {stuck} requests still admitted 15 s after the round")
                name = "warm-up" if k == 0 else f"round {k}" + (f" (t={summary['at_s']:.0f} s)" if args.soak else "")
                lat = summary["latency_ms"]
                print(f"{name:8s} {summary['requests']} requests in {summary['wall_s']:.1f} s = "
                      f"{summary['requests_per_s']:.1f} req/s | non-stream p50/p95 {lat['nonstream']['p50']}/"
                      f"{lat['nonstream']['p95']} ms | stream {lat['stream']['p50']}/{lat['stream']['p95']} ms, "
                      f"first token {lat['ttft']['p50']}/{lat['ttft']['p95']} ms | /health {lat['health']['p50']}/"
                      f"{lat['health']['p95']} ms | statuses {summary['statuses']} "
                      f"| 429 retried {summary['retries_429']} (unexplained {summary['unexplained_429']}) "
                      f"| RSS {summary['rss_mib']:.1f} MiB | wrong {len(summary['mismatches'])}", flush=True)
            final = httpx.post(base + COMPLETE, json={"prompt": "To be", "max_tokens": 2, "temperature": 0},
                               timeout=30, trust_env=False)
            report["final_request_status"] = final.status_code
            if final.status_code != 200 or not server.alive():
                problems.append(f"the server did not answer a last request: HTTP {final.status_code}")
            report["rounds"] = rounds
            warm, last = rounds[0]["rss_mib"], rounds[-1]["rss_mib"]
            report["rss_growth_mib"] = round(last - warm, 1)
            report["rss_growth_pct"] = round(100 * (last - warm) / warm, 1)
        report["server_exit"] = server.proc.returncode
    print(f"RSS after warm-up {warm:.1f} MiB, after the last round {last:.1f} MiB: "
          f"{report['rss_growth_mib']:+.1f} MiB ({report['rss_growth_pct']:+.1f}%)")
    total = sum(r["requests"] for r in rounds)
    if args.soak is not None:
        statuses: Counter = Counter()
        for r in rounds[1:]:
            statuses.update(r["statuses"])
        report["soak"] = {"minutes": round((rounds[-1]["at_s"]) / 60, 2), "rounds": len(rounds) - 1,
                          "requests": sum(r["requests"] for r in rounds[1:]), "statuses": dict(sorted(statuses.items())),
                          "wrong": sum(len(r["mismatches"]) for r in rounds[1:]),
                          "slots_taken_at_end": rounds[-1]["admitted_after"]}
        s = report["soak"]
        # over time: each tenth of the soak's rounds, its medians of the rounds' p50 / p95 and its mean memory
        soaked, tenths = rounds[1:], []
        k = max(1, len(rounds[1:]) // 10)
        for i in range(0, len(soaked) - k + 1, k):
            part = soaked[i:i + k]
            lat = {key: tuple(round(statistics.median(r["latency_ms"][key][q] for r in part
                                                       if r["latency_ms"][key][q] is not None))
                              for q in ("p50", "p95")) for key in ("nonstream", "stream", "ttft", "malformed")}
            tenths.append({"until_s": part[-1]["at_s"], "latency_ms": lat,
                           "rss_mib": round(statistics.mean(r["rss_mib"] for r in part), 1)})
        s["over_time"] = tenths
        first, last_t = tenths[0]["rss_mib"], tenths[-1]["rss_mib"]
        s["rss_trend_pct"] = round(100 * (last_t - first) / first, 2)
        print("until   non-stream p50/p95   stream p50/p95   first token   malformed   RSS (MiB)")
        for t in tenths:
            la = t["latency_ms"]
            print(f"{t['until_s']:5.0f} s {la['nonstream'][0]:6d}/{la['nonstream'][1]:<6d} ms {la['stream'][0]:6d}/"
                  f"{la['stream'][1]:<6d} ms {la['ttft'][0]:5d}/{la['ttft'][1]:<5d} ms {la['malformed'][0]:4d}/"
                  f"{la['malformed'][1]:<4d} ms {t['rss_mib']:8.1f}")
        print(f"soak: {s['requests']} requests in {s['rounds']} rounds over {s['minutes']:.1f} min; by status "
              f"{s['statuses']}; wrong or lost {s['wrong']}; slots taken at the end {s['slots_taken_at_end']}; "
              f"memory, first tenth to last: {s['rss_trend_pct']:+.2f}%")
    print(f"{total} requests: {'all answers correct' if not problems else f'{len(problems)} problems'}")
    for p in problems[:20]:
        print("  " + p)
    report["problems"] = problems
    line = json.dumps(report, ensure_ascii=False)
    if args.json_out:
        args.json_out.write_text(line + "\n", encoding="utf-8")
    print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
