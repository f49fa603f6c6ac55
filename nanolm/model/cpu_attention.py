"""Causal attention for training and scoring on a CPU, in query blocks.

PyTorch's CPU flash attention runs far from the CPU's matrix-product speed at the shapes small models train
(at `minimind-26m`'s 4 x 512 in bf16 it takes 4.5x its products' floor, and at head size 32 its bf16 backward is
slower than float32's). This computes attention as batched matrix products in the input's dtype, with the
softmax between them, one block of queries at a time: block i's queries score only the keys up to their own
block's end, so with 4 blocks the products and the score tensors cover 10/16 of the T x T square instead of all
of it (a causal query never looks past itself). A key/value head's query heads are stacked as rows of one
product, so shared heads are never copied out. The probabilities are kept for the backward pass, which is the
usual one (dV = P^T dO, dS = P (dP - rowsum(dO O)), dQ = dS K, dK = dS^T Q), block by block.

Measured (`bench/throughput.py --breakdown`, bench/RESULTS.md): forward and backward of one layer at
`minimind-26m`'s shape in bf16 about 2x faster than PyTorch's kernel, at `cpu-small`'s 1.6x faster than the
float32 kernel nanolm ran there. In float32 it equals PyTorch's results to rounding; in bf16 its errors against a
float32 reference are of the same size as PyTorch's bf16 kernel's (scores and probabilities rounded to bf16).

The price is memory: the probabilities of every layer are held until the backward pass (10/16 of B x n_head x
T x T values a layer, in the compute dtype), so above MAX_SCORE_BYTES a layer PyTorch's kernel (which keeps
none) is used instead.
"""

from __future__ import annotations

import math

import torch

# Query blocks per sequence: more blocks skip more of the masked half but run more, smaller products (at 4 x 512
# x 8 heads: 1 block 54, 2 blocks 41, 4 blocks 27, 8 blocks 33 ms forward and backward, bf16, 2 threads).
BLOCKS = 4
MIN_BLOCK = 32  # below this many queries a block is not split further
# The most bytes of probabilities (B x n_head x the blocks' share of T x T, in the compute dtype) one layer may
# hold for its backward pass: 128 MiB (`minimind-26m` at 4 x 512 holds 10 MiB in bf16). Longer sequences or
# larger batches fall back to PyTorch's kernel, which holds none.
MAX_SCORE_BYTES = 128 << 20

_masks: dict[tuple[int, torch.device], torch.Tensor] = {}


def _upper(n: int, device: torch.device) -> torch.Tensor:
    """(n, n) bool, True above the diagonal: the keys a block's queries may not see among its own."""
    m = _masks.get((n, device))
    if m is None:
        m = _masks[(n, device)] = torch.ones(n, n, dtype=torch.bool, device=device).triu_(1)
    return m


def _blocks(T: int) -> list[tuple[int, int]]:
    """The query blocks [a, b) of a sequence of T: BLOCKS of them (fewer below MIN_BLOCK queries each), the last
    one shorter where T does not divide."""
    n = max(1, min(BLOCKS, T // MIN_BLOCK))
    size = -(-T // n)
    return [(a, min(T, a + size)) for a in range(0, T, size)]


def usable(q: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether this kernel takes attention of q (B, n_head, T, hs) computed in `dtype`: on a CPU, in float32 or
    bfloat16, at least two blocks' worth of queries, and within MAX_SCORE_BYTES a layer."""
    B, H, T, _ = q.shape
    if q.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or T < 2 * MIN_BLOCK:
        return False
    held = sum((b - a) * b for a, b in _blocks(T))
    return B * H * held * (4 if dtype == torch.float32 else 2) <= MAX_SCORE_BYTES


class _BlockedCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                blocked: torch.Tensor | None) -> torch.Tensor:
        B, H, T, D = q.shape
        Hk = k.shape[1]
        g = H // Hk
        qs = (q * (1.0 / math.sqrt(D))).reshape(B, Hk, g, T, D)  # the scale folded into the queries
        k, v = k.contiguous(), v.contiguous()
        out = torch.empty(B, T, Hk, g, D, dtype=q.dtype, device=q.device)  # the layout o_proj reads
        probs = []
        for a, b in _blocks(T):
            n = b - a
            s = torch.matmul(qs[:, :, :, a:b].reshape(B, Hk, g * n, D), k[:, :, :b].transpose(-1, -2))
            s = s.view(B, Hk, g, n, b)
            if blocked is None:
                s[..., a:].masked_fill_(_upper(n, q.device), float("-inf"))
            else:  # packed conversations: the mask holds causality and the segments
                s.masked_fill_(blocked[:, :, a:b, :b].unsqueeze(2), float("-inf"))
            p = torch.softmax(s, dim=-1)
            o = torch.matmul(p.view(B, Hk, g * n, b), v[:, :, :b]).view(B, Hk, g, n, D)
            out[:, a:b] = o.permute(0, 3, 1, 2, 4)
            probs.append(p)
        o = out.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        ctx.save_for_backward(qs, k, v, o, *probs)
        return o

    @staticmethod
    def backward(ctx, do: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        with torch.autocast(do.device.type, enabled=False):
            return _BlockedCausal._backward(ctx, do)

    @staticmethod
    def _backward(ctx, do: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        qs, k, v, o, *probs = ctx.saved_tensors
        B, H, T, D = o.shape
        Hk = k.shape[1]
        g = H // Hk
        do = do.to(v.dtype).reshape(B, Hk, g, T, D)
        # rowsum(dO * O): each query's term of the softmax's backward, in float32
        delta = (do.float() * o.reshape(B, Hk, g, T, D).float()).sum(-1, keepdim=True).to(do.dtype)
        dq = torch.empty_like(qs)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for (a, b), p in zip(_blocks(T), probs):
            n = b - a
            pf = p.view(B, Hk, g * n, b)
            dob = do[:, :, :, a:b].reshape(B, Hk, g * n, D)
            dv[:, :, :b] += torch.matmul(pf.transpose(-1, -2), dob)
            ds = torch.matmul(dob, v[:, :, :b].transpose(-1, -2)).view(B, Hk, g, n, b)
            ds = ds.sub_(delta[:, :, :, a:b]).mul_(p).view(B, Hk, g * n, b)  # masked scores: p = 0, so ds = 0
            dq[:, :, :, a:b] = torch.matmul(ds, k[:, :, :b]).view(B, Hk, g, n, D)
            dk[:, :, :b] += torch.matmul(ds.transpose(-1, -2), qs[:, :, :, a:b].reshape(B, Hk, g * n, D))
        dq = dq.mul_(1.0 / math.sqrt(D)).view(B, H, T, D)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal scaled dot-product attention, as F.scaled_dot_product_attention(q, k, v, is_causal=True,
    enable_gqa=True) computes it (with `mask`: attn_mask=mask, a (B, 1, T, T) boolean that already holds
    causality, True where a query may attend a key; every query must see at least itself).

    q (B, n_head, T, hs), k and v (B, n_kv_head, T, hs), all in one dtype, float32 or bfloat16 (see `usable`);
    -> (B, n_head, T, hs) in that dtype, a transposed view of a (B, T, n_head, hs) tensor. Runs outside autocast:
    every product and the softmax take the inputs' dtype.
    """
    blocked = None if mask is None else ~mask
    with torch.autocast(q.device.type, enabled=False):
        return _BlockedCausal.apply(q, k, v, blocked)
