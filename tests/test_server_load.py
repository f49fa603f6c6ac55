"""The server under load, and the limits that keep one request's cost bounded.

The load test drives a `serve()` subprocess on loopback through bench/server_load.py's
driver: 200 requests per round from 20 concurrent clients (chat and completions,
streaming or not, seeded or greedy, ~10% malformed, ~10% leaving mid-stream) with a
queue smaller than the client count, so 429s happen and are retried.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
import signal
import sys
from pathlib import Path

import pytest
from server_helpers import running, tiny_model  # skips this module without uvicorn

import nanolm.infer.server as server_mod
from nanolm.config import ServeConfig
from nanolm.errors import UserError
from nanolm.infer.engine import Engine
from nanolm.tokenizer import Tokenizer

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from nanolm.infer.server.routes import max_token_bytes  # noqa: E402  (needs the serve extra)
from nanolm.infer.server.schemas import MAX_STOPS  # noqa: E402


def _load_bench():
    """bench/server_load.py as a module (bench/ is scripts, not a package)."""
    path = Path(__file__).resolve().parent.parent / "bench" / "server_load.py"
    spec = importlib.util.spec_from_file_location("nanolm_bench_server_load", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


bench = _load_bench()

CHAT, COMPLETE = bench.CHAT, bench.COMPLETE


@pytest.mark.slow
def test_200_requests_from_20_clients_every_answer_right_and_memory_flat(tmp_path):
    clients, max_queue, max_body = 20, 8, 256 * 1024
    run = bench.build_checkpoint(tmp_path)
    plan = bench.make_plan(200, seed=1, max_body_bytes=max_body)
    kinds = [r.kind for r in plan]
    assert (kinds.count("ok"), kinds.count("bad"), kinds.count("drop")) == (160, 20, 20)
    assert sum(r.stream for r in plan if r.kind == "ok") == 80
    assert len({r for r in plan if r.kind == "bad"}) == 20  # every malformed template is sent

    with bench.serving(run, max_queue=max_queue, max_body_bytes=max_body) as server:
        solo = bench.solo_answers(server.url, plan)
        assert len({w.text for w in solo.values()}) > 20  # the random model's replies differ: the check means something
        rss_start = server.rss_mib()
        rounds, rss = [], []
        for k in range(3):  # a warm-up round, then two measured ones
            order = plan[:]
            random.Random(k).shuffle(order)
            # A generous grace: a slot is freed just after its client sees the end, later on a loaded CI machine.
            rnd = bench.run_round(server.url, order, clients, max_queue, grace_s=10.0)
            assert bench.wait_idle(server.url) == 0, f"round {k}: queue slots still taken after the round"
            rss.append(server.rss_mib())
            rounds.append(rnd)

        for k, rnd in enumerate(rounds):
            assert len(rnd.results) == 200
            problems = [p for p in (bench.check(r, solo) for r in rnd.results) if p]
            assert not problems, f"round {k}: {len(problems)} wrong answers, e.g. {problems[:5]}"
            for r in rnd.results:
                if r.req.kind == "ok":  # exactly its solo answer (bench.check), from a 200, after any 429s
                    assert r.status == 200 and r.text == solo[r.req].text and r.finish == solo[r.req].finish
                elif r.req.kind == "bad":
                    assert 400 <= r.status < 500 and r.status == r.req.want_status, r.req.name
                    assert r.error["message"] and r.error["type"], r.req.name
            assert sum(r.left for r in rnd.results) >= 16  # most leaving clients left mid-stream, not after the end
            assert sum(r.retries for r in rnd.results) > 0  # 20 clients, 8 slots: the queue filled up
            assert sum(r.unexplained_429 for r in rnd.results) == 0
            assert rnd.max_admitted <= max_queue
            # The event loop kept answering while the worker generated.
            assert bench.pct(rnd.health_s, 0.95) < 1.0

        # Still up: a last request, and /health.
        r = httpx.post(server.url + COMPLETE, json={"prompt": "To be", "max_tokens": 3, "temperature": 0},
                       timeout=30, trust_env=False)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        health = httpx.get(server.url + "/health", timeout=30, trust_env=False).json()
        assert health == {"status": "ok", "model": "run", "admitted": 0, "max_queue": max_queue, "max_batch": 16}
        assert server.alive()

        # Memory: the warm-up round adds little (a 256 KiB prompt used to leave ~60 MiB resident after its
        # tokenization), and 400 more requests add nothing. Over 10 rounds the RSS drifted within 2 MiB;
        # keeping one reply's KV cache (64 KiB for this model) per request would add 25 MiB.
        assert rss[0] - rss_start < 48, (rss_start, rss)
        assert rss[-1] - rss[0] < 16, rss
    assert server.proc.returncode in (0, -signal.SIGINT)  # Ctrl+C: a clean shutdown


def test_scaling_sends_at_once_and_keeps_requests_in_flight(tmp_path):
    """--scaling's two measures on a served random model: C completions sent at once, and C kept in flight
    (each client's next request as soon as its last is answered) for a while: every answer counted, each level's
    ratio to one alone."""
    run = bench.build_preset_checkpoint(tmp_path, "tiny")
    with bench.serving(run, max_queue=8) as server:
        burst = bench.scaling(server.url, [1, 4], max_tokens=8, repeats=1)
        kept = bench.sustained(server.url, [1, 4], max_tokens=8, seconds=1.0, repeats=1)
        assert bench.wait_idle(server.url) == 0
    assert [r["concurrent"] for r in burst] == [r["concurrent"] for r in kept] == [1, 4]
    assert burst[0]["x_one"] == kept[0]["x_one"] == 1.0
    assert 0 < burst[1]["tokens"] <= 4 * 8
    # in flight for a second: each of 4 clients sent one request after another, each up to 8 tokens
    assert kept[1]["requests"] > 4 and 0 < kept[1]["tokens"] <= 8 * kept[1]["requests"]
    assert kept[1]["wall_s"] >= 1.0
    assert all(r["tokens_per_s"] == pytest.approx(r["tokens"] / r["wall_s"]) for r in burst + kept)


# --- the limits, in process ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok(tokenizer_dir) -> Tokenizer:
    return Tokenizer.load(tokenizer_dir)


def test_max_token_bytes_bounds_every_text(tok, corpus):
    n = max_token_bytes(tok)
    assert n >= len("<|endoftext|>") and n >= int(tok.token_byte_lengths().max())
    texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()]
    texts += ["<|im_start|>user\n<|im_end|><|endoftext|>", "一壶浊酒喜相逢" * 20]
    for text in texts:
        assert len(text.encode("utf-8")) <= n * len(tok.encode(text))


def error(r) -> dict:
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return body


def test_body_over_the_limit_gets_413_unread(tok):
    with running(server_mod.create_app(Engine(tiny_model()), tok, ServeConfig(model_name="tiny", max_body_bytes=200))) as url:
        fits = json.dumps({"model": "m" * 150, "prompt": "To be", "max_tokens": 1}).encode()
        assert len(fits) <= 200
        r = httpx.post(url + COMPLETE, content=fits, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 200

        big = json.dumps({"prompt": "x" * 300}).encode()
        r = httpx.post(url + COMPLETE, content=big, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 413
        e = error(r)
        assert e["code"] == "request_too_large"
        assert e["message"] == (f"the request body is {len(big)} bytes, over this server's limit of 200 bytes; "
                                "shorten the prompt or the conversation")

        # Without a Content-Length: refused once 200 bytes have arrived.
        r = httpx.post(url + CHAT, content=(big[i:i + 64] for i in range(0, len(big), 64)), timeout=30)
        assert r.status_code == 413 and error(r)["message"].startswith("the request body passes this server's "
                                                                        "limit of 200 bytes;")

        # A far larger one is refused from its header alone; the connection stays usable.
        with httpx.Client(timeout=30) as c:
            r = c.post(url + CHAT, content=b"{" * (32 << 20), headers={"content-type": "application/json"})
            assert r.status_code == 413
            assert c.post(url + COMPLETE, content=fits, headers={"content-type": "application/json"}).status_code == 200


def test_prompt_too_long_by_its_bytes_is_refused_before_tokenizing(tok, monkeypatch):
    engine = Engine(tiny_model())
    limit = 4 * max_token_bytes(tok) * engine.max_seq_len
    calls = []
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text: calls.append(len(text)) or real(text))
    with running(server_mod.create_app(engine, tok, ServeConfig(model_name="tiny"))) as url:
        r = httpx.post(url + COMPLETE, json={"prompt": "a" * (limit + 1)}, timeout=30)
        assert r.status_code == 400
        e = error(r)
        assert (e["code"], e["param"]) == ("context_length_exceeded", "prompt")
        assert e["message"].startswith(f"the prompt is {limit + 1} bytes long, more tokens than the model's context "
                                       f"of {engine.max_seq_len} tokens can hold")
        r = httpx.post(url + CHAT, json={"messages": [{"role": "user", "content": "话" * limit}]}, timeout=30)
        assert r.status_code == 400 and error(r)["param"] == "messages"
        assert calls == []  # neither was tokenized

        # Just under the byte bound it is tokenized, and refused by its token count.
        r = httpx.post(url + COMPLETE, json={"prompt": "a" * limit}, timeout=30)
        assert r.status_code == 400 and "tokens long" in error(r)["message"] and calls == [limit]


def test_stop_strings_are_capped(tok):
    with running(server_mod.create_app(Engine(tiny_model()), tok, ServeConfig(model_name="tiny"))) as url:
        ok = {"prompt": "x", "max_tokens": 2, "stop": [f"s{i}" for i in range(MAX_STOPS)]}
        assert httpx.post(url + COMPLETE, json=ok, timeout=30).status_code == 200
        r = httpx.post(url + COMPLETE, json={**ok, "stop": ok["stop"] + ["one more"]}, timeout=30)
        assert r.status_code == 400
        e = error(r)
        assert e["param"] == "stop" and e["message"] == (f"stop: at most {MAX_STOPS} stop strings are "
                                                         f"allowed, got {MAX_STOPS + 1}")


def test_health_needs_no_key_and_counts_admitted_requests(tok):
    with running(server_mod.create_app(Engine(tiny_model()), tok,
                                       ServeConfig(model_name="tiny", api_key="k", max_queue=3))) as url:
        r = httpx.get(url + "/health", timeout=30)
        assert r.status_code == 200 and r.json() == {"status": "ok", "model": "tiny", "admitted": 0, "max_queue": 3,
                                                     "max_batch": 16}
        assert httpx.get(url + "/v1/models", timeout=30).status_code == 401


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1"])
def test_max_body_bytes_must_be_a_positive_integer(tok, bad):
    with pytest.raises(UserError, match=r"max_body_bytes=.*: must be an integer >= 1"):
        server_mod.create_app(Engine(tiny_model()), tok, ServeConfig(model_name="tiny", max_body_bytes=bad))


@pytest.mark.parametrize("field, bad, says", [
    ("max_queue", 0, "max_queue=0: must be an integer >= 1"),
    ("max_queue", 2.0, "max_queue=2.0: must be an integer >= 1"),
    ("body_timeout_s", 0, "body_timeout_s=0: must be a number of seconds > 0"),
    ("body_timeout_s", True, "body_timeout_s=True: must be a number of seconds > 0"),
    ("body_timeout_s", float("inf"), "body_timeout_s=inf: must be a number of seconds > 0"),
    ("port", 65536, "--port 65536: must be an integer from 0 to 65535 (0 picks a free port)"),
    ("port", "80", "--port '80': must be an integer from 0 to 65535"),
    ("host", "", "host='': must be a host name or address"),
    ("api_key", "", "api_key: must be a non-empty string, or None"),
    ("model_name", None, "model_name=None: must be a string"),
])
def test_server_settings_are_checked_when_made(field, bad, says):
    with pytest.raises(UserError, match=re.escape(says)):
        ServeConfig(**{field: bad})


def test_server_settings_defaults_and_the_unnamed_model(tok):
    c = ServeConfig()
    assert (c.host, c.port, c.api_key, c.model_name, c.max_queue, c.max_body_bytes, c.body_timeout_s) == \
        ("127.0.0.1", 8000, None, "", 64, 1 << 20, 30.0)  # loopback unless told otherwise
    assert "s3cret" not in repr(ServeConfig(api_key="s3cret"))
    with pytest.raises(UserError, match="model_name is empty"):
        server_mod.create_app(Engine(tiny_model()), tok, ServeConfig())
