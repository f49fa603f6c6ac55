"""A call only where tools are offered (nanolm/infer/bans.py): with no tools in the conversation no path (the chat,
the server streaming and not, eval's generations, the RL rollouts) lets a reply write the tool-call tag, even from a
model whose logits favour it, whether the tag is one token (nanolm's tokenizers) or spelled in several (a vocabulary
without it); with tools offered the call is still written; with thinking off, no `<think>`."""

from __future__ import annotations

import json

import pytest
import torch

from nanolm.chat import Content, Message, ReplyParser
from nanolm.config import SamplingParams, ServeConfig
from nanolm.infer.bans import AllGuides, BanVocab, ReplyGuides, TagBan
from nanolm.infer.session import ChatSession
from nanolm.infer.engine import Engine
from nanolm.infer.guide import ToolCallGuide
from nanolm.infer.tools import Toolbox

from server_helpers import tiny_model

TAG = "<tool_call>"
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0)


class Favours(torch.nn.Module):
    """A tiny random model whose logits favour spelling `spelling` (token ids) over and over: after spelling[k] the
    next piece gets +1e4, after anything else the first one. Its own logits decide among the rest."""

    def __init__(self, inner: torch.nn.Module, spelling: list[int]) -> None:
        super().__init__()
        self.inner, self.config, self.spelling = inner, inner.config, list(spelling)

    def _favour(self, logits: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """logits (N, ..., V), prev (N,) each row's latest token."""
        logits = logits.clone()
        for i, p in enumerate(prev.tolist()):
            k = self.spelling.index(p) + 1 if p in self.spelling[:-1] else 0
            logits[i, ..., self.spelling[k]] += 1e4
        return logits

    def forward(self, x, cache=None, last=None):
        prev = x[:, -1] if last is None else x.gather(1, last.view(-1, 1)).squeeze(1)
        return self._favour(self.inner(x, cache, last=last), prev)

    def decode_and_prefill(self, idx, cache, prompts, prompt_cache, last):
        rows, first = self.inner.decode_and_prefill(idx, cache, prompts, prompt_cache, last)
        return (self._favour(rows, idx[:, -1]),
                self._favour(first, prompts.gather(1, last.view(-1, 1)).squeeze(1)))


def favouring(tok, text: str, max_seq_len: int = 1024) -> Engine:
    return Engine(Favours(tiny_model(vocab_size=max(400, tok.vocab_size), max_seq_len=max_seq_len),
                          tok.encode(text)))


def plain(tok, max_seq_len: int = 1024) -> Engine:
    return Engine(tiny_model(vocab_size=max(400, tok.vocab_size), max_seq_len=max_seq_len))


def builtin() -> Toolbox:
    return Toolbox.from_specs(["builtin"])


@pytest.fixture(scope="module")
def spelt(tmp_path_factory):
    """A tokenizer without the tags as tokens: `<tool_call>` and `<think>` are text of several tokens (each piece a
    different token, trained on the tags, so that `Favours` can follow its spelling)."""
    from test_byo_tokenizer import MINIMIND_ADDED, minimind_layout_tokenizer

    from nanolm.tokenizer import Tokenizer
    tok = Tokenizer.load(minimind_layout_tokenizer(tmp_path_factory.mktemp("spelt") / "t", added=MINIMIND_ADDED[:3],
                                                   texts=("<tool_call> <think>",)))
    for tag in (TAG, "<think>"):
        ids = tok.encode(tag)
        assert tag not in tok.tag_ids and len(ids) >= 3 and len(set(ids)) == len(ids)
    return tok


# ------------------------------------------------------------------------------------------ the ban itself

VOCAB = [b"<", b"tool", b"_call", b">", b"<tool", b"_call>", b"a", b"<tool_call>", b"x<tool_call>y", b"ll>",
         b"<t", b"ool_call>", b"call>", b"l>"]


def banned(g) -> list[bytes]:
    m = g.allowed()
    return [] if m is None else [VOCAB[i] for i in range(len(VOCAB)) if not m[i]]


def test_a_ban_masks_exactly_the_tokens_that_would_complete_the_tag():
    v = BanVocab(VOCAB, len(VOCAB) + 2, [TAG.encode()])
    g = TagBan(v)
    assert banned(g) == [b"<tool_call>", b"x<tool_call>y"]  # holding it whole: banned anywhere
    g.advance(VOCAB.index(b"<tool"))
    assert g.states == (5,) and banned(g) == [b"_call>", b"<tool_call>", b"x<tool_call>y"]
    g.advance(VOCAB.index(b"_call"))
    assert g.states == (10,) and banned(g) == [b">", b"<tool_call>", b"x<tool_call>y"]
    twin = g.fork()
    g.advance(VOCAB.index(b"a"))
    assert g.states == (0,) and twin.states == (10,)  # forks do not share their state
    t = TagBan(v)
    t.advance(VOCAB.index(b"<t"))
    assert banned(t) == [b"<tool_call>", b"x<tool_call>y", b"ool_call>"]
    # ids past the tokenizer's (a padded model vocabulary) stand for no bytes and are never banned
    assert g.allowed()[len(VOCAB):].tolist() == [True, True]


def test_a_vocabulary_that_only_spells_the_tag_costs_nothing_until_a_tag_is_under_way():
    v = BanVocab([b"<", b"tool", b"_call", b">", b"a"], 5, [TAG.encode()])
    g = TagBan(v)
    assert g.allowed() is None  # an ordinary step: nothing masked
    for t in (0, 1, 2):
        g.advance(t)
    assert g.allowed().tolist() == [True, True, True, False, True]
    g.advance(4)
    assert g.allowed() is None


def test_the_reply_guides_are_a_ban_without_tools_and_the_call_guide_with_them(tok):
    guides = ReplyGuides(tok, 400)
    assert guides.switches_thinking  # QWEN3 closes the think block with thinking off
    assert guides.banned(tools=False, thinking=False) == (b"<tool_call>", b"<think>")
    assert guides.banned(tools=False, thinking=True) == (b"<tool_call>",)
    assert guides.banned(tools=True, thinking=True) == ()
    assert guides.reply(thinking=True).allowed().logical_not().nonzero().flatten().tolist() == \
        [tok.tag_ids["<tool_call>"]]
    assert guides.reply().allowed().logical_not().nonzero().flatten().tolist() == \
        sorted([tok.tag_ids["<tool_call>"], tok.tag_ids["<think>"]])
    with_tools = guides.reply(builtin().tools)
    assert isinstance(with_tools, AllGuides) and isinstance(with_tools.guides[1], ToolCallGuide)
    assert isinstance(guides.reply(builtin().tools, thinking=True), ToolCallGuide)
    assert guides.reply(builtin().tools, thinking=True, guide_calls=False) is None


# ------------------------------------------------------------------------------------------ the chat

def chat_reply(engine, tok, tools=None, thinking=False, most: int = 24) -> tuple[Message, list]:
    session = ChatSession(engine, tok, SamplingParams(max_new_tokens=most, temperature=0.0), tools=tools,
                          thinking=thinking, max_tool_rounds=0)
    events = list(session.turn("What is AI?"))
    return session.history[1], events


def test_the_chat_with_no_tools_never_writes_the_tag_from_a_model_that_favours_it(tok):
    favoured, _ = chat_reply(favouring(tok, TAG), tok)
    base, _ = chat_reply(plain(tok), tok)
    # the tag masked, the favouring model draws its own next choice: the plain model's reply, token for token
    assert TAG not in favoured.content and not favoured.tool_calls
    assert favoured.content == base.content and favoured.content
    # tools offered: the call is written, guided to a built-in tool (a random model never closes its string)
    called, _ = chat_reply(favouring(tok, TAG), tok, tools=builtin(), most=40)
    assert opens_a_call(called.content)


def opens_a_call(text: str) -> bool:
    return any(text.startswith(f'{TAG}\n{{"name": "{name}", "arguments": ') for name in builtin().names())


def test_the_chat_with_thinking_off_never_opens_a_think_block(tok):
    off, _ = chat_reply(favouring(tok, "<think>"), tok)
    assert "<think>" not in off.content and not off.reasoning
    assert off.content == chat_reply(plain(tok), tok)[0].content
    on, _ = chat_reply(favouring(tok, "<think>"), tok, thinking=True)  # no ban: the tag is the model's to write
    assert "<think>" in on.reasoning + on.content


def test_a_tag_spelt_in_several_tokens_is_never_completed(spelt):
    favoured, events = chat_reply(favouring(spelt, TAG), spelt)
    text = "".join(e.text for e in events if isinstance(e, Content))
    assert TAG not in text and not favoured.tool_calls
    assert text.startswith("<tool_call")  # it spelt all but the last piece, which the ban held back
    called, _ = chat_reply(favouring(spelt, TAG), spelt, tools=builtin(), most=40)
    assert opens_a_call(called.content)  # tools offered: the spelt tag opens a call, guided as before


# ------------------------------------------------------------------------------------------ the server

httpx = pytest.importorskip("httpx")


def post(url: str, body: dict) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def streamed(url: str, body: dict) -> tuple[str, list, str]:
    content, calls, finish = "", [], None
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            content += choice["delta"].get("content") or ""
            calls += choice["delta"].get("tool_calls") or []
            finish = choice["finish_reason"] or finish
    return content, calls, finish


@pytest.mark.parametrize("which", ["one token", "spelt"])
def test_the_server_writes_no_tag_with_tools_absent_or_empty_streaming_or_not(which, tok, spelt):
    from server_helpers import running

    from nanolm.infer.server import create_app
    tk = tok if which == "one token" else spelt
    ask = {"model": "t", "messages": [{"role": "user", "content": "What is AI?"}], "max_tokens": 24,
           "temperature": 0}
    with running(create_app(favouring(tk, TAG), tk, ServeConfig(model_name="t"))) as url:
        # logit_bias cannot re-open the tag: refused (400 naming it), or, were it applied, masked after it
        bias = {**ask, "tools": [], "logit_bias": {str(i): 100 for i in tk.encode(TAG)}}
        r = httpx.post(url + "/v1/chat/completions", json=bias, timeout=120)
        if r.status_code == 400:
            assert r.json()["error"]["param"] == "logit_bias"
        else:
            assert r.status_code == 200 and TAG not in r.json()["choices"][0]["message"]["content"]
        for extra in ({}, {"tools": []}, {"tool_choice": "none", "tools": builtin().tools}):
            whole = post(url, {**ask, **extra})["choices"][0]
            assert TAG not in whole["message"]["content"] and not whole["message"].get("tool_calls")
            assert whole["finish_reason"] == "length"
            content, calls, finish = streamed(url, {**ask, **extra})
            assert content == whole["message"]["content"] and not calls and finish == "length"
        with_tools = post(url, {**ask, "tools": builtin().tools, "max_tokens": 40})["choices"][0]
        assert opens_a_call(with_tools["message"]["content"])  # offered, the call is written (unclosed: text)
    if which == "spelt":  # it spells the tag up to its last piece again and again, never the whole of it
        assert content.startswith("<tool_call") and content.count("<tool_call") >= 2
        return
    with running(create_app(plain(tk), tk, ServeConfig(model_name="t"))) as url:
        assert post(url, ask)["choices"][0]["message"]["content"] == content  # the plain model's own reply


# ------------------------------------------------------------------------------------------ eval, rollouts

def test_eval_chat_generations_offer_no_tools_and_write_no_tag(tok):
    from nanolm.eval.scoring import score_gen
    from nanolm.eval.tasks import GenItem
    items = [GenItem("What is AI?", "x", "What is AI?"), GenItem("Say hi.", "hi", "Say hi.")]
    favoured = score_gen(favouring(tok, TAG), tok, items, GREEDY, chat=True, rows=2)["items"]
    base = score_gen(plain(tok), tok, items, GREEDY, chat=True, rows=2)["items"]
    assert [it["reply"] for it in favoured] == [it["reply"] for it in base]
    assert all(TAG not in it["reply"] and it["reply"] for it in favoured)


@pytest.mark.parametrize("which", ["one token", "spelt"])
def test_rollouts_of_prompts_offering_no_tools_write_no_tag(which, tok, spelt):
    from nanolm.data.kinds.prompts import PromptBatch
    from nanolm.train.rl.rollout import Sampler
    tk = tok if which == "one token" else spelt
    model = Favours(tiny_model(vocab_size=max(400, tk.vocab_size), max_seq_len=1024), tk.encode(TAG))
    fmt = tk.chat_format
    tool = json.dumps(builtin().tools[0])
    prompts = [tk.encode(fmt.render([Message("user", "What is AI?")], tools)) for tools in ([], [tool])]
    pb = PromptBatch(prompts, [{"messages": [], "tools": [], "record": {}},
                               {"messages": [], "tools": [tool], "record": {}}])
    sampler = Sampler(tk, None, torch.device("cpu"))
    params = [SamplingParams(max_new_tokens=16, temperature=1.0, seed=s) for s in (1, 2)]
    sampled = sampler.sample_batch(model, pb, 3, params)
    texts = [tk.decode(t) for t in sampled.tokens]
    assert sampled.prompt == [0, 0, 0, 1, 1, 1]
    assert all(TAG not in t for t in texts[:3])  # no tools offered: never the tag, in 3 sampled rows
    assert all(t.startswith(TAG) for t in texts[3:])  # offered: the favoured tag is written


def test_agent_rollouts_offer_each_prompt_its_tools_and_ban_the_tag_where_none(tok):
    from nanolm.train.rl.agent import AgentSampler, AgentTools
    sampler = AgentSampler(tok, None, torch.device("cpu"), tools=AgentTools.from_spec("builtin"), max_rounds=1)
    sampler._engine(tiny_model(max_seq_len=1024))
    none, some = sampler._guides([[], builtin().tools])
    assert isinstance(none, TagBan) and isinstance(some, AllGuides)
    assert none.allowed().logical_not().nonzero().flatten().tolist() == \
        sorted([tok.tag_ids["<tool_call>"], tok.tag_ids["<think>"]])
