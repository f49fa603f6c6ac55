"""The built-in `everyday` benchmark: what fine-tuning did to a model's ordinary replies, on held-out prompts.

`nanolm eval RUN --task everyday`: the items are held-out conversations of
the built-in chat corpora (`nanolm.corpora.holdout`: chatterbot's by a hash
of the first question, idioms' by a hash of the idiom), which no training
path reads (`training_view`), less those whose first question asks for a
computation (`ASKS_COMPUTATION`). By default DEFAULT_ITEMS of them,
chatterbot's and idioms' in turn, each corpus's in an order drawn with a
fixed seed (chatterbot's are English and Chinese, idioms' Chinese).

Two scores, both better lower:

- `arith_or_call`: the share of items whose reply (greedy, through the chat
  template, no tools offered, the conversation's first user turn as the
  prompt, at most MAX_NEW_TOKENS) is arithmetic-shaped or writes a tool call
  (`off_topic`): an expression with its result (`ARITHMETIC`: "12 + 7 = 19",
  "3 × 4 =") or a GSM8K-style final answer ("#### 21"), or the tool-call tag
  `<tool_call>`. None of these prompts asks for a computation, so such a
  reply is what a fine-tuning mixture heavy in arithmetic costs. `arithmetic`
  and `calls` give the two shares apart.
- `reply_bpb`: the bits per byte of the corpus's own replies (every
  assistant turn of each item's conversation), teacher-forced, the loss on
  the replies only as SFT takes it (`nanolm.eval.loss.reply_bits`).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from nanolm.chat import Conversation, Message
from nanolm.errors import UserError
from nanolm.eval.tasks import Task

SEED = 0
DEFAULT_ITEMS = 48
MAX_NEW_TOKENS = 48
CORPORA = ("chatterbot", "idioms")  # the order items alternate in
# A reply that computes: an expression with its result, or a GSM8K-style final answer.
ARITHMETIC = re.compile(r"\d+\s*[-+*/×÷xX]\s*\d+\s*=|####\s*-?\d")
TOOL_CALL = "<tool_call>"
# A prompt that asks for a computation is no everyday prompt for this task: an expression, or a word that asks
# for arithmetic.
ASKS_COMPUTATION = re.compile(r"\d\s*[-+*/×÷xX=]\s*\d|\b(?:calculate|compute|plus|minus|times|divided by|"
                              r"multiplied by)\b|计算|等于|加上|减去|乘以|除以", re.I)


@dataclass(frozen=True)
class EverydayItem:
    """A held-out conversation: its first user turn is the prompt, its assistant turns the replies scored."""

    prompt: str
    messages: tuple[Message, ...]
    source: str  # the corpus: chatterbot or idioms
    where: str = ""  # file:line


def off_topic(reply: str) -> tuple[bool, bool]:
    """(arithmetic-shaped, writes a tool call) of a reply."""
    return bool(ARITHMETIC.search(reply)), TOOL_CALL in reply


def held_out_conversations(name: str, path: Path) -> list[EverydayItem]:
    """The held-out conversations of built-in chat corpus `name` cached at `path` that ask for no computation, in
    file order."""
    from nanolm.corpora.holdout import HOLDOUTS
    held_out = HOLDOUTS[name]
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip() or not held_out(line):
                continue
            turns = json.loads(line)["conversations"]
            messages = tuple(Message(t["role"], t["content"]) for t in turns)
            if messages[0].role != "user" or ASKS_COMPUTATION.search(messages[0].content):
                continue
            out.append(EverydayItem(messages[0].content, messages, name, f"{path}:{n}"))
    return out


def everyday_items(files: dict[str, Path], n: int | None = None, seed: int = SEED) -> list[EverydayItem]:
    """n items (DEFAULT_ITEMS without n): each corpus's held-out conversations
    (`files`: corpus name -> its cached file) shuffled by `seed`, then taken from the corpora in turn."""
    pools = []
    for name in CORPORA:
        if name in files:
            pool = held_out_conversations(name, files[name])
            random.Random(f"{seed}:{name}").shuffle(pool)
            pools.append(pool)
    items: list[EverydayItem] = []
    want = n or DEFAULT_ITEMS
    while len(items) < want and any(pools):
        for pool in pools:
            if pool and len(items) < want:
                items.append(pool.pop(0))
    if not items:
        raise UserError(f"{', '.join(map(str, files.values()))}: no held-out conversations; the everyday task needs "
                        "the built-in chat corpora (`nanolm data fetch chatterbot idioms`)")
    return items


def everyday_task(n: int | None = None, seed: int = SEED) -> Task:
    """The `everyday` task from the cached built-in chat corpora (fetched on first use)."""
    from nanolm.corpora import fetch
    files = {name: fetch(name, quiet=True) for name in CORPORA}
    return Task("everyday", "everyday", everyday_items(files, n, seed), "built-in",
                "built-in held-out everyday prompts", metric="arith_or_call")


def score_everyday(engine: Any, tok: Any, items: Sequence[EverydayItem], *, model: Any = None, rows: int = 16,
                   max_new_tokens: int = MAX_NEW_TOKENS, batch_size: int = 8) -> dict[str, Any]:
    """Score `everyday` items: greedy replies to each prompt by `engine` (batched rows, no tools offered) and
    the reply bits per byte under `model` (default the engine's). Returns {"kind": "everyday", "n",
    "metric": "arith_or_call", "arith_or_call", "arith_or_call_stderr", "arithmetic", "calls", "reply_bpb",
    "reply_tokens", "reply_bytes", "chance": 0, "higher_is_better": False, "items"}."""
    from nanolm.config.sampling import SamplingParams
    from nanolm.eval.loss import reply_bits
    from nanolm.eval.scoring import generate_texts, summary
    from nanolm.infer.bans import ReplyGuides

    fmt = tok.chat_format
    prompts = [tok.encode(fmt.render([Message("user", it.prompt)], add_generation_prompt=True, thinking=False))
               for it in items]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, top_k=0, top_p=1.0)
    no_tools = ReplyGuides(tok, engine.model.config.vocab_size, engine.device).reply()  # no call tag, as in chat
    replies = generate_texts(engine, tok, prompts, params, stop_ids=(tok.im_end_id, tok.eot_id), rows=rows,
                             guide=no_tools)
    flags = [off_topic(r) for r in replies]
    bits = reply_bits(model if model is not None else engine.model, tok,
                      [Conversation(it.messages) for it in items], batch_size=batch_size)
    s = summary([float(a or c) for a, c in flags], 0.0)
    n = len(items)
    return {"kind": "everyday", "n": n, "metric": "arith_or_call", "arith_or_call": s["acc"],
            "arith_or_call_stderr": s["stderr"], "arithmetic": sum(a for a, _ in flags) / n,
            "calls": sum(c for _, c in flags) / n, "reply_bpb": bits["bpb"], "reply_tokens": bits["tokens"],
            "reply_bytes": bits["bytes"], "chance": 0.0, "higher_is_better": False,
            "items": [{"where": it.where, "source": it.source, "prompt": it.prompt, "reply": r, "arithmetic": a,
                       "call": c} for it, r, (a, c) in zip(items, replies, flags)]}
