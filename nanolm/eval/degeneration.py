"""Degeneration of sampled text: distinct-1/2 and the fraction of completions caught in a loop.

Counted on the model's own tokens, so Chinese (no spaces) and English are
measured alike:

- distinct-n (Li et al., 2016): distinct n-grams over all n-grams of all
  completions together; 1.0 when no n-gram repeats, near 0 for text that says
  the same thing over and over.
- loop fraction: the share of completions whose end is one block of p tokens
  repeated (`loop_period`): at least LOOP_REPEATS times in a row, covering at
  least LOOP_MIN_TOKENS tokens, for some period p up to LOOP_MAX_PERIOD. A
  completion that stopped by itself (end of text or of the turn) before the
  budget is judged by what it wrote too.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

LOOP_REPEATS = 3
LOOP_MIN_TOKENS = 12
LOOP_MAX_PERIOD = 64


def distinct_n(seqs: Sequence[Sequence[int]], n: int) -> float:
    """Distinct n-grams / n-grams over all sequences (0.0 when they hold none)."""
    grams = [tuple(s[i:i + n]) for s in seqs for i in range(len(s) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def loop_period(ids: Sequence[int], repeats: int = LOOP_REPEATS, min_tokens: int = LOOP_MIN_TOKENS,
                max_period: int = LOOP_MAX_PERIOD) -> int | None:
    """The shortest period p such that the last max(repeats * p, min_tokens) tokens repeat with period p
    (ids[i] == ids[i - p] throughout); None when the sequence does not end in such a loop."""
    for p in range(1, max_period + 1):
        span = max(repeats * p, min_tokens)
        if span > len(ids):
            break
        tail = ids[len(ids) - span:]
        if all(tail[i] == tail[i - p] for i in range(p, span)):
            return p
    return None


def degeneration_scores(completions: Sequence[Sequence[int]]) -> dict[str, float]:
    """{"distinct_1", "distinct_2", "loop_fraction", "n", "mean_tokens"} of token-id completions."""
    n = len(completions)
    loops = sum(loop_period(c) is not None for c in completions)
    return {"distinct_1": distinct_n(completions, 1), "distinct_2": distinct_n(completions, 2),
            "loop_fraction": loops / n if n else 0.0, "n": n,
            "mean_tokens": sum(map(len, completions)) / n if n else 0.0}


def sample_completions(engine: Any, prompts: Sequence[Sequence[int]], params: Any,
                       stop_ids: Sequence[int] = ()) -> list[list[int]]:
    """One sampled completion per prompt, decoded together; prompt i draws with params.seed + i."""
    per = [params if params.seed is None else replace(params, seed=params.seed + i) for i in range(len(prompts))]
    limit = engine.max_seq_len - 1
    return engine.generate_many([list(p)[-limit:] for p in prompts], per, stop_ids)
