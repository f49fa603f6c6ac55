"""The decoder: causality, GQA, KV cache, parameter and FLOP reports."""

import torch

from nanolm.config import ModelConfig, preset
from nanolm.model.transformer import KVCache, Transformer, count_params, flops_per_token


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=97, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=64)
    return ModelConfig(**{**base, **kw})


def test_attention_is_causal():
    torch.manual_seed(0)
    model = Transformer(tiny()).eval()
    x = torch.randint(0, 97, (2, 20))
    y = x.clone()
    y[:, 12:] = torch.randint(0, 97, (2, 8))  # change only the later tokens
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.equal(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_gqa_with_all_heads_is_multi_head_attention():
    """n_kv_head == n_head must equal a hand-written multi-head attention on the same weights."""
    torch.manual_seed(0)
    cfg = tiny(n_kv_head=4)
    model = Transformer(cfg).eval()
    attn = model.layers[0].self_attn
    x = torch.randn(2, 10, cfg.d_model)
    cos, sin = model.rope_cos[:10], model.rope_sin[:10]
    with torch.no_grad():
        got = attn(x, cos, sin)
        from nanolm.model.transformer import apply_rope
        B, T, C, nh, hs = 2, 10, cfg.d_model, cfg.n_head, cfg.head_dim
        q = apply_rope((x @ attn.q_proj.weight.T).view(B, T, nh, hs).transpose(1, 2), cos, sin)
        k = apply_rope((x @ attn.k_proj.weight.T).view(B, T, nh, hs).transpose(1, 2), cos, sin)
        v = (x @ attn.v_proj.weight.T).view(B, T, nh, hs).transpose(1, 2)
        att = (q @ k.transpose(-1, -2)) / hs ** 0.5
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        want = (att @ v).transpose(1, 2).reshape(B, T, C) @ attn.o_proj.weight.T
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_gqa_equals_multi_head_attention_with_repeated_kv_heads():
    """GQA (2 kv heads for 4 query heads) == MHA whose k/v heads are the GQA heads, each repeated twice."""
    torch.manual_seed(0)
    gqa = Transformer(tiny(n_kv_head=2)).eval()
    mha = Transformer(tiny(n_kv_head=4)).eval()
    hs = gqa.config.head_dim
    with torch.no_grad():
        for name, p in mha.named_parameters():
            src = dict(gqa.named_parameters())[name]
            if name.endswith(("k_proj.weight", "v_proj.weight")):
                p.copy_(src.view(2, hs, -1).repeat_interleave(2, dim=0).reshape(4 * hs, -1))
            else:
                p.copy_(src)
        x = torch.randint(0, 97, (2, 16))
        torch.testing.assert_close(gqa(x), mha(x), atol=1e-5, rtol=1e-5)


def assert_cached_decode_equals_full_forward(model, x: torch.Tensor, prefill: int, chunk_end: int,
                                            cache_len: int) -> KVCache:
    """Prefill x[:, :prefill], a chunk up to chunk_end after the cache, then one token at a time: the logits
    equal one full forward of x. Returns the cache."""
    with torch.no_grad():
        full = model(x)
        cache = KVCache.empty(model.config, x.shape[0], cache_len, "cpu", torch.float32)
        parts = [model(x[:, :prefill], cache), model(x[:, prefill:chunk_end], cache)]
        parts += [model(x[:, i:i + 1], cache) for i in range(chunk_end, x.shape[1])]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)
    return cache


def test_kv_cache_matches_full_forward():
    torch.manual_seed(0)
    model = Transformer(tiny()).eval()
    cache = assert_cached_decode_equals_full_forward(model, torch.randint(0, 97, (2, 24)), 10, 17, 32)
    assert cache.pos == 24


def test_tied_embeddings_share_storage():
    model = Transformer(tiny())
    assert model.lm_head.weight is model.embed_tokens.weight
    untied = Transformer(tiny(tie_embeddings=False))
    assert untied.lm_head.weight is not untied.embed_tokens.weight
    assert count_params(untied)["total"] - count_params(model)["total"] == 97 * 32


def test_minimind_26m_parameter_count_and_flops():
    cfg = preset("minimind-26m").model
    model = Transformer(cfg)
    p = count_params(model)
    assert p["total"] == p["trainable"] == 25_829_888  # MiniMind2-Small's ~26M
    assert p["embedding"] == 6400 * 512
    per_layer = 512 * 64 * (8 + 4) + 512 * 512 + 3 * 512 * 1408
    assert flops_per_token(cfg, 512) == 6 * (8 * per_layer + 6400 * 512) + 12 * 8 * 512 * 512


def test_sequence_longer_than_context_is_refused():
    model = Transformer(tiny(max_seq_len=8))
    try:
        model(torch.zeros(1, 9, dtype=torch.long))
    except ValueError as e:
        assert "max_seq_len=8" in str(e)
    else:
        raise AssertionError("expected ValueError")


def test_packed_segments_equal_separate_sequences():
    """Two sequences packed in one row with seg/pos give the logits each gives alone."""
    torch.manual_seed(0)
    model = Transformer(tiny()).eval()
    a, b = torch.randint(0, 97, (1, 7)), torch.randint(0, 97, (1, 5))
    packed = torch.cat([a, b], dim=1)
    seg = torch.tensor([[0] * 7 + [1] * 5])
    pos = torch.tensor([list(range(7)) + list(range(5))])
    with torch.no_grad():
        got = model(packed, pos=pos, seg=seg)
        torch.testing.assert_close(got[:, :7], model(a), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[:, 7:], model(b), atol=1e-5, rtol=1e-5)
        # without the segment mask the second sequence would see the first
        assert not torch.allclose(model(packed, pos=pos)[:, 7:], model(b), atol=1e-3)
