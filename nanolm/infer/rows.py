"""The engine's many-row decode paths, applied to the model from outside (as infer/fuse.py applies its products).

The architecture (model/transformer.py) decodes one sequence at a time from a cache filled to `cache.pos`. The
engine decodes many rows together, each filled to its own length (`cache.lengths`): each row's new token is
rotated by its own position, written at its own place in the cache and attends to its own filled positions only;
and a prompt joining rows being decoded is prefilled in the same pass through the layers as their step. Those two
paths are here: `RowsTransformer` is the Transformer with them (the engine's copy becomes one, `rows_model`), and
it drives the model's own modules (norms, `Attention.project`, o_proj, the MLP, the head), so the fused products of
infer/fuse.py and LoRA adapters run in them as in the architecture's path.

Shapes: B rows, P prompts of T tokens, S the longest row with its new token, n heads, hs head size, V vocabulary.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanolm.model.transformer import Attention, Block, KVCache, Transformer


class _KnownBreak(logging.Filter):
    """Drops torch.compile's one-time advice on a graph break at `Tensor.item()`: the decode step of rows of
    different lengths reads the longest of them as a Python int, to attend to no more cache than that, and breaks
    its graph there by design; the advice (15 lines on stderr) is for PyTorch's developers, not for a user."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Graph break from `Tensor.item()`" not in record.getMessage()


def quiet_known_break() -> None:
    """Filter `_KnownBreak`'s advice from dynamo's log (once per process)."""
    logger = logging.getLogger("torch._dynamo.variables.tensor")
    if not any(isinstance(f, _KnownBreak) for f in logger.filters):
        logger.addFilter(_KnownBreak())


def rows_attention(attn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int,
                   mask: torch.Tensor) -> torch.Tensor:
    """One new token per row (q, k, v: (B, n, 1, hs)), written at the row's own position (cache.lengths) and
    attending to the row's filled positions; `mask` (B, 1, 1, S) covers the longest row -> (B, nh, 1, hs)."""
    B = q.shape[0]
    rows = torch.arange(B, device=q.device)
    cache.k[layer][rows, :, cache.lengths] = k[:, :, 0].to(cache.k[layer].dtype)
    cache.v[layer][rows, :, cache.lengths] = v[:, :, 0].to(cache.v[layer].dtype)
    k = cache.k[layer][:, :, :mask.shape[-1]]  # (B, nkv, S, hs)
    v = cache.v[layer][:, :, :mask.shape[-1]]
    # One query per row: a key/value head's query heads attend as rows of one group, which PyTorch's
    # CPU kernels do in half the time of enable_gqa with a mask (16 rows: 0.26 vs 0.50 ms a layer).
    g = attn.n_head // attn.n_kv_head
    return F.scaled_dot_product_attention(q.to(k.dtype).reshape(B, attn.n_kv_head, g, attn.head_dim), k, v,
                                          attn_mask=mask).reshape(B, attn.n_head, 1, attn.head_dim)


def rows_and_prompts_attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                               cache: KVCache, prompts: KVCache, layer: int, mask: torch.Tensor) -> torch.Tensor:
    """`RowsTransformer.decode_and_prefill`'s attention: x (1, B + P*T, C) holds B rows' new tokens, then P prompts
    of T tokens; the rows attend as `rows_attention` does, each prompt causally to itself, written at positions
    0..T-1 of `prompts` (P rows) -> the attention's output (1, B + P*T, C)."""
    q, k, v = attn.project(x, cos, sin)  # (1, n, B + P*T, hs)
    B, P = cache.lengths.shape[0], prompts.k[layer].shape[0]
    T = (x.shape[1] - B) // P

    def rows(t: torch.Tensor) -> torch.Tensor:  # (1, n, B + P*T, hs) -> (B, n, 1, hs)
        return t[0, :, :B].transpose(0, 1).unsqueeze(2)

    def prompt(t: torch.Tensor) -> torch.Tensor:  # (1, n, B + P*T, hs) -> (P, n, T, hs)
        return t[0, :, B:].unflatten(1, (P, T)).transpose(0, 1)

    y_rows = rows_attention(attn, rows(q), rows(k), rows(v), cache, layer, mask)  # (B, nh, 1, hs)
    prompts.k[layer][:, :, :T] = prompt(k)
    prompts.v[layer][:, :, :T] = prompt(v)
    pk, pv = prompts.k[layer][:, :, :T], prompts.v[layer][:, :, :T]
    y_prompts = F.scaled_dot_product_attention(prompt(q).to(pk.dtype), pk, pv, is_causal=T > 1,
                                               enable_gqa=attn.n_kv_head != attn.n_head)  # (P, nh, T, hs)
    y = torch.cat([y_rows.squeeze(2), y_prompts.transpose(1, 2).reshape(P * T, attn.n_head, attn.head_dim)])
    return attn.o_proj(y.to(x.dtype).reshape(1, B + P * T, attn.n_head * attn.head_dim))


def block_step(block: Block, x: torch.Tensor,
               attend: Callable[[Attention, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One block as Block.forward computes it, its attention `attend(attention, normed x)`: x (B, T, C) -> (B, T, C)."""
    x = x + block.dropout(attend(block.self_attn, block.input_layernorm(x)))
    return x + block.dropout(block.mlp(block.post_attention_layernorm(x)))


class RowsTransformer(Transformer):
    """The Transformer that also decodes rows of different lengths (a cache with `lengths`: `model(idx, cache)`)
    and decodes rows while prefilling prompts in one pass (`decode_and_prefill`). Made from a Transformer by
    `rows_model`, sharing its modules and tensors; every other call is the architecture's own forward."""

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None, *args: torch.Tensor | None,
                **kw: torch.Tensor | None) -> torch.Tensor:
        """As Transformer.forward; with a cache of rows of different lengths (cache.lengths), `decode_rows`; one
        token after a cache filled to cache.pos in eval mode, `decode_one`."""
        plain = not any(a is not None for a in (*args, *kw.values()))
        if (cache is not None and cache.lengths is None and idx.shape[1] == 1 and plain and not self.training
                and self.config.causal):
            return self.decode_one(idx, cache)
        if cache is None or cache.lengths is None:
            return super().forward(idx, cache, *args, **kw)
        if not plain:
            raise ValueError("rows of different lengths decode one token each, with no positions, segments, "
                             "targets or picked positions")
        return self.decode_rows(idx, cache)

    def decode_one(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One token per row after cache.pos (idx (B, 1) -> logits (B, 1, V)): the operations of the architecture's
        decoding path, in its order (so the same logits, bit for bit), without what a 30-layer token paid for
        nothing in eval mode: each block's and attention's module call, the dropouts, the training and masking
        branches of Attention.forward."""
        B, pos = idx.shape[0], cache.pos
        if pos + 1 > self.config.max_seq_len:
            raise ValueError(f"sequence of {pos + 1} tokens exceeds model.max_seq_len={self.config.max_seq_len}")
        cos, sin = self.rope_cos[pos:pos + 1], self.rope_sin[pos:pos + 1]  # (1, hs)
        x = self._embed(idx)  # (B, 1, C)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v = attn.project(layer.input_layernorm(x), cos, sin)  # (B, n, 1, hs)
            cache.k[i][:, :, pos:pos + 1] = k
            cache.v[i][:, :, pos:pos + 1] = v
            k, v = cache.k[i][:, :, :pos + 1], cache.v[i][:, :, :pos + 1]  # (B, nkv, S, hs)
            y = F.scaled_dot_product_attention(q.to(k.dtype), k, v, enable_gqa=attn.n_kv_head != attn.n_head)
            x = x + attn.o_proj(y.to(x.dtype).transpose(1, 2).reshape(B, 1, attn.n_head * attn.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        cache.pos += 1
        return self._head(self.norm(x))  # (B, 1, V)

    def decode_rows(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One token per row after rows of different lengths (cache.lengths): idx (B, 1) -> logits (B, 1, V)."""
        B, lengths = idx.shape[0], cache.lengths
        mask = self.rows_mask(idx, cache)
        cos = self.rope_cos[lengths].view(B, 1, 1, -1)  # (B, 1, 1, hs): each row rotated by its own position
        sin = self.rope_sin[lengths].view(B, 1, 1, -1)

        def attend(attn: Attention, h: torch.Tensor, i: int) -> torch.Tensor:
            y = rows_attention(attn, *attn.project(h, cos, sin), cache, i, mask)  # (B, nh, 1, hs)
            return attn.o_proj(y.to(h.dtype).reshape(B, 1, -1))

        x = self.dropout(self._embed(idx))  # (B, 1, C)
        for i, layer in enumerate(self.layers):
            x = block_step(layer, x, lambda attn, h: attend(attn, h, i))
        cache.lengths += 1
        return self._head(self.norm(x))  # (B, 1, V)

    def rows_mask(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The attention mask (B, 1, 1, S) of one new token per row after rows of different lengths (cache.lengths),
        S the longest row with its new token: each row sees its own filled positions and the new one. Checks
        that idx is (B, 1) and that the longest row fits the model and the cache."""
        B, T = idx.shape
        lengths = cache.lengths
        if T != 1 or lengths.shape != (B,):
            raise ValueError(f"rows of different lengths decode one token each: idx is {tuple(idx.shape)}, "
                             f"the cache holds {tuple(lengths.shape)} rows")
        span = int(lengths.max()) + 1  # the longest row, with its new token
        if span > min(self.config.max_seq_len, cache.max_len):
            raise ValueError(f"sequence of {span} tokens exceeds model.max_seq_len={self.config.max_seq_len} "
                             f"or the cache's {cache.max_len} positions")
        return (torch.arange(span, device=idx.device) <= lengths[:, None]).view(B, 1, 1, span)

    def decode_and_prefill(self, idx: torch.Tensor, cache: KVCache, prompts: torch.Tensor, prompt_cache: KVCache,
                           last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What `self(idx, cache)` (one token per row of `cache`, rows of different lengths) and
        `self(prompts, prompt_cache, last=last)` (an empty cache) compute, in one pass through the layers: the
        products, norms and MLP of both as one call each, the attention of each its own, so a prompt joining rows
        being decoded costs its tokens' arithmetic, not a second forward's operations. idx (B, 1), prompts (P, T)
        right-padded -> (the rows' logits (B, V), the prompts' at their position last[p] (P, V))."""
        B, P, T = idx.shape[0], prompts.shape[0], prompts.shape[1]
        mask = self.rows_mask(idx, cache)
        if prompt_cache.pos != 0 or T > min(self.config.max_seq_len, prompt_cache.max_len):
            raise ValueError(f"prompts {tuple(prompts.shape)} are prefilled into an empty cache of at least their "
                             f"length: this one has {prompt_cache.pos} of {prompt_cache.max_len} positions filled "
                             f"(model.max_seq_len {self.config.max_seq_len})")
        at = torch.cat([cache.lengths, torch.arange(T, device=idx.device).repeat(P)])  # each token's position
        cos, sin = self.rope_cos[at], self.rope_sin[at]  # (B + P*T, hs)
        x = self.dropout(self._embed(torch.cat([idx.reshape(B), prompts.reshape(P * T)]))).unsqueeze(0)
        for i, layer in enumerate(self.layers):
            x = block_step(layer, x, lambda attn, h: rows_and_prompts_attention(attn, h, cos, sin, cache,
                                                                                prompt_cache, i, mask))
        cache.lengths += 1
        prompt_cache.pos = T
        ends = torch.cat([torch.arange(B, device=idx.device), B + T * torch.arange(P, device=idx.device) + last])
        logits = self._head(self.norm(x[0].index_select(0, ends)))  # (B + P, V)
        return logits[:B], logits[B:]


def rows_model(model: nn.Module) -> nn.Module:
    """`model` with every Transformer in it (itself, or the one a wrapper holds) made a `RowsTransformer` sharing
    its modules, parameters and buffers (nothing is copied); returns the model (itself, unless it was one)."""
    def converted(t: Transformer) -> RowsTransformer:
        rows = RowsTransformer.__new__(RowsTransformer)
        rows.__dict__.update(t.__dict__)  # the same modules, parameters, buffers, config and mode
        return rows

    if type(model) is Transformer:
        return converted(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is Transformer:
                setattr(parent, name, converted(child))
    return model
