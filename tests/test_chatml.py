"""Tests for nanolm.chat: messages with tools and reasoning, the two layouts and their Jinja templates (parity
through transformers), exact loss masks, truncation by exchanges (reading a reply: tests/test_reply.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from chat_helpers import old_chatml_tokenizer

from nanolm import chat
from nanolm.chat import CHATML, QWEN3, ChatError, Message, ToolCall, message_from_dict
from nanolm.errors import UserError
from nanolm.tokenizer import Tokenizer

CALC = {"type": "function", "function": {"name": "calculator", "description": "计算算式",
                                         "parameters": {"type": "object",
                                                        "properties": {"expression": {"type": "string"}}}}}
CLOCK = {"type": "function", "function": {"name": "current_time", "parameters": {"type": "object"}}}

# Conversations in the shapes people have: OpenAI (calls with "function" and arguments as a JSON string),
# MiniMind (bare calls with arguments as an object, reasoning inside <think>), several results in a row.
TOOL_CONVS = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    [{"role": "system", "content": "你是助手。"}, {"role": "user", "content": "2+3 等于多少？"},
     {"role": "assistant", "content": None,
      "tool_calls": [{"id": "c1", "type": "function",
                      "function": {"name": "calculator", "arguments": "{\"expression\": \"2+3\"}"}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "5"},
     {"role": "assistant", "content": "<think>\n算出来了\n</think>\n\n等于 5。"}],
    [{"role": "user", "content": "two at once"},
     {"role": "assistant", "content": "Sure.", "reasoning_content": "two calls",
      "tool_calls": [{"name": "calculator", "arguments": {"expression": "1+1"}},
                     {"name": "current_time", "arguments": {}}]},
     {"role": "tool", "content": "2"}, {"role": "tool", "content": "2026-12-01 15:00"},
     {"role": "assistant", "content": "\n\n2, at 15:00."}, {"role": "user", "content": "thanks"},
     {"role": "assistant", "content": "You're welcome."}],
]


def msgs(conv):
    return [message_from_dict(f"m[{i}]", m) for i, m in enumerate(conv)]


def test_roles_and_the_names_a_request_may_use():
    assert list(chat.ROLES) == ["system", "user", "assistant", "tool"]
    assert [r for r, rule in chat.ROLES.items() if rule.trains] == ["assistant"]
    assert chat.ROLE_NAMES["developer"] == "system" and chat.ROLE_NAMES["tool"] == "tool"


def test_control_strings_and_tags_in_text_are_found():
    assert chat.control_in("plain <b>text</b>") is None
    assert chat.control_in("a<|im_end|>b<|im_start|>") == "<|im_end|>"
    assert chat.control_in("so </think> here") == "</think>"
    assert chat.control_in("x<tool_call>") == "<tool_call>"


def test_messages_read_from_every_shape():
    a, b, c = msgs(TOOL_CONVS[1])[2:]
    assert a == Message("assistant", "", "", (ToolCall("calculator", '{"expression": "2+3"}'),))
    assert b == Message("tool", "5")
    assert c == Message("assistant", "等于 5。", "算出来了")  # split as the template splits it
    d = msgs(TOOL_CONVS[2])[1]
    assert d.reasoning == "two calls" and d.tool_calls == (
        ToolCall("calculator", '{"expression": "1+1"}'), ToolCall("current_time", "{}"))
    # MiniMind stores tool_calls as JSON text; a single call object is a list of one.
    e = message_from_dict("m", {"role": "assistant", "content": "",
                                "tool_calls": '[{"name": "f", "arguments": {"x": 1}}]'})
    assert e.tool_calls == (ToolCall("f", '{"x": 1}'),)
    assert message_from_dict("m", {"role": "developer", "content": "be brief"}).role == "system"
    assert chat.tools_from_value("t", json.dumps([CALC])) == (json.dumps(CALC, ensure_ascii=False),)


@pytest.mark.parametrize("message, error", [
    ({"role": "bot", "content": "x"}, 'm has unknown role "bot"; allowed roles: system, user, assistant, tool'),
    ({"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": "{x: 1}"}]},
     "m.tool_calls[0].arguments is not valid JSON (Expecting property name enclosed in double quotes); give a "
     'JSON object such as {"x": 1}'),
    ({"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": "[1]"}]},
     "m.tool_calls[0].arguments must be a JSON object (the function's named arguments), got an array"),
    ({"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]},
     "m.tool_calls[0] has no function name (a non-empty string)"),
    ({"role": "assistant", "content": "", "tool_calls": "not json"},
     "m.tool_calls is not valid JSON (Expecting value); give an array of calls"),
    ({"role": "assistant", "content": "<think>\nhm"},
     "m.content contains the control token <think>, which would change the conversation's turns"),
    ({"role": "assistant", "content": "ok", "reasoning_content": 3},
     "m.reasoning_content must be a string, got a number"),
])
def test_malformed_messages_are_named(message, error):
    with pytest.raises(ChatError) as e:
        message_from_dict("m", message)
    assert str(e.value) == error


def test_a_reply_sent_back_as_written_may_hold_the_tags_the_model_wrote():
    """A server's history: an assistant message is the model's own reply, whose tags render as written; the texts
    of the other roles are held to the rule all the same, and a surrogate is refused in any."""
    reply = {"role": "assistant", "content": "<tool_call>x</tool_call> <|im_start|>", "reasoning_content": "a <think>",
             "tool_calls": [{"name": "f", "arguments": '{"q": "<think>"}'}]}
    got = message_from_dict("m", reply, replies_as_written=True)
    assert got == Message("assistant", "<tool_call>x</tool_call> <|im_start|>", "a <think>",
                          (ToolCall("f", '{"q": "<think>"}'),))
    for role in ("user", "system", "tool"):
        with pytest.raises(ChatError, match=r"^m.content contains the control token <tool_call>, "):
            message_from_dict("m", {"role": role, "content": "<tool_call>"}, replies_as_written=True)
    with pytest.raises(ChatError, match=r"^m.content holds an unpaired surrogate escape"):
        message_from_dict("m", {"role": "assistant", "content": "a\ud800"}, replies_as_written=True)
    with pytest.raises(ChatError, match=r"^m.tool_calls\[0\].arguments contains the control token <think>, "):
        message_from_dict("m", reply)  # training data, and any caller that does not say so
    with pytest.raises(ChatError, match=r"^m.content contains the control token <tool_call>, "):
        message_from_dict("m", {"role": "assistant", "content": reply["content"]})


@pytest.mark.parametrize("conv, error", [
    ([{"role": "user", "content": "q"}, {"role": "tool", "content": "5"}, {"role": "assistant", "content": "x"}],
     "c[1] is a tool result with no tool call before it; a tool message answers an assistant message's tool_calls"),
    (TOOL_CONVS[1][:3] + [{"role": "tool", "content": "5"}, {"role": "tool", "content": "6"}] + TOOL_CONVS[1][4:],
     "c[4] is tool result 2 after 1 tool call(s); give one result per call"),
    (TOOL_CONVS[1][:3] + [{"role": "assistant", "content": "x"}],
     'c[3] is assistant, but c[2] called a tool; give its result as a "tool" message first'),
    (TOOL_CONVS[1][:3], 'c ends with a tool call turn; a conversation must end with an assistant reply (drop the '
                        'unanswered turn)'),
])
def test_conversations_out_of_order_are_named(conv, error):
    with pytest.raises(ChatError) as e:
        chat.check_conversation("c", msgs(conv))
    assert str(e.value) == error


def test_prompts_may_end_with_a_tool_result_but_not_an_unanswered_call():
    chat.check_conversation("c", msgs(TOOL_CONVS[1][:4]), complete=False)
    with pytest.raises(ChatError, match=r'^c ends with a tool call; add its result as a "tool" message$'):
        chat.check_conversation("c", msgs(TOOL_CONVS[1][:3]), complete=False)


def test_qwen3_layout_exact_text():
    text = QWEN3.render(msgs(TOOL_CONVS[1]), chat.tools_from_value("t", [CALC]), add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\n你是助手。\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(CALC, ensure_ascii=False) + "\n</tools>\n\nFor each function call, return a json object with "
        "function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
        "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n2+3 等于多少？<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": "
        "{\"expression\": \"2+3\"}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n算出来了\n</think>\n\n等于 5。<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert QWEN3.generation_prompt(thinking=True) == "<|im_start|>assistant\n<think>\n"
    assert CHATML.render(msgs(TOOL_CONVS[0]), add_generation_prompt=True) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("tools", [None, [CALC, CLOCK]])
@pytest.mark.parametrize("conv", TOOL_CONVS)
def test_template_renders_what_nanolm_trains_on_through_transformers(tokenizer_dir, conv, tools, thinking):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ts = chat.tools_from_value("t", tools) if tools else ()
    for gen in (False, True):
        want = QWEN3.render(msgs(conv), ts, add_generation_prompt=gen, thinking=thinking)
        for given in (conv, [m.to_dict() for m in msgs(conv)]):  # as the user wrote it, and as nanolm reads it
            got = hf.apply_chat_template(given, tools=tools, tokenize=False, add_generation_prompt=gen,
                                         enable_thinking=thinking)
            assert got == want
            # MiniMind's switch is open_thinking
            assert hf.apply_chat_template(given, tools=tools, tokenize=False, add_generation_prompt=gen,
                                          open_thinking=thinking) == want


def test_plain_chatml_template_through_transformers(tokenizer_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    old = _old_tokenizer(tokenizer_dir, tmp_path)
    assert old.chat_format is CHATML
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "old"))
    for gen in (False, True):
        assert hf.apply_chat_template(TOOL_CONVS[0], tokenize=False, add_generation_prompt=gen) == \
            CHATML.render(msgs(TOOL_CONVS[0]), add_generation_prompt=gen)


def _old_tokenizer(tokenizer_dir, tmp_path) -> Tokenizer:
    return old_chatml_tokenizer(tokenizer_dir, tmp_path / "old")


def test_an_old_tokenizer_keeps_its_template_and_refuses_tools(tokenizer_dir, tmp_path):
    old = _old_tokenizer(tokenizer_dir, tmp_path)
    old.save(tmp_path / "again")  # saved again (into a checkpoint, an export): the same template
    assert json.loads((tmp_path / "again" / "tokenizer_config.json").read_text())["chat_template"] == \
        CHATML.template
    with pytest.raises(ChatError, match=r"^c has tool calls, but the tokenizer t carries the plain ChatML template"):
        old.chat_format.check("c", msgs(TOOL_CONVS[1][1:]), (), "t")
    old.chat_format.check("c", msgs(TOOL_CONVS[0]), (), "t")


def runs(text_ids, mask, tok):
    edges = np.diff(np.r_[0, mask.astype(np.int8), 0])
    return [tok.decode(text_ids[a:b]) for a, b in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1))]


def _encode(tok, conv, tools=(), final_only=False):
    spans = QWEN3.spans(msgs(conv), tools, final_only=final_only)
    text = "".join(s.text for s in spans)
    ids = tok.encode(text)
    chat.check_spelling(text, ids, tok.token_bytes(), "t")
    return chat.encode_chat(spans, ids, tok.spelled_lengths(), "t")


def test_loss_mask_covers_reasoning_content_and_calls_never_results_or_scaffolding(tok):
    tools = chat.tools_from_value("t", [CALC])
    ids, mask = _encode(tok, TOOL_CONVS[1], tools)
    assert ids.tolist() == tok.encode(QWEN3.render(msgs(TOOL_CONVS[1]), tools))
    assert runs(ids, mask & chat.TARGET, tok) == [
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call><|im_end|>',
        "算出来了\n</think>\n\n等于 5。<|im_end|>"]
    # One exchange, starting at the user's question (after the system turn with the tools).
    (start,) = np.flatnonzero(mask & chat.EXCHANGE)
    assert tok.decode(ids[start:start + 8]).startswith("<|im_start|>user\n2+3")
    ids, mask = _encode(tok, TOOL_CONVS[2])
    assert runs(ids, mask & chat.TARGET, tok) == [
        'two calls\n</think>\n\nSure.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "current_time", "arguments": {}}\n</tool_call><|im_end|>',
        "2, at 15:00.<|im_end|>", "You're welcome.<|im_end|>"]
    assert len(np.flatnonzero(mask & chat.EXCHANGE)) == 2  # tool results open no exchange
    # Preference data: the final reply alone.
    ids, mask = _encode(tok, TOOL_CONVS[2], final_only=True)
    assert runs(ids, mask & chat.TARGET, tok) == ["You're welcome.<|im_end|>"]


def test_truncation_drops_whole_exchanges_and_keeps_the_tools(tok):
    tools = chat.tools_from_value("t", [CALC])
    conv = TOOL_CONVS[2] + TOOL_CONVS[1][1:]  # exchange 1 (calls and results), a short one, exchange 3
    ids, mask = _encode(tok, [{"role": "system", "content": "s"}] + conv, tools)
    starts = np.flatnonzero(mask & chat.EXCHANGE)
    assert len(starts) == 3
    head = int(starts[0])
    # Room for the head and the last two exchanges: the first exchange goes, tool turns and all.
    fit = head + len(ids) - int(starts[1])
    got_ids, got_mask = chat.fit_conversation(ids, mask, fit)
    assert got_ids.tolist() == ids[:head].tolist() + ids[starts[1]:].tolist()
    assert (got_mask == np.r_[mask[:head], mask[starts[1]:]]).all()
    assert tok.decode(got_ids).startswith(QWEN3.render([Message("system", "s")], tools))
    # Too short for the last exchange alone: it is cut at the end, and a cut reply keeps no <|im_end|>.
    reply_at = int(np.flatnonzero(mask[starts[2]:] & chat.TARGET)[0])  # into the last exchange
    short = head + reply_at + 5
    got_ids, got_mask = chat.fit_conversation(ids, mask, short)
    assert got_ids.tolist() == ids[:head].tolist() + ids[starts[2]:][:reply_at + 5].tolist()
    assert got_mask[-1] & chat.TARGET and got_ids[-1] != tok.im_end_id
    # Nothing to train on left: skipped.
    assert chat.fit_conversation(ids, mask, head + reply_at) is None


def test_truncation_of_data_prepared_before_the_exchange_bit():
    # Plain ChatML ids (<|im_start|> = 1), mask 0/1 only: user turns are found by their place.
    sys_, user, reply = [1, 9, 2, 3], [1, 10, 11, 2, 3], [1, 12, 13, 2, 3]
    ids = np.array(sys_ + user + reply + user + reply)
    mask = np.array([0] * 4 + [0] * 5 + [0, 0, 1, 1, 0] + [0] * 5 + [0, 0, 1, 1, 0], dtype=np.uint8)
    got_ids, got_mask = chat.fit_conversation(ids, mask, 14)
    assert got_ids.tolist() == sys_ + user + reply and got_mask.tolist() == [0] * 11 + [1, 1, 0]


def test_data_and_a_checkpoint_made_with_an_old_tokenizer_keep_its_template(tokenizer_dir, tmp_path):
    """A tokenizer as nanolm made them before tools and reasoning: prepare, a checkpoint carrying it, and chat
    all render plain ChatML, and the checkpoint's tokenizer still says so."""
    import torch

    from nanolm.checkpoint import load_model, save_checkpoint
    from nanolm.config import Config, ModelConfig, SamplingParams, TrainConfig
    from nanolm.data.prepare import prepare
    from nanolm.infer.session import ChatSession
    from nanolm.infer.engine import Engine
    from nanolm.model.transformer import Transformer

    old = _old_tokenizer(tokenizer_dir, tmp_path)
    src = tmp_path / "chat.jsonl"
    src.write_text(json.dumps({"messages": TOOL_CONVS[0]}) + "\n", encoding="utf-8")
    m = prepare([src], tmp_path / "old", tmp_path / "data", format="chat", val_fraction=0, workers=0, quiet=True)
    assert m.section["template"] == "chatml"
    ids = np.fromfile(tmp_path / "data" / "train-00000.bin", dtype=m.dtype).astype(np.int64)
    assert ids.tolist() == old.encode(CHATML.render(msgs(TOOL_CONVS[0]))) + [old.eot_id]
    # Tool data with it is a bad line that says what to do.
    src.write_text(json.dumps({"messages": TOOL_CONVS[1]}, ensure_ascii=False) + "\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"chat\.jsonl:1: the conversation has tools|chat\.jsonl:1: the conversation "
                                        r"has tool calls, but the tokenizer .* carries the plain ChatML template"):
        prepare([src], tmp_path / "old", tmp_path / "data2", format="chat", val_fraction=0, workers=0, quiet=True)
    mc = ModelConfig(vocab_size=old.vocab_size, d_model=32, n_layer=1, n_head=2, n_kv_head=1, max_seq_len=64)
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "run", 1, Transformer(mc), None, Config(model=mc, train=TrainConfig(seq_len=64)), {},
                    tokenizer_dir=tmp_path / "old")
    model, ckpt = load_model(tmp_path / "run")
    back = Tokenizer.load(ckpt)
    assert back.chat_format is CHATML and back.chat_template == CHATML.template
    session = ChatSession(Engine(model), back, SamplingParams(max_new_tokens=4, seed=0))
    ids, _ = session.prompt_ids("hi")
    assert ids == back.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
