"""Tools through a chat template that has no place for them (SmolLM2's): the tool list in a system turn, the
calls and results as text in QWEN3's layout, rendered by the template itself; `<tool_call>` spelt in several
tokens, read back by the reply parser and held to the tools by the call guide. And a tokenizer directory saved
by transformers 5, whose template lives in chat_template.jinja."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from nanolm import chat
from nanolm.chat import Message, TemplateFormat, ToolCall, encode_chat, message_from_dict, tools_from_value
from nanolm.cli import main
from nanolm.config import SamplingParams
from nanolm.data.builtin.tooluse import build_calculator_conversations
from nanolm.infer.session import ChatSession, run_chat
from nanolm.infer.guide import GuideVocab, ToolCallGuide
from nanolm.infer.tools import BUILTIN_TOOLS, Toolbox, calculator
from nanolm.tokenizer import Tokenizer
from test_chat import Replies, call_text
from test_family_templates import SMOLLM2, family_tokenizer, read_docs

transformers = pytest.importorskip("transformers")

SMOL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # SmolLM2's added tokens; no <tool_call>
TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
              "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
              "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
              "<args-json-object>}\n</tool_call>")


@pytest.fixture(scope="module")
def smol(tmp_path_factory) -> Tokenizer:
    root = tmp_path_factory.mktemp("smol")
    return Tokenizer.load(family_tokenizer(root / "smol", SMOLLM2, SMOL_SPECIALS,
                                           {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))


@pytest.fixture(scope="module")
def tool_set(tmp_path_factory) -> Path:
    return build_calculator_conversations(tmp_path_factory.mktemp("tools") / "tools.jsonl", 12, seed=0,
                                          calculator=calculator, tools=BUILTIN_TOOLS)


def first_call(path: Path) -> dict:
    """The first record of the built-in tool-use set whose assistant calls the calculator."""
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return next(r for r in records if any(m.get("tool_calls") for m in r["messages"]))


def pieces_of(record: dict) -> list[tuple[str, bool]]:
    """The text a tool conversation renders to through SmolLM2's template, by hand: (piece, trains)."""
    user, called, result, reply = record["messages"]
    expression = json.loads(called["tool_calls"][0]["function"]["arguments"])["expression"]
    system = TOOLS_HEAD + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in record["tools"]) + TOOLS_TAIL
    return [(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user['content']}<|im_end|>\n"
             "<|im_start|>assistant\n", False),
            (f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n'
             "</tool_call><|im_end|>\n", True),
            (f"<|im_start|>user\n<tool_response>\n{result['content']}\n</tool_response><|im_end|>\n"
             "<|im_start|>assistant\n", False),
            (f"{reply['content']}<|im_end|>\n", True)]


def expected(tok: Tokenizer, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    ids, mask = [], []
    for text, trains in pieces:
        got = tok.encode(text)
        ids += got
        mask += [int(trains)] * len(got)
    return ids, mask


def test_the_tag_is_text_and_the_format_takes_tools(smol):
    assert isinstance(smol.chat_format, TemplateFormat) and not smol.chat_format.reads_tools
    assert smol.tag_ids == {} and len(smol.encode("<tool_call>")) > 1  # spelt in several tokens
    assert (smol.chat_format.tools, smol.chat_format.guided_calls, smol.chat_format.bare_calls) == (True, True, False)


def test_a_tool_conversation_renders_to_exact_ids_and_loss_mask(smol, tool_set):
    record = first_call(tool_set)
    msgs = [message_from_dict(f"m[{i}]", m) for i, m in enumerate(record["messages"])]
    tools = tools_from_value("tools", record["tools"])
    spans = smol.chat_format.spans(msgs, tools)
    text = "".join(s.text for s in spans)
    pieces = pieces_of(record)
    assert text == "".join(p for p, _ in pieces)
    ids, mask = encode_chat(spans, smol.encode(text), smol.spelled_lengths(), str(smol.path))
    want_ids, want_mask = expected(smol, pieces)
    assert ids.tolist() == want_ids and (mask & chat.TARGET).tolist() == want_mask
    # The one exchange opens on the user's question, not on the tool result's user turn.
    assert np.flatnonzero(mask & chat.EXCHANGE).tolist() == [len(smol.encode(pieces[0][0].split("<|im_start|>user")[0]))]
    # What the template is given renders as transformers renders it.
    ref = transformers.AutoTokenizer.from_pretrained(str(smol.path.parent))
    plain = [m.to_dict() for m in smol.chat_format.plain_messages(msgs, tools)]
    assert ref.apply_chat_template(plain, tokenize=False) == text
    # The prompt for the reply after the call ends in the template's generation prompt.
    prompt = smol.chat_format.render(msgs[:3], tools, add_generation_prompt=True)
    assert prompt == "".join(p for p, _ in pieces[:3])


def test_prepare_chat_accepts_tool_conversations(smol, tool_set, tmp_path):
    out = tmp_path / "out"
    assert main(["prepare", str(tool_set), "--format", "chat", "--tokenizer", str(smol.path.parent), "--out",
                 str(out), "--val-fraction", "0", "--workers", "0", "--quiet"]) == 0
    from nanolm.data.shards import Manifest
    docs = read_docs(out, Manifest.read(out))
    assert len(docs) == 12  # none refused
    record = first_call(tool_set)
    at = [json.loads(line) for line in tool_set.read_text(encoding="utf-8").splitlines()].index(record)
    ids, mask = docs[at]
    want_ids, want_mask = expected(smol, pieces_of(record))
    assert ids.tolist() == want_ids + [smol.eot_id]
    assert (mask[:-1] & chat.TARGET).tolist() == want_mask


def test_a_chat_session_reads_a_text_call_back_and_runs_the_calculator(smol):
    question = "What is 12*(3+4)?"
    reply = call_text("calculator", {"expression": "12*(3+4)"})
    assert len(smol.encode("<tool_call>")) > 1
    eng = Replies(smol, [reply, "12*(3+4) = 84."])
    builtin = Toolbox.from_specs(["builtin"])
    s = ChatSession(eng, smol, SamplingParams(max_new_tokens=256), tools=builtin)
    assert s.guide is not None  # calls are guided in text too
    out = io.StringIO()
    run_chat(s, stdin=io.StringIO(question + "\n"), out=out, interactive=False)
    assert out.getvalue() == (f"user: {question}\n"
                              'tool call: calculator({"expression": "12*(3+4)"})\n'
                              "tool result: 84\n"
                              "assistant: 12*(3+4) = 84.\n")
    call = ToolCall("calculator", '{"expression": "12*(3+4)"}')
    turn = [Message("user", question), Message("assistant", "", "", (call,)), Message("tool", "84")]
    assert s.history == [*turn, Message("assistant", "12*(3+4) = 84.")]
    system = TOOLS_HEAD + "".join("\n" + t for t in builtin.texts()) + TOOLS_TAIL
    second = (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
              f"<|im_start|>assistant\n{reply}<|im_end|>\n"
              "<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert eng.prompts[1] == smol.encode(second)


def test_the_guide_wakes_on_a_spelt_out_tag(smol):
    guide = ToolCallGuide(GuideVocab.of(smol, 400), list(BUILTIN_TOOLS))
    for t in smol.encode("Let me compute. "):
        guide.advance(t)
    assert not guide.in_call
    for t in smol.encode("<tool_call>"):
        guide.advance(t)
    assert guide.in_call
    allowed = guide.allowed()
    bytes_of = smol.token_bytes()
    # Only the call's opening may come next: tokens that begin '\n{"name": "'.
    assert {bytes_of[i] for i in torch.nonzero(allowed).flatten().tolist()} == \
        {b for b in bytes_of[:400] if b and b'\n{"name": "'.startswith(b)}
    for t in smol.encode('\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'):
        assert guide.allowed() is None or guide.allowed()[t]
        guide.advance(t)
    assert not guide.in_call


def test_the_guide_masks_a_token_that_finishes_the_tag_and_goes_on_as_no_call_can():
    pieces = [b"<", b"tool", b"_call", b">", b">\n", b">\n\n", b">x", b"\n", b"{", b"a", b"x>"]
    vocab = GuideVocab(pieces, len(pieces))
    guide = ToolCallGuide(vocab, list(BUILTIN_TOOLS))
    assert guide.allowed() is None  # nothing can finish the tag from here
    for t in (0, 1, 2):  # "<tool_call"
        guide.advance(t)
    mask = guide.allowed()
    assert [pieces[i] for i in range(len(pieces)) if not mask[i]] == [b">\n\n", b">x"]
    guide.advance(pieces.index(b">\n"))
    assert guide.in_call


def test_chat_template_jinja_saved_by_transformers_wins_and_is_imported(tmp_path, smol):
    from nanolm.export.hf import import_hf
    src = tmp_path / "hf"
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(smol.path), bos_token="<|im_start|>",
                                                  eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                                  chat_template=SMOLLM2)
    hf_tok.save_pretrained(str(src))
    assert (src / "chat_template.jinja").read_text(encoding="utf-8") == SMOLLM2
    config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert "chat_template" not in config
    # Both present: transformers reads chat_template.jinja, and so does nanolm.
    config["chat_template"] = chat.CHATML.template
    (src / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    ref = transformers.AutoTokenizer.from_pretrained(str(src))
    tok = Tokenizer.load(src)
    assert tok.chat_template == SMOLLM2 and isinstance(tok.chat_format, TemplateFormat)
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    want = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert want.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert tok.chat_format.render([Message("user", conv[0]["content"])], add_generation_prompt=True) == want

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True))
    model.save_pretrained(src)
    out = import_hf(src, tmp_path / "nano")
    saved = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert saved["chat_template"] == SMOLLM2  # the imported checkpoint keeps the model's own layout
    assert Tokenizer.load(out).chat_format.render([Message("user", conv[0]["content"])],
                                                  add_generation_prompt=True) == want
