"""The output projection and next-token cross-entropy as one operation, over chunks of rows.

The plain path, `cross_entropy(lm_head(h).float(), y)`, writes the (N, V)
logits, a float32 copy of them, their log-softmax and its gradient: four
passes over N x V numbers that do not fit in a CPU's cache (2,048 tokens of a
6,400-token vocabulary are 52 MB in float32), on a model whose every other
activation is a few MB. Here each chunk of rows is projected, reduced to its
log-sum-exp and turned into its logits' gradient P (softmax minus the
one-hot target) while it is still in cache; the backward pass is then two
matrix products over the stored gradient, `dh = P W` and `dW = P^T h`.

The products run in the autocast dtype when autocast is on (as `lm_head` would
under it) and everything else in float32, so under float32 the loss and both
gradients equal the plain path's to rounding, and under bf16 they equal it to
bf16's rounding of the logits' gradient, which the plain path makes too (its
backward casts that gradient to bf16 for the same products).
"""

from __future__ import annotations

import torch

# Rows per chunk: about this many logits (float32) at a time, a few MB of cache on a CPU; a GPU is better served
# by fewer, larger products. Each chunk reads the whole output matrix, so a chunk has at least MIN_ROWS rows: at
# Qwen2.5's 151,936-token vocabulary the cache rule alone gives 3 rows, and 256 rows of a step took 13.7 s against
# 0.98 s with chunks of 256 (forward and backward, 2-core CPU, bench/lora_peft.py); a 6,400-token vocabulary
# measured the same at 81 and 256 rows.
CHUNK_LOGITS = {"cpu": 1 << 19, "default": 1 << 24}
MIN_ROWS = 256


def _chunk_rows(device: torch.device, vocab: int) -> int:
    return max(MIN_ROWS, CHUNK_LOGITS.get(device.type, CHUNK_LOGITS["default"]) // vocab)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                compute_dtype: torch.dtype) -> torch.Tensor:
        n, vocab = h.shape[0], weight.shape[0]
        hc, wc = h.to(compute_dtype), weight.to(compute_dtype)
        grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        probs = torch.empty(n, vocab, dtype=compute_dtype, device=h.device) if grad else None  # dloss/dlogits
        valid = targets >= 0
        safe = torch.where(valid, targets, 0)[:, None]  # (N, 1): ignored rows point at id 0, weighted 0
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        rows = _chunk_rows(h.device, vocab)
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, n, rows):
                e = (hc[s:s + rows] @ wc.T).float()  # (r, V) logits
                keep, tgt = valid[s:s + rows], safe[s:s + rows]
                picked = e.gather(1, tgt).squeeze(1)  # (r,) the target's logit
                top = e.amax(dim=-1, keepdim=True)
                sums = e.sub_(top).exp_().sum(dim=-1)  # e = exp(logit - max), in place
                lse = top.squeeze(1) + sums.log()
                total += torch.where(keep, lse - picked, 0.0).sum()
                if grad:
                    # dloss/dlogits = softmax - onehot(target) = (e - [target] sum e) / sum e, 0 where ignored
                    e.scatter_add_(1, tgt, -sums[:, None])
                    torch.mul(e, (keep / sums)[:, None], out=probs[s:s + rows])
        if grad:
            ctx.save_for_backward(hc, wc, probs)
            ctx.dtypes = h.dtype, weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        hc, wc, probs = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        dh = dw = None
        if ctx.needs_input_grad[0]:
            dh = (probs @ wc).to(h_dtype) * grad_out.to(h_dtype)
        if ctx.needs_input_grad[1]:
            dw = (probs.T @ hc).to(w_dtype) * grad_out.to(w_dtype)
        return dh, dw, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """sum over rows of cross_entropy(h @ weight.T, targets), in float32; rows whose target is negative count 0.

    h (N, C), weight (V, C), targets (N,) int64. The products take the autocast dtype when autocast is on.
    """
    device_type = h.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else h.dtype
    return _LinearCrossEntropy.apply(h, weight, targets, dtype)
