"""The OpenAI-compatible server: the official client gets the engine's exact outputs, streaming or not;
stop strings, usage, errors, API key, concurrent clients, a full queue and clients that go away."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from nanolm.chat import render_chat
from nanolm.config import SamplingParams, ServeConfig
from nanolm.errors import UserError
from nanolm.infer.bans import ReplyGuides
from nanolm.infer.engine import Engine

from engine_doubles import SlowBatch

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
from server_helpers import CTX, ScriptedEngine, SlowEngine, running, tiny_model  # noqa: E402  (skips without uvicorn)

import nanolm.infer.server as server_mod  # noqa: E402  (imports nothing from the extra itself)
create_app = server_mod.create_app

STOPS = (2, 0)  # <|im_end|>, <|endoftext|>: where the server stops a reply


def client(base: str, key: str = "unused") -> "openai.OpenAI":
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=30)


def chat_ids(tok, text: str) -> list[int]:
    return tok.encode(render_chat([{"role": "user", "content": text}], add_generation_prompt=True))


def no_tools(engine, tok):
    """The guide the server gives a chat reply that offers no tools, thinking off (`ServerState.guide`): no
    <tool_call>, no <think>. A completion gets none."""
    return ReplyGuides(tok, engine.model.config.vocab_size, engine.device).reply()


def solo(engine, tok, ids, params: SamplingParams, chat: bool) -> list[int]:
    """The engine's reply to `ids` generated alone, a chat's under the server's no-tools guide."""
    return list(engine.generate(ids, params, STOPS, guide=no_tools(engine, tok) if chat else None))


def reference(engine, tok, ids, max_tokens, temperature=0.0, top_p=1.0, seed=None,
              chat: bool = True) -> tuple[str, str, int]:
    """What a solo request must return: (text, finish_reason, completion_tokens). chat: ids are a rendered chat
    (guided as the server guides it), else a completion's prompt."""
    out = solo(engine, tok, ids, SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                                seed=seed), chat)
    return tok.decode(out), "length" if len(out) == max_tokens else "stop", len(out)


def sse_events(response) -> list:
    """The `data:` payloads of a server-sent event stream, parsed; [DONE] kept as the string."""
    out = []
    for line in response.iter_lines():
        if line:
            assert line.startswith("data: "), line
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def ask(c, kind: str, streaming: bool, prompt: str, **kw) -> tuple[str, str, object, list[str]]:
    """One request through the official client: (text, finish_reason, usage, the streamed pieces)."""
    extra = {"stream_options": {"include_usage": True}} if streaming else {}
    if kind == "chat":
        r = c.chat.completions.create(messages=[{"role": "user", "content": prompt}], stream=streaming, **extra, **kw)
    else:
        r = c.completions.create(prompt=prompt, stream=streaming, **extra, **kw)
    if not streaming:
        choice = r.choices[0]
        text = choice.message.content if kind == "chat" else choice.text
        return text, choice.finish_reason, r.usage, [text]
    chunks = list(r)
    choices = [ch.choices[0] for ch in chunks if ch.choices]
    pieces = [(ch.delta.content or "") if kind == "chat" else ch.text for ch in choices]
    return "".join(pieces), choices[-1].finish_reason, chunks[-1].usage, pieces


def test_official_client_gets_the_engines_greedy_output(base, engine, tok):
    c = client(base)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    prompt = "你好，请介绍一下三国。"
    text, finish, n = reference(engine, tok, chat_ids(tok, prompt), 24)
    assert n > 0 and text.strip()  # the random model says something, so the comparison means something
    messages = [{"role": "user", "content": prompt}]

    r = c.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=24)
    assert r.object == "chat.completion" and r.model == "tiny"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == text
    assert r.choices[0].finish_reason == finish
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(chat_ids(tok, prompt)), n)
    assert r.usage.total_tokens == r.usage.prompt_tokens + n

    chunks = list(c.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=24,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == finish
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n

    ctext, cfinish, cn = reference(engine, tok, tok.encode("To be, or not"), 20, chat=False)
    r = c.completions.create(model="tiny", prompt="To be, or not", temperature=0, max_tokens=20)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (ctext, cfinish)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(tok.encode("To be, or not")), cn)
    chunks = list(c.completions.create(model="tiny", prompt="To be, or not", temperature=0, max_tokens=20,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == ctext
    assert chunks[-1].choices[0].finish_reason == cfinish

    # Without max_tokens a completion stops after 16 tokens, as OpenAI's does.
    r = c.completions.create(model="tiny", prompt="To be, or not", temperature=0)
    assert r.usage.completion_tokens == 16 and r.choices[0].text == reference(engine, tok, tok.encode("To be, or not"),
                                                                              16, chat=False)[0]


def test_stream_wire_format(base, engine, tok):
    text, finish, _ = reference(engine, tok, chat_ids(tok, "hi"), 6)
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 6,
            "stream": True}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert all(c["model"] == "tiny" and c["id"].startswith("chatcmpl-") for c in chunks)
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}]
    middle = chunks[1:-1]
    assert all(list(c["choices"][0]["delta"]) == ["content"] and c["choices"][0]["finish_reason"] is None
               for c in middle)
    assert "".join(c["choices"][0]["delta"]["content"] for c in middle) == text
    assert chunks[-1]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}]


SENTENCE = "To be, or not to be, that is the question."


@pytest.fixture(scope="module")
def scripted(tok):
    eng = ScriptedEngine(tok.encode(SENTENCE))
    with running(create_app(eng, tok, ServeConfig(model_name="scripted"))) as url:
        yield url, eng.script


def tokens_until(tok, script, stop) -> int:
    """How many tokens the model has produced when `stop` first shows in the text."""
    return next(k for k in range(1, len(script) + 1) if stop in tok.decode(script[:k]))


@pytest.mark.parametrize("stop, want", [("not to", "To be, or "), (["question", ", or"], "To be"),
                                        ("quest", "To be, or not to be, that is the "), ("be,", "To ")])
def test_stop_strings_cut_the_text(scripted, tok, stop, want):
    url, script = scripted
    c = client(url)
    first = stop if isinstance(stop, str) else ", or"  # the one that occurs first
    for kind in ("chat", "completion"):
        for streaming in (False, True):
            text, finish, usage, pieces = ask(c, kind, streaming, "q", model="m", stop=stop, max_tokens=40)
            assert (text, finish) == (want, "stop"), (kind, streaming)
            assert usage.completion_tokens == tokens_until(tok, script, first)
            assert not any(first in p for p in pieces)


def test_stop_string_that_never_completes_is_released(scripted, tok):
    url, script = scripted
    c = client(url)
    chunks = list(c.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}], stop="question?",
                                            stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == SENTENCE
    assert chunks[-1].choices[0].finish_reason == "stop"  # the model itself ended (a stop token)


def test_finish_reason_stop_at_the_end_token_and_length_at_max_tokens(scripted, tok):
    url, script = scripted
    c = client(url)
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (SENTENCE, "stop")
    assert r.usage.completion_tokens == len(script)
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}], max_tokens=3)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (tok.decode(script[:3]), "length")
    r = c.completions.create(model="m", prompt="q", max_tokens=len(script))
    assert (r.choices[0].text, r.choices[0].finish_reason) == (SENTENCE, "length")
    r = c.completions.create(model="m", prompt="q", max_tokens=len(script) + 1)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (SENTENCE, "stop")


CHAT = "/v1/chat/completions"
COMPLETE = "/v1/completions"
OK_MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path, body, param", [
    (CHAT, "{", None),
    (CHAT, "", None),
    (CHAT, "[1, 2]", None),
    (CHAT, {}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": [{"role": "user"}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    (CHAT, {"messages": OK_MSG, "temperature": -0.1}, "temperature"),
    (CHAT, {"messages": OK_MSG, "temperature": 2.5}, "temperature"),
    (CHAT, {"messages": OK_MSG, "temperature": "hot"}, "temperature"),
    (CHAT, {"messages": OK_MSG, "top_p": 0}, "top_p"),
    (CHAT, {"messages": OK_MSG, "top_p": 1.5}, "top_p"),
    (CHAT, {"messages": OK_MSG, "max_tokens": 0}, "max_tokens"),
    (CHAT, {"messages": OK_MSG, "max_tokens": "5"}, "max_tokens"),
    (CHAT, {"messages": OK_MSG, "n": 0}, "n"),
    (CHAT, {"messages": OK_MSG, "n": 65}, "n"),
    (CHAT, {"messages": OK_MSG, "n": 17}, "n"),  # more than this server's max_batch (16 on a CPU)
    (CHAT, {"messages": OK_MSG, "presence_penalty": 2.5}, "presence_penalty"),
    (CHAT, {"messages": OK_MSG, "frequency_penalty": -3}, "frequency_penalty"),
    (CHAT, {"messages": OK_MSG, "repetition_penalty": 0}, "repetition_penalty"),
    (CHAT, {"messages": OK_MSG, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": OK_MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (COMPLETE, {"prompt": "a", "logprobs": 6}, "logprobs"),
    (CHAT, {"messages": OK_MSG, "stream": "yes"}, "stream"),
    (CHAT, {"messages": OK_MSG, "stop": 5}, "stop"),
    (CHAT, {"messages": OK_MSG, "stop": [""]}, "stop"),
    (CHAT, {"messages": OK_MSG, "seed": 2**70}, "seed"),
    (COMPLETE, {"model": "tiny"}, "prompt"),
    (COMPLETE, {"prompt": ["a", "b"]}, "prompt"),
    (COMPLETE, {"prompt": "a", "echo": True}, "echo"),
])
def test_bad_requests_get_400_with_an_openai_error_body(base, path, body, param):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(base + path, content=content, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert err["message"].startswith(f"{param}: " if param else "request body: ")


def test_other_client_errors_have_the_error_body_too(base):
    r = httpx.get(base + "/v1/nothing", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(base + CHAT, timeout=30)
    assert r.status_code == 405 and r.json()["error"]["message"] == "Method Not Allowed"
    r = httpx.get(base + "/v1/models/other", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(base + "/v1/models/tiny", timeout=30).json()["id"] == "tiny"
    with pytest.raises(openai.BadRequestError, match=r"n: 17 choices asked for, and this server decodes at most 16 rows"):
        client(base).chat.completions.create(model="tiny", messages=OK_MSG, n=17)


def test_fields_a_request_leaves_out_take_the_sampling_defaults(base, engine, tok):
    """SamplingParams' defaults unless the server was given others (`nanolm serve --temperature ...`); what a
    request gives wins, field by field. A chat without max_tokens gets the server's max_new_tokens, a
    completion without it 16 tokens (OpenAI's rule)."""
    ids = chat_ids(tok, "hi")
    r = client(base).chat.completions.create(model="tiny", messages=OK_MSG, seed=11, max_tokens=12)
    assert r.choices[0].message.content == tok.decode(solo(engine, tok, ids, SamplingParams(max_new_tokens=12,
                                                                                           seed=11), True))
    defaults = SamplingParams(max_new_tokens=5, temperature=0.9, top_k=7, top_p=0.8, seed=3)
    with running(create_app(engine, tok, ServeConfig(model_name="tiny"), defaults)) as url:
        c = client(url)
        want = solo(engine, tok, ids, defaults, True)
        r = c.chat.completions.create(model="tiny", messages=OK_MSG)
        assert (r.choices[0].message.content, r.usage.completion_tokens) == (tok.decode(want), len(want))
        r = c.chat.completions.create(model="tiny", messages=OK_MSG, temperature=0, max_tokens=9)
        assert r.choices[0].message.content == reference(engine, tok, ids, 9)[0]
        mixed = SamplingParams(max_new_tokens=8, temperature=0.9, top_k=0, top_p=0.8, seed=4)
        r = c.chat.completions.create(model="tiny", messages=OK_MSG, max_tokens=8, extra_body={"top_k": 0}, seed=4)
        assert r.choices[0].message.content == tok.decode(solo(engine, tok, ids, mixed, True))
        r = c.completions.create(model="tiny", prompt="To be", temperature=0)
        assert r.usage.completion_tokens == 16


def test_prompt_longer_than_the_context_is_refused(base, tok):
    long = "To be, or not to be, that is the question. " * 20
    n = len(chat_ids(tok, long))
    assert n >= CTX
    r = httpx.post(base + CHAT, json={"messages": [{"role": "user", "content": long}]}, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert f"the prompt is {n} tokens long and the model's context is {CTX} tokens" in err["message"]
    r = httpx.post(base + COMPLETE, json={"prompt": long, "stream": True}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "repetition_penalty"])
def test_nan_and_infinity_are_not_numbers(base, field, number):
    body = '{"messages": [{"role": "user", "content": "hi"}], "%s": %s}' % (field, number)
    r = httpx.post(base + CHAT, content=body, headers={"content-type": "application/json"}, timeout=30)
    err = r.json()["error"]
    assert (r.status_code, err["param"], err["message"]) == (
        400, field, f"{field}: must be a number (NaN and Infinity are not numbers)")


@pytest.mark.parametrize("bias, message", [
    ({"400": 5}, "logit_bias: '400' is not a token id of this model; its ids are 0 to 399"),
    ({"99999999999": -100}, "logit_bias: '99999999999' is not a token id of this model; its ids are 0 to 399"),
    ({"-1": 1}, "logit_bias: '-1' is not a token id of this model; its ids are 0 to 399"),
    ({"abc": 1}, "logit_bias: 'abc' is not a token id of this model; its ids are 0 to 399"),
    ({"5": 101}, "logit_bias['5']: 101 is outside -100 to 100"),
    # in the vocabulary and in range: refused too, rather than ignored (the sampler has no per-token bias)
    ({"5": -100}, "logit_bias: not supported by this server (its sampler has no per-token bias); leave it out"),
])
@pytest.mark.parametrize("path", [CHAT, COMPLETE])
def test_logit_bias_is_refused_not_ignored(base, bias, message, path):
    body = {"messages": OK_MSG} if path == CHAT else {"prompt": "a"}
    r = httpx.post(base + path, json={**body, "logit_bias": bias}, timeout=30)
    err = r.json()["error"]
    assert (r.status_code, err["param"], err["message"]) == (400, "logit_bias", message)
    r = httpx.post(base + path, json={**body, "logit_bias": {}, "max_tokens": 2}, timeout=30)  # empty: nothing to do
    assert r.status_code == 200


def test_api_key_is_enforced(engine, tok):
    with running(create_app(engine, tok, ServeConfig(model_name="tiny", api_key="s3cret"))) as url:
        # The scheme's name is case-insensitive (RFC 9110): any spelling of Bearer with the key is served.
        for scheme in ("Bearer", "bearer", "BEARER"):
            r = httpx.get(url + "/v1/models", headers={"Authorization": f"{scheme} s3cret"}, timeout=30)
            assert r.status_code == 200, scheme
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic s3cret"}, {"Authorization": "bearer s3cretX"}):
            r = httpx.post(url + CHAT, content="{", headers=headers, timeout=30)  # refused before parsing
            assert r.status_code == 401, headers
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(url + "/v1/models", headers=headers, timeout=30).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").models.list()
        r = client(url, "s3cret").chat.completions.create(model="tiny", messages=OK_MSG, max_tokens=3)
        assert r.usage.completion_tokens == 3


def test_a_foreign_web_page_cannot_drive_the_server(engine, tok):
    """A cross-origin "simple" POST (text/plain, no preflight) and a DNS-rebound Host get 403 before anything
    runs; the server's own page (same origin) and programs (no Origin) are served."""
    body = json.dumps({"model": "tiny", "messages": OK_MSG, "max_tokens": 2})
    with running(create_app(engine, tok, ServeConfig(model_name="tiny"))) as url:
        port = url.rsplit(":", 1)[1]
        r = httpx.post(url + CHAT, content=body, headers={"Origin": "http://evil.example",
                                                           "Content-Type": "text/plain"}, timeout=30)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
        assert r.json()["error"]["message"].startswith("a page from http://evil.example may not use this server")
        r = httpx.post(url + CHAT, content=body, headers={"Host": f"rebound.example:{port}"}, timeout=30)
        assert r.status_code == 403 and "answers only requests to localhost, 127.0.0.1 or [::1]" in \
            r.json()["error"]["message"]
        assert httpx.get(url + "/", headers={"Host": f"rebound.example:{port}"}, timeout=30).status_code == 403
        same = httpx.post(url + CHAT, content=body, headers={"Origin": url, "Content-Type": "application/json"},
                          timeout=30)
        assert same.status_code == 200 and same.json()["usage"]["completion_tokens"] == 2
        local = httpx.post(url + CHAT, content=body, headers={"Host": f"localhost:{port}",
                                                              "Content-Type": "application/json"}, timeout=30)
        assert local.status_code == 200
        assert client(url).chat.completions.create(model="tiny", messages=OK_MSG, max_tokens=2).usage \
            .completion_tokens == 2
    # Listening on every interface, any Host is fine (the LAN's names), but a foreign Origin is still refused.
    with running(create_app(engine, tok, ServeConfig(model_name="tiny", host="0.0.0.0"))) as url:
        port = url.rsplit(":", 1)[1]
        ok = httpx.post(url + CHAT, content=body, headers={"Host": f"box.lan:{port}", "Origin": f"http://box.lan:{port}",
                                                            "Content-Type": "application/json"}, timeout=30)
        assert ok.status_code == 200
        r = httpx.post(url + CHAT, content=body, headers={"Origin": "http://evil.example"}, timeout=30)
        assert r.status_code == 403


def test_a_conversation_too_long_to_fit_is_refused_before_it_is_rendered(engine, tok, monkeypatch):
    """20,000 tiny messages (a 700 KB body) or messages whose text alone is too long: 400 context_length_exceeded,
    without converting or rendering a message."""
    import nanolm.infer.server.routes as routes

    def never(*a, **kw):
        raise AssertionError("a message was converted")

    monkeypatch.setattr(routes, "message_from_dict", never)
    with running(create_app(engine, tok, ServeConfig(model_name="tiny"))) as url:
        most = engine.max_seq_len // 3  # messages the context can hold at most
        n = most + most // 2 + 1  # past that, yet not twice that: counted exactly
        few = ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * n)[:n - 1] + OK_MSG
        r = httpx.post(url + CHAT, json={"model": "tiny", "messages": few}, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and (err["param"], err["code"]) == ("messages", "context_length_exceeded")
        assert err["message"] == (f"the conversation has {n} messages, more than the model's context of "
                                  f"{engine.max_seq_len} tokens can hold (each takes at least 3); shorten the "
                                  "conversation")
        # thousands: refused while the body arrives, once it holds twice as many "role" keys as the limit
        many = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 10_000 + OK_MSG
        r = httpx.post(url + CHAT, json={"model": "tiny", "messages": many}, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and (err["param"], err["code"]) == ("messages", "context_length_exceeded")
        assert err["message"] == (f"the conversation holds more than {2 * most} \"role\" keys, more messages than "
                                  f"the model's context of {engine.max_seq_len} tokens can hold (each takes at "
                                  "least 3); shorten the conversation")
        assert r.headers["connection"] == "close"  # the rest of the body is not read and discarded
        # However the "role" key is spelt (\u0072ole is the same JSON key) or if it is missing: counted as the
        # parser counts messages, refused before any message is validated or converted.
        for spelt in ('{"\\u0072ole": "user", "content": "a"}', '{"content": "a"}'):
            body = '{"model": "tiny", "messages": [' + ", ".join([spelt] * 20_000) + "]}"
            with monkeypatch.context() as m:  # not validated either (20,000 messages took 140 ms)
                m.setattr(routes.ChatRequest, "model_validate_json", never)
                r = httpx.post(url + CHAT, content=body, headers={"content-type": "application/json"}, timeout=30)
            err = r.json()["error"]
            assert (r.status_code, err["param"], err["message"]) == (400, "messages", (
                f"the conversation has 20000 messages, more than the model's context of {engine.max_seq_len} tokens "
                "can hold (each takes at least 3); shorten the conversation")), spelt
        long = [{"role": "user", "content": "x" * 400_000}]
        r = httpx.post(url + CHAT, json={"model": "tiny", "messages": long}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("the messages hold 400000 bytes")


def test_a_bug_answers_500_without_its_text_and_logs_it(engine, tok, monkeypatch, capfd):
    from nanolm.infer.server.routes import ServerState

    def broken(self, req):
        raise RuntimeError("secret detail /home/someone/model")

    monkeypatch.setattr(ServerState, "chat_prompt", broken)
    with running(create_app(engine, tok, ServeConfig(model_name="tiny"))) as url:
        r = httpx.post(url + CHAT, json={"model": "tiny", "messages": OK_MSG}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 500 and err["type"] == "server_error" and "secret" not in err["message"]
    ref = err["message"].split()[2].rstrip(";")
    assert err["message"] == f"internal error {ref}; the server's log has the details"
    log = capfd.readouterr().err
    assert f"internal error {ref} on POST /v1/chat/completions" in log and "secret detail" in log


def in_threads(fn, n: int, timeout: float = 120) -> None:
    """fn(0) ... fn(n - 1), each on its own thread, all at once; returns when all are done (or timed out)."""
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)


def test_concurrent_clients_each_get_their_solo_output(base, engine, tok):
    """16 requests from 8 threads at once: chat and completions, streaming or not, greedy or seeded sampling."""
    prompts = ["To be", "你好", "The quality of mercy", "滚滚长江", "All the world", "话说天下", "We hold",
               "一壶浊酒"]
    jobs = []
    for i in range(16):
        kind, streaming, p = ("chat", "completion")[i % 2], bool(i // 2 % 2), prompts[i % 8]
        temperature, seed = (0.0, None) if i % 3 else (0.9, 100 + i)
        ids = chat_ids(tok, p) if kind == "chat" else tok.encode(p)
        want = reference(engine, tok, ids, 12, temperature, 0.9, seed, chat=kind == "chat")
        jobs.append((kind, streaming, p, temperature, seed, want))
    results: dict[int, tuple] = {}
    barrier = threading.Barrier(8)

    def run(worker: int) -> None:
        c = client(base)
        barrier.wait()
        for i in range(worker, 16, 8):
            kind, streaming, p, temperature, seed, _ = jobs[i]
            results[i] = ask(c, kind, streaming, p, model="tiny", temperature=temperature, top_p=0.9, seed=seed,
                             max_tokens=12)[:2]

    in_threads(run, 8)
    assert len(results) == 16
    for i, job in enumerate(jobs):
        text, finish, _ = job[-1]
        assert results[i] == (text, finish), job[:5]


class CountingBatch(SlowBatch):
    """The real batch, slowed so that requests overlap; records the most rows a step decoded."""

    most = 0

    def step(self):
        CountingBatch.most = max(CountingBatch.most, len(self))
        return super().step()


class CountingEngine(SlowEngine):
    def batch(self):
        return CountingBatch(self, self.signals, self.delay)


def test_twenty_concurrent_clients_are_decoded_together_and_each_gets_its_solo_answer(engine, tok):
    """20 clients at once, each request different (chat or completion, streaming or not, greedy or seeded, with
    or without penalties): the server decodes them in one batch, and every answer equals the request sent alone
    (the engine generating it by itself)."""
    prompts = ["To be", "你好", "The quality of mercy", "滚滚长江", "All the world", "话说天下", "We hold",
               "一壶浊酒", "Now is the winter", "白发渔樵"]
    jobs = []
    for i in range(20):
        kind, streaming, p = ("chat", "completion")[i % 2], bool(i // 2 % 2), prompts[i % 10]
        temperature, seed = (0.0, None) if i % 3 else (0.9, 300 + i)
        penalties = {"frequency_penalty": 0.5, "repetition_penalty": 1.3} if i % 4 == 1 else {}
        ids = chat_ids(tok, p) if kind == "chat" else tok.encode(p)
        params = SamplingParams(max_new_tokens=16, temperature=temperature, top_p=0.9, seed=seed, **penalties)
        out = solo(engine, tok, ids, params, kind == "chat")
        jobs.append((kind, streaming, p, temperature, seed, penalties,
                     (tok.decode(out), "length" if len(out) == 16 else "stop")))
    CountingBatch.most = 0
    eng = CountingEngine()
    eng.gate.clear()  # the first step holds until all 20 requests are in
    results: dict[int, tuple] = {}
    with running(create_app(eng, tok, ServeConfig(model_name="tiny"))) as url:
        def open_when_all_admitted() -> None:
            deadline = time.monotonic() + 60
            while httpx.get(url + "/health", timeout=30).json()["admitted"] < 20 and time.monotonic() < deadline:
                time.sleep(0.02)
            eng.gate.set()

        def run(i: int) -> None:
            if i == 20:
                return open_when_all_admitted()
            kind, streaming, p, temperature, seed, penalties, _ = jobs[i]
            results[i] = ask(client(url), kind, streaming, p, model="tiny", temperature=temperature, top_p=0.9,
                             seed=seed, max_tokens=16, extra_body=penalties)[:2]

        try:
            in_threads(run, 21)
        finally:
            eng.gate.set()
    assert len(results) == 20
    for i, job in enumerate(jobs):
        assert results[i] == job[-1], job[:6]
    assert CountingBatch.most == 16  # decoded together, max_batch (16 on a CPU) at once, the rest waiting


def test_n_choices_share_the_prompt_and_each_is_its_seed_alone(base, engine, tok):
    """n = 3 seeded: choice i is the request alone with seed + i, streaming or not; usage counts every choice."""
    ids = chat_ids(tok, "滚滚长江")
    alone = [solo(engine, tok, ids, SamplingParams(max_new_tokens=10, temperature=1.0, top_p=1.0, seed=42 + i),
                  True) for i in range(3)]
    want = [tok.decode(reply) for reply in alone]
    assert len(set(want)) == 3
    c = client(base)
    messages = [{"role": "user", "content": "滚滚长江"}]
    r = c.chat.completions.create(model="tiny", messages=messages, n=3, seed=42, temperature=1.0, top_p=1.0,
                                  max_tokens=10)
    assert [ch.index for ch in r.choices] == [0, 1, 2] and [ch.message.content for ch in r.choices] == want
    assert r.usage.completion_tokens == sum(len(reply) for reply in alone)
    chunks = list(c.chat.completions.create(model="tiny", messages=messages, n=3, seed=42, temperature=1.0,
                                            top_p=1.0, max_tokens=10, stream=True))
    streamed = ["".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices[0].index == i)
                for i in range(3)]
    assert streamed == want
    assert sorted(ch.choices[0].index for ch in chunks if ch.choices[0].finish_reason) == [0, 1, 2]
    r = c.completions.create(model="tiny", prompt="To be", n=2, seed=7, temperature=1.0, top_p=1.0, max_tokens=8)
    assert [ch.text for ch in r.choices] == [
        tok.decode(engine.generate_all(tok.encode("To be"), SamplingParams(max_new_tokens=8, temperature=1.0,
                                                                            top_p=1.0, seed=7 + i), STOPS))
        for i in range(2)]


def test_logprobs_in_both_apis_are_the_models(base, engine, tok):
    """Chat's logprobs.content and completions' logprobs: one entry per reply token, the model's log-probability
    (recomputed here without a cache) and the most likely alternatives, sorted."""
    model = engine.model
    prompt = "All the world"
    ids = chat_ids(tok, prompt)
    c = client(base)
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], temperature=0,
                                  max_tokens=6, logprobs=True, top_logprobs=3)
    reply = solo(engine, tok, ids, SamplingParams(max_new_tokens=6, temperature=0), True)
    entries = r.choices[0].logprobs.content
    assert len(entries) == len(reply) > 0
    context = list(ids)
    table = tok.token_bytes()
    for tid, e in zip(reply, entries):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([context]))[0, -1].float(), -1)
        assert e.bytes == list(table[tid]) and e.logprob == pytest.approx(float(logp[tid]), abs=1e-4)
        top = logp.topk(3)
        assert [t.bytes for t in e.top_logprobs] == [list(table[i]) for i in top.indices.tolist()]
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-6)  # greedy took the top one
        context.append(tid)
    r = c.completions.create(model="tiny", prompt="To be", temperature=0, max_tokens=5, logprobs=2)
    lp = r.choices[0].logprobs
    reply = engine.generate_all(tok.encode("To be"), SamplingParams(max_new_tokens=5, temperature=0), STOPS)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(reply)
    assert all(len(alt) <= 2 for alt in lp.top_logprobs)
    texts = [table[t].decode("utf-8", errors="replace") for t in reply]
    assert lp.tokens == texts and lp.text_offset == [sum(len(x) for x in texts[:i]) for i in range(len(texts))]
    assert r.choices[0].logprobs is not None and c.completions.create(
        model="tiny", prompt="To be", max_tokens=2).choices[0].logprobs is None


def test_full_queue_gets_429_and_the_server_keeps_answering(engine, tok):
    eng = SlowEngine()
    eng.gate.clear()  # generation holds at its first token until the test opens the gate
    want = reference(engine, tok, chat_ids(tok, "hi"), 5)[0]
    body = {"messages": OK_MSG, "max_tokens": 5, "temperature": 0, "stream": True}
    with running(create_app(eng, tok, ServeConfig(model_name="tiny", max_queue=1))) as url:
        try:
            with httpx.stream("POST", url + CHAT, json=body, timeout=30) as first:
                lines = (json.loads(x[6:]) for x in first.iter_lines() if x.startswith("data: {"))
                assert next(lines)["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # admitted
                r = httpx.post(url + COMPLETE, json={"prompt": "x", "max_tokens": 2}, timeout=30)
                assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
                assert r.headers["retry-after"] == "1"
                t0 = time.monotonic()
                assert httpx.get(url + "/v1/models", timeout=30).status_code == 200  # the event loop is free
                assert time.monotonic() - t0 < 2
                eng.gate.set()
                assert "".join(c["choices"][0]["delta"].get("content", "") for c in lines) == want
        finally:
            eng.gate.set()
        r = httpx.post(url + CHAT, json={**body, "stream": False}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want


def post_until_admitted(url: str, body: dict) -> "httpx.Response":
    """The freed slot is released by the worker just after the generation closes; allow it a moment (on two
    loaded cores, more than 5 s has been seen)."""
    deadline = time.monotonic() + 20
    while True:
        r = httpx.post(url + COMPLETE, json=body, timeout=30)
        if r.status_code != 429 or time.monotonic() > deadline:
            return r
        time.sleep(0.02)


def test_client_leaving_mid_stream_stops_its_generation(tok):
    eng = SlowEngine(delay=0.03)  # 80 tokens would take 2.4 s
    with running(create_app(eng, tok, ServeConfig(model_name="tiny", max_queue=1))) as url:
        body = {"prompt": "To be", "max_tokens": 80, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + COMPLETE, json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # one token received; leave
        assert eng.closed.wait(5)
        assert eng.tokens < 40
        r = post_until_admitted(url, {"prompt": "To be", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

        # A non-streaming client that gives up is noticed too: its generation stops and its queue slot (the
        # only one) comes back. Every interleaving of the leaving and the decoding thread is forced in
        # tests/test_server_worker.py::test_a_slot_is_freed_whenever_the_client_leaves.
        eng.closed.clear()
        eng.tokens = 0
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + COMPLETE, json={"prompt": "To be", "max_tokens": 80}, timeout=0.3)
        assert eng.closed.wait(5)
        assert eng.tokens < 60
        r = post_until_admitted(url, {"prompt": "To be", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_a_stream_whose_client_left_before_it_began_frees_its_job(tok):
    """A streaming client gone at once, before its first token: its job is cancelled and its only queue slot
    freed at once (by the stream's own `finally`, or, when Starlette never starts the body, by the response's
    background task), and the generation stops early or never begins."""
    import asyncio

    eng = SlowEngine(delay=0.02)  # 200 tokens would take 4 s
    app = create_app(eng, tok, ServeConfig(model_name="tiny", max_queue=1))
    body = json.dumps({"prompt": "To be", "max_tokens": 200, "temperature": 0, "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": COMPLETE, "raw_path": COMPLETE.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "state": {}}
    sent = []

    async def scenario() -> None:
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}  # gone at once

        async def send(message):
            sent.append(message["type"])

        async with app.router.lifespan_context(app):
            await app(scope, receive, send)
            state = app.state.nanolm
            for _ in range(300):
                if state.worker.admitted == 0:
                    break
                await asyncio.sleep(0.01)
            assert state.worker.admitted == 0
    asyncio.run(scenario())
    assert eng.tokens < 150  # stopped early, or never began


def test_half_sent_and_surplus_connections_are_closed(engine, tok):
    """A socket that sends part of its headers (or nothing) is closed after header_timeout_s, also after a first
    request on it; one beyond max_connections is closed at once; a request under way is not cut however long."""
    cfg = ServeConfig(model_name="tiny", header_timeout_s=0.5, max_connections=4)
    with running(create_app(engine, tok, cfg)) as url:
        host, port = url.removeprefix("http://").split(":")

        def closed_within(sock: socket.socket, seconds: float) -> bool:
            sock.settimeout(seconds)
            try:
                while True:
                    if not sock.recv(65536):
                        return True  # EOF: the server closed it
            except socket.timeout:
                return False
            except ConnectionResetError:
                return True
        half = [socket.create_connection((host, int(port))) for _ in range(3)]
        half[0].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
        half[1].sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # answered, then its next request stalls
        half[1].sendall(b"GET /health HTTP/1.1\r\nHo")
        surplus = [socket.create_connection((host, int(port))) for _ in range(2)]  # 5 and 6 of at most 4
        assert closed_within(surplus[-1], 0.3)
        t = time.monotonic()
        assert all(closed_within(s, 3) for s in half)
        assert 0.3 < time.monotonic() - t < 2.5
        for s in half + surplus:
            s.close()
    # a request that takes longer than the header time-out (40 steps of 30 ms) runs to its end
    with running(create_app(SlowEngine(delay=0.03), tok, cfg)) as url:
        t = time.monotonic()
        r = httpx.post(url + COMPLETE, json={"prompt": "To be", "max_tokens": 40, "temperature": 0,
                                             "stream": True}, timeout=30)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]") and time.monotonic() - t > 1


def test_missing_serve_extra_is_a_user_error(engine, tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if not installed
    with pytest.raises(UserError, match=r"pip install 'nanolm\[serve\]'"):
        create_app(engine, tok, ServeConfig(model_name="tiny"))
    with pytest.raises(UserError, match=r"pip install 'nanolm\[serve\]'"):
        server_mod.serve("no-such-run")


def test_busy_port_is_a_user_error_before_loading(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(UserError, match=f"--port {port}: cannot listen there"):
            server_mod.serve(tmp_path / "no-such-run", ServeConfig(port=port))


@pytest.mark.parametrize("compile", [False, True])
def test_serve_a_trained_checkpoint(data_dir, tmp_path, tok, compile):
    """serve() on a trained run answers the engine's reply; with --compile it compiles the decode step before it
    listens, says whether it kept it, and answers the same (the worker thread running the compiled step)."""
    from test_train import tiny_cfg

    from nanolm.checkpoint import load_model
    from nanolm.train.trainer import train

    run = tmp_path / "myrun"
    train(tiny_cfg(data_dir, run, **{"train.max_steps": 3, "model.max_seq_len": 64}), quiet=True)
    model, _ = load_model(run, "best")
    want = reference(Engine(model), tok, chat_ids(tok, "你好"), 8)[0]

    code = (f"from nanolm.config import ServeConfig; from nanolm.infer.server import serve; "
            f"serve({str(run)!r}, ServeConfig(port=0, api_key='k', compile={compile}), device='cpu')")
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True)
    reader.start()
    try:
        url, said = None, []
        deadline = time.monotonic() + (240 if compile else 60)
        while url is None and time.monotonic() < deadline:
            try:
                said.append(lines.get(timeout=1))
                m = re.match(r"serving 'myrun' at (http://127\.0\.0\.1:\d+/v1) ", said[-1])
                url = m and m.group(1)
            except queue.Empty:
                assert proc.poll() is None, "serve exited"
        assert url, "serve did not say where it listens"
        compiled = re.search(r"; the decode step (compiled|left uncompiled) \(compiled in \d+ s\): a step of 16 rows "
                             r"plus one of 1 row took [\d.]+ ms compiled, [\d.]+ ms as it is\]$", "".join(said), re.M)
        assert bool(compiled) == compile, "".join(said)
        c = openai.OpenAI(base_url=url, api_key="k", max_retries=2, timeout=30)  # retries: uvicorn may still start
        assert [m.id for m in c.models.list().data] == ["myrun"]
        r = c.chat.completions.create(model="myrun", messages=[{"role": "user", "content": "你好"}], temperature=0,
                                      max_tokens=8)
        assert r.choices[0].message.content == want
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        finally:
            if proc.poll() is None:
                proc.kill()
    # Ctrl+C shuts down gracefully and serve() returns (older uvicorn re-raised the signal itself).
    assert proc.returncode in (0, -signal.SIGINT)
    reader.join(5)
    assert "Application shutdown complete." in "".join(lines.queue)


def test_a_tokenizer_larger_than_the_model_is_refused_at_start(tok):
    small = Engine(tiny_model(vocab_size=tok.vocab_size - 1))
    with pytest.raises(UserError, match=rf"the tokenizer has {tok.vocab_size} tokens but the model only "
                                        rf"{tok.vocab_size - 1}"):
        create_app(small, tok, ServeConfig(model_name="tiny"))


def test_text_that_is_not_utf8_is_a_400(base):
    for path, body in (("/v1/chat/completions",
                        '{"model": "tiny", "messages": [{"role": "user", "content": "a \\ud800 b"}]}'),
                       ("/v1/completions", b'{"model": "tiny", "prompt": "a \xff b"}')):
        r = httpx.post(base + path, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def read_http_response(conn) -> str:
    """One whole HTTP/1.1 response from a raw socket: the server may send the headers and the body in separate
    packets, so read until the headers end and then until Content-Length bytes of body have come."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        assert chunk, f"the connection closed before the headers ended: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = conn.recv(65536)
        assert chunk, f"the connection closed after {len(body)} of {length} body bytes"
        body += chunk
    return (head + b"\r\n\r\n" + body).decode()


def test_a_body_that_stops_arriving_gets_408_and_the_server_goes_on(engine, tok):
    import socket
    with running(create_app(engine, tok, ServeConfig(model_name="tiny", body_timeout_s=0.5))) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"model\": \"tiny\", ")  # then nothing more
            reply = read_http_response(conn)
        status, _, rest = reply.partition("\r\n")
        assert status == "HTTP/1.1 408 Request Timeout"
        body = json.loads(rest.split("\r\n\r\n", 1)[1])
        assert body["error"]["code"] == "request_timeout" and "did not arrive within 0.5 s" in body["error"]["message"]
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
