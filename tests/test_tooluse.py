"""The built-in tool-use set: every tool result is the calculator's own, every reply quotes it, and the
conversations prepare as chat data with the mask on the calls and replies."""

from __future__ import annotations

import json

import numpy as np

from nanolm.data import chatml
from nanolm.data.formats import iter_chat_records
from nanolm.data.prepare import prepare
from nanolm.data.tooluse import build_calculator_conversations
from nanolm.infer.tools import BUILTIN_TOOLS, calculator
from nanolm.tokenizer import Tokenizer


def build(out, n, seed):
    return build_calculator_conversations(out, n, seed, calculator=calculator, tools=BUILTIN_TOOLS)


def test_results_are_computed_by_the_calculator_and_quoted(tmp_path):
    out = build(tmp_path / "tools.jsonl", 200, seed=3)
    assert out.read_bytes() == build(tmp_path / "again.jsonl", 200, seed=3).read_bytes()
    convs = [c for c, _ in iter_chat_records(out)]
    assert len(convs) == 200
    calls = 0
    for conv in convs:
        assert conv.tools == tuple(json.dumps(t, ensure_ascii=False) for t in BUILTIN_TOOLS)
        m = conv.messages
        if len(m) == 2:  # no tool needed
            continue
        calls += 1
        (call,) = m[1].tool_calls
        assert call.name == "calculator" and m[2].role == "tool"
        assert m[2].content == calculator(json.loads(call.arguments)) and not m[2].content.startswith("error")
        assert m[2].content in m[3].content
    assert 150 < calls < 200  # most ask for arithmetic, some do not


def test_the_set_prepares_with_the_mask_on_calls_and_replies(tmp_path, tokenizer_dir):
    src = build(tmp_path / "tools.jsonl", 30, seed=0)
    m = prepare([src], tokenizer_dir, tmp_path / "data", format="chat", max_tokens=2048, val_fraction=0,
                workers=0, quiet=True)
    assert m["totals"]["n_docs"] == 30 and m["chat"]["truncated"] == 0
    tok = Tokenizer.load(tokenizer_dir)
    ids = np.fromfile(tmp_path / "data" / "train-00000.bin", dtype=m["dtype"])
    mask = np.fromfile(tmp_path / "data" / "train-00000.mask", dtype=np.uint8)
    targets = tok.decode(ids[(mask & chatml.TARGET) > 0].tolist())
    assert targets.count("<tool_call>") == sum(len(c.messages) == 4 for c, _ in iter_chat_records(src))
    assert "<tool_response>" not in targets and "# Tools" not in targets
