"""Tool calls held to the tools' schemas (nanolm/infer/guide.py): the grammar byte by byte, the exact mask of a
hand-made vocabulary, and guided generation from a random model in the engine, the chat session and the server,
where every call the model opens comes out a call of an offered tool with schema-valid arguments."""

from __future__ import annotations

import json

import pytest
import torch

from nanolm.chat import Message, ReplyParser, parse_tool_call
from nanolm.config import SamplingParams, ServeConfig
from nanolm.infer.engine import Engine
from nanolm.infer.guide import _DONE, TRIGGER, GuideVocab, ToolCallGuide, call_state, step
from nanolm.infer.tools import BUILTIN_TOOLS


def tool(name: str, properties: dict, required=()) -> dict:
    return {"type": "function", "function": {"name": name, "description": name,
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": list(required)}}}


LIGHT = tool("set_light", {"on": {"type": "boolean"}, "color": {"type": "string", "enum": ["red", "green"]},
                           "level": {"type": "integer"}}, required=["on"])
WEIRD = tool("plot", {"xs": {"type": "array", "items": {"type": "number"}},
                      "opts": {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]},
                      "extra": {}}, required=["xs", "opts"])


def call_bytes(name: str, arguments: dict) -> bytes:
    """A call as the chat template renders it (json.dumps spacing)."""
    return (f'\n{{"name": "{name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n'
            "</tool_call>").encode()


@pytest.mark.parametrize("name,arguments", [
    ("calculator", {"expression": "12*(3+4)"}),
    ("calculator", {"expression": 'a "quoted" \\ back\nslash 算'}),
    ("current_time", {}),
    ("current_time", {"timezone": "Asia/Shanghai"}),
    ("set_light", {"on": True}),
    ("set_light", {"on": False, "level": -30}),
    ("set_light", {"on": True, "color": "green", "level": 0}),
    ("plot", {"xs": [], "opts": {"title": "t"}}),
    ("plot", {"xs": [1.5, -2e-3, 0, 7], "opts": {"title": ""}, "extra": {"k": [None, True, "v", {"n": 1}]}}),
])
def test_every_schema_valid_call_is_accepted_to_its_close(name, arguments):
    state = call_state([*BUILTIN_TOOLS, LIGHT, WEIRD])
    data = call_bytes(name, arguments)
    for k in range(1, len(data)):  # every prefix is alive, none is the end
        assert step(state, data[:k]) not in (frozenset(), _DONE), data[:k]
    assert step(state, data) == _DONE


@pytest.mark.parametrize("text,dies_at", [
    ('\n{"name": "calculatr"', '\n{"name": "calculatr'),  # no such tool
    ('\n{"name":"calculator"', '\n{"name":"'),  # the template's spacing
    ('\n{"name": "set_light", "arguments": {"color": "red"', '\n{"name": "set_light", "arguments": {"c'),  # "on" first
    ('\n{"name": "set_light", "arguments": {"on": yes', '\n{"name": "set_light", "arguments": {"on": y'),
    ('\n{"name": "set_light", "arguments": {"on": true, "color": "blue"',
     '\n{"name": "set_light", "arguments": {"on": true, "color": "b'),
    ('\n{"name": "set_light", "arguments": {"on": true, "level": 1.5',
     '\n{"name": "set_light", "arguments": {"on": true, "level": 1.'),  # an integer
    ('\n{"name": "set_light", "arguments": {"on": true, "level": 01',
     '\n{"name": "set_light", "arguments": {"on": true, "level": 01'),  # no leading zero
    ('\n{"name": "set_light", "arguments": {"on": true}}</tool_call>',
     '\n{"name": "set_light", "arguments": {"on": true}}<'),  # the newline before the close
    ('\n{"name": "plot", "arguments": {"xs": [1], "opts": {}', '\n{"name": "plot", "arguments": {"xs": [1], "opts": {}'),
    ('\n{"name": "calculator", "arguments": {"expression": "a\tb"',
     '\n{"name": "calculator", "arguments": {"expression": "a\t'),  # a control byte in a string
])
def test_the_first_byte_that_cannot_be_part_of_a_call_is_refused(text, dies_at):
    state = call_state([*BUILTIN_TOOLS, LIGHT, WEIRD])
    dead = dies_at.encode()
    assert text.encode().startswith(dead)
    assert step(state, dead[:-1]) not in (frozenset(), _DONE)
    assert step(state, dead) == frozenset()


# A hand-made vocabulary: id -> bytes. 0 is a control token (its own text), 9 the </tool_call> tag token.
VOCAB = [b"<|im_end|>", b"\n", b'\n{"name": "', b"set_", b"light", b'", "arguments": ', b'{"on": ', b"true",
         b"}}\n", b"</tool_call>", b'"', b"x", b"x\"", b"{", b"}", b" ", b"\\", b"n", b"tr", b"ue}}\n"]


def allowed_after(prefix: bytes, tools, vocab=VOCAB) -> set[int]:
    guide = ToolCallGuide(GuideVocab(vocab, len(vocab) + 2, never=[0], tags=[9]), tools)
    guide.feed(TRIGGER + prefix)
    mask = guide.allowed()
    assert mask is not None and mask.shape == (len(vocab) + 2,)
    return set(torch.nonzero(mask).flatten().tolist())


def test_the_mask_is_exactly_the_tokens_that_keep_a_call_possible():
    light = tool("set_light", {"on": {"type": "boolean"}}, required=["on"])
    assert allowed_after(b"", [light]) == {1, 2}  # "\n" and the whole head
    assert allowed_after(b'\n{"name": "', [light]) == {3}
    assert allowed_after(b'\n{"name": "set_light', [light]) == {5, 10}  # '"' alone, or the whole separator
    assert allowed_after(b'\n{"name": "set_light", "arguments": ', [light]) == {6, 13}
    assert allowed_after(b'\n{"name": "set_light", "arguments": {"on": ', [light]) == {7, 18}
    # A token that closes the call and runs on is allowed: its tail is free text. The tag only where spelled.
    assert allowed_after(b'\n{"name": "set_light", "arguments": {"on": tr', [light]) == {19}
    assert allowed_after(b'\n{"name": "set_light", "arguments": {"on": true}}\n', [light]) == {9}
    # Inside a free string: every plain token, and of the others those a string can take: not the control
    # token, not the tag, not a lone backslash-free quote run past the string's end ... exactly:
    calc = [BUILTIN_TOOLS[0]]
    inside = allowed_after(b'\n{"name": "calculator", "arguments": {"expression": "1', calc)
    # Not: 0 (control), 1, 2, 8, 19 (a raw newline), 9 (the tag), 5, 6 (close the string, then not "}").
    assert inside == {3, 4, 7, 10, 11, 12, 13, 14, 15, 16, 17, 18}
    # After a backslash: an escape (\" \\ \n \t: "true" and "tr" start with t), not \u with no hex after.
    assert allowed_after(b'\n{"name": "calculator", "arguments": {"expression": "1\\', calc) == {7, 10, 16, 17, 18}


def test_a_guide_masks_nothing_outside_a_call_and_guides_each_call_of_a_reply():
    vocab = [b"a", b"<tool_call>", b'\n{"name": "set_light", "arguments": {"on": true}}\n', b"</tool_call>", b"b"]
    guide = ToolCallGuide(GuideVocab(vocab, 5, tags=[1, 3]), [LIGHT])
    assert guide.allowed() is None
    for token, masked in [(0, False), (1, True), (2, True), (3, False), (4, False), (1, True)]:
        assert (guide.allowed() is not None) == guide.in_call
        guide.advance(token)
        assert guide.in_call == masked
    twin = guide.fork()
    twin.advance(2)
    assert guide.in_call and twin.in_call and guide.state != twin.state  # forks do not share their state


TINY_TOOLS = [LIGHT, tool("reset_all", {"force": {"type": "boolean"}}, required=["force"])]


def guided_reply(engine, tok, params, guide: bool, n: int = 1) -> list[str]:
    prompt = tok.chat_format.render([Message("user", "lights on")], [json.dumps(t) for t in TINY_TOOLS],
                                    add_generation_prompt=True) + "<tool_call>"
    g = ToolCallGuide(GuideVocab.of(tok, engine.model.config.vocab_size), TINY_TOOLS) if guide else None
    if g is not None:
        g.feed(TRIGGER)  # the prompt opened the call
    batch = engine.batch()
    rows = batch.add(tok.encode(prompt), params, (tok.im_end_id, tok.eot_id), n=n, guide=g)
    out = {r: [] for r in rows}
    while batch:
        for t in batch.step():
            if t.token is not None:
                out[t.row].append(t.token)
    return ["<tool_call>" + tok.decode(out[r]) for r in rows]


def read(text: str) -> ReplyParser:
    """The whole reply read as the chat and the server read it (thinking off, tools offered)."""
    p = ReplyParser(thinking=False, calls=True)
    p.push(text)
    p.finish()
    return p


def the_call(text: str):
    p = read(text)
    assert not p.problems, p.problems
    (call,) = p.message().tool_calls
    return call


def test_a_random_model_guided_writes_valid_calls_and_unguided_does_not(tok):
    from server_helpers import tiny_model
    engine = Engine(tiny_model(max_seq_len=1024))
    greedy = SamplingParams(max_new_tokens=120, temperature=0.0)
    (free,) = guided_reply(engine, tok, greedy, guide=False)
    assert not read(free).message().tool_calls
    (text,) = guided_reply(engine, tok, greedy, guide=True)
    call = the_call(text)
    assert call.name in ("set_light", "reset_all")
    args = json.loads(call.arguments)
    assert set(args) <= {"on", "color", "level", "force"} and (("on" in args) or ("force" in args))
    # n sampled rows, each with its own fork of the guide: every one a call
    for text in guided_reply(engine, tok, SamplingParams(max_new_tokens=120, temperature=1.0, seed=3), True, n=4):
        call = the_call(text)
        assert isinstance(json.loads(call.arguments), dict)


def test_the_chat_session_guides_the_calls_of_a_model_that_opens_one(tok, tmp_path):
    """A random model made to open calls (its logits put <tool_call> first, then are its own): with the guide
    each reply's call is run as a real call; with --free-calls it is text the chat cannot read."""
    from server_helpers import tiny_model

    from nanolm.infer.session import ChatSession
    from nanolm.infer.tools import Toolbox

    model = tiny_model(max_seq_len=1024)
    call_id = tok.tag_ids["<tool_call>"]

    class OpensACall(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.config = model, model.config

        def forward(self, x, cache=None, last=None):
            logits = self.inner(x, cache, last=last)
            if last is not None:  # the prefill: the reply's first token opens a call
                logits[:, -1, call_id] = 1e4
            return logits

    engine = Engine(OpensACall())
    (tmp_path / "tools.json").write_text(json.dumps(TINY_TOOLS))
    tools = Toolbox.from_specs([str(tmp_path / "tools.json")])
    greedy = SamplingParams(max_new_tokens=80, temperature=0.0)
    guided = ChatSession(engine, tok, greedy, tools=tools, max_tool_rounds=0)
    events = list(guided.turn("What time is it?"))
    results = [e for e in events if type(e).__name__ == "ToolResult"]
    assert results and results[0].call.name in ("set_light", "reset_all")
    free = ChatSession(engine, tok, greedy, tools=tools, max_tool_rounds=0, guide_calls=False)
    events = list(free.turn("What time is it?"))
    assert not [e for e in events if type(e).__name__ == "ToolResult"]


httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")


def test_the_server_guides_tool_choice_required_and_can_be_told_not_to(tok):
    from server_helpers import running, tiny_model

    from nanolm.infer.server import create_app
    engine = Engine(tiny_model(max_seq_len=1024))
    for guide in (True, False):
        with running(create_app(engine, tok, ServeConfig(model_name="t", guide_calls=guide))) as url:
            c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
            r = c.chat.completions.create(model="t", messages=[{"role": "user", "content": "lights on"}],
                                          tools=TINY_TOOLS, tool_choice="required", max_tokens=120, temperature=0,
                                          n=1)
            choice = r.choices[0]
            if guide:  # (the random model runs on after its call to max_tokens: finish_reason "length")
                (call,) = choice.message.tool_calls
                assert call.function.name in ("set_light", "reset_all")
                parse_tool_call(json.dumps({"name": call.function.name,
                                            "arguments": json.loads(call.function.arguments)}))
            else:
                assert choice.finish_reason != "tool_calls" and not choice.message.tool_calls


def test_the_cli_has_the_switches():
    from nanolm.cli import build_parser
    p = build_parser()
    assert p.parse_args(["chat", "run", "--free-calls"]).free_calls is True
    assert p.parse_args(["chat", "run"]).free_calls is False
    assert p.parse_args(["serve", "run", "--no-guide-calls"]).guide_calls is False
    assert p.parse_args(["serve", "run"]).guide_calls is True
