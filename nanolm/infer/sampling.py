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
sorted and tempered; without a cut nothing is sorted), and one is drawn per
row by the inverse of its cumulative distribution, as `torch.multinomial`
draws, for all rows at once; only the random numbers are drawn row by row,
one per row from its own generator, so a row draws what it draws alone,
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


def nucleus(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
            temperature: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's candidates after top-k and top-p, as (ids, weights, counts).

    x (B, V) the logits, divided by temperature (B,) (> 0; None: taken as they are); top_k (B,) (<= 0 or >= V: no
    cut), top_p (B,) (>= 1: no cut). Top-k keeps the k largest tempered logits and any tied with the k-th; top-p then
    keeps the smallest set of the most likely tokens whose probability reaches p (the most likely is always kept;
    ties are ranked by id). ids (B, W): every row's candidates in id order, W the most any row has (V past a row's
    own count); weights (B, W): their probabilities up to a factor per row (exp(logit - max)), 0 where top-p cut
    them or past the row's count; counts (B,): the row's candidates before top-p. Only the candidates are sorted
    and tempered, so a cut to a few tokens costs a top-k, not a sort of V nor a pass over it.
    """
    vocab = x.shape[-1]
    ks, ps = top_k.tolist(), top_p.tolist()
    if not any(0 < k < vocab for k in ks) and all(p >= 1.0 for p in ps):
        return _every_token(x, temperature)
    found = _top_k_alone(x, top_k, ks, temperature)
    if found is not None:
        logits, ids, counts = found
    else:
        x = _tempered(x, temperature)
        logits, ids, counts = _top_k_with_ties(x, top_k)
    width = logits.shape[-1]
    if width > 1 and bool((logits[:, 1:] == logits[:, :-1]).any()):  # ties: rank them by id (topk's order is its own)
        ids, order = ids.sort(dim=-1)
        logits, order = logits.gather(-1, order).sort(dim=-1, descending=True, stable=True)
        ids = ids.gather(-1, order)
    # Where every row keeps all `width` columns (one k for all rows, the common case) nothing needs masking.
    inside = None if all(c == width for c in counts.tolist()) else \
        torch.arange(width, device=x.device) < counts.unsqueeze(-1)
    weights = torch.exp(logits - logits[:, :1])
    if inside is not None:
        weights = weights.masked_fill(~inside, 0.0)
    if any(p < 1.0 for p in ps):
        # cumsum runs along each row in order, so a row's sums do not depend on the columns past its own count
        mass = torch.cumsum(weights, dim=-1)
        total = mass[:, -1:] if inside is None else mass.gather(-1, (counts - 1).unsqueeze(-1))
        p = torch.tensor([p if p < 1.0 else float("inf") for p in ps], dtype=weights.dtype,
                         device=x.device).unsqueeze(-1)
        weights = weights.masked_fill((mass - weights) / total >= p, 0.0)  # the mass ranked above reaches p: cut
    # In id order for the draw, so that a change in the logits too small to change the candidates changes their
    # ranks, not which random number each candidate gets. Columns past a row's count sort last.
    if inside is not None:
        ids = ids.masked_fill(~inside, vocab)
    ids, order = ids.sort(dim=-1, stable=True)
    return ids, weights.gather(-1, order), counts


def _tempered(x: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """x (B, ...) in float32, each row divided by its temperature (B,) (None: as it is)."""
    x = x.float()
    return x if temperature is None else x / temperature.to(x.device).view(-1, *[1] * (x.dim() - 1))


def _every_token(x: torch.Tensor, temperature: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """nucleus where no row cuts (no top-k, top-p 1: RL's rollouts sample so): every finite logit is a candidate,
    already in id order, so nothing is sorted; the -inf of a guide's mask are moved past the row's count."""
    rows, vocab = x.shape
    x = _tempered(x, temperature)
    weights = torch.exp(x - x.amax(dim=-1, keepdim=True))
    finite = x > float("-inf")
    counts = finite.sum(dim=-1)
    ids = torch.arange(vocab, device=x.device)
    if bool((counts == vocab).all()):
        return ids.expand(rows, vocab), weights, counts
    # Each finite id's column among its row's finite ids; the masked ids all go to a spare column, dropped after.
    column = torch.where(finite, finite.cumsum(dim=-1) - 1, vocab)
    kept_ids = torch.full((rows, vocab + 1), vocab, dtype=torch.long, device=x.device)
    kept_weights = torch.zeros(rows, vocab + 1, dtype=weights.dtype, device=x.device)
    kept_ids.scatter_(-1, column, ids.expand(rows, vocab))
    kept_weights.scatter_(-1, column, weights)
    return kept_ids[:, :vocab], kept_weights[:, :vocab], counts.clamp_min(1)


def _top_k_alone(x: torch.Tensor, top_k: torch.Tensor, ks: list[int],
                 temperature: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The common case, from one top-k of the untempered logits: every row cuts to k (0 < k < V) and nothing past
    its first k ties with its k-th after tempering, which is finite. Then (tempered logits (B, K) descending, their
    ids, counts = top_k), K the largest k; else None. Dividing by a positive temperature never reorders two logits
    (it may make them equal), so the k largest tempered logits are those of the k + 1 largest untempered ones, and
    the (k + 1)-th tells whether a tie with the k-th reaches past them. ks: top_k as a list."""
    vocab = x.shape[-1]
    if not ks or not all(0 < k < vocab for k in ks):
        return None
    kmax = max(ks)
    top = torch.topk(x, kmax + 1, dim=-1)
    values = _tempered(top.values, temperature)  # the same division as of the whole row, only of the candidates
    if len(set(ks)) == 1:
        kth, after = values[:, kmax - 1], values[:, kmax]
    else:
        at = top_k.to(x.device).unsqueeze(-1)
        kth, after = values.gather(-1, at - 1).squeeze(-1), values.gather(-1, at).squeeze(-1)
    if not bool(((kth > after) & (kth > float("-inf"))).all()):
        return None
    return values[:, :kmax], top.indices[:, :kmax], top_k.to(x.device)


def _top_k_with_ties(x: torch.Tensor, top_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row's top-k with the ties of its k-th, of tempered logits x (B, V): (logits (B, W) descending, their
    ids, counts), W the largest count; a row without a cut (k <= 0 or >= V) counts its finite logits."""
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
        return logits, ids, counts
    if top is None or width > top.values.shape[-1]:
        top = torch.topk(x, width, dim=-1)
    return top.values[:, :width], top.indices[:, :width], counts  # the first `width` of a longer top: the same


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits (B, V) -> each row's argmax (B,), the first of tied maxima, as torch.argmax. PyTorch's CPU argmax
    reduces one element at a time (16 rows of 6,400: about 90 us); for many rows this takes each block of 64's
    maximum (a vectorised reduction), the first block holding the row's maximum, then the argmax within it
    (30 us)."""
    rows, vocab = logits.shape
    blocks = vocab // GREEDY_BLOCK
    if logits.device.type != "cpu" or rows * vocab < GREEDY_BLOCKED_FROM or blocks < 2 or vocab % GREEDY_BLOCK:
        return logits.argmax(dim=-1)
    x = logits.view(rows, blocks, GREEDY_BLOCK)
    block = x.amax(dim=-1).argmax(dim=-1)  # (B,) the first block holding the maximum
    inside = x.gather(1, block.view(rows, 1, 1).expand(rows, 1, GREEDY_BLOCK)).squeeze(1).argmax(dim=-1)
    return block * GREEDY_BLOCK + inside


GREEDY_BLOCK = 64
GREEDY_BLOCKED_FROM = 32768  # elements; below it one argmax is the faster (one row of 6,400: 7 against 18 us)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token id per row from logits (B, V) -> (B,): the argmax for rows at temperature 0, else drawn after
    the row's temperature, top-k and top-p (`nucleus`), with the row's generator (None: torch's global one).
    temperature, top_k, top_p: (B,) tensors. Penalties are applied before this.

    The draw is by the inverse of the cumulative distribution, as torch.multinomial draws with replacement: a
    row draws one uniform number from its own generator, scaled by the mass of its candidates (in id order), and
    takes the first candidate whose cumulative mass exceeds it; so what it draws does not depend on the rows
    beside it."""
    drawn = (temperature > 0).tolist()
    if not any(drawn):
        return greedy(logits)
    rows = [i for i, d in enumerate(drawn) if d]
    greedy_rows = [i for i, d in enumerate(drawn) if not d]
    if greedy_rows:
        index = torch.tensor(rows, device=logits.device)
        x, temperature, top_k, top_p = (t.index_select(0, index.to(t.device))
                                        for t in (logits, temperature, top_k, top_p))
    else:
        x = logits
    candidates, weights, counts = nucleus(x, top_k.to(x.device), top_p.to(x.device), temperature)
    u = torch.empty(len(rows), 1, dtype=weights.dtype, device=weights.device)
    unseeded = [j for j, i in enumerate(rows) if generators[i] is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), 1, dtype=weights.dtype, device=weights.device)
    for j, i in enumerate(rows):
        if generators[i] is not None:
            u[j].uniform_(generator=generators[i])
    mass = torch.cumsum(weights, dim=-1)  # a row's sums do not depend on the columns past its count (weight 0)
    total = mass[:, -1:]
    # Strictly below the total, so that the first column whose mass exceeds it always exists and has a weight.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    pick = torch.searchsorted(mass, target, right=True)
    ids = candidates.gather(-1, pick).squeeze(-1)
    if not greedy_rows:
        return ids
    out = torch.empty(len(drawn), dtype=torch.long, device=logits.device)
    at = torch.tensor(greedy_rows, device=logits.device)
    out.index_copy_(0, at, greedy(logits.index_select(0, at)))
    return out.index_copy_(0, index, ids)


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
