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

Top-k and top-p choose each row's candidates (`nucleus`: only they are
sorted), and one is drawn by the exponential race, as `torch.multinomial`
draws one sample, for all rows at once; only the random numbers are drawn row
by row, each from its own generator, so a row draws what it draws alone,
whatever rows run beside it.
"""

from __future__ import annotations

from typing import Sequence

import torch

from nanolm.config.sampling import SamplingParams

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


def nucleus(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's candidates after top-k and top-p, as (ids, weights, counts).

    x (B, V) the tempered logits; top_k (B,) (<= 0 or >= V: no cut), top_p (B,) (>= 1: no cut). Top-k keeps the
    k largest logits and any tied with the k-th; top-p then keeps the smallest set of the most likely tokens
    whose probability reaches p (the most likely is always kept; ties are ranked by id). ids (B, W): every
    row's candidates in id order, W the most any row has (V past a row's own count); weights (B, W): their
    probabilities up to a factor per row (exp(logit - max)), 0 where top-p cut them or past the row's count;
    counts (B,): the row's candidates before top-p. Only the candidates are sorted, so a cut to a few tokens
    costs a top-k, not a sort of V.
    """
    vocab = x.shape[-1]
    limited = (top_k > 0) & (top_k < vocab)
    kth = torch.full((x.shape[0], 1), float("-inf"), device=x.device)
    top = None
    if bool(limited.any()):
        k = torch.where(limited, top_k, 1)
        top = torch.topk(x, int(k.max()), dim=-1)
        kth = top.values.gather(-1, (k - 1).unsqueeze(-1)).masked_fill(~limited.unsqueeze(-1), float("-inf"))
    counts = ((x >= kth) & (x > float("-inf"))).sum(dim=-1).clamp_min(1)  # -inf (a guide's mask) never counts
    width = int(counts.max())
    if width == vocab:
        logits, ids = torch.sort(x, dim=-1, descending=True, stable=True)
    else:  # the top `width`, then ranked by logit and id (torch.topk's order among ties is its own)
        if top is None or width > top.values.shape[-1]:
            top = torch.topk(x, width, dim=-1)
        logits, ids = top.values[:, :width], top.indices[:, :width]  # the first `width` of a longer top: the same
        if bool((logits[:, 1:] == logits[:, :-1]).any()):  # without ties, topk's order is already that ranking
            ids, order = ids.sort(dim=-1)
            logits, order = logits.gather(-1, order).sort(dim=-1, descending=True, stable=True)
            ids = ids.gather(-1, order)
    inside = torch.arange(width, device=x.device) < counts.unsqueeze(-1)
    weights = torch.exp(logits - logits[:, :1]).masked_fill(~inside, 0.0)
    # cumsum runs along each row in order, so a row's sums do not depend on the columns past its own count
    mass = torch.cumsum(weights, dim=-1)
    total = mass.gather(-1, (counts - 1).unsqueeze(-1))
    p = torch.where(top_p < 1.0, top_p.to(x.dtype), float("inf")).unsqueeze(-1)
    weights = weights.masked_fill((mass - weights) / total >= p, 0.0)  # the mass ranked above reaches p: cut
    # In id order for the draw, so that a change in the logits too small to change the candidates changes their
    # ranks, not which random number each candidate gets. Columns past a row's count sort last.
    ids, order = ids.masked_fill(~inside, vocab).sort(dim=-1, stable=True)
    return ids, weights.gather(-1, order), counts


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token id per row from logits (B, V) -> (B,): the argmax for rows at temperature 0, else drawn after
    the row's temperature, top-k and top-p (`nucleus`), with the row's generator (None: torch's global one).
    temperature, top_k, top_p: (B,) tensors. Penalties are applied before this.

    The draw is the exponential race (the argmax of weight / E, E ~ Exp(1); torch.multinomial draws one sample
    so): a row draws one E per candidate from its own generator, in id order, so what it draws does not
    depend on the rows beside it."""
    drawn = (temperature > 0).tolist()
    if not any(drawn):
        return logits.argmax(dim=-1)
    rows = [i for i, d in enumerate(drawn) if d]
    greedy = [i for i, d in enumerate(drawn) if not d]
    ids = torch.zeros(len(drawn), dtype=torch.long, device=logits.device)
    if greedy:
        at = torch.tensor(greedy, device=logits.device)
        ids.index_copy_(0, at, logits.index_select(0, at).argmax(dim=-1))
    index = torch.tensor(rows, device=logits.device)
    x = logits.index_select(0, index).float() / temperature.index_select(0, index).to(logits.device).unsqueeze(-1)
    candidates, weights, counts = nucleus(x, top_k.index_select(0, index).to(x.device),
                                          top_p.index_select(0, index).to(x.device))
    race = torch.ones_like(weights)
    unseeded = [j for j, i in enumerate(rows) if generators[i] is None]
    if unseeded:
        race[unseeded] = torch.empty(len(unseeded), race.shape[-1], device=race.device).exponential_()
    for j, n in enumerate(counts.tolist()):
        if generators[rows[j]] is not None:
            race[j, :n].exponential_(generator=generators[rows[j]])
    pick = (weights / race).argmax(dim=-1, keepdim=True)
    return ids.index_copy(0, index, candidates.gather(-1, pick).squeeze(-1))


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
