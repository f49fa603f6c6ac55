"""Choosing the next token: penalties, filters and the draw, as tensor operations over a batch of rows.

Every function takes logits (B, V), one row per sequence, and each row's own
setting (a number for all rows, or a (B,) tensor of one per row), so a step
of many rows costs a fixed number of tensor operations whatever the number of
rows. The order is that of HuggingFace's and vLLM's samplers: the penalties
change the model's logits (also for greedy decoding), then the temperature
divides them, top-k and top-p cut the tail, and one token is drawn per row
with the row's own generator. `Penalties` holds what the penalties need of a
row's history.

- repetition_penalty (CTRL, Keskar et al. 2019; `transformers`' and vLLM's
  extension): every token already in the prompt or the reply has its logit
  divided by p when positive and multiplied by p when negative, so p > 1 makes
  it less likely either way; 1 is off.
- presence_penalty and frequency_penalty (OpenAI's): a token the reply already
  holds c > 0 times loses presence + c x frequency from its logit; the prompt
  does not count (as OpenAI and vLLM do); 0 is off.

The draw is `torch.multinomial`'s own for one sample (the exponential race:
the argmax of p / E, E ~ Exp(1) drawn from the row's generator), done for all
rows at once; only the random numbers are drawn row by row, each from its own
generator, so a row draws what it draws alone, whatever rows run beside it.
"""

from __future__ import annotations

from typing import Sequence

import torch

from nanolm.config import SamplingParams

PerRow = float | torch.Tensor  # one value for every row, or a (B,) tensor of one per row


def _column(value: PerRow, logits: torch.Tensor) -> torch.Tensor | float:
    """A per-row tensor as a (B, 1) column of the logits' dtype (broadcasts over the vocabulary)."""
    if isinstance(value, torch.Tensor):
        return value.to(device=logits.device, dtype=logits.dtype).reshape(-1, 1)
    return value


def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: PerRow) -> torch.Tensor:
    """logits (B, V); seen (B, V) bool, the tokens in the prompt or the reply so far."""
    if not isinstance(penalty, torch.Tensor) and penalty == 1.0:
        return logits
    p = _column(penalty, logits)
    penalised = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalised, logits)


def presence_frequency_penalty(logits: torch.Tensor, counts: torch.Tensor, presence: PerRow,
                               frequency: PerRow) -> torch.Tensor:
    """logits (B, V); counts (B, V), how often each token occurs in the reply so far."""
    if not isinstance(presence, torch.Tensor) and not isinstance(frequency, torch.Tensor) \
            and presence == 0.0 and frequency == 0.0:
        return logits
    counts = counts.to(logits.dtype)
    return logits - _column(presence, logits) * (counts > 0).to(logits.dtype) - _column(frequency, logits) * counts


def top_k_filter(logits: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits (ties at the boundary kept), set the rest to -inf; a row's k <= 0 or
    >= V keeps all. logits (..., V); k a number or a (B,) tensor."""
    vocab = logits.shape[-1]
    if not isinstance(k, torch.Tensor):
        if k <= 0 or k >= vocab:
            return logits
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]
        return logits.masked_fill(logits < kth, float("-inf"))
    k = k.to(logits.device)
    on = (k > 0) & (k < vocab)
    if not bool(on.any()):
        return logits
    kk = torch.where(on, k, 1)
    values = torch.topk(logits, int(kk.max()), dim=-1).values
    kth = values.gather(-1, (kk - 1).unsqueeze(-1))
    kth = kth.masked_fill(~on.unsqueeze(-1), float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float | torch.Tensor) -> torch.Tensor:
    """Nucleus filter: keep each row's smallest set of tokens whose probability mass reaches its p (>= 1: all).

    The most likely token is always kept. logits (..., V); p a number or a (B,) tensor.
    """
    if isinstance(p, torch.Tensor):
        p = p.to(device=logits.device, dtype=logits.dtype)
        if not bool((p < 1.0).any()):
            return logits
        p = torch.where(p < 1.0, p, float("inf")).unsqueeze(-1)  # a row at 1 drops nothing, whatever rounding
    elif p >= 1.0:
        return logits
    sorted_logits, idx = torch.sort(logits, descending=True, dim=-1, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of the tokens ranked above each one
    drop_sorted = mass_before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token id per row from logits (B, V) -> (B,): the argmax for rows at temperature 0, else drawn after
    the row's temperature, top-k and top-p, with the row's generator (None: torch's global one).
    temperature, top_k, top_p: (B,) tensors. Penalties are applied before this."""
    ids = logits.argmax(dim=-1)
    drawn = (temperature > 0).tolist()
    if not any(drawn):
        return ids
    rows = [i for i, d in enumerate(drawn) if d]
    index = torch.tensor(rows, device=logits.device)
    x = logits.index_select(0, index).float() / temperature.index_select(0, index).to(logits.device).unsqueeze(-1)
    x = top_p_filter(top_k_filter(x, top_k.index_select(0, index)), top_p.index_select(0, index))
    probs = torch.softmax(x, dim=-1)
    race = torch.empty_like(probs)
    unseeded = [j for j, i in enumerate(rows) if generators[i] is None]
    if unseeded:
        race[unseeded] = torch.empty(len(unseeded), probs.shape[-1], device=probs.device).exponential_()
    for j, i in enumerate(rows):
        if generators[i] is not None:
            race[j].exponential_(generator=generators[i])
    return ids.index_copy(0, index, (probs / race).argmax(dim=-1))


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row from logits (B, V) -> (B,), every row with the same params and generator (drawn in
    turn): greedy at temperature 0, else drawn after the filters. Penalties are applied before this."""
    b = logits.shape[0]

    def full(value: float) -> torch.Tensor:
        return torch.full((b,), value, device=logits.device)

    return sample_rows(logits, full(params.temperature), full(params.top_k).long(), full(params.top_p),
                       [generator] * b)


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
        return apply_penalties(logits, [self]) if self.active else logits

    def add(self, token: int) -> None:
        """Note a token the reply now holds."""
        if self.repetition:
            self.seen[token] = True
        if self.openai:
            self.counts[token] += 1


def apply_penalties(logits: torch.Tensor, rows: Sequence[Penalties]) -> torch.Tensor:
    """logits (B, V), one row per entry of `rows` -> the penalised logits in float32, every row at once (a row
    whose params penalise nothing comes out as it went in)."""
    logits = logits.float()
    vocab, device = logits.shape[-1], logits.device
    if any(r.repetition for r in rows):
        seen = torch.stack([r.seen if r.repetition else torch.zeros(vocab, dtype=torch.bool, device=device)
                            for r in rows])
        penalty = torch.tensor([r.params.repetition_penalty for r in rows], device=device)
        logits = repetition_penalty(logits, seen, penalty)
    if any(r.openai for r in rows):
        counts = torch.stack([r.counts if r.openai else torch.zeros(vocab, device=device) for r in rows])
        presence = torch.tensor([r.params.presence_penalty for r in rows], device=device)
        frequency = torch.tensor([r.params.frequency_penalty for r in rows], device=device)
        logits = presence_frequency_penalty(logits, counts, presence, frequency)
    return logits
