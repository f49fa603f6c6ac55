"""The built-in tool-use set: every tool result is the calculator's own, every reply quotes it, each record offers
one to three tools, the conversations prepare as chat data with the mask on the calls and replies, and the `calc`
benchmark's questions are disjoint from everything the set writes."""

from __future__ import annotations

import collections
import json
import re

import numpy as np
import pytest

from nanolm import chat
from nanolm.data.formats import iter_chat_records
from nanolm.data.prepare import prepare
from nanolm.corpora.holdout import numbers_held_out
from nanolm.data.builtin.tooluse import (HELDOUT_EN, HELDOUT_ZH, OTHER_TOOLS, _QUESTIONS_EN, _QUESTIONS_ZH,
                                 build_calculator_conversations, calc_items, operands)
from nanolm.infer.tools import BUILTIN_TOOLS, calculator
from nanolm.tokenizer import Tokenizer


def build(out, n, seed):
    return build_calculator_conversations(out, n, seed, calculator=calculator, tools=BUILTIN_TOOLS)


def test_results_are_computed_by_the_calculator_and_quoted(tmp_path):
    out = build(tmp_path / "tools.jsonl", 200, seed=3)
    assert out.read_bytes() == build(tmp_path / "again.jsonl", 200, seed=3).read_bytes()
    convs = [c for c, _ in iter_chat_records(out)]
    assert len(convs) == 200
    calls, offered = 0, collections.Counter()
    texts = {json.dumps(t, ensure_ascii=False): t["function"]["name"] for t in (*BUILTIN_TOOLS, *OTHER_TOOLS)}
    for conv in convs:
        names = [texts[t] for t in conv.tools]  # each offered tool is a built-in or one of the compact others
        assert 1 <= len(names) <= 3 and len(set(names)) == len(names)
        offered[len(names)] += 1
        m = conv.messages
        if len(m) == 2:  # no tool needed
            continue
        assert "calculator" in names
        calls += 1
        (call,) = m[1].tool_calls
        assert call.name == "calculator" and m[2].role == "tool"
        assert m[2].content == calculator(json.loads(call.arguments)) and not m[2].content.startswith("error")
        assert m[2].content in m[3].content
    assert 150 < calls < 200  # most ask for arithmetic, some do not
    assert all(offered[k] > 30 for k in (1, 2, 3))  # one, two and three tools all come up


def _template_re(template: str) -> re.Pattern:
    return re.compile(re.sub(r"\\\{[abc]\\\}", r"\\d+", re.escape(template)) + "$")


def test_calc_items_are_disjoint_from_the_tool_use_set(tmp_path):
    """The calc benchmark's phrasings match no training template and no training template matches them; its
    number pairs are held out, and no conversation of a large set uses a held-out operand tuple."""
    train_templates = [q for q, _ in _QUESTIONS_ZH + _QUESTIONS_EN]
    held_templates = [q for q, _ in HELDOUT_ZH + HELDOUT_EN]
    items = calc_items(400, calculator=calculator)
    assert len({it.question for it in items}) == 400
    assert sum(bool(re.search("[\u4e00-\u9fff]", it.question)) for it in items) == 200
    for it in items:
        assert not any(_template_re(t).match(it.question) for t in train_templates), it.question
        assert any(_template_re(t).match(it.question) for t in held_templates)
        assert numbers_held_out("calc", *operands(it.expression)) and len(operands(it.expression)) == 2
        assert it.answer == calculator({"expression": it.expression}) and not it.answer.startswith("error")
    out = build(tmp_path / "big.jsonl", 6000, seed=0)
    questions = set()
    for conv, _ in iter_chat_records(out):
        m = conv.messages
        questions.add(m[0].content)
        if len(m) == 4:
            assert not numbers_held_out("calc", *operands(json.loads(m[1].tool_calls[0].arguments)["expression"]))
            assert not any(_template_re(t).match(m[0].content) for t in held_templates)
    assert not questions & {it.question for it in items}
    assert calc_items(50, calculator=calculator) == items[:50]


def test_every_frame_asks_every_operator_in_words_the_benchmark_never_uses():
    """The composed phrasings: each frame with each operator (so a sentence's shape tells no operator), and no
    operator phrase inside a calc benchmark phrasing."""
    from nanolm.data.builtin import tooluse as t
    held = [q.lower() for q, _ in HELDOUT_ZH + HELDOUT_EN]
    for frames, phrases, key, questions in ((t._FRAMES_EN, t._PHRASES_EN, "x", _QUESTIONS_EN),
                                            (t._COMMANDS_EN, t._VERBS_EN, "v", _QUESTIONS_EN),
                                            (t._FRAMES_ZH, t._PHRASES_ZH, "x", _QUESTIONS_ZH),
                                            (t._COMMANDS_ZH, t._VERBS_ZH, "v", _QUESTIONS_ZH)):
        ops = {expr.split()[1] for _, expr in phrases}
        assert ops == {"+", "-", "*", "/"}
        for frame in frames:
            for phrase, expr in phrases:
                text = frame.replace("{" + key + "}", phrase)
                assert (text[0].upper() + text[1:] if frame[0] == "{" else text, expr) in questions
        for phrase, _ in phrases:
            assert not any(phrase.lower() in h for h in held), phrase
    assert ("Multiply {a} with {b}.", "{a} * {b}") in _QUESTIONS_EN  # a verb starting the sentence, capitalised
    assert len(_QUESTIONS_EN) == len(set(_QUESTIONS_EN)) and len(_QUESTIONS_ZH) == len(set(_QUESTIONS_ZH))


def test_operands_and_the_held_out_share():
    assert operands("(12 + 5) * 3") == (12, 5, 3)
    share = sum(numbers_held_out("calc", a, b) for a in range(10, 100) for b in range(10, 100)) / 90 ** 2
    assert 0.08 < share < 0.12
    with pytest.raises(Exception, match="no `calculator`"):
        build_calculator_conversations("x.jsonl", 3, calculator=calculator, tools=BUILTIN_TOOLS[1:])


def test_the_set_prepares_with_the_mask_on_calls_and_replies(tmp_path, tokenizer_dir):
    src = build(tmp_path / "tools.jsonl", 30, seed=0)
    m = prepare([src], tokenizer_dir, tmp_path / "data", format="chat", max_tokens=2048, val_fraction=0,
                workers=0, quiet=True)
    assert m.totals["n_docs"] == 30 and m.section["truncated"] == 0
    tok = Tokenizer.load(tokenizer_dir)
    ids = np.fromfile(tmp_path / "data" / "train-00000.bin", dtype=m.dtype)
    mask = np.fromfile(tmp_path / "data" / "train-00000.mask", dtype=np.uint8)
    targets = tok.decode(ids[(mask & chat.TARGET) > 0].tolist())
    assert targets.count("<tool_call>") == sum(len(c.messages) == 4 for c, _ in iter_chat_records(src))
    assert "<tool_response>" not in targets and "# Tools" not in targets


def test_the_drill_is_the_set_rendered_without_tool_lists(tmp_path):
    """The pretraining drill holds the tool-use set's conversations of the same seed as chat-layout text, with no
    system turn or tool list, and keeps the calc benchmark's numbers and phrasings out."""
    from nanolm.data.builtin.tooluse import build_tool_drill
    drill = build_tool_drill(tmp_path / "drill.jsonl", 300, seed=5, calculator=calculator, tools=BUILTIN_TOOLS)
    assert drill.read_bytes() == build_tool_drill(tmp_path / "again.jsonl", 300, seed=5, calculator=calculator,
                                                  tools=BUILTIN_TOOLS).read_bytes()
    texts = [json.loads(line)["text"] for line in drill.read_text(encoding="utf-8").splitlines()]
    convs = [c for c, _ in iter_chat_records(build(tmp_path / "tools.jsonl", 300, seed=5))]
    assert texts == [chat.render_chat(c.messages) for c in convs]
    held_templates = [q for q, _ in HELDOUT_ZH + HELDOUT_EN]
    calls = 0
    for text, conv in zip(texts, convs):
        assert text.startswith("<|im_start|>user\n") and "<tools>" not in text and "system" not in text
        m = conv.messages
        assert not any(_template_re(t).match(m[0].content) for t in held_templates)
        if len(m) == 4:
            calls += 1
            expression = json.loads(m[1].tool_calls[0].arguments)["expression"]
            assert f'{{"expression": "{expression}"}}' in text and f"<tool_response>\n{m[2].content}\n" in text
            assert not numbers_held_out("calc", *operands(expression))
    assert calls > 200


def test_rl_prompts_use_phrasings_of_their_own_and_the_calculators_answers(tmp_path):
    """The built-in RL prompts: each in an RL phrasing that is neither a tool-use template nor a calc benchmark
    phrasing, over training numbers, its answer the calculator's (no negative difference, whole quotients); every
    operator in both languages; the same n and seed give the same file; the CLI writes them."""
    import subprocess
    import sys
    from nanolm.data.builtin import tooluse as t
    from nanolm.data.builtin.tooluse import RL_EN, RL_ZH, calculator_prompts
    rl = [q for q, _ in RL_ZH + RL_EN]
    others = {q for q, _ in _QUESTIONS_ZH + _QUESTIONS_EN + HELDOUT_ZH + HELDOUT_EN}
    assert len(set(rl)) == len(rl) and not set(rl) & others
    for phrasings in (RL_ZH, RL_EN):
        assert {expr.split()[1] for _, expr in phrasings} == {"+", "-", "*", "/"}
    held = [q.lower() for q, _ in HELDOUT_ZH + HELDOUT_EN]
    for frames, phrases in ((t._RL_FRAMES_EN, t._RL_PHRASES_EN), (t._RL_FRAMES_ZH, t._RL_PHRASES_ZH)):
        assert {expr.split()[1] for _, expr in phrases} == {"+", "-", "*", "/"}
        for phrase, expr in phrases:  # every frame asks every operator phrase; none is inside a benchmark phrasing
            assert not any(phrase.lower() in h for h in held), phrase
            assert all(any(_template_re(q).match(f.replace("{x}", phrase).format(a=12, b=34, c=56))
                           for q, e in RL_ZH + RL_EN if e == expr) for f in frames)
    out = calculator_prompts(tmp_path / "p.jsonl", 400, seed=2, calculator=calculator)
    assert out.read_bytes() == calculator_prompts(tmp_path / "q.jsonl", 400, seed=2, calculator=calculator).read_bytes()
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(records) == 400 and len({r["prompt"] for r in records}) > 350
    assert sum(bool(re.search("[\u4e00-\u9fff]", r["prompt"])) for r in records) == 200
    used = set()
    for r in records:
        (template, expr), = [(q, e) for q, e in RL_ZH + RL_EN if _template_re(q).match(r["prompt"])]
        used.add(template)
        # the numbers, in the template's order, fill its expression: its answer is the calculator's
        nums = dict(zip(re.findall(r"\{([abc])\}", template), map(int, re.findall(r"\d+", r["prompt"]))))
        expression = expr.format(**nums)
        assert r["answer"] == calculator({"expression": expression}) and re.fullmatch(r"\d+", r["answer"])
        assert not numbers_held_out("calc", *operands(expression))
        assert not any(_template_re(q).match(r["prompt"]) for q in others)
    assert used == set(rl)  # 400 prompts meet every phrasing
    cli = subprocess.run([sys.executable, "-m", "nanolm", "data", "tools", "--prompts", "--n", "400", "--seed", "2",
                          "--out", str(tmp_path / "cli.jsonl")], capture_output=True, text=True, check=True)
    assert "400 calculator prompts" in cli.stdout and (tmp_path / "cli.jsonl").read_bytes() == out.read_bytes()
    with pytest.raises(Exception, match="positive integer"):
        calculator_prompts(tmp_path / "r.jsonl", 0, calculator=calculator)
