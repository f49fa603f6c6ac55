"""bench/agent_calc.py's questions over other numbers: in the GRPO prompts' phrasings, never a GRPO prompt."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path

from nanolm.data.builtin.tooluse import RL_EN, RL_ZH

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _load_bench():
    sys.path.insert(0, str(BENCH))  # the bench imports its neighbour grpo_arith in main() only
    spec = importlib.util.spec_from_file_location("nanolm_bench_agent_calc", BENCH / "agent_calc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fresh_items_are_new_questions_in_the_prompts_phrasings(tmp_path):
    bench = _load_bench()
    a = argparse.Namespace(phrasings="rl", written_out=False)
    prompts = bench.calc_prompts(tmp_path / "calc_prompts.jsonl", 2000, seed=1000, phrasings="rl")
    trained = {json.loads(line)["prompt"] for line in prompts.read_text(encoding="utf-8").splitlines()}
    items = bench.fresh_items(prompts, 200, 3000, a)
    assert len(items) == 200
    assert not trained & {it.question for it in items}
    # a question that is also a GRPO prompt is left out: with the prompts' own seed every one would be
    assert bench.fresh_items(prompts, 10, 1000, a) == []
    shapes = [q for q, _ in RL_ZH + RL_EN]
    for it in items[:40]:
        assert any(_fits(shape, it.question) for shape in shapes), it.question
        assert float(it.answer) >= 0  # the calculator's result, never negative


def _fits(shape: str, question: str) -> bool:
    pattern = re.escape(shape)
    for key in ("a", "b", "c"):
        pattern = pattern.replace(re.escape("{" + key + "}"), r"\d+")
    return re.fullmatch(pattern, question) is not None
