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
also learns when not to call. Every record offers the built-in tools (the
calculator and the clock), as a chat with `--tools builtin` does.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable, Sequence

from nanolm.errors import UserError
from nanolm.io import write_bytes_atomic

# (question template, expression template): {a}, {b}, {c} are random numbers.
_QUESTIONS_ZH: list[tuple[str, str]] = [
    ("{a} 加 {b} 等于多少？", "{a} + {b}"),
    ("{a} 减去 {b} 是多少？", "{a} - {b}"),
    ("{a} 乘以 {b} 等于几？", "{a} * {b}"),
    ("{a} 除以 {b} 是多少？", "{a} / {b}"),
    ("一箱苹果有 {a} 个，{b} 箱一共有多少个？", "{a} * {b}"),
    ("小明有 {a} 元，花了 {b} 元，还剩多少钱？", "{a} - {b}"),
    ("{a} 个人平分 {c} 元，每人分到多少？", "{c} / {a}"),
    ("帮我算一下 ({a} + {b}) * {c}", "({a} + {b}) * {c}"),
    ("{a} 的平方是多少？", "{a} ** 2"),
    ("{c} 的平方根是多少？", "sqrt({c})"),
    ("计算 {a} * {b} + {c}", "{a} * {b} + {c}"),
]
_QUESTIONS_EN: list[tuple[str, str]] = [
    ("What is {a} plus {b}?", "{a} + {b}"),
    ("What is {a} minus {b}?", "{a} - {b}"),
    ("What is {a} times {b}?", "{a} * {b}"),
    ("What is {c} divided by {a}?", "{c} / {a}"),
    ("A box holds {a} eggs. How many eggs are in {b} boxes?", "{a} * {b}"),
    ("I had {a} dollars and spent {b}. How much is left?", "{a} - {b}"),
    ("Split {c} dollars among {a} people: how much does each get?", "{c} / {a}"),
    ("Compute ({a} + {b}) * {c}.", "({a} + {b}) * {c}"),
    ("What is {a} squared?", "{a} ** 2"),
    ("What is the square root of {c}?", "sqrt({c})"),
    ("Calculate {a} * {b} - {c}.", "{a} * {b} - {c}"),
]
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


def build_calculator_conversations(out: Path, n: int, seed: int = 0, *, calculator: Callable[[dict], str],
                                   tools: Sequence[dict]) -> Path:
    """Write n tool-use conversations to `out` (.jsonl, OpenAI `{"messages": [...], "tools": [...]}` records)
    and return it. The same n and seed always give the same file. calculator: `{"expression": ...}` -> the
    result text that the tool turn holds and the reply quotes; tools: the tool objects every record offers
    (the calculator's among them)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UserError(f"n={n!r}: must be a positive integer (the number of conversations)")
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        zh = rng.random() < 0.5
        if rng.random() < DIRECT_SHARE:
            q, a = rng.choice([d for d in _DIRECT if (ord(d[0][0]) > 127) == zh] or _DIRECT)
            messages = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        else:
            question, expr = rng.choice(_QUESTIONS_ZH if zh else _QUESTIONS_EN)
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            nums = {"a": a, "b": b, "c": a * rng.randint(2, 30) if "/" in expr else rng.randint(2, 999)}
            if "sqrt" in expr:
                nums["c"] = rng.randint(2, 40) ** 2 if rng.random() < 0.7 else rng.randint(2, 999)
            expression = expr.format(**nums)
            result = calculator({"expression": expression})
            if result.startswith("error"):
                raise AssertionError(f"the calculator could not answer {expression!r}: {result}")
            reply = rng.choice(_REPLIES_ZH if zh else _REPLIES_EN).format(expr=expression, result=result)
            call = {"type": "function", "function": {"name": "calculator",
                                                     "arguments": json.dumps({"expression": expression})}}
            messages = [{"role": "user", "content": question.format(**nums)},
                        {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "content": result},
                        {"role": "assistant", "content": reply}]
        lines.append(json.dumps({"messages": messages, "tools": list(tools)}, ensure_ascii=False) + "\n")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(out, "".join(lines).encode("utf-8"))
    return out
