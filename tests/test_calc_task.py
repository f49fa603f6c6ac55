"""The built-in `calc` benchmark: an item counts when a call computes the right number and the reply states it;
the calls are run and their results fed back; `nanolm eval --task calc` scores a real checkpoint."""

from __future__ import annotations

import collections
import json

import torch
from engine_doubles import ScriptBatch, Watched

from nanolm.config import ModelConfig
from nanolm.data.tooluse import CalcItem
from nanolm.eval.calc import calc_task, score_calc, states
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
