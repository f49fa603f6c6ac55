"""A built-in tool-use set: arithmetic questions answered through the calculator, for SFT, docs and the quickstart.

`build_calculator_conversations` writes conversations in which the assistant
calls the built-in `calculator`, the calculator's own result comes back as the
tool turn, and the reply quotes that result: no answer is written by hand, each
is computed by running the call the conversation makes. The calculator and the
tools offered are given by the caller (`nanolm.infer.tools.calculator` and
`BUILTIN_TOOLS`, which the chat runs), so this data module imports nothing
from the inference layer above it.
Questions are arithmetic word problems and bare expressions, in Chinese and
English, over random numbers (sums, differences, products, quotients, powers,
square roots, mixed expressions with parentheses); a share of conversations
ask something that needs no tool and are answered directly, so that a model
also learns when not to call. Each record offers one to three tools, in a
random order: the calculator (always, where it is called), and some of the
other tools given and a few compact ones that are offered but never called
(`OTHER_TOOLS`), so the model learns to pick the calculator by its name and
most of each record's tokens are the exchange, not the tool list.

`calculator_prompts` writes prompts for reinforcement learning with the calculator in the loop (a question
and the calculator's result as the reference answer) in phrasings of their own (`RL_ZH`, `RL_EN`), which
neither the conversations nor the benchmark use. `calc_items` makes the built-in `calc` benchmark's
questions: other phrasings (`HELDOUT_ZH`, `HELDOUT_EN`, never used here for training or RL) over number pairs
that `nanolm.corpora.holdout.numbers_held_out` keeps out of every conversation and prompt this module writes.
`calc2_items` makes the `calc2` benchmark's: two operations each (`HELDOUT2_ZH`, `HELDOUT2_EN`), over number
triples held out the same way.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from nanolm.chat import render_chat
from nanolm.corpora.holdout import numbers_held_out
from nanolm.errors import UserError
from nanolm.io import write_bytes_atomic

# (question template, expression template): {a}, {b}, {c} are random numbers.
_QUESTIONS_ZH: list[tuple[str, str]] = [
    ("{a} 加 {b} 等于多少？", "{a} + {b}"),
    ("{a} 加 {b} 是多少？", "{a} + {b}"),
    ("求 {a} 与 {b} 的和。", "{a} + {b}"),
    ("{a} + {b} 等于几？", "{a} + {b}"),
    ("{a} 和 {b} 加起来是多少？", "{a} + {b}"),
    ("把 {a} 跟 {b} 相加，结果是几？", "{a} + {b}"),
    ("{a} 再加上 {b}，一共多少？", "{a} + {b}"),
    ("{a} 减去 {b} 是多少？", "{a} - {b}"),
    ("{a} 减 {b} 得多少？", "{a} - {b}"),
    ("小明有 {a} 元，花了 {b} 元，还剩多少钱？", "{a} - {b}"),
    ("{a} - {b} 等于几？", "{a} - {b}"),
    ("{a} 减掉 {b} 等于几？", "{a} - {b}"),
    ("从 {a} 中拿走 {b}，还有几个？", "{a} - {b}"),
    ("{a} 比 {b} 多多少？", "{a} - {b}"),
    ("{a} 乘以 {b} 等于几？", "{a} * {b}"),
    ("{a} 乘 {b} 是多少？", "{a} * {b}"),
    ("求 {a} 与 {b} 的积。", "{a} * {b}"),
    ("一箱苹果有 {a} 个，{b} 箱一共有多少个？", "{a} * {b}"),
    ("{a} 乘上 {b} 得几？", "{a} * {b}"),
    ("{b} 倍的 {a} 等于几？", "{a} * {b}"),
    ("两数相乘：{a} 和 {b}，积是多少？", "{a} * {b}"),
    ("{a} 除以 {b} 是多少？", "{a} / {b}"),
    ("{a} 个人平分 {c} 元，每人分到多少？", "{c} / {a}"),
    ("{c} 个苹果平均分成 {a} 份，每份几个？", "{c} / {a}"),
    ("{c} 除以 {a} 等于几？", "{c} / {a}"),
    ("帮我算一下 ({a} + {b}) * {c}", "({a} + {b}) * {c}"),
    ("{a} 的平方是多少？", "{a} ** 2"),
    ("{c} 的平方根是多少？", "sqrt({c})"),
    ("计算 {a} * {b} + {c}", "{a} * {b} + {c}"),
]
_QUESTIONS_EN: list[tuple[str, str]] = [
    ("What is {a} plus {b}?", "{a} + {b}"),
    ("What is the sum of {a} and {b}?", "{a} + {b}"),
    ("How much is {a} + {b}?", "{a} + {b}"),
    ("If I add {b} apples to {a} apples, how many do I have?", "{a} + {b}"),
    ("{a} plus {b} equals what?", "{a} + {b}"),
    ("Please add up {a} and {b}.", "{a} + {b}"),
    ("What is the total of {a} and {b}?", "{a} + {b}"),
    ("What is {a} minus {b}?", "{a} - {b}"),
    ("Subtract {b} from {a}.", "{a} - {b}"),
    ("I had {a} dollars and spent {b}. How much is left?", "{a} - {b}"),
    ("How much is {a} - {b}?", "{a} - {b}"),
    ("What is left if you take {b} from {a}?", "{a} - {b}"),
    ("Remove {b} from {a}: how many remain?", "{a} - {b}"),
    ("How much bigger is {a} than {b}?", "{a} - {b}"),
    ("What is {a} times {b}?", "{a} * {b}"),
    ("What is {a} multiplied by {b}?", "{a} * {b}"),
    ("What is the product {a} x {b}?", "{a} * {b}"),
    ("A box holds {a} eggs. How many eggs are in {b} boxes?", "{a} * {b}"),
    ("What do {a} and {b} multiply to?", "{a} * {b}"),
    ("Work out the product: {a} x {b}.", "{a} * {b}"),
    ("Please multiply {a} with {b}.", "{a} * {b}"),
    ("What product do {a} and {b} give?", "{a} * {b}"),
    ("What is {c} divided by {a}?", "{c} / {a}"),
    ("Split {c} dollars among {a} people: how much does each get?", "{c} / {a}"),
    ("{a} people split {c} dollars evenly. What is each share?", "{c} / {a}"),
    ("Divide {c} by {a}.", "{c} / {a}"),
    ("Compute ({a} + {b}) * {c}.", "({a} + {b}) * {c}"),
    ("What is {a} squared?", "{a} ** 2"),
    ("What is the square root of {c}?", "sqrt({c})"),
    ("Calculate {a} * {b} - {c}.", "{a} * {b} - {c}"),
]

# Frames x operator phrases: every frame is asked with every operator, so only the operator's words tell
# which one a question wants. With one operator per sentence shape (the lists above alone), a small model learns the
# shape: the quickstart's model answered "Multiply 11 by 67." with 11 / 67, the shape of "Divide {c} by {a}."
# No phrase below occurs in a `calc` benchmark phrasing (tested).
_FRAMES_EN = ("What is {x}?", "Can you work out {x}?", "Tell me {x}.")
_PHRASES_EN = (("{a} plus {b}", "{a} + {b}"), ("the sum of {a} and {b}", "{a} + {b}"),
               ("{a} minus {b}", "{a} - {b}"), ("the difference between {a} and {b}", "{a} - {b}"),
               ("{a} times {b}", "{a} * {b}"), ("{a} multiplied by {b}", "{a} * {b}"),
               ("{c} divided by {a}", "{c} / {a}"), ("{c} shared equally by {a}", "{c} / {a}"),
               # "the ... of {a} and {b}" for three operators, so that only the noun tells which; and an operand
               # order the sentence reverses ("{b} ... {a}" -> {a} - {b})
               ("the difference of {a} and {b}", "{a} - {b}"), ("the quotient of {c} and {a}", "{c} / {a}"),
               ("{b} less than {a}", "{a} - {b}"))
_COMMANDS_EN = ("{v}.", "Could you {v}?")  # {v}: a verb phrase, capitalised at the start
_VERBS_EN = (("add up {a} and {b}", "{a} + {b}"), ("sum {a} and {b}", "{a} + {b}"),
             ("subtract {b} from {a}", "{a} - {b}"), ("deduct {b} from {a}", "{a} - {b}"),
             ("multiply {a} with {b}", "{a} * {b}"), ("work out {a} times {b}", "{a} * {b}"),
             ("divide {c} by {a}", "{c} / {a}"), ("split {c} into {a} equal parts", "{c} / {a}"),
             ("remove {b} from {a}", "{a} - {b}"))
# The same in Chinese: "{a} 与 {b} 相乘得多少？" had been answered {a} + {b} by every model, the shape of the
# training set's "求 {a} 与 {b} 的和。"
_FRAMES_ZH = ("{x}等于多少？", "请帮我算算{x}。", "{x}的结果是什么？")
_PHRASES_ZH = (("{a} 加 {b}", "{a} + {b}"), ("{a} 跟 {b} 的总和", "{a} + {b}"),
               ("{a} 减 {b}", "{a} - {b}"), ("{a} 跟 {b} 的差", "{a} - {b}"),
               ("{a} 乘 {b}", "{a} * {b}"), ("{a} 跟 {b} 的乘积", "{a} * {b}"),
               ("{c} 除以 {a}", "{c} / {a}"), ("{c} 被 {a} 除", "{c} / {a}"))
_COMMANDS_ZH = ("请{v}。", "你能{v}吗？")
_VERBS_ZH = (("把 {a} 和 {b} 相加", "{a} + {b}"), ("算出 {a} 加 {b} 的和", "{a} + {b}"),
             ("用 {a} 减去 {b}", "{a} - {b}"), ("从 {a} 中去掉 {b}", "{a} - {b}"),
             ("把 {a} 和 {b} 相乘", "{a} * {b}"), ("算出 {a} 乘 {b} 的积", "{a} * {b}"),
             ("用 {c} 除以 {a}", "{c} / {a}"), ("把 {c} 平分成 {a} 份", "{c} / {a}"))


def _composed(frames: Sequence[str], phrases: Sequence[tuple[str, str]], key: str) -> list[tuple[str, str]]:
    """Every frame with every phrase: (question template, expression template); a frame's phrase that starts the
    sentence is capitalised."""
    out = []
    for frame in frames:
        for phrase, expr in phrases:
            text = frame.replace("{" + key + "}", phrase)
            out.append((text[:1].upper() + text[1:] if frame.startswith("{") else text, expr))
    return out


_QUESTIONS_EN = list(dict.fromkeys(_QUESTIONS_EN + _composed(_FRAMES_EN, _PHRASES_EN, "x")
                                   + _composed(_COMMANDS_EN, _VERBS_EN, "v")))
_QUESTIONS_ZH = list(dict.fromkeys(_QUESTIONS_ZH + _composed(_FRAMES_ZH, _PHRASES_ZH, "x")
                                   + _composed(_COMMANDS_ZH, _VERBS_ZH, "v")))
_REPLIES_ZH = ["{expr} 的结果是 {result}。", "算出来是 {result}。", "答案是 {result}。"]
_REPLIES_EN = ["{expr} = {result}.", "The answer is {result}.", "It comes to {result}."]
# Questions that need no tool, answered directly.
_DIRECT: list[tuple[str, str]] = [
    ("你好", "你好！有什么可以帮你的吗？需要计算的话，我可以用计算器。"),
    ("你是谁？", "我是一个小小的语言模型，会用计算器帮你算数。"),
    ("谢谢", "不客气！"),
    ("Hello", "Hello! Ask me anything; for arithmetic I use the calculator."),
    ("Who are you?", "A small language model that can use a calculator."),
    ("Thanks!", "You're welcome!"),
]
DIRECT_SHARE = 0.15


def _tool(name: str, description: str, **params: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {k: {"type": v} for k, v in params.items()}, "required": list(params)}}}


# Offered beside the calculator in some records, never called: the model learns to pick a tool by its name.
OTHER_TOOLS: tuple[dict, ...] = (
    _tool("get_weather", "Weather in a city.", city="string"),
    _tool("web_search", "Search the web.", query="string"),
    _tool("translate", "Translate text.", text="string", to="string"),
)

# The `calc` benchmark's phrasings: none of them is a training template above (tested).
HELDOUT_ZH: list[tuple[str, str]] = [
    ("{a} 和 {b} 的和是多少？", "{a} + {b}"),
    ("从 {a} 里减掉 {b}，剩下多少？", "{a} - {b}"),
    ("{a} 与 {b} 相乘得多少？", "{a} * {b}"),
    ("把 {c} 本书平均分给 {b} 个同学，每人几本？", "{c} / {b}"),
    ("请问 {a} 加上 {b} 得几？", "{a} + {b}"),
    ("{a} 的 {b} 倍是多少？", "{a} * {b}"),
]
HELDOUT_EN: list[tuple[str, str]] = [
    ("Add {a} and {b}.", "{a} + {b}"),
    ("Take {b} away from {a}. What remains?", "{a} - {b}"),
    ("Multiply {a} by {b}.", "{a} * {b}"),
    ("If {b} friends share {c} marbles equally, how many does each get?", "{c} / {b}"),
    ("What do you get when you add {b} to {a}?", "{a} + {b}"),
    ("Find the product of {a} and {b}.", "{a} * {b}"),
]
# Phrasings of their own for reinforcement-learning prompts (`calculator_prompts`): neither a template of the
# tool-use set above nor a `calc` benchmark phrasing, and no operator phrase of theirs inside a benchmark phrasing
# (tested), so that RL meets questions the fine-tuned model has never been taught to read, as the
# benchmark's are, and its rewards, not fine-tuning, decide what it calls. Word problems, each its own sentence,
# and frames x operator phrases (every frame with every operator, some phrases naming their operands in the
# reverse order: "{b} more than {a}"), where only the operator's words tell which call is right.
_RL_SENTENCES_ZH: list[tuple[str, str]] = [
    ("篮子里有 {a} 个鸡蛋，又放进 {b} 个，现在一共几个？", "{a} + {b}"),
    ("把 {b} 加到 {a} 上，得到几？", "{a} + {b}"),
    ("书架上有 {a} 本书，借走了 {b} 本，还剩几本？", "{a} - {b}"),
    ("{a} 比 {b} 大多少？", "{a} - {b}"),
    ("每盒有 {a} 支笔，{b} 盒共有几支？", "{a} * {b}"),
    ("{a} 行座位，每行 {b} 个，一共多少个座位？", "{a} * {b}"),
    ("{c} 米长的绳子，每段 {a} 米，能剪成几段？", "{c} / {a}"),
    ("{c} 里面有几个 {a}？", "{c} / {a}"),
]
_RL_SENTENCES_EN: list[tuple[str, str]] = [
    ("I have {a} stickers and get {b} more. How many do I have now?", "{a} + {b}"),
    ("Combine {a} with {b}: what is the result?", "{a} + {b}"),
    ("A tank holds {a} liters and {b} leak out. How many liters are left?", "{a} - {b}"),
    ("By how much does {a} exceed {b}?", "{a} - {b}"),
    ("Each of {a} bags holds {b} coins. How many coins are there in all?", "{a} * {b}"),
    ("There are {a} rows of {b} chairs. How many chairs is that?", "{a} * {b}"),
    ("{c} cookies are packed {a} to a box. How many boxes are needed?", "{c} / {a}"),
    ("How many times does {a} go into {c}?", "{c} / {a}"),
]
_RL_FRAMES_EN = ("I need {x}.", "Help me figure out {x}.", "Do you know {x}?")
_RL_PHRASES_EN = (("{a} increased by {b}", "{a} + {b}"), ("the total of {a} and {b}", "{a} + {b}"),
                  ("{b} more than {a}", "{a} + {b}"),
                  ("{a} decreased by {b}", "{a} - {b}"), ("{a} reduced by {b}", "{a} - {b}"),
                  ("{b} fewer than {a}", "{a} - {b}"),
                  ("{a} groups of {b}", "{a} * {b}"), ("{a} lots of {b}", "{a} * {b}"),
                  ("{a} scaled by {b}", "{a} * {b}"),
                  ("{c} over {a}", "{c} / {a}"), ("{c} shared among {a}", "{c} / {a}"),
                  ("how many {a}s fit in {c}", "{c} / {a}"))
_RL_FRAMES_ZH = ("{x}是多少？", "我想知道{x}。", "麻烦算一下{x}。")
_RL_PHRASES_ZH = (("{a} 增加 {b} 后的数", "{a} + {b}"), ("{a} 与 {b} 的合计", "{a} + {b}"),
                  ("比 {a} 多 {b} 的数", "{a} + {b}"),
                  ("{a} 扣掉 {b} 后的数", "{a} - {b}"), ("{a} 和 {b} 的差", "{a} - {b}"),
                  ("比 {a} 少 {b} 的数", "{a} - {b}"),
                  ("{a} 个 {b} 相加的和", "{a} * {b}"), ("{a} 和 {b} 的乘积", "{a} * {b}"),
                  ("{a} 组、每组 {b} 个的总数", "{a} * {b}"),
                  ("{c} 被 {a} 平分后的每份", "{c} / {a}"), ("{a} 去除 {c} 的商", "{c} / {a}"),
                  ("{c} 分成 {a} 等份的一份", "{c} / {a}"))
RL_ZH: list[tuple[str, str]] = _RL_SENTENCES_ZH + _composed(_RL_FRAMES_ZH, _RL_PHRASES_ZH, "x")
RL_EN: list[tuple[str, str]] = _RL_SENTENCES_EN + _composed(_RL_FRAMES_EN, _RL_PHRASES_EN, "x")
_OPERANDS = re.compile(r"\d+")


def operands(expression: str) -> tuple[int, ...]:
    """The numbers of an expression, in order ("(12 + 5) * 3" -> (12, 5, 3)): what the held-out rule hashes."""
    return tuple(int(x) for x in _OPERANDS.findall(expression))


@dataclass(frozen=True)
class CalcItem:
    """A `calc` benchmark question: the expression a right call computes and the calculator's result for it."""

    question: str
    expression: str
    answer: str
    where: str = ""
    phrasing: str = ""  # the question's template (HELDOUT_ZH / HELDOUT_EN), for results by phrasing


def _check_count(n: int, what: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UserError(f"n={n!r}: must be a positive integer (the number of {what})")


def _computed(calculator: Callable[[dict], str], expression: str) -> str:
    """The calculator's result for an expression this module wrote (never an error: that would be a bug here)."""
    result = calculator({"expression": expression})
    if result.startswith("error"):
        raise AssertionError(f"the calculator could not answer {expression!r}: {result}")
    return result


def _write_lines(out: Path, lines: list[str]) -> Path:
    """Write JSONL lines to `out` atomically (its folder made if missing) and return it as a Path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(out, "".join(lines).encode("utf-8"))
    return out


def _offered(rng: random.Random, tools: Sequence[dict], needs: dict | None) -> list[dict]:
    """One to three tools in a random order: `needs` (the tool the conversation calls) and others."""
    calc_name = needs["function"]["name"] if needs else None
    others = [t for t in (*tools, *OTHER_TOOLS) if t["function"]["name"] != calc_name]
    k = rng.randint(0 if needs else 1, 2)
    chosen = ([needs] if needs else []) + rng.sample(others, min(k, len(others)))
    rng.shuffle(chosen)
    return chosen


def _conversations(n: int, seed: int, calculator: Callable[[dict], str], tools: Sequence[dict]):
    """n (messages, offered tools) of the tool-use set, as `build_calculator_conversations` documents them."""
    _check_count(n, "conversations")
    calc_tool = next((t for t in tools if t["function"]["name"] == "calculator"), None)
    if calc_tool is None:
        raise UserError("build_calculator_conversations: the tools given hold no `calculator`; pass the built-in "
                        "tools (nanolm.infer.tools.BUILTIN_TOOLS)")
    rng = random.Random(seed)
    made = 0
    while made < n:
        zh = rng.random() < 0.5
        if rng.random() < DIRECT_SHARE:
            q, a = rng.choice([d for d in _DIRECT if (ord(d[0][0]) > 127) == zh] or _DIRECT)
            messages = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            offered = _offered(rng, tools, None)
        else:
            question, expr = rng.choice(_QUESTIONS_ZH if zh else _QUESTIONS_EN)
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            nums = {"a": a, "b": b, "c": a * rng.randint(2, 30) if "/" in expr else rng.randint(2, 999)}
            if "sqrt" in expr:
                nums["c"] = rng.randint(2, 40) ** 2 if rng.random() < 0.7 else rng.randint(2, 999)
            expression = expr.format(**nums)
            if numbers_held_out("calc", *operands(expression)):
                continue  # the calc benchmark's numbers
            result = _computed(calculator, expression)
            reply = rng.choice(_REPLIES_ZH if zh else _REPLIES_EN).format(expr=expression, result=result)
            call = {"type": "function", "function": {"name": "calculator",
                                                     "arguments": json.dumps({"expression": expression})}}
            messages = [{"role": "user", "content": question.format(**nums)},
                        {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "content": result},
                        {"role": "assistant", "content": reply}]
            offered = _offered(rng, tools, calc_tool)
        made += 1
        yield messages, offered


def build_calculator_conversations(out: Path, n: int, seed: int = 0, *, calculator: Callable[[dict], str],
                                   tools: Sequence[dict]) -> Path:
    """Write n tool-use conversations to `out` (.jsonl, OpenAI `{"messages": [...], "tools": [...]}` records)
    and return it. The same n and seed always give the same file. calculator: `{"expression": ...}` -> the
    result text that the tool turn holds and the reply quotes; tools: the tool objects a record may offer
    (the calculator's among them; each record offers one to three, see the module doc)."""
    lines = [json.dumps({"messages": m, "tools": t}, ensure_ascii=False) + "\n"
             for m, t in _conversations(n, seed, calculator, tools)]
    return _write_lines(out, lines)


def build_tool_drill(out: Path, n: int, seed: int = 1, *, calculator: Callable[[dict], str],
                     tools: Sequence[dict]) -> Path:
    """Write n conversations of the tool-use set as pretraining text (.jsonl `{"text": ...}` records): each
    rendered in the chat layout of nanolm's tokenizers (`chat.render_chat`, Qwen3's), without its tool list,
    and return `out`.

    A model copies numbers from its context (the question's into the call, the tool's result into the reply)
    only after it has seen many examples where copying pays: about a million tokens of them for the `tiny`
    model (measured: teacher-forced call digits right 12% after 0.6 M drill tokens, 97% after 3 M). Without the
    system turn a conversation is about 80 tokens, so a pretraining mixture holds many of them per step, where
    the fine-tuning set, each record with its tool list, holds a few. The numbers obey the same held-out rule.
    """
    lines = [json.dumps({"text": render_chat(m)}, ensure_ascii=False) + "\n"
             for m, _ in _conversations(n, seed, calculator, tools)]
    return _write_lines(out, lines)


def calculator_prompts(out: Path, n: int, seed: int = 0, *, calculator: Callable[[dict], str]) -> Path:
    """Write n reinforcement-learning prompts for the calculator to `out` (.jsonl `{"prompt": question,
    "answer": result}` records, `nanolm prepare --format prompts` reads them) and return it: half Chinese and half
    English (alternating), each a question in a phrasing of `RL_ZH` / `RL_EN` (phrasings that neither the
    tool-use set nor the `calc` benchmark uses) over numbers the held-out rule leaves to training, its answer the
    calculator's result for the question's expression. A difference is never negative and a quotient is whole.
    The same n and seed give the same file."""
    _check_count(n, "prompts")
    rng = random.Random(seed)
    lines: list[str] = []
    while len(lines) < n:
        question, expr = rng.choice(RL_ZH if len(lines) % 2 == 0 else RL_EN)
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        if "-" in expr:
            a, b = max(a, b), min(a, b)
        nums = {"a": a, "b": b, "c": a * rng.randint(2, 30)}
        expression = expr.format(**nums)
        if numbers_held_out("calc", *operands(expression)):
            continue  # the calc benchmark's numbers
        answer = _computed(calculator, expression)
        lines.append(json.dumps({"prompt": question.format(**nums), "answer": answer}, ensure_ascii=False) + "\n")
    return _write_lines(out, lines)


# Reinforcement-learning prompts that need two operations, in phrasings of their own: none is a `calc2`
# benchmark phrasing, a tool-use or one-operation RL phrasing (tested).
RL2_ZH: list[tuple[str, str]] = [
    ("{a} 加上 {b}，然后整体乘以 {c}，是多少？", "({a} + {b}) * {c}"),
    ("从 {a} 里去掉 {b}，剩下的乘 {c} 等于几？", "({a} - {b}) * {c}"),
    ("{a} 乘 {b} 之后再加 {c}，一共多少？", "{a} * {b} + {c}"),
    ("{a} 乘 {b} 的结果再减掉 {c}，剩多少？", "{a} * {b} - {c}"),
    ("书架上层 {a} 本、下层 {b} 本，每本 {c} 元，总价多少元？", "({a} + {b}) * {c}"),
    ("{a} 和 {b} 合在一起，再平均分给 {c} 个人，每人几个？", "({a} + {b}) / {c}"),
]
RL2_EN: list[tuple[str, str]] = [
    ("What do you get if you add {a} to {b} and then multiply by {c}?", "({a} + {b}) * {c}"),
    ("Subtract {b} from {a}, then multiply that by {c}. What is it?", "({a} - {b}) * {c}"),
    ("Work out {a} times {b}, plus {c}.", "{a} * {b} + {c}"),
    ("Find {a} times {b}, minus {c}.", "{a} * {b} - {c}"),
    ("A shop sold {a} pens in the morning and {b} in the afternoon at {c} dollars each. How much money?",
     "({a} + {b}) * {c}"),
    ("Put {a} and {b} together and split them evenly into {c} groups. How many per group?", "({a} + {b}) / {c}"),
]


def _two_step_numbers(rng: random.Random, expr: str) -> dict[str, int] | None:
    """The numbers of a two-operation phrasing's expression, drawn as `calc2_items` and `calculator_prompts2`
    draw them: a and b from 21 to 99 (a > b in a difference), c from 2 to 9 where it multiplies or divides (10 to
    99 where it is added or subtracted); None where a == b or a quotient would not be whole."""
    a, b = rng.randint(21, 99), rng.randint(21, 99)
    if "{a} - {b}" in expr:
        a, b = max(a, b), min(a, b)
    c = rng.randint(2, 9) if "* {c}" in expr or "/ {c}" in expr else rng.randint(10, 99)
    if a == b or ("/ {c}" in expr and (a + b) % c):
        return None
    return {"a": a, "b": b, "c": c}


def calculator_prompts2(out: Path, n: int, seed: int = 0, *, calculator: Callable[[dict], str]) -> Path:
    """Write n reinforcement-learning prompts that need two operations (`RL2_ZH` / `RL2_EN`, alternating) to
    `out`, as `calculator_prompts` writes its prompts: a and b from 21 to 99 and c as `calc2_items` draws them,
    over numbers the held-out rule leaves to training (neither the pair nor the triple held out, so no `calc`
    or `calc2` item's numbers). The same n and seed give the same file."""
    _check_count(n, "prompts")
    rng = random.Random(seed)
    lines: list[str] = []
    while len(lines) < n:
        question, expr = rng.choice(RL2_ZH if len(lines) % 2 == 0 else RL2_EN)
        nums = _two_step_numbers(rng, expr)
        if nums is None or numbers_held_out("calc", nums["a"], nums["b"]) \
                or numbers_held_out("calc", nums["a"], nums["b"], nums["c"]):
            continue
        answer = _computed(calculator, expr.format(**nums))
        lines.append(json.dumps({"prompt": question.format(**nums), "answer": answer}, ensure_ascii=False) + "\n")
    return _write_lines(out, lines)


def calc_items(n: int, seed: int = 0, *, calculator: Callable[[dict], str]) -> list[CalcItem]:
    """n `calc` benchmark questions, half Chinese and half English (alternating): a held-out phrasing over two
    two-digit numbers whose pair is held out (a quotient's dividend a multiple of its divisor, so that the result
    is whole), each with the calculator's result for its expression. The same n and seed give the same items."""
    rng = random.Random(seed)
    items: list[CalcItem] = []
    seen: set[str] = set()
    while len(items) < n:
        zh = len(items) % 2 == 0
        question, expr = rng.choice(HELDOUT_ZH if zh else HELDOUT_EN)
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if "-" in expr:
            a, b = max(a, b), min(a, b)
        nums = {"a": a, "b": b, "c": b * rng.randint(2, 9)}
        expression = expr.format(**nums)
        text = question.format(**nums)
        if text in seen or not numbers_held_out("calc", *operands(expression)):
            continue
        seen.add(text)
        items.append(CalcItem(text, expression, calculator({"expression": expression}), f"calc:{len(items)}",
                              question))
    return items


# The `calc2` benchmark's phrasings: two operations each (a compound expression, or two calls one after the
# other), none a template of the tool-use set, its RL prompts, the `calc` benchmark or the arithmetic task (tested).
HELDOUT2_ZH: list[tuple[str, str]] = [
    ("先把 {a} 和 {b} 加起来，再乘以 {c}，得多少？", "({a} + {b}) * {c}"),
    ("{a} 减去 {b} 的差再乘 {c} 是多少？", "({a} - {b}) * {c}"),
    ("{a} 与 {b} 的积再加上 {c}，结果是几？", "{a} * {b} + {c}"),
    ("{a} 与 {b} 的积减去 {c} 是多少？", "{a} * {b} - {c}"),
    ("一班有 {a} 人，二班有 {b} 人，每人发 {c} 支笔，一共要几支笔？", "({a} + {b}) * {c}"),
    ("把 {a} 加 {b} 的和平均分成 {c} 份，每份是多少？", "({a} + {b}) / {c}"),
]
HELDOUT2_EN: list[tuple[str, str]] = [
    ("Add {a} and {b}, then multiply the result by {c}.", "({a} + {b}) * {c}"),
    ("Take {b} from {a} and multiply what is left by {c}.", "({a} - {b}) * {c}"),
    ("Multiply {a} by {b} and then add {c} to the product.", "{a} * {b} + {c}"),
    ("What is {c} less than the product of {a} and {b}?", "{a} * {b} - {c}"),
    ("{a} guests came, then {b} more, and each brought {c} flowers. How many flowers in all?", "({a} + {b}) * {c}"),
    ("Sum {a} and {b}, then divide the total by {c}.", "({a} + {b}) / {c}"),
]


def calc2_items(n: int, seed: int = 0, *, calculator: Callable[[dict], str]) -> list[CalcItem]:
    """n `calc2` benchmark questions, half Chinese and half English (alternating): a phrasing of HELDOUT2_ZH /
    HELDOUT2_EN over a and b from 21 to 99 (above every number the arithmetic task writes; a > b in a
    difference) and c (2 to 9 where it multiplies or divides, the sum then a multiple of it; 10 to 99 where it
    is added or subtracted), whose (a, b) and (a, b, c) are both held out (`numbers_held_out("calc", ...)`, so
    neither the tool-use set, its drill nor its RL prompts write them, nor the first step's pair), each with the
    calculator's result for its expression. The same n and seed give the same items."""
    _check_count(n, "questions")
    rng = random.Random(seed)
    items: list[CalcItem] = []
    seen: set[str] = set()
    while len(items) < n:
        zh = len(items) % 2 == 0
        question, expr = rng.choice(HELDOUT2_ZH if zh else HELDOUT2_EN)
        nums = _two_step_numbers(rng, expr)
        if nums is None or not (numbers_held_out("calc", nums["a"], nums["b"])
                                and numbers_held_out("calc", nums["a"], nums["b"], nums["c"])):
            continue
        expression, text = expr.format(**nums), question.format(**nums)
        if text in seen:
            continue
        seen.add(text)
        items.append(CalcItem(text, expression, _computed(calculator, expression), f"calc2:{len(items)}", question))
    return items
