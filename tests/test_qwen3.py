"""Qwen3's decoder in nanolm: QK-norm, YaRN RoPE scaling, the MiniMind-3 presets.

QK-norm is checked against a hand-written attention and through every path
that computes attention (training forward, KV-cache prefill and decode, rows
of different lengths, the engine's fused projections, LoRA); YaRN's
frequencies and attention factor against transformers' own function, bit for
bit; a model stretched with YaRN at load time generates past its trained
context through the scaled tables; the presets have MiniMind-3's parameter
counts.
"""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch

from nanolm import checkpoint as ckpt
from nanolm.config import PRESETS, Config, ModelConfig, SamplingParams, TrainConfig, preset
from nanolm.errors import UserError
from nanolm.infer.engine import Engine
from nanolm.infer.fuse import FusedAttention, fuse_projections
from nanolm.infer.rows import rows_model
from nanolm.model.lora import apply_lora, merge_lora
from nanolm.model.transformer import KVCache, Transformer, Yarn, apply_rope, count_params, rope_tables

from test_model import assert_cached_decode_equals_full_forward  # noqa: E402


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=61, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=64, init_std=0.3,
                qk_norm=True)
    return ModelConfig(**{**base, **kw})


def random_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A model whose norm weights are away from 1, so a norm left out or swapped would show."""
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model


# ----------------------------------------------------------------------------- QK-norm

def test_qk_norm_adds_two_head_sized_weights_per_layer_and_nothing_else():
    plain, normed = Transformer(tiny(qk_norm=False)), Transformer(tiny())
    extra = set(normed.state_dict()) - set(plain.state_dict())
    assert extra == {f"layers.{i}.self_attn.{n}.weight" for i in range(2) for n in ("q_norm", "k_norm")}
    assert set(plain.state_dict()) <= set(normed.state_dict())
    assert not any("q_norm" in k or "k_norm" in k for k in plain.state_dict())  # old checkpoints load as before
    assert normed.layers[0].self_attn.q_norm.weight.shape == (8,)
    assert count_params(normed)["total"] - count_params(plain)["total"] == 2 * 2 * 8


def test_qk_norm_attention_equals_a_hand_written_one():
    """RMSNorm of each head's q and k over the head dimension (one weight shared by the heads), then RoPE."""
    cfg = tiny()
    model = random_model(cfg)
    attn = model.layers[0].self_attn
    x = torch.randn(2, 10, cfg.d_model)
    cos, sin = model.rope_cos[:10], model.rope_sin[:10]
    B, T, nh, nkv, hs = 2, 10, 4, 2, 8

    def rms(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w

    with torch.no_grad():
        got = attn(x, cos, sin)
        q = apply_rope(rms((x @ attn.q_proj.weight.T).view(B, T, nh, hs), attn.q_norm.weight).transpose(1, 2),
                       cos, sin)
        k = apply_rope(rms((x @ attn.k_proj.weight.T).view(B, T, nkv, hs), attn.k_norm.weight).transpose(1, 2),
                       cos, sin)
        v = (x @ attn.v_proj.weight.T).view(B, T, nkv, hs).transpose(1, 2)
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        att = (q @ k.transpose(-1, -2)) / hs ** 0.5
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        want = (att @ v).transpose(1, 2).reshape(B, T, nh * hs) @ attn.o_proj.weight.T
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # The norm is really applied: without it the output differs.
        attn.q_norm, attn.k_norm = None, None
        assert not torch.allclose(attn(x, cos, sin), got, atol=1e-3)


@pytest.mark.parametrize("over", [{}, {"rope_scaling": "yarn", "rope_factor": 2.0, "rope_original_max_len": 32}],
                         ids=["qk-norm", "qk-norm-yarn"])
def test_kv_cache_prefill_and_decode_equal_the_full_forward(over):
    model = random_model(tiny(**over))
    x = torch.randint(0, 61, (2, 50), generator=torch.Generator().manual_seed(1))
    assert_cached_decode_equals_full_forward(model, x, 20, 37, 64)


def test_rows_of_different_lengths_decode_as_each_alone():
    """`RowsTransformer.decode_rows` (cache.lengths): each row rotated, normalised and masked by its own position."""
    cfg = tiny()
    model = rows_model(random_model(cfg))
    rows = [torch.randint(0, 61, (1, n), generator=torch.Generator().manual_seed(n)) for n in (5, 12, 9)]
    with torch.no_grad():
        alone = [model(r)[0, -1] for r in rows]  # (V,) the logits of each row's last token
        cache = KVCache.empty(cfg, 3, 16, "cpu", torch.float32)
        for b, r in enumerate(rows):  # fill each row's cache with all but its last token, one row at a time
            one = KVCache.empty(cfg, 1, 16, "cpu", torch.float32)
            model(r[:, :-1], one)
            for layer in range(cfg.n_layer):
                cache.k[layer][b] = one.k[layer][0]
                cache.v[layer][b] = one.v[layer][0]
        cache.lengths = torch.tensor([r.shape[1] - 1 for r in rows])
        got = model(torch.stack([r[0, -1:] for r in rows]), cache)[:, 0]  # (3, V)
    torch.testing.assert_close(got, torch.stack(alone), atol=1e-5, rtol=1e-5)
    assert cache.lengths.tolist() == [5, 12, 9]


def test_fused_attention_applies_the_norms_and_the_engine_decodes_like_recompute():
    model = random_model(tiny())
    fused = copy.deepcopy(model)
    assert fuse_projections(fused) == 2 * 2
    attn = fused.layers[0].self_attn
    assert type(attn) is FusedAttention
    assert torch.equal(attn.q_norm.weight, model.layers[0].self_attn.q_norm.weight)
    x = torch.randint(0, 61, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), atol=1e-6, rtol=1e-6)
    # The fused module loads the model's own layout, norms included (how Engine.load_weights refreshes it).
    other = random_model(tiny(), seed=5)
    fused.load_state_dict(other.state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), other(x), atol=1e-6, rtol=1e-6)

    prompt = [3, 14, 15, 9, 26, 5]
    engine = Engine(model)
    assert type(engine.model.layers[1].self_attn) is FusedAttention
    got = engine.generate_all(prompt, SamplingParams(max_new_tokens=30, temperature=0))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(30):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert got == ids[len(prompt):] and len(set(got)) > 3


def test_rows_batched_in_the_engine_equal_each_alone():
    engine = Engine(random_model(tiny()))
    prompts = [[3, 14, 15], list(range(5, 30)), [7], list(range(40, 52))]
    params = SamplingParams(max_new_tokens=15, temperature=0)
    alone = [engine.generate_all(p, params) for p in prompts]
    assert engine.generate_many(prompts, params) == alone


def test_lora_wraps_the_projections_and_leaves_the_norms():
    model = random_model(tiny())
    wrapped = apply_lora(model, rank=2, alpha=4.0, dropout=0.0)
    assert not any("norm" in name for name in wrapped) and len(wrapped) == 2 * 7
    with pytest.raises(UserError, match=r"lora.targets: 'q_norm' names no linear layer"):
        apply_lora(random_model(tiny()), rank=2, alpha=4.0, dropout=0.0, targets=("q_norm",))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0.0, 0.1)
    x = torch.randint(0, 61, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        adapted = model(x)
        merge_lora(model)
        torch.testing.assert_close(model(x), adapted, atol=1e-5, rtol=1e-5)
    assert set(model.state_dict()) == set(Transformer(tiny()).state_dict())


def test_a_checkpoint_without_qk_norm_is_refused_by_a_qk_norm_config(tmp_path):
    cfg = tiny(qk_norm=False)
    ckpt.save_model(tmp_path / "m", Transformer(cfg), tokenizer_from=None)
    with pytest.raises(UserError, match=r"4 missing, first: layers\.0\.self_attn\.k_norm\.weight"):
        ckpt.build_model(tiny(), tmp_path / "m")
    assert ckpt.build_model(cfg, tmp_path / "m").config == cfg


# ----------------------------------------------------------------------------- YaRN

YARN_CASES = list(itertools.product([8, 96, 128], [1e4, 1e6], [2.0, 4.0, 16.0, 2.5], [32, 512, 2048],
                                    [(32.0, 1.0), (16.0, 2.0)]))


@pytest.mark.parametrize("head_dim,theta,factor,original,betas", YARN_CASES)
def test_yarn_frequencies_and_attention_factor_are_transformers_bit_for_bit(head_dim, theta, factor, original,
                                                                               betas):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.Qwen3Config(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                      max_position_embeddings=int(original * factor), rope_parameters={
                                          "rope_type": "yarn", "rope_theta": theta, "factor": factor,
                                          "original_max_position_embeddings": original, "beta_fast": betas[0],
                                          "beta_slow": betas[1]})
    want, scale = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    yarn = Yarn(factor, original, *betas)
    got = yarn.inv_freq(head_dim, theta)
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)
    assert yarn.scale == scale == 0.1 * math.log(factor) + 1


def test_yarn_keeps_fast_pairs_interpolates_slow_ones_and_scales_the_tables():
    hs, theta, original = 64, 1e4, 2048
    yarn = Yarn(4.0, original)
    inv = yarn.inv_freq(hs, theta).double()
    plain = 1.0 / theta ** (torch.arange(0, hs, 2, dtype=torch.float64) / hs)
    # Pair i turns original * f_i / 2 pi times over the trained context: 32 times at pair 8.06, once at 20.1,
    # so pairs 0..8 keep f_i, pairs 21.. get f_i / 4, and the ramp blends pairs 9..20.
    turns = original * plain / (2 * math.pi)
    assert turns[8] > 32 > turns[9] and turns[20] > 1 > turns[21]
    torch.testing.assert_close(inv[:9], plain[:9], rtol=1e-7, atol=0)
    torch.testing.assert_close(inv[21:], plain[21:] / 4, rtol=1e-7, atol=0)
    ramp = (torch.arange(9, 21, dtype=torch.float64) - 8) / (21 - 8)
    torch.testing.assert_close(inv[9:21], plain[9:21] * (1 - ramp) + plain[9:21] / 4 * ramp, rtol=1e-6, atol=0)
    cos, sin = rope_tables(hs, 256, theta, yarn)
    angles = torch.arange(256, dtype=torch.float64)[:, None] * torch.cat([inv, inv])
    scale = 0.1 * math.log(4) + 1
    torch.testing.assert_close(cos.double(), angles.cos() * scale, rtol=0, atol=1e-7)
    torch.testing.assert_close(sin.double(), angles.sin() * scale, rtol=0, atol=1e-7)
    # An explicit attention factor replaces the default one (MiniMind's inference scaling uses 1).
    cos1, _ = rope_tables(hs, 256, theta, Yarn(4.0, original, attention_factor=1.0))
    torch.testing.assert_close(cos1.double(), angles.cos(), rtol=0, atol=1e-7)


def test_yarn_config_is_validated_with_one_line_messages():
    with pytest.raises(UserError, match=r"model.rope_scaling must be one of none, yarn, llama3, got 'ntk'"):
        tiny(rope_scaling="ntk")
    with pytest.raises(UserError, match=r"model.rope_factor=4.0 applies only with model.rope_scaling yarn"):
        tiny(rope_factor=4.0)
    with pytest.raises(UserError, match=r"model.rope_original_max_len must be in \[1, model.max_seq_len=64\]"):
        tiny(rope_scaling="yarn", rope_factor=4.0)
    with pytest.raises(UserError, match=r"model.rope_original_max_len must be in \[1, model.max_seq_len=64\]"):
        tiny(rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=128)
    with pytest.raises(UserError, match=r"model.rope_factor must be >= 1"):
        tiny(rope_scaling="yarn", rope_factor=0.5, rope_original_max_len=16)
    with pytest.raises(UserError, match=r"model.rope_beta_fast \(1.0\) must exceed model.rope_beta_slow \(2.0\)"):
        tiny(rope_scaling="yarn", rope_factor=2.0, rope_original_max_len=16, rope_beta_fast=1.0, rope_beta_slow=2.0)
    with pytest.raises(UserError, match=r"model.rope_attention_factor must be >= 0"):
        tiny(rope_scaling="yarn", rope_factor=2.0, rope_original_max_len=16, rope_attention_factor=-1.0)
    cfg = ModelConfig.from_dict({"rope_scaling": "yarn", "rope_factor": "4", "rope_original_max_len": "128"})
    assert (cfg.rope_factor, cfg.rope_original_max_len, cfg.max_seq_len) == (4.0, 128, 512)


def test_with_yarn_stretches_a_trained_context():
    cfg = tiny(max_seq_len=32)
    long = cfg.with_yarn(4)
    assert (long.rope_scaling, long.rope_factor, long.rope_original_max_len, long.max_seq_len) == ("yarn", 4.0, 32, 128)
    assert cfg.with_yarn(2.5, trained_len=20).max_seq_len == 50
    with pytest.raises(UserError, match=r"the model already uses YaRN \(model.rope_factor=4"):
        long.with_yarn(2)
    with pytest.raises(UserError, match=r"the YaRN factor must be > 1, got 1"):
        cfg.with_yarn(1.0)
    with pytest.raises(UserError, match=r"the trained length must be in \[1, model.max_seq_len=32\], got 33"):
        cfg.with_yarn(2.0, trained_len=33)


def yarn_run(tmp_path, tokenizer_dir, seq_len: int = 32):
    """A run of a tiny QK-norm model with max_seq_len 32, trained (as its config says) on `seq_len` windows."""
    cfg = tiny(max_seq_len=32)
    model = random_model(cfg)
    run = tmp_path / "run"
    ckpt.save_checkpoint(run, 1, model, None, Config(model=cfg, train=TrainConfig(seq_len=seq_len)), {},
                         tokenizer_dir=tokenizer_dir)
    return run, model


def test_a_model_loaded_with_yarn_generates_past_its_trained_context(tmp_path, tokenizer_dir):
    run, plain = yarn_run(tmp_path, tokenizer_dir)
    long, _ = ckpt.load_model(run, yarn=4)
    assert (long.config.max_seq_len, long.config.rope_original_max_len, long.config.rope_factor) == (128, 32, 4.0)
    assert long.rope_cos.shape == (128, 8)
    prompt = list(range(1, 21))
    params = SamplingParams(max_new_tokens=100, temperature=0)
    with pytest.raises(ValueError, match="exceeds model.max_seq_len=32"):
        plain(torch.tensor([list(range(33))]))
    got = Engine(long).generate_all(prompt, params)
    assert len(got) == 100  # 20 + 100 tokens, far past the 32 it was trained at: the KV cache follows max_seq_len
    assert len(Engine(plain).generate_all(prompt, params)) == 12  # the plain model stops at its context

    # Within the first 32 positions the two differ only by the RoPE tables: the plain model given the YaRN
    # tables computes exactly what the YaRN model does, and without them it does not.
    x = torch.randint(0, 61, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        scaled = long(x)
        assert (scaled - plain(x)).abs().max() > 1e-2
        plain.rope_cos, plain.rope_sin = long.rope_cos[:32], long.rope_sin[:32]
        assert torch.equal(plain(x), scaled)


def test_yarn_starts_from_the_trained_window_and_refuses_twice(tmp_path, tokenizer_dir):
    run, _ = yarn_run(tmp_path, tokenizer_dir, seq_len=16)  # context 32, trained on 16-token windows
    model, _ = ckpt.load_model(run, yarn=4)
    assert (model.config.rope_original_max_len, model.config.max_seq_len) == (16, 64)
    stretched = ckpt.save_model(tmp_path / "long", model, tokenizer_from=tokenizer_dir)
    with pytest.raises(UserError, match=r"^--yarn 2: .*long: the model already uses YaRN"):
        ckpt.load_model(stretched, yarn=2)
    assert ckpt.load_model(stretched)[0].config == model.config  # the YaRN settings are saved with the model


def test_cli_inference_commands_take_yarn():
    from nanolm.cli import build_parser
    for command in ("generate", "chat", "serve"):
        assert build_parser().parse_args([command, "run", "--yarn", "4"]).yarn == 4.0
    assert build_parser().parse_args(["generate", "run"]).yarn is None


# ----------------------------------------------------------------------------- presets

@pytest.mark.parametrize("name,total,active", [("minimind-3", 63_912_192, 63_912_192),
                                               ("minimind-3-moe", 198_416_640, 63_936_768)])
def test_minimind_3_presets_have_minimind_3s_shape_and_size(name, total, active):
    cfg = preset(name)
    m = cfg.model
    assert (m.vocab_size, m.d_model, m.n_layer, m.n_head, m.n_kv_head, m.head_dim, m.n_hidden) == \
        (6400, 768, 8, 8, 4, 96, 2432)
    assert (m.max_seq_len, m.rope_theta, m.norm_eps, m.qk_norm, m.tie_embeddings, m.rope_scaling) == \
        (32768, 1e6, 1e-6, True, True, "none")
    if m.use_moe:
        assert (m.n_experts, m.top_k, m.n_shared_experts, m.moe_n_hidden, m.norm_topk) == (4, 1, 0, 2432, True)
    with torch.device("meta"):
        p = count_params(Transformer(m))
    assert (p["total"], p["active"], p["embedding"]) == (total, active, 6400 * 768)
    # MiniMind-3's own count: one layer is its attention (q, k, v, o, QK-norm), its MLP (or 4 experts + router)
    # and two norms; then the tied embedding and the final norm.
    attn = 768 * 96 * (8 + 4 + 4) + 8 * 96 * 768 + 2 * 96
    mlp = 4 * 3 * 768 * 2432 + 768 * 4 if m.use_moe else 3 * 768 * 2432
    assert total == 8 * (attn + mlp + 2 * 768) + 6400 * 768 + 768


def test_cli_lists_every_preset(capsys):
    from nanolm.cli import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    shown = "".join(capsys.readouterr().out.split())  # the help text, unwrapped
    assert ",".join(PRESETS) in shown and "minimind-3,minimind-3-moe" in shown


def test_qk_norm_weights_train_without_decay():
    from nanolm.train.optim import param_groups
    model = Transformer(tiny())
    no_decay = {id(p) for p in param_groups(model, 0.1)[1]["params"]}
    assert id(model.layers[0].self_attn.q_norm.weight) in no_decay
