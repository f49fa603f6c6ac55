"""The built-in `calc` benchmark: arithmetic questions answered through the calculator, held out.

`nanolm eval RUN --task calc`: each item is a question in a phrasing the
built-in tool-use set never uses, over a number pair it never writes
(`nanolm.data.builtin.tooluse.calc_items`). The model is offered the built-in tools
(as `nanolm chat --tools builtin` offers them), replies greedily with its tool
call guided as in the chat, its calls are run, the results fed back as tool
turns, and it writes its answer. An item counts when a call's result is the
right number and the final reply states it. Chance is 0. Besides the
accuracy, the result says how often the model called the calculator at all
(`called`) and how often a call computed the right number (`computed`), so a
model that has learnt the format but not to copy the question's numbers shows
as such; `misses` counts each missed item by what went wrong first (`MISSES`),
and `by_phrasing` gives the accuracy of each held-out phrasing, which a model
tends to get all right or all wrong.

`nanolm eval RUN --task calc2` is the harder one: questions that need two
operations ("Add 23 and 45, then multiply the result by 3."), in phrasings and
over number triples no training path writes (`nanolm.data.builtin.tooluse.calc2_items`),
scored the same way with up to two rounds of calls (one compound expression, or
one call and then another on its result).

Items are scored in batches of rows (`scoring.generate_texts`), a round at a
time: the replies that call, then the replies to the tool results (which may
call again while rounds are left).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from nanolm.chat import Message, read_reply
from nanolm.data.builtin.tooluse import CalcItem, calc2_items, calc_items, operands
from nanolm.errors import UserError
from nanolm.eval.scoring import NUMBER, answers_match, generate_texts, summary
from nanolm.eval.tasks import Task

SEED = 0
DEFAULT_ITEMS = 200
ROUNDS = {"calc": 1, "calc2": 2}  # rounds of calls run per item, by task kind
# What went wrong with a missed item, the first that applies: no call at all; a call that computed the answer
# and a reply that does not state it; a call with exactly the question's numbers that computed something else
# (the wrong operation, or the operands in the wrong order); any other call (a number not the question's, one
# left out, an argument that is not an expression).
MISSES = ("no call", "misstated", "operation", "numbers")


def calc_task(n: int | None = None, seed: int = SEED) -> Task:
    """The `calc` task: its first n items (DEFAULT_ITEMS without n), half Chinese and half English."""
    from nanolm.infer.tools import calculator
    return Task("calc", "calc", calc_items(n or DEFAULT_ITEMS, seed, calculator=calculator), "built-in",
                "built-in held-out calculator questions")


def calc2_task(n: int | None = None, seed: int = SEED) -> Task:
    """The `calc2` task: its first n items (DEFAULT_ITEMS without n), half Chinese and half English."""
    from nanolm.infer.tools import calculator
    return Task("calc2", "calc2", calc2_items(n or DEFAULT_ITEMS, seed, calculator=calculator), "built-in",
                "built-in held-out two-operation calculator questions")


def states(reply: str, answer: str) -> bool:
    """Whether a reply states the answer as one of its numbers ("The answer is 1,088." states 1088)."""
    return any(answers_match(x.replace("$", ""), answer) for x in NUMBER.findall(reply))


def miss(question: str, calls: Sequence[str], computed: bool, correct: bool) -> str | None:
    """What went wrong with an item (one of MISSES), None when it counts. calls: each call's arguments (JSON)."""
    if correct:
        return None
    if not calls:
        return "no call"
    if computed:
        return "misstated"
    wanted = sorted(operands(question))
    for arguments in calls:
        try:
            expression = json.loads(arguments).get("expression")
        except (ValueError, AttributeError):
            continue
        if isinstance(expression, str) and sorted(operands(expression)) == wanted:
            return "operation"
    return "numbers"


def score_calc(engine: Any, tok: Any, items: Sequence[CalcItem], *, rows: int = 16,
               max_new_tokens: int = 64, temperature: float = 0.0, seed: int = 0,
               rounds: int = 1) -> dict[str, Any]:
    """Score `calc` (and `calc2`, rounds 2) items with greedy replies (or sampled at `temperature`, nothing else
    cut, item i of each round drawing with seed + i) through the chat template with the built-in tools offered.
    Returns {"kind": "calc", "n", "acc", "chance": 0, "centred", "stderr", "called", "computed", "misses",
    "by_phrasing", "items"}: misses, the missed items counted by MISSES; by_phrasing, {phrasing: {"n",
    "correct"}} over the items that carry their phrasing. rounds: how many replies' calls are run, each
    reply's results fed back before the next; the reply after the last round is final (its calls not run).
    An item's calls are those of every round; `called` counts the items whose first reply calls."""
    from nanolm.config.sampling import SamplingParams
    from nanolm.infer.bans import ReplyGuides
    from nanolm.infer.tools import Toolbox

    fmt = tok.chat_format
    if not fmt.tools:
        raise UserError(f"--task calc: the tokenizer {tok.path} carries the plain ChatML template, which has no "
                        "tools; score a model whose tokenizer was trained by this nanolm (`nanolm tokenizer train`)")
    box = Toolbox.from_specs(["builtin"])
    texts = box.texts()
    guide = ReplyGuides(tok, engine.model.config.vocab_size, engine.device).reply(box.tools, thinking=False)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=0, top_p=1.0,
                            seed=seed if temperature > 0 else None)
    stop_ids = (tok.im_end_id, tok.eot_id)

    def replies(conversations: list[list[Message]]) -> list[str]:
        prompts = [tok.encode(fmt.render(c, texts, add_generation_prompt=True, thinking=False))
                   for c in conversations]
        return generate_texts(engine, tok, prompts, params, stop_ids=stop_ids, rows=rows, guide=guide)

    talks = [[Message("user", it.question)] for it in items]
    results: list[list[str]] = [[] for _ in items]
    calls: list[list[str]] = [[] for _ in items]  # each call's arguments (JSON), every round
    finals: dict[int, str] = {}
    pending = list(range(len(items)))
    answered: list[int] = []
    for turn in range(rounds + 1):
        calling = []
        for i, text in zip(pending, replies([talks[i] for i in pending])):
            reply = read_reply(text, bare_calls=fmt.bare_calls)
            if not reply.tool_calls or turn == rounds:
                finals[i] = reply.content
                continue
            talks[i].append(reply)
            ran = [box.run(c) if box.can_run(c) else f"error: there is no tool named {c.name!r}"
                   for c in reply.tool_calls]
            results[i] += ran
            calls[i] += [c.arguments for c in reply.tool_calls]
            talks[i] += [Message("tool", r) for r in ran]
            calling.append(i)
        if turn == 0:
            answered = calling
        pending = calling
    per_item, correct = [], []
    for i, it in enumerate(items):
        computed = any(answers_match(r, it.answer) for r in results[i])
        final = finals[i]
        ok = computed and states(final, it.answer)
        correct.append(float(ok))
        per_item.append({"where": it.where, "question": it.question, "answer": it.answer, "calls": calls[i],
                         "results": results[i], "reply": final, "computed": computed, "correct": ok,
                         "miss": miss(it.question, calls[i], computed, ok), "phrasing": it.phrasing})
    s = summary(correct, 0.0)
    n = len(items)
    by_phrasing: dict[str, dict[str, int]] = {}
    for p in per_item:
        if p["phrasing"]:
            count = by_phrasing.setdefault(p["phrasing"], {"n": 0, "correct": 0})
            count["n"] += 1
            count["correct"] += p["correct"]
    return {"kind": "calc2" if rounds > 1 else "calc", "n": n, "acc": s["acc"], "chance": 0.0,
            "centred": s["centred"], "stderr": s["stderr"],
            "called": len(answered) / n, "computed": sum(p["computed"] for p in per_item) / n,
            "misses": {k: sum(p["miss"] == k for p in per_item) for k in MISSES}, "by_phrasing": by_phrasing,
            "items": per_item}


def format_misses(misses: dict[str, int]) -> str:
    """The missed items by kind, in MISSES' order: "no call 1, misstated 0, operation 9, numbers 7"."""
    return ", ".join(f"{k} {v}" for k, v in misses.items())


def format_calc(res: dict[str, Any]) -> str:
    """A `calc` result's misses and, where known, its accuracy by phrasing, as lines under the summary table."""
    lines = [f"calc: {res['n'] - sum(res['misses'].values())} of {res['n']} right; missed: "
             + format_misses(res["misses"])]
    for phrasing, c in res.get("by_phrasing", {}).items():
        lines.append(f"  {c['correct']:>3}/{c['n']:<3} {phrasing}")
    return "\n".join(lines)
