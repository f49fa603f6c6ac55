"""The built-in `calc2` benchmark: two-operation questions in phrasings and over numbers that no training path
writes (the tool-use set, its drill, its RL prompts, the arithmetic task), scored as `calc` with two rounds of
calls."""

from __future__ import annotations

import json
import re

from test_calc_task import Replies, call
from test_tooluse import _template_re

from nanolm.corpora.holdout import numbers_held_out
from nanolm.data.builtin import tooluse as t
from nanolm.data.builtin.arith import problems, write_arith
from nanolm.data.formats import iter_chat_records
from nanolm.data.builtin.tooluse import (HELDOUT2_EN, HELDOUT2_ZH, CalcItem, build_calculator_conversations,
                                 build_tool_drill, calc2_items, calculator_prompts, operands)
from nanolm.eval.calc import calc2_task, score_calc
from nanolm.infer.tools import BUILTIN_TOOLS, calculator

TEMPLATES = [q for q, _ in HELDOUT2_ZH + HELDOUT2_EN]


def rl_expression(prompt: str) -> str:
    """The expression an RL prompt asks for: its phrasing's, with the prompt's numbers in the phrasing's order."""
    (template, expr), = [(q, e) for q, e in t.RL_ZH + t.RL_EN if _template_re(q).match(prompt)]
    return expr.format(**dict(zip(re.findall(r"\{([abc])\}", template), map(int, re.findall(r"\d+", prompt)))))


def test_items_are_two_operations_over_held_out_numbers():
    items = calc2_items(400, calculator=calculator)
    assert len({it.question for it in items}) == 400
    assert sum(bool(re.search("[\u4e00-\u9fff]", it.question)) for it in items) == 200
    for it in items:
        a, b, c = operands(it.expression)
        assert len(re.findall(r"[-+*/]", it.expression)) == 2 and a >= 21 and b >= 21
        assert numbers_held_out("calc", a, b, c) and numbers_held_out("calc", a, b)
        assert it.answer == calculator({"expression": it.expression}) and re.fullmatch(r"\d+", it.answer)
        assert it.phrasing in TEMPLATES and _template_re(it.phrasing).match(it.question)
    assert {it.phrasing for it in items} == set(TEMPLATES)
    assert calc2_items(50, calculator=calculator) == items[:50]
    task = calc2_task(10)
    assert (task.name, task.kind, len(task.items)) == ("calc2", "calc2", 10) and calc2_task(4).items == task.items[:4]


def test_items_are_disjoint_from_every_training_path(tmp_path):
    """No training template matches a calc2 question and no calc2 phrasing a training question; no conversation,
    drill record or RL prompt of large sets computes a calc2 item's numbers (its triple, or its first pair), and
    no arithmetic-task problem is a calc2 question or holds its first pair."""
    items = calc2_items(400, calculator=calculator)
    trained = [q for q, _ in t._QUESTIONS_ZH + t._QUESTIONS_EN + t.RL_ZH + t.RL_EN + t.HELDOUT_ZH + t.HELDOUT_EN]
    assert not set(trained) & set(TEMPLATES)
    for it in items:
        assert not any(_template_re(q).match(it.question) for q in trained), it.question
    held = {operands(it.expression) for it in items} | {operands(it.expression)[:2] for it in items}
    asked = {it.question for it in items}
    written: set[tuple[int, ...]] = set()
    questions: set[str] = set()
    out = build_calculator_conversations(tmp_path / "tools.jsonl", 6000, calculator=calculator,
                                         tools=BUILTIN_TOOLS)
    drill = build_tool_drill(tmp_path / "drill.jsonl", 6000, calculator=calculator, tools=BUILTIN_TOOLS)
    for conv, _ in iter_chat_records(out):
        questions.add(conv.messages[0].content)
        for m in conv.messages:
            for c in m.tool_calls:
                written.add(operands(json.loads(c.arguments)["expression"]))
    for line in drill.read_text(encoding="utf-8").splitlines():
        text = json.loads(line)["text"]
        written |= {operands(json.loads(e)) for e in re.findall(r'"expression": ("[^"]*")', text)}
        questions |= set(re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", text, re.S))
    prompts = calculator_prompts(tmp_path / "rl.jsonl", 4000, calculator=calculator)
    for line in prompts.read_text(encoding="utf-8").splitlines():
        questions.add(json.loads(line)["prompt"])
        written.add(operands(rl_expression(json.loads(line)["prompt"])))
    assert len(written) > 5000 and not written & held
    assert not questions & asked
    for q in questions:
        assert not any(_template_re(p).match(q) for p in TEMPLATES), q
    arith = write_arith(tmp_path / "arith", 1500, 1000, 200)
    texts = [json.loads(line) for f in ("sft", "prompts", "heldout") for line in
             arith[f].read_text(encoding="utf-8").splitlines()]
    arith_questions = [r["prompt"] if "prompt" in r else r["messages"][0]["content"] for r in texts]
    arith_questions += [p["question"] for p in problems(2000, 7)]
    assert len(arith_questions) > 4000 and not set(arith_questions) & asked
    for q in arith_questions:
        assert max(map(int, re.findall(r"\d+", q))) <= 20  # every calc2 question's first two numbers are above
        assert not any(_template_re(p).match(q) for p in TEMPLATES)


def test_two_rounds_of_calls_are_run_and_an_item_counts_when_its_result_is_stated(tok):
    items = [CalcItem("Add 23 and 45, then multiply the result by 3.", "(23 + 45) * 3", "204"),
             CalcItem("Sum 30 and 41, then multiply the total by 2.", "(30 + 41) * 2", "142"),
             CalcItem("Add 30 and 41, then multiply the result by 2.", "(30 + 41) * 2", "142"),
             CalcItem("Add 50 and 22, then multiply the result by 4.", "(50 + 22) * 4", "288")]
    # round 0 for the four items, round 1 for the three that called, round 2 for the one that called again
    replies = [call("23 + 45"), call("(30+41)*2"), call("30 + 41"), "It is 10.",
               call("68 * 3"), "The answer is 142.", "It is 71.",
               "It is 204."]
    eng = Replies(tok, replies)
    res = score_calc(eng, tok, items, rows=2, rounds=2)
    assert res["kind"] == "calc2" and [p["correct"] for p in res["items"]] == [True, True, False, False]
    first = res["items"][0]
    assert first["calls"] == ['{"expression": "23 + 45"}', '{"expression": "68 * 3"}']
    assert first["results"] == ["68", "204"] and first["reply"] == "It is 204."
    assert [p["miss"] for p in res["items"]] == [None, None, "numbers", "no call"]
    assert (res["acc"], res["called"], res["computed"]) == (0.5, 0.75, 0.5)
    # the third round's prompt holds both calls' results, in order
    last = tok.decode(eng.signals.prompts[-1])
    assert last.index("<tool_response>\n68\n</tool_response>") < last.index("<tool_response>\n204\n</tool_response>")
    # with one round (calc), the second call is not run and item 0 is not computed
    one = score_calc(Replies(tok, replies[:7]), tok, items, rows=2, rounds=1)
    assert [p["correct"] for p in one["items"]] == [False, True, False, False]
    assert one["items"][0]["results"] == ["68"] and one["kind"] == "calc"


def test_nanolm_eval_names_the_task():
    from nanolm.eval.runner import load_task
    lt = load_task("calc2:n=3")
    assert lt.task.name == "calc2" and lt.task.kind == "calc2" and len(lt.task.items) == 3


def test_two_operation_rl_prompts_are_disjoint_from_calc_and_calc2():
    """The two-operation RL prompts (`calculator_prompts2`) train where calc2 scores: their phrasings are none of
    calc2's, calc's, the tool-use set's or the one-operation RL prompts', neither of their numbers' pairs nor
    triples is held out, and each answer is the calculator's result of its phrasing's expression."""
    import tempfile
    from pathlib import Path
    others = [q for q, _ in t._QUESTIONS_ZH + t._QUESTIONS_EN + t.RL_ZH + t.RL_EN + t.HELDOUT_ZH + t.HELDOUT_EN
              + HELDOUT2_ZH + HELDOUT2_EN]
    mine = t.RL2_ZH + t.RL2_EN
    assert not {q for q, _ in mine} & set(others)
    items = {it.question for it in calc2_items(400, calculator=calculator)}
    with tempfile.TemporaryDirectory() as tmp:
        out = t.calculator_prompts2(Path(tmp) / "rl2.jsonl", 600, calculator=calculator)
        records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
        assert t.calculator_prompts2(Path(tmp) / "again.jsonl", 600, calculator=calculator).read_text() == \
            out.read_text()
    assert len(records) == 600 and not {r["prompt"] for r in records} & items
    assert sum(bool(re.search("[\u4e00-\u9fff]", r["prompt"])) for r in records) == 300
    for r in records:
        (template, expr), = [(q, e) for q, e in mine if _template_re(q).match(r["prompt"])]
        assert not any(_template_re(q).match(r["prompt"]) for q in others)
        nums = dict(zip(re.findall(r"\{([abc])\}", template), map(int, re.findall(r"\d+", r["prompt"]))))
        expression = expr.format(**nums)
        a, b, c = operands(expression)
        assert not numbers_held_out("calc", a, b) and not numbers_held_out("calc", a, b, c)
        assert r["answer"] == calculator({"expression": expression})
