"""The output projection and next-token cross-entropy as one operation, over chunks of rows.

The plain path, `cross_entropy(lm_head(h).float(), y)`, writes the (N, V)
logits, a float32 copy of them, their log-softmax and its gradient: four
passes over N x V numbers that do not fit in a CPU's cache (2,048 tokens of a
6,400-token vocabulary are 52 MB in float32), on a model whose every other
activation is a few MB. Here each chunk of rows is projected, reduced to its
log-sum-exp and turned into its logits' gradient P (softmax minus the
one-hot target) in slices that stay in cache; the backward pass is then two
matrix products over the stored gradient, `dh = P W` and `dW = P^T h`.

The products run in the autocast dtype when autocast is on (as `lm_head` would
under it) and everything else in float32, so under float32 the loss and both
gradients equal the plain path's to rounding, and under bf16 they equal it to
bf16's rounding of the logits' gradient, which the plain path makes too (its
backward casts that gradient to bf16 for the same products).
"""

from __future__ import annotations

import torch

# Rows per product: each reads the whole output matrix, so a product has at least MIN_ROWS rows (at Qwen2.5's
# 151,936-token vocabulary, 256 rows of a step took 13.7 s in products of 3 rows against 0.98 s in one of 256:
# forward and backward, 2-core CPU, bench/lora_peft.py), and more where CHUNK_LOGITS logits allow.
# The softmax and its gradient then run over slices of CHUNK_LOGITS logits (float32), which stay in a CPU's
# cache: over a whole product of 256 x 151,936 logits (155 MB in float32) they took 0.39 s of a 2.3 s LoRA step,
# in slices 0.07 s (bench/lora_peft.py, bf16, 24 layers); a GPU is served by larger ones.
CHUNK_LOGITS = {"cpu": 1 << 19, "default": 1 << 24}
MIN_ROWS = 256


def _chunk_rows(device: torch.device, vocab: int) -> int:
    return max(MIN_ROWS, _slice_rows(device, vocab))


def _slice_rows(device: torch.device, vocab: int) -> int:
    return max(1, CHUNK_LOGITS.get(device.type, CHUNK_LOGITS["default"]) // vocab)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                compute_dtype: torch.dtype) -> torch.Tensor:
        n, vocab = h.shape[0], weight.shape[0]
        hc, wc = h.to(compute_dtype), weight.to(compute_dtype)
        grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        rows, step = _chunk_rows(h.device, vocab), _slice_rows(h.device, vocab)
        # dloss/dlogits, written over each product's logits in place; without gradients one product's buffer
        probs = torch.empty(n if grad else min(n, rows), vocab, dtype=compute_dtype, device=h.device)
        valid = targets >= 0
        safe = torch.where(valid, targets, 0)[:, None]  # (N, 1): ignored rows point at id 0, weighted 0
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, n, rows):
                logits = probs[s:s + rows] if grad else probs[:min(rows, n - s)]
                torch.mm(hc[s:s + rows], wc.T, out=logits)  # (r, V)
                for a in range(0, logits.shape[0], step):  # a slice of rows whose logits stay in cache
                    b = min(a + step, logits.shape[0])
                    e = logits[a:b].float()  # float32 logits (the slice itself under float32)
                    keep, tgt = valid[s + a:s + b], safe[s + a:s + b]
                    picked = e.gather(1, tgt).squeeze(1)  # the target's logit
                    top = e.amax(dim=-1, keepdim=True)
                    sums = e.sub_(top).exp_().sum(dim=-1)  # e = exp(logit - max), in place
                    total += torch.where(keep, top.squeeze(1) + sums.log() - picked, 0.0).sum()
                    if grad:
                        # dloss/dlogits = softmax - onehot(target) = (e - [target] sum e) / sum e, 0 where ignored
                        e.scatter_add_(1, tgt, -sums[:, None]).mul_((keep / sums)[:, None])
                        logits[a:b].copy_(e)
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
