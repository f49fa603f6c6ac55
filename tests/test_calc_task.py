"""The built-in `calc` benchmark: an item counts when a call computes the right number and the reply states it;
the calls are run and their results fed back; `nanolm eval --task calc` scores a real checkpoint."""

from __future__ import annotations

import collections
import json

import torch
from engine_doubles import ScriptBatch, Watched

from nanolm.config import ModelConfig
from nanolm.data.builtin.tooluse import CalcItem
from nanolm.eval.calc import calc_task, format_calc, miss, score_calc, states
from nanolm.infer.engine import Engine
from nanolm.infer.tools import calculator
from nanolm.model.transformer import Transformer


class Replies(Watched, Engine):
    """An engine whose k-th row replays the k-th reply text; `signals.prompts` holds each row's prompt ids."""

    def __init__(self, tok, replies: list[str]) -> None:
        torch.manual_seed(0)
        super().__init__(Transformer(ModelConfig(vocab_size=400, d_model=32, n_layer=1, n_head=4, n_kv_head=2,
                                                 max_seq_len=4096)))
        self.replies = collections.deque(tok.encode(r) for r in replies)
        self.watch()

    def batch(self) -> ScriptBatch:
        return ScriptBatch([], self.signals, 0.0, self.replies)


def call(expression: str) -> str:
    return f'<tool_call>\n{{"name": "calculator", "arguments": {json.dumps({"expression": expression})}}}\n</tool_call>'


def test_an_item_counts_when_the_call_computes_and_the_reply_states_it(tok):
    items = [CalcItem("Add 12 and 30.", "12 + 30", "42"), CalcItem("Multiply 11 by 13.", "11 * 13", "143"),
             CalcItem("Add 20 and 25.", "20 + 25", "45"), CalcItem("Add 40 and 41.", "40 + 41", "81")]
    replies = [call("12 + 30"), call("11*13"), call("20 + 52"), "It is 81.",  # the first round, item by item
               "The answer is 42.", "It comes to 142.", "The answer is 45."]  # replies to the three results
    eng = Replies(tok, replies)
    res = score_calc(eng, tok, items, rows=2)
    assert [p["correct"] for p in res["items"]] == [True, False, False, False]
    assert [p["computed"] for p in res["items"]] == [True, True, False, False]
    assert res["items"][1]["results"] == ["143"] and res["items"][2]["results"] == ["72"]
    assert res["items"][3]["reply"] == "It is 81." and res["items"][3]["calls"] == []
    assert (res["acc"], res["called"], res["computed"], res["chance"], res["n"]) == (0.25, 0.75, 0.5, 0.0, 4)
    assert [p["miss"] for p in res["items"]] == [None, "misstated", "numbers", "no call"]
    assert res["misses"] == {"no call": 1, "misstated": 1, "operation": 0, "numbers": 1}
    # the second round's prompts hold each call's result as the tool turn, after the question
    second = [tok.decode(p) for p in eng.signals.prompts[4:]]
    assert len(second) == 3
    for text, item, result in zip(second, items, ("42", "143", "72")):
        assert item.question in text and f"<tool_response>\n{result}\n</tool_response>" in text
        assert '"name": "calculator"' in text  # the built-in tools are offered


def test_states_reads_the_numbers_of_a_reply():
    assert states("The answer is 1,088.", "1088") and states("答案是 6。", "6")
    assert not states("The answer is 10880.", "1088") and not states("no number", "3")


def test_calc_task_items_and_their_results():
    task = calc_task(10)
    assert task.name == "calc" and task.kind == "calc" and len(task.items) == 10
    for it in task.items:
        assert it.answer == calculator({"expression": it.expression})
    assert calc_task(4).items == task.items[:4]


def test_misses_by_kind_and_accuracy_by_phrasing(tok):
    """A call with the question's numbers in the wrong order is an operation miss; each phrasing is counted."""
    take, add = "Take {b} away from {a}. What remains?", "Add {a} and {b}."
    items = [CalcItem("Take 5 away from 19. What remains?", "19 - 5", "14", phrasing=take),
             CalcItem("Take 7 away from 30. What remains?", "30 - 7", "23", phrasing=take),
             CalcItem("Add 12 and 30.", "12 + 30", "42", phrasing=add)]
    replies = [call("5 - 19"), call("30 - 7"), call("12 + 30"), "It is -14.", "It is 23.", "It is 42."]
    res = score_calc(Replies(tok, replies), tok, items, rows=3)
    assert [p["miss"] for p in res["items"]] == ["operation", None, None]
    assert res["misses"] == {"no call": 0, "misstated": 0, "operation": 1, "numbers": 0}
    assert res["by_phrasing"] == {take: {"n": 2, "correct": 1}, add: {"n": 1, "correct": 1}}
    assert format_calc(res).splitlines() == [
        "calc: 2 of 3 right; missed: no call 0, misstated 0, operation 1, numbers 0",
        f"    1/2   {take}", f"    1/1   {add}"]


def test_miss_reads_the_calls_arguments():
    assert miss("Add 3 and 4.", ['{"expression": "4 + 3"}'], computed=True, correct=True) is None
    assert miss("Add 3 and 4.", ['{"expression": "3 * 4"}'], computed=False, correct=False) == "operation"
    assert miss("Add 3 and 4.", ['{"expression": "3 + 44"}'], computed=False, correct=False) == "numbers"
    assert miss("Add 3 and 4.", ['{"expression": "3"}'], computed=False, correct=False) == "numbers"
    assert miss("Add 3 and 4.", ['not json', '["x"]'], computed=False, correct=False) == "numbers"
    assert miss("Add 3 and 4.", [], computed=False, correct=False) == "no call"


def test_calc_items_carry_their_phrasing():
    import re
    from nanolm.data.builtin.tooluse import HELDOUT_EN, HELDOUT_ZH
    phrasings = {q for q, _ in HELDOUT_ZH + HELDOUT_EN}
    items = calc_task(24).items
    for it in items:
        assert it.phrasing in phrasings
        assert re.fullmatch(re.sub(r"\\\{[abc]\\\}", r"\\d+", re.escape(it.phrasing)), it.question), it
    assert len({it.phrasing for it in items}) > 6


def test_sampled_scoring_is_seeded(tok):
    """At a temperature, item i draws with seed + i: the same seed gives the same replies, another seed others."""
    torch.manual_seed(0)
    eng = Engine(Transformer(ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layer=1, n_head=4, n_kv_head=2,
                                         max_seq_len=1024)))
    items = [CalcItem(f"Add {a} and 7.", f"{a} + 7", str(a + 7)) for a in (11, 12, 13, 14)]

    def replies(**kw):
        return [(p["calls"], p["reply"]) for p in score_calc(eng, tok, items, rows=2, max_new_tokens=12, **kw)["items"]]

    assert replies(temperature=1.0, seed=3) == replies(temperature=1.0, seed=3)
    assert replies(temperature=1.0, seed=3) != replies(temperature=1.0, seed=4)
    assert replies() == replies(seed=5)  # greedy: the seed changes nothing
