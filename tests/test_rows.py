"""The engine's decode paths (nanolm/infer/rows.py) against the architecture's own: `decode_one`, the one-token
step the engine's copy takes after a cache filled to `pos`, gives the architecture's logits and cache bit for bit,
for one row and many, fused or plain, with LoRA adapters or without, in float32 and bf16."""

from __future__ import annotations

import copy

import pytest
import torch

from nanolm.config import ModelConfig
from nanolm.infer.fuse import fuse_projections
from nanolm.infer.rows import RowsTransformer, rows_model
from nanolm.model.lora import apply_lora
from nanolm.model.transformer import KVCache, Transformer


def _model(qk_norm: bool = False) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, d_model=48, n_layer=3, n_head=6, n_kv_head=2, max_seq_len=64, init_std=0.3,
                      qk_norm=qk_norm)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # norm weights away from 1, so a norm left out would show
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model


def _decode(model: torch.nn.Module, rows: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], KVCache]:
    """A 7-token prefill of `rows` rows, then 5 tokens one at a time: each step's logits and the cache."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 61, (rows, 7), generator=g)
    cache = KVCache.empty(model.config, rows, 16, "cpu", torch.float32)
    out = [model(prompt, cache)]
    for _ in range(5):
        out.append(model(torch.randint(0, 61, (rows, 1), generator=g), cache))
    return out, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("variant", ["plain", "fused", "lora", "qk-norm"])
def test_decode_one_is_the_architectures_step_bit_for_bit(variant, rows, dtype):
    model = _model(qk_norm=variant == "qk-norm")
    if variant == "lora":
        apply_lora(model, rank=4, alpha=8.0, dropout=0.0)
        with torch.no_grad():  # B away from zero, so the adapters change the products
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
    model = model.to(dtype)
    ours = rows_model(copy.deepcopy(model))
    if variant == "fused":
        assert fuse_projections(model) == fuse_projections(ours) == 2 * 3
    assert type(ours) is RowsTransformer and type(model) is Transformer
    steps = []
    ours.decode_one = lambda idx, cache, f=ours.decode_one: steps.append(idx.shape) or f(idx, cache)
    with torch.inference_mode():
        want, want_cache = _decode(model, rows, dtype)
        got, got_cache = _decode(ours, rows, dtype)
    assert steps == [(rows, 1)] * 5  # the prefill took the architecture's path, every step decode_one
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert got_cache.pos == want_cache.pos == 12
    for a, b in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v):
        assert torch.equal(a, b)


def test_decode_one_checks_the_context_and_leaves_training_to_the_architecture():
    model = rows_model(_model())
    cache = KVCache.empty(model.config, 1, 64, "cpu", torch.float32)
    cache.pos = 64
    with pytest.raises(ValueError, match="exceeds model.max_seq_len=64"):
        model(torch.tensor([[1]]), cache)
    model.train()  # dropout and training branches: the architecture's forward
    model.decode_one = lambda *a: pytest.fail("decode_one in training mode")
    cache.pos = 3
    model(torch.tensor([[1]]), cache)
