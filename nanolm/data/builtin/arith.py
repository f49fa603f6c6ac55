"""A built-in RL task with verifiable answers: arithmetic word problems whose answers are computed.

`nanolm data arith --out DIR` writes three JSONL files of distinct problems
(no problem, that is no template with the same numbers, is in two of them):

- `sft.jsonl`: conversations whose assistant reply works the problem out and
  ends with `#### <answer>` (the GSM8K convention the answer reward reads);
- `prompts.jsonl`: RL prompts `{"prompt": ..., "answer": "<n>"}` to train on
  (`nanolm prepare --format prompts`, then `--stage grpo`);
- `heldout.jsonl`: more prompts of the same form, for evaluation only: problems
  whose numbers are held out (`held_out`, about 10% of them), which no seed
  ever writes into the other two files; the built-in `arith` benchmark
  (`nanolm eval --task arith`) is drawn from the same held-out problems.

Problems are templated sentences in English and Chinese (half each) with
numbers drawn from `random.Random(seed)`, so that the answer is exact and
computed, never looked up. Two levels: `standard` (the default) is one
operation (+, -, x) of two numbers up to 20, or two of three; `easy` is one
sum or difference of two numbers up to 9, in three templates each: a small
model learns part of it in a short SFT, which leaves RL groups with mixed
rewards to learn from (`max_number` changes the range of either). A worked reply states the operations (`7 + 5 = 12`) then the
answer, which is what SFT teaches and what RL then rewards.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any, Callable

from nanolm.corpora.holdout import HELD_OUT_NUMBERS_PER_MILLE, numbers_held_out
from nanolm.errors import UserError
from nanolm.io import write_text_atomic

# (question, worked steps) templates: a function of the drawn numbers giving the text and the answer.
Problem = tuple[str, str, int]


def _sum(zh: str, en: str) -> Callable[[int, int, bool], Problem]:
    """A template of a + b: the question in Chinese and in English, each with {a} and {b} to fill."""
    def problem(a: int, b: int, in_zh: bool) -> Problem:
        return (zh if in_zh else en).format(a=a, b=b), f"{a} + {b} = {a + b}", a + b
    return problem


def _difference(zh: str, en: str) -> Callable[[int, int, bool], Problem]:
    """A template of the larger number less the smaller: the question in Chinese and in English, as `_sum`."""
    def problem(a: int, b: int, in_zh: bool) -> Problem:
        a, b = max(a, b), min(a, b)
        return (zh if in_zh else en).format(a=a, b=b), f"{a} - {b} = {a - b}", a - b
    return problem


def _mul(a: int, b: int, zh: bool) -> Problem:
    q = f"每盒有{a}支铅笔，一共有{b}盒。一共有几支铅笔？" if zh else \
        f"Each box holds {a} pencils. There are {b} boxes. How many pencils are there in all?"
    return q, f"{a} × {b} = {a * b}", a * b


def _add_sub(a: int, b: int, c: int, zh: bool) -> Problem:
    c = min(c, a + b)
    q = f"车上有{a}人，到站上来{b}人，又下去{c}人。车上现在有几人？" if zh else \
        f"A bus has {a} people. At a stop {b} get on and {c} get off. How many people are on the bus now?"
    return q, f"{a} + {b} = {a + b}, {a + b} - {c} = {a + b - c}", a + b - c


# level "easy": one sum or difference of two numbers (single digits by default), in three templates each, so a
# small model learns part of it in a short SFT and RL has mixed groups to learn from. The order is the draw's.
EASY: list[Callable[[int, int, bool], Problem]] = [make(zh, en) for make, zh, en in [
    (_sum, "小明有{a}个苹果，妈妈又给了他{b}个。他现在有几个苹果？",
     "Tom has {a} apples. His mother gives him {b} more. How many apples does Tom have now?"),
    (_difference, "书架上有{a}本书，借走了{b}本。还剩几本书？",
     "A shelf holds {a} books. {b} books are borrowed. How many books are left on the shelf?"),
    (_sum, "小红有{a}块糖，又买了{b}块。她一共有几块糖？",
     "Anna has {a} sweets and buys {b} more. How many sweets does Anna have in all?"),
    (_difference, "树上有{a}只鸟，飞走了{b}只。树上还有几只鸟？",
     "There are {a} birds in a tree and {b} fly away. How many birds are still in the tree?"),
    (_sum, "院子里有{a}只鸡，又跑来{b}只。现在院子里有几只鸡？",
     "A farm has {a} hens and {b} more hens arrive. How many hens are on the farm now?"),
    (_difference, "盘子里有{a}个饺子，吃掉了{b}个。盘子里还剩几个饺子？",
     "A plate has {a} cookies and {b} are eaten. How many cookies are left on the plate?"),
]]
TWO: list[Callable[[int, int, bool], Problem]] = [EASY[0], EASY[1], _mul]  # the apples and the books
THREE: list[Callable[[int, int, int, bool], Problem]] = [_add_sub]
LEVELS = {"easy": 9, "standard": 20}  # level -> default max_number


SPLITS = {"train": 1 - HELD_OUT_NUMBERS_PER_MILLE / 1000, "heldout": HELD_OUT_NUMBERS_PER_MILLE / 1000}


def held_out(steps: str) -> bool:
    """Whether a problem belongs to the held-out split: by the numbers of its worked steps ("7 + 5 = 12"), so a
    problem's split does not depend on its template, language or the order its numbers were drawn in."""
    return numbers_held_out("arith", *(int(x) for x in re.findall(r"\d+", steps)))


def problems(n: int, seed: int, *, max_number: int | None = None, level: str = "standard",
             split: str = "train") -> list[dict[str, Any]]:
    """n distinct problems: {"question", "steps", "answer" (int), "lang"}, drawn with random.Random(seed).

    level "standard" (the default): +, - or x of two numbers up to max_number (20; the factor up to 9), or + then
    - of three; level "easy": a sum or a difference of two numbers up to max_number (9). split "train": problems
    whose numbers are not held out (`held_out`), for SFT and RL prompts; "heldout": only those, for evaluation
    (the built-in `arith` benchmark and heldout.jsonl): no seed or count makes a training problem a held-out one."""
    if split not in SPLITS:
        raise UserError(f"unknown arith split {split!r}: use one of {', '.join(SPLITS)}")
    if level not in LEVELS:
        raise UserError(f"unknown arith level {level!r}: use one of {', '.join(LEVELS)}")
    max_number = LEVELS[level] if max_number is None else max_number
    if max_number < 1:
        raise UserError(f"--max-number {max_number}: the numbers are drawn from 1..max_number; use 1 or more")
    rng = random.Random(seed)
    seen: set[str] = set()  # question texts: (a, b) and (b, a) of a subtraction are one problem
    out: list[dict[str, Any]] = []
    if level == "easy":
        space = 2 * len(EASY) * (max_number ** 2 + max_number * (max_number + 1) // 2) // 2  # + ordered, - not
    else:
        space = 2 * (len(TWO) * max_number ** 2 + len(THREE) * max_number ** 3)  # (template, numbers): fewer
    space = round(space * SPLITS[split])
    if n > space * 0.6:
        what = "--n-sft + --n-prompts" if split == "train" else "--n-heldout"
        raise UserError(f"{n} distinct {split} problems asked for ({what}); level {level} with numbers up to "
                        f"{max_number} makes about {space}: ask for at most {int(space * 0.6)} or raise --max-number")
    while len(out) < n:
        zh = rng.random() < 0.5
        if level == "easy":
            q, steps, ans = EASY[rng.randrange(len(EASY))](rng.randint(1, max_number), rng.randint(1, max_number), zh)
        elif rng.random() < 0.75:
            t = rng.randrange(len(TWO))
            nums = (rng.randint(1, max_number), rng.randint(1, max_number if t != 2 else 9))
            q, steps, ans = TWO[t](*nums, zh)
        else:
            t = rng.randrange(len(THREE))
            nums3 = (rng.randint(1, max_number), rng.randint(1, max_number), rng.randint(1, max_number))
            q, steps, ans = THREE[t](*nums3, zh)
        if q in seen or held_out(steps) != (split == "heldout"):
            continue
        seen.add(q)
        out.append({"question": q, "steps": steps, "answer": ans, "lang": "zh" if zh else "en"})
    return out


def worked_reply(p: dict[str, Any]) -> str:
    return f"{p['steps']}. #### {p['answer']}" if p["lang"] == "en" else f"{p['steps']}。#### {p['answer']}"


def write_arith(out: Path, n_sft: int, n_prompts: int, n_heldout: int, seed: int = 0,
                max_number: int | None = None, level: str = "standard") -> dict[str, Path]:
    """Write sft.jsonl, prompts.jsonl and heldout.jsonl of distinct problems into `out`; returns their paths."""
    ps = problems(n_sft + n_prompts, seed, max_number=max_number, level=level)
    held = problems(n_heldout, seed, max_number=max_number, level=level, split="heldout") if n_heldout else []
    out.mkdir(parents=True, exist_ok=True)
    sft, rl = ps[:n_sft], ps[n_sft:]

    def line(obj: dict[str, Any]) -> str:
        return json.dumps(obj, ensure_ascii=False) + "\n"
    files = {
        "sft": "".join(line({"messages": [{"role": "user", "content": p["question"]},
                                          {"role": "assistant", "content": worked_reply(p)}]}) for p in sft),
        "prompts": "".join(line({"prompt": p["question"], "answer": str(p["answer"])}) for p in rl),
        "heldout": "".join(line({"prompt": p["question"], "answer": str(p["answer"])}) for p in held),
    }
    paths = {}
    for name, text in files.items():
        paths[name] = out / f"{name}.jsonl"
        write_text_atomic(paths[name], text)
    return paths
