"""The one generation engine: KV-cached decoding with sampling, streaming token ids.

The engine knows token ids and a model, nothing about text: the CLI, the chat
terminal and the HTTP server turn text into ids and back around it. It decodes
from its own prepared copy of the model, so the caller's model (one that keeps
training, say) is never changed by it. Sampling filters are small pure
functions over a logits vector.
"""

from __future__ import annotations

import copy
from typing import Iterator, Sequence

import torch
import torch.nn as nn

from nanolm.config import SamplingParams
from nanolm.infer.fuse import fuse_projections
from nanolm.model.transformer import KVCache


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
    """One token id per row from logits (B, V) -> (B,)."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / params.temperature
    logits = top_p_filter(top_k_filter(logits, params.top_k), params.top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def inference_copy(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A copy of `model` in eval mode, its floating-point parameters and buffers in `dtype` on `device`.

    Each tensor is copied straight into `dtype` (as `model.to(device, dtype)` would convert it), so no
    second full-precision copy is held on the way; parameters are copied without their gradients and
    do not require any. `model` itself, its modules and its tensors are left as they are.
    """
    def converted(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(device=device, dtype=dtype if t.is_floating_point() else t.dtype, copy=True)

    # deepcopy takes a tensor found in the memo instead of copying it; a tied weight is one entry, so it
    # stays tied in the copy.
    memo: dict[int, object] = {id(p): nn.Parameter(converted(p), requires_grad=False) for p in model.parameters()}
    memo.update({id(b): converted(b) for b in model.buffers()})
    return copy.deepcopy(model, memo).eval()


class Engine:
    """Generates from a decoder-only model with a KV cache, decoding from its own prepared copy of it.

    Memory: the copy holds every weight once more, in the engine's dtype (minimind-26m: 103 MB in float32,
    52 MB in bfloat16), beside the caller's model, which stays as it was (its dtype, device, mode and
    tensors); a caller that has no further use for its model drops it, and only the copy remains. On the
    way, each tensor is converted straight into the engine's dtype (no float32 copy of a bf16 engine's
    weights is made), and fusing, like `load_weights`, stacks one module's q/k/v or gate/up at a time, so
    beyond the two models at most one module's projections are held once more.
    """

    def __init__(self, model: nn.Module, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        """Prepare the copy: weights in `dtype` on `device` (decoding reads every weight once per token, so
        bf16 weights halve the bytes, and nothing is re-cast under autocast), eval mode, and the q/k/v and
        gate/up products fused (`infer/fuse.py`): the same weights, fewer products."""
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = inference_copy(model, self.device, dtype)
        fuse_projections(self.model)  # fewer, larger products per token
        # PyTorch's CPU kernels attend one query in bf16/fp16 several times slower than in float32 (138 vs
        # 36 us for 300 cached tokens on 2 cores), and less exactly. A float32 cache is attended as it is,
        # where a bf16 one would be cast whole at every layer of every token.
        self.cache_dtype = torch.float32 if self.device.type == "cpu" else dtype
        self.max_seq_len: int = model.config.max_seq_len

    def load_weights(self, model: nn.Module) -> None:
        """Take `model`'s current weights again (a model that keeps training, for one): each is copied into
        the engine's copy in place, converted to its dtype and device (the copy's tensors are kept; a fused
        module's weights are stacked, one module at a time, on the way in).

        `model` must have the modules and shapes of the model the engine was built from (torch's
        load_state_dict error names what differs). Not to be called while `generate` runs.
        """
        with torch.no_grad():
            self.model.load_state_dict(model.state_dict())

    @torch.inference_mode()
    def generate(self, prompt: Sequence[int], params: SamplingParams,
                 stop_ids: Sequence[int] = ()) -> Iterator[int]:
        """Yield new token ids one at a time; stops at a stop id (not yielded), max_new_tokens or the context end."""
        if len(prompt) == 0:
            raise ValueError("the prompt must hold at least one token")
        if len(prompt) >= self.max_seq_len:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the model's context is {self.max_seq_len}")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        budget = min(params.max_new_tokens, self.max_seq_len - len(prompt))
        if budget <= 0:
            return
        cache = KVCache.empty(self.model.config, 1, len(prompt) + budget, self.device, self.cache_dtype)
        stops = set(stop_ids)
        x = torch.tensor([list(prompt)], dtype=torch.long, device=self.device)  # (1, T) prefill
        for i in range(budget):
            logits = self.model(x, cache)[:, -1, :]  # (1, V)
            token = sample_next(logits, params, generator)  # (1,)
            tid = int(token.item())
            if tid in stops:
                return
            yield tid
            if i + 1 < budget:
                x = token.view(1, 1)

    def generate_all(self, prompt: Sequence[int], params: SamplingParams, stop_ids: Sequence[int] = ()) -> list[int]:
        return list(self.generate(prompt, params, stop_ids))
