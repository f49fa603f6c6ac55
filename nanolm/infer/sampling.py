"""Choosing the next token: penalties, filters and the draw, as small pure functions over logits.

The order is that of HuggingFace's and vLLM's samplers: the penalties change
the model's logits (also for greedy decoding), then the temperature divides
them, top-k and top-p cut the tail, and one token is drawn with the row's own
generator. `Penalties` holds what the penalties need of a row's history.

- repetition_penalty (CTRL, Keskar et al. 2019; `transformers`' and vLLM's
  extension): every token already in the prompt or the reply has its logit
  divided by p when positive and multiplied by p when negative, so p > 1 makes
  it less likely either way; 1 is off.
- presence_penalty and frequency_penalty (OpenAI's): a token the reply already
  holds c > 0 times loses presence + c x frequency from its logit; the prompt
  does not count (as OpenAI and vLLM do); 0 is off.
"""

from __future__ import annotations

import torch

from nanolm.config import SamplingParams


def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits (..., V); seen (..., V) bool, the tokens in the prompt or the reply so far."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def presence_frequency_penalty(logits: torch.Tensor, counts: torch.Tensor, presence: float,
                               frequency: float) -> torch.Tensor:
    """logits (..., V); counts (..., V), how often each token occurs in the reply so far."""
    if presence == 0.0 and frequency == 0.0:
        return logits
    counts = counts.to(logits.dtype)
    return logits - presence * (counts > 0).to(logits.dtype) - frequency * counts


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits (ties at the boundary kept), set the rest to -inf. logits: (..., V)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of tokens whose probability mass reaches p.

    The most likely token is always kept.
    """
    if p >= 1.0:
        return logits
    sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of the tokens ranked above each one
    drop_sorted = mass_before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row from logits (B, V) -> (B,): greedy at temperature 0, else drawn after the filters.
    Penalties are applied before this (`Penalties.apply`)."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / params.temperature
    logits = top_p_filter(top_k_filter(logits, params.top_k), params.top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class Penalties:
    """One row's history as the penalties need it: which tokens the prompt or reply hold, and how often
    each occurs in the reply. Holds nothing when the row's params penalise nothing."""

    def __init__(self, params: SamplingParams, prompt: list[int], vocab_size: int, device: torch.device) -> None:
        self.params = params
        self.repetition = params.repetition_penalty != 1.0
        self.openai = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        self.seen = self.counts = None
        if self.repetition:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.seen[torch.tensor(prompt, dtype=torch.long, device=device)] = True
        if self.openai:
            self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)

    @property
    def active(self) -> bool:
        return self.repetition or self.openai

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (1, V) -> the penalised logits (float32 where a penalty applies)."""
        if self.repetition:
            logits = repetition_penalty(logits.float(), self.seen, self.params.repetition_penalty)
        if self.openai:
            logits = presence_frequency_penalty(logits.float(), self.counts, self.params.presence_penalty,
                                                self.params.frequency_penalty)
        return logits

    def add(self, token: int) -> None:
        """Note a token the reply now holds."""
        if self.repetition:
            self.seen[token] = True
        if self.openai:
            self.counts[token] += 1
