"""Scoring a model on benchmark items: multiple choice by log-likelihood, generative by extracted answers.

Multiple choice (`score_mc`): each choice is scored by the log-probability the
model gives its tokens after the prompt (k solved dev items first, for k-shot;
or the chat template's user turn and assistant header, for chat models). Two
picks per item, both reported:

- `acc`: the choice with the highest summed log-probability;
- `acc_norm`: the highest log-probability per character of the choice's
  text (without the delimiter before it), which is what lm-evaluation-harness
  computes for its acc_norm (`len()` of the choice string; its docs call it
  byte-length normalisation). A long right answer is not punished for its
  length; on Chinese text characters, not UTF-8 bytes, are the unit, as in
  lm-eval.
- `acc_mutual_info`: the highest log-probability after the prompt less the
  choice's own log-probability as a text of its own (after <|endoftext|>),
  as lm-evaluation-harness computes its acc_mutual_info: how much the prompt
  raises the choice, whatever the choice's own likelihood (a common word or a
  rare name). The score of tasks whose choices are texts as unlike as four
  passages of a book (`cloze`).

Accuracy is the mean of 0/1 correctness; `stderr` the standard error of that
mean (the sample standard deviation over sqrt(n), as lm-eval reports it);
`centred` the chance-centred accuracy (acc - c) / (1 - c), where c is the mean
of 1/k over the items (k choices each): 0 at chance, 1 when every answer is
right, negative below chance.

Generative (`score_gen`): greedy (or seeded, temperature > 0) replies from the
one batched engine (`nanolm/infer/engine.py`), cut at stop strings, the answer
extracted (GSM8K's `#### n`, else the last `\\boxed{...}`, else the last
number; text answers as they are) and compared numerically when both sides
are numbers, else as text (case and surrounding punctuation ignored).

Everything here works on token ids through a tokenizer-like object (`encode`,
`decode`, `eot_id`, `im_end_id`, `chat_format`), so tests drive it with a
model whose log-probabilities are known.
"""

from __future__ import annotations

import itertools
import math
import re
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Protocol, Sequence

import torch

from nanolm.chat import Message
from nanolm.eval.tasks import GenItem, MCItem
from nanolm.infer.bans import ReplyGuides
from nanolm.infer.engine import run_to_end
from nanolm.model.transformer import KVCache, Transformer


class TokenizerLike(Protocol):
    eot_id: int
    im_end_id: int
    chat_format: Any

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


# ----------------------------------------------------------------------------- log-likelihood of continuations

def encode_pair(tok: TokenizerLike, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-evaluation-harness cuts them: whitespace ending the context moves
    to the continuation, context + continuation is tokenized as one text, and the continuation is what follows
    the context's own token count, so it is scored as the model saw such text in training. An empty context
    is <|endoftext|> (the first token is predicted after it)."""
    n_space = len(context) - len(context.rstrip())
    if n_space:
        context, continuation = context[:-n_space], context[-n_space:] + continuation
    whole = tok.encode(context + continuation)
    n = len(tok.encode(context)) if context else 0
    ctx, cont = whole[:n], whole[n:]
    if not cont:
        raise ValueError(f"the continuation {continuation!r} adds no token after its context")
    return ctx or [tok.eot_id], cont


@torch.inference_mode()
def continuation_logprobs(model: torch.nn.Module, requests: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                          batch_size: int = 16, device: torch.device | str | None = None,
                          on_batch: Callable[[int], None] | None = None) -> list[tuple[float, bool]]:
    """For each (context ids, continuation ids): the summed log-probability of the continuation after the
    context, and whether each of its tokens is the model's greedy pick. A sequence longer than the model's
    context (model.config.max_seq_len + 1 tokens) loses its oldest context tokens.

    Rows are run longest first in batches of `batch_size`, padded on the right: under causal attention a
    row's positions never see its padding, so its scores do not depend on what it is batched with.
    Continuations that share a long context (a multiple-choice item's choices after a passage) run it once
    when the model is nanolm's causal Transformer: the context's keys and values are cached, and the
    continuations run after it together (`_shared_context`), so such an item of four choices costs one
    context, not four.
    """
    max_len = model.config.max_seq_len
    device = torch.device(device) if device is not None else next(model.parameters()).device
    seqs = []
    for ctx, cont in requests:
        if not cont:
            raise ValueError("a continuation of no tokens has no log-likelihood")
        if not ctx:
            raise ValueError("the context must hold at least one token (use <|endoftext|> for none)")
        full = [*ctx, *cont][-(max_len + 1):]
        n_cont = min(len(cont), len(full) - 1)
        seqs.append((full, n_cont))
    out: list[tuple[float, bool]] = [(0.0, False)] * len(seqs)
    alone = list(range(len(seqs)))
    if isinstance(model, Transformer) and model.config.causal:
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (ctx, cont) in enumerate(requests):
            if len(ctx) + len(cont) <= max_len + 1:  # uncut: the context is the same tokens for each
                groups.setdefault(tuple(ctx), []).append(i)
        # Worth it when the context is long beside its continuations: one pass of a context costs a forward of
        # its own, which a long one pays back (cloze: 184-token passages, four 50-token choices: 1.7x faster;
        # idioms' 12-token questions before 21-token choices ran about 2x slower shared).
        shared = [(ctx, ids) for ctx, ids in groups.items()
                  if (len(ids) - 1) * len(ctx) >= sum(len(requests[i][1]) for i in ids)]
        in_groups = {i for _, ids in shared for i in ids}
        alone = [i for i in alone if i not in in_groups]
        for ctx, ids in shared:
            conts = [list(requests[i][1]) for i in ids]
            for i, score in zip(ids, _shared_context(model, list(ctx), conts, batch_size, device)):
                out[i] = score
            if on_batch is not None:
                on_batch(len(ids))
    order = sorted(alone, key=lambda i: -len(seqs[i][0]))
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        width = max(len(seqs[i][0]) for i in rows) - 1
        x = torch.zeros(len(rows), width, dtype=torch.long)
        for r, i in enumerate(rows):
            full = seqs[i][0]
            x[r, :len(full) - 1] = torch.tensor(full[:-1])
        logits = model(x.to(device))  # (B, T, V)
        for r, i in enumerate(rows):
            full, n_cont = seqs[i]
            t = len(full) - 1  # input positions of this row
            target = torch.tensor(full[-n_cont:], device=device)
            out[i] = _picked(logits[r, t - n_cont:t], target)
        if on_batch is not None:
            on_batch(len(rows))
    return out


def _picked(logits: torch.Tensor, target: torch.Tensor) -> tuple[float, bool]:
    """logits (n, V) at the positions that predict target (n,) -> (summed log-probability, all greedy)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # only the positions that predict the continuation
    picked = logp.gather(-1, target[:, None]).squeeze(-1)
    return float(picked.double().sum()), bool((logp.argmax(-1) == target).all())


def _shared_context(model: Transformer, ctx: list[int], conts: list[list[int]], batch_size: int,
                    device: torch.device) -> list[tuple[float, bool]]:
    """The scores of continuations after one context: the context runs once, filling a KV cache whose
    last logits predict every continuation's first token; then the continuations (longest first, padded on
    the right) run in batches after copies of that cache, each position predicting the next token."""
    cache = KVCache.empty(model.config, 1, len(ctx) + max(len(c) for c in conts), device,
                          model.norm.weight.dtype)  # the residual stream's dtype
    first = model(torch.tensor([ctx], device=device), cache)[0, -1:]  # (1, V): predicts each first token
    out: list[tuple[float, bool]] = [(0.0, False)] * len(conts)
    order = sorted(range(len(conts)), key=lambda j: -len(conts[j]))
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        width = len(conts[rows[0]]) - 1  # tokens each row feeds: its continuation but the last
        logits = first.new_empty(len(rows), 0, first.shape[-1])
        if width > 0:
            x = torch.zeros(len(rows), width, dtype=torch.long)
            for r, j in enumerate(rows):
                x[r, :len(conts[j]) - 1] = torch.tensor(conts[j][:-1])
            rows_cache = KVCache([k.expand(len(rows), -1, -1, -1).clone() for k in cache.k],
                                 [v.expand(len(rows), -1, -1, -1).clone() for v in cache.v], pos=len(ctx))
            logits = model(x.to(device), rows_cache)  # (B, width, V)
        for r, j in enumerate(rows):
            cont = conts[j]
            out[j] = _picked(torch.cat([first, logits[r, :len(cont) - 1]]), torch.tensor(cont, device=device))
    return out


def rolling_requests(tokens: Sequence[int], max_len: int, eot_id: int) -> list[tuple[list[int], list[int]]]:
    """Requests that score every token of a text exactly once (lm-eval's loglikelihood_rolling): windows of
    up to max_len predicted tokens, the first after <|endoftext|>, each with the preceding text that fits the
    model's window as context (one token for a full window)."""
    full = [eot_id, *tokens]
    out = []
    for start in range(0, len(tokens), max_len):
        cont = full[start + 1:start + 1 + max_len]
        out.append((full[max(0, start + 1 - (max_len + 1 - len(cont))):start + 1], cont))
    return out


# ----------------------------------------------------------------------------- prompts

def chat_prompt(tok: TokenizerLike, turns: Sequence[tuple[str, str]], question: str) -> str:
    messages = []
    for q, a in turns:
        messages += [Message("user", q), Message("assistant", a)]
    messages.append(Message("user", question))
    return tok.chat_format.render(messages, add_generation_prompt=True)


def mc_strings(item: MCItem, shots: Sequence[MCItem] = (), chat: bool = False,
               tok: TokenizerLike | None = None) -> tuple[str, list[str]]:
    """(context, continuation per choice) of an item: plain text (shots, each solved, a blank line apart,
    then the prompt; each choice after the delimiter) or, with `chat`, the chat template (shots as earlier
    turns, the question as the user's turn; each choice as the assistant's reply)."""
    if chat:
        context = chat_prompt(tok, [(s.question, s.choices[s.answer]) for s in shots], item.question)
        return context, list(item.choices)
    solved = "".join(f"{s.prompt}{s.delimiter}{s.choices[s.answer]}\n\n" for s in shots)
    return solved + item.prompt, [item.delimiter + c for c in item.choices]


def gen_prompt(item: GenItem, shots: Sequence[GenItem] = (), chat: bool = False,
               tok: TokenizerLike | None = None) -> str:
    if chat:
        return chat_prompt(tok, [(s.question, s.solution) for s in shots], item.question)
    solved = "".join(f"{s.prompt} {s.solution}\n\n" for s in shots)
    return solved + item.prompt


# ----------------------------------------------------------------------------- multiple choice

def summary(correct: Sequence[float], chance: float) -> dict[str, float]:
    """acc, stderr and chance-centred accuracy of 0/1 correctness values."""
    n = len(correct)
    acc = sum(correct) / n
    var = sum((c - acc) ** 2 for c in correct) / (n - 1) if n > 1 else 0.0
    stderr = math.sqrt(var / n)
    return {"acc": acc, "stderr": stderr, "centred": (acc - chance) / (1 - chance) if chance < 1 else 0.0,
            "centred_stderr": stderr / (1 - chance) if chance < 1 else 0.0}


def score_mc(model: torch.nn.Module, tok: TokenizerLike, items: Sequence[MCItem], *,
             shots: Sequence[MCItem] = (), chat: bool = False, batch_size: int = 16,
             device: torch.device | str | None = None,
             on_batch: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Score multiple-choice items. Returns {"n", "acc", "acc_norm", "acc_mutual_info", "chance", "centred",
    "centred_norm", "centred_mutual_info", "stderr", "stderr_norm", "stderr_mutual_info", "items": [{"where",
    "answer", "pick", "pick_norm", "pick_mutual_info", "logprobs", "logprobs_alone", "chars"}]}."""
    requests, spans = [], []
    for item in items:
        context, conts = mc_strings(item, shots, chat, tok)
        spans.append((len(requests), conts))
        requests += [encode_pair(tok, context, c) for c in conts]
    alone = [encode_pair(tok, "", c) for item in items for c in item.choices]  # each choice as a text of its own
    scores = continuation_logprobs(model, requests + alone, batch_size=batch_size, device=device,
                                   on_batch=on_batch)
    per_item, correct = [], {"": [], "_norm": [], "_mutual_info": []}
    for item, (first, conts) in zip(items, spans):
        k = range(len(conts))
        lp = [scores[first + j][0] for j in k]
        lp_alone = [scores[len(requests) + first + j][0] for j in k]
        chars = [len(c) for c in item.choices]  # lm-eval's acc_norm: the choice's own length
        picks = {"": max(k, key=lambda j: (lp[j], -j)),  # the first of equal scores
                 "_norm": max(k, key=lambda j: (lp[j] / chars[j], -j)),
                 "_mutual_info": max(k, key=lambda j: (lp[j] - lp_alone[j], -j))}
        for key, pick in picks.items():
            correct[key].append(float(pick == item.answer))
        per_item.append({"where": item.where, "answer": item.answer, **{f"pick{key}": p for key, p in picks.items()},
                         "logprobs": lp, "logprobs_alone": lp_alone, "chars": chars})
    chance = sum(1 / len(it.choices) for it in items) / len(items)
    out: dict[str, Any] = {"kind": "mc", "n": len(items), "chance": chance}
    for key, values in correct.items():
        s = summary(values, chance)
        out |= {f"acc{key}": s["acc"], f"centred{key}": s["centred"], f"stderr{key}": s["stderr"]}
    return out | {"items": per_item}


# ----------------------------------------------------------------------------- generation

def generate_texts(engine: Any, tok: TokenizerLike, prompts: Sequence[Sequence[int]], params: Any, *,
                   stops: Sequence[str] = (), stop_ids: Sequence[int] = (), rows: int = 16,
                   guide: Any = None) -> list[str]:
    """The reply to each prompt (token ids), decoded by the engine's batched rows, `rows` at a time (a row that
    ends makes room for the next prompt), each cut before the first of `stops`. With a seed, prompt i draws
    with seed + i, so a reply does not depend on which prompts ran beside it. guide: a row guide
    (`infer/guide.py`) each row gets a fork of, a list of one per prompt, or None."""
    from dataclasses import replace

    batch = engine.batch()
    pending = iter(range(len(prompts)))
    index: dict[int, int] = {}  # row id -> prompt index
    texts: dict[int, str] = {}  # prompt index -> its reply, cut before a stop string
    limit = engine.max_seq_len - 1

    def refill(live: int) -> list[int]:
        added = []
        for i in itertools.islice(pending, max(rows - live, 0)):
            p = params if params.seed is None else replace(params, seed=params.seed + i)
            (row,) = batch.add(list(prompts[i])[-limit:], p, stop_ids,
                               guide=guide[i] if isinstance(guide, list) else guide)
            index[row] = i
            added.append(row)
        return added

    def until(row: int, tokens: list[int]) -> bool:
        text = tok.decode(tokens)
        cut = min((text.find(s) for s in stops if s in text), default=-1)
        if cut >= 0:
            texts[index[row]] = text[:cut]
        return cut >= 0

    replies = run_to_end(batch, refill=refill, until=until if stops else None)
    for row, reply in replies.items():
        texts.setdefault(index[row], tok.decode(reply.tokens))
    return [texts[i] for i in range(len(prompts))]


NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _boxed(text: str) -> str | None:
    """The content of the last \\boxed{...}, braces balanced; None when there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j].strip()
    return None


def extract_answer(text: str) -> str:
    """The answer in a reply: after GSM8K's `####`, else inside the last \\boxed{}, else the last number,
    else the reply's first line."""
    m = re.search(r"####\s*([^\n]*)", text)
    if m and m.group(1).strip():
        return m.group(1).strip()
    boxed = _boxed(text)
    if boxed is not None:
        return boxed
    numbers = NUMBER.findall(text)
    if numbers:
        return numbers[-1]
    return text.strip().split("\n")[0].strip()


def as_number(text: str) -> Decimal | None:
    """'1,234' '$12.50' '72.' '-3' '50%' '\\frac{1}{2}'-free numbers -> Decimal; None when not a number."""
    s = text.strip().replace(",", "").replace("$", "").rstrip(".").removesuffix("%").strip()
    if not s or not re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)", s):
        return None
    try:
        return Decimal(s)
    except InvalidOperation:
        return None


def answers_match(predicted: str, reference: str) -> bool:
    """Numeric equality when both are numbers (72 == 72.0 == 72.00), else text equality ignoring case,
    surrounding whitespace and punctuation."""
    a, b = as_number(predicted), as_number(reference)
    if a is not None and b is not None:
        return a == b
    strip = " \t\n.,;:!?。，；：！？\"'“”‘’「」"
    return predicted.strip(strip).casefold() == reference.strip(strip).casefold()


GEN_STOPS = ("\n\n", "Question:", "问题：")


def score_gen(engine: Any, tok: TokenizerLike, items: Sequence[GenItem], params: Any, *,
              shots: Sequence[GenItem] = (), chat: bool = False, rows: int = 16) -> dict[str, Any]:
    """Score generative items: replies cut at GEN_STOPS (plain text) or the end of the assistant's turn (chat),
    the answer extracted and compared. Returns {"n", "acc", "chance": 0, "centred", "stderr", "items"}."""
    prompts = [tok.encode(gen_prompt(item, shots, chat, tok)) for item in items]
    # A chat reply where no tools are offered (thinking off) opens no call nor think block, as in `nanolm chat`.
    guide = ReplyGuides(tok, engine.model.config.vocab_size, engine.device).reply() if chat else None
    replies = generate_texts(engine, tok, prompts, params, stops=() if chat else GEN_STOPS,
                             stop_ids=(tok.eot_id, tok.im_end_id), rows=rows, guide=guide)
    per_item, correct = [], []
    for item, reply in zip(items, replies):
        predicted = extract_answer(reply)
        ok = answers_match(predicted, item.answer)
        correct.append(float(ok))
        per_item.append({"where": item.where, "answer": item.answer, "predicted": predicted, "reply": reply,
                         "correct": ok})
    s = summary(correct, 0.0)
    return {"kind": "gen", "n": len(items), "acc": s["acc"], "chance": 0.0, "centred": s["centred"],
            "stderr": s["stderr"], "items": per_item}


