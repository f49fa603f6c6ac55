"""How tokens are drawn (`SamplingParams`): the one set of defaults generate, chat, the server, GRPO's rollouts
and the quickstart sample with."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from nanolm.config.fields import check as _check


# What torch.Generator.manual_seed takes.
SEED_RANGE = (-2**63, 2**64)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class SamplingParams:
    """How the next token is drawn and how many are drawn: the one set of defaults that `nanolm generate`,
    `nanolm chat`, the server (for the fields a request leaves out) and the quickstart all take.

    The defaults are the command line's long-standing ones, tuned for small models: top-k 50 and top-p 0.95
    cut the long tail of unlikely tokens a small model's sampled text otherwise wanders into. The command-line
    options (`--temperature`, `--top-k`, ...) are generated from these fields; `help` is their help text.
    """

    max_new_tokens: int = field(default=256, metadata={"help": "the most tokens to generate"})
    temperature: float = field(default=0.8, metadata={"help": "0 = greedy"})
    top_k: int = field(default=50, metadata={"help": "keep the k most likely tokens; 0 = off"})
    top_p: float = field(default=0.95, metadata={"help": "keep the most likely tokens up to this mass; 1 = off"})
    seed: int | None = field(default=None, metadata={"help": "makes sampling reproducible"})
    repetition_penalty: float = field(default=1.0, metadata={
        "help": "> 1 makes tokens already in the prompt or reply less likely (logit / p, or x p if negative); 1 = off"})
    presence_penalty: float = field(default=0.0, metadata={
        "help": "subtracted from the logit of every token the reply already holds (OpenAI's, -2 to 2); 0 = off"})
    frequency_penalty: float = field(default=0.0, metadata={
        "help": "subtracted, times its count in the reply so far, from each token's logit (-2 to 2); 0 = off"})

    def __post_init__(self) -> None:
        _check(is_int(self.max_new_tokens) and self.max_new_tokens >= 0,
               f"max_new_tokens must be >= 0, got {self.max_new_tokens!r}")
        _check(is_number(self.temperature) and self.temperature >= 0,
               f"temperature must be >= 0, got {self.temperature!r}")
        _check(is_int(self.top_k) and self.top_k >= 0, f"top_k must be >= 0, got {self.top_k!r}")
        _check(is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(self.seed is None or (is_int(self.seed) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1]),
               f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        _check(is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= 10,
               f"repetition_penalty must be in (0, 10] (1 = off, 1.1-1.3 is usual), got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(is_number(value) and -2 <= value <= 2, f"{name} must be in [-2, 2] (0 = off), got {value!r}")

