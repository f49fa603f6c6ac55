"""The small models people already have: Qwen2 / Qwen2.5, Llama 3.x and Qwen3, in from and out to their own
transformers classes, and out to llama.cpp.

Each family is built by transformers' own config and model classes at a tiny random size (Qwen2 with random
non-zero q/k/v biases, Llama 3 with its llama3 RoPE scaling and a head size other than hidden / heads, Qwen3
with head_dim 32 at hidden 64 and 4 heads; tied and untied output embeddings), saved with save_pretrained and
imported; nanolm then computes transformers' logits in float32 (1e-4) in a prefill, token by token through its
KV cache, and its engine's greedy continuations (rows of different lengths decoded together, through the fused
q/k/v product) are transformers' generate's. Exported back, transformers reloads the same logits. Beside them:
the llama3 frequencies bit for bit, an old config.json without the new fields, LoRA on a biased model, and the
GGUF export of each family (its llama.cpp logits where llama-cpp-python is installed).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from nanolm import checkpoint as ckpt
from nanolm.config import Config, ModelConfig, SamplingParams, TrainConfig
from nanolm.train.configure import load_config
from nanolm.errors import UserError
from nanolm.export.hf import export_hf, from_hf, import_hf, to_hf
from nanolm.infer.engine import Engine
from nanolm.infer.fuse import FusedAttention
from nanolm.model.lora import apply_lora, base_state_dict, disable_adapters, lora_modules, \
    mark_only_lora_as_trainable, merge_lora
from nanolm.model.transformer import KVCache, Llama3, Transformer
from nanolm.tokenizer import Tokenizer

import test_export_hf as hf_tests  # noqa: E402
from test_export_hf import load_hf  # noqa: E402

transformers = pytest.importorskip("transformers")

VOCAB = 400  # the conftest tokenizer's requested size: the imported models carry it, for export and GGUF
# Llama 3's scaling over a 256-token original context at theta 1e4 and head size 32: pairs 0-4 keep their
# frequency (wavelength < 256 / 4), pairs 5-6 are blended, pairs 7-15 divided by 8 (wavelength > 256 / 1).
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
FAMILIES = {
    # Qwen2.5-0.5B's layout: biases, tied embeddings, head_dim = hidden / heads
    "qwen2-tied": ("Qwen2", {"tie_word_embeddings": True, "rope_parameters": {"rope_type": "default",
                                                                              "rope_theta": 1e6}}),
    "qwen2-head32-untied": ("Qwen2", {"head_dim": 32, "tie_word_embeddings": False}),
    "llama3-head32-untied": ("Llama", {"head_dim": 32, "rope_parameters": LLAMA3, "tie_word_embeddings": False}),
    "llama3-tied": ("Llama", {"rope_parameters": LLAMA3, "tie_word_embeddings": True}),  # Llama 3.2 1B / 3B
    "qwen3-head32-tied": ("Qwen3", {"head_dim": 32, "tie_word_embeddings": True}),  # Qwen3-0.6B's proportions
    "qwen3-head32-untied": ("Qwen3", {"head_dim": 32, "tie_word_embeddings": False}),
}
MODEL_TYPES = {"Qwen2": "qwen2", "Llama": "llama", "Qwen3": "qwen3"}


def hf_model(family: str, **over) -> torch.nn.Module:
    """A random transformers model of `family` (Qwen2, Llama, Qwen3) from its own classes: norm weights away
    from 1 and biases (Qwen2's) random and non-zero, so a dropped or misplaced one shows in the logits."""
    torch.manual_seed(0)
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1)
    config = getattr(transformers, f"{family}Config")(**{**kw, **over})
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return model


def imported(tmp_path: Path, tokenizer_dir: Path, family: str, **over) -> tuple[torch.nn.Module, Path, Path]:
    """(the transformers model, its save_pretrained directory, its nanolm import) for a FAMILIES case."""
    hf = hf_model(family, **over)
    src = tmp_path / "hf"
    hf.save_pretrained(src)
    Tokenizer.load(tokenizer_dir).save(src)  # nanolm's special ids, so the import carries the tokenizer
    return hf, src, import_hf(src, tmp_path / "nano")


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(params=FAMILIES.values(), ids=FAMILIES.keys())
def family(request, tmp_path, tokenizer_dir):
    name, over = request.param
    hf, src, out = imported(tmp_path, tokenizer_dir, name, **over)
    model, _ = ckpt.load_model(out)
    return name, over, hf, src, out, model.eval()


# ----------------------------------------------------------------------------- import from transformers

def test_import_reads_the_family_and_computes_transformers_logits(family):
    name, over, hf, src, out, model = family
    cfg = model.config
    head_dim = over.get("head_dim", 16)
    assert (cfg.head_dim, cfg.qkv_bias, cfg.qk_norm, cfg.tie_embeddings) == \
        (head_dim, name == "Qwen2", name == "Qwen3", over["tie_word_embeddings"])
    assert model.layers[0].self_attn.q_proj.weight.shape == (4 * head_dim, 64)
    assert model.layers[0].self_attn.o_proj.weight.shape == (64, 4 * head_dim)
    if name == "Qwen2":
        bias = model.layers[1].self_attn.k_proj.bias
        assert bias.shape == (2 * head_dim,) and torch.equal(bias, hf.model.layers[1].self_attn.k_proj.bias)
    if over.get("rope_parameters") == LLAMA3:
        assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max_len, cfg.rope_low_freq_factor,
                cfg.rope_high_freq_factor, cfg.rope_theta) == ("llama3", 8.0, 256, 1.0, 4.0, 1e4)
    x = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(x).logits
        assert max_diff(model(x), want) < 1e-4  # prefill
        # token by token through the KV cache, after an 8-token prefill
        cache = KVCache.empty(cfg, 2, 32, "cpu", torch.float32)
        steps = [model(x[:, :8], cache)] + [model(x[:, t:t + 1], cache) for t in range(8, 32)]
        assert max_diff(torch.cat(steps, dim=1), want) < 1e-4


def test_engine_greedy_continuations_are_transformers_generate(family):
    """Two prompts of different lengths decoded together (per-row positions, the fused q/k/v product with its
    stacked biases) continue as transformers' greedy generate continues each alone."""
    _, _, hf, _, _, model = family
    ids = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    prompts = [ids[:5], ids]
    engine = Engine(model)
    assert all(type(layer.self_attn) is FusedAttention for layer in engine.model.layers)
    ours = engine.generate_many(prompts, SamplingParams(max_new_tokens=12, temperature=0))
    assert len(set(ours[0] + ours[1])) > 1  # not one token over and over, which any model might agree on
    for prompt, got in zip(prompts, ours):
        x = torch.tensor([prompt])
        theirs = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, min_new_tokens=12,
                             max_new_tokens=12)[0, len(prompt):].tolist()
        assert got == theirs


# ----------------------------------------------------------------------------- export to transformers

def test_export_back_is_the_family_and_transformers_reloads_the_same_logits(family, tmp_path):
    name, over, hf, _, out, model = family
    back = export_hf(out, tmp_path / "back")
    config = json.loads((back / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == (MODEL_TYPES[name], [f"{name}ForCausalLM"])
    assert (config["head_dim"], config["tie_word_embeddings"]) == (model.config.head_dim, over["tie_word_embeddings"])
    if name == "Llama":
        assert config["rope_scaling"] == {k: v for k, v in LLAMA3.items() if k != "rope_theta"}
        assert config["rope_parameters"] == LLAMA3
    if name == "Qwen2":
        assert "attention_bias" not in config and not config["use_sliding_window"]
    reloaded = load_hf(back)
    assert type(reloaded) is type(hf)
    x = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert max_diff(reloaded(x).logits, hf(x).logits) < 1e-4
    # and in again: the same config and weights
    again, _ = ckpt.load_model(import_hf(back, tmp_path / "again"))
    assert again.config == model.config
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


NANOLM_MADE = {
    "qkv-bias": {"qkv_bias": True},
    "qkv-bias-head32-untied": {"qkv_bias": True, "head_dim": 32, "tie_embeddings": False},
    "llama3-head8": {"rope_scaling": "llama3", "rope_factor": 8.0, "rope_original_max_len": 256, "head_dim": 8},
    "qk-norm-head32": {"qk_norm": True, "head_dim": 32, "norm_eps": 1e-6},
    "moe-qkv-bias": {"qkv_bias": True, "use_moe": True, "n_experts": 4, "top_k": 2, "n_shared_experts": 1},
}


@pytest.mark.parametrize("over", NANOLM_MADE.values(), ids=NANOLM_MADE.keys())
def test_a_nanolm_model_of_each_family_exports_with_its_logits(over, tmp_path, tokenizer_dir):
    """Trained in nanolm (random here; make_run sets every 1-D weight, biases too, away from 0 and 1): export
    picks the family from the config (qkv_bias -> qwen2, QK-norm -> qwen3, else llama; MoE with biases ->
    qwen2_moe with those biases) and transformers computes the same logits; import gives the model back."""
    run, model = hf_tests.make_run(tmp_path, tokenizer_dir, **over)
    out = export_hf(run, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    want_type = ("qwen2_moe" if over.get("use_moe") else "qwen2" if over.get("qkv_bias") else
                 "qwen3" if over.get("qk_norm") else "llama")
    assert config["model_type"] == want_type
    hf = load_hf(out)
    assert hf_tests.max_logit_diff(model, hf) < 1e-4
    back, _ = ckpt.load_model(import_hf(out, tmp_path / "back"))
    assert back.config == model.config
    a, b = model.state_dict(), back.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_adapter_keeps_qwen2_moe_biases_and_drops_zero_stand_ins():
    mc = hf_tests.model_cfg(qkv_bias=True, use_moe=True, n_experts=4, top_k=2, n_shared_experts=0)
    model = Transformer(mc)
    with torch.no_grad():
        model.layers[0].self_attn.v_proj.bias.normal_()
    sd = ckpt.model_state(model)
    hf_sd, hf_cfg = to_hf(sd, mc)
    assert hf_cfg["qkv_bias"] is True and torch.equal(hf_sd["model.layers.0.self_attn.v_proj.bias"],
                                                      sd["layers.0.self_attn.v_proj.bias"])
    back, mc2 = from_hf(hf_sd, hf_cfg)
    assert mc2 == mc and back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    # all-zero biases are what nanolm writes for a model without them: read back as none
    zero = {k: torch.zeros_like(t) if k.endswith("proj.bias") else t for k, t in hf_sd.items()}
    assert from_hf(zero, hf_cfg)[1].qkv_bias is False


def test_export_refuses_biases_with_qk_norm(tmp_path, tokenizer_dir):
    run, _ = hf_tests.make_run(tmp_path, tokenizer_dir, n_layer=1, qkv_bias=True, qk_norm=True)
    with pytest.raises(UserError, match=r"^model\.qkv_bias with model\.qk_norm: no transformers family has both"):
        export_hf(run, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# ----------------------------------------------------------------------------- Llama 3's RoPE scaling

@pytest.mark.parametrize("head_dim", [8, 32, 64, 128])
@pytest.mark.parametrize("theta,factor,original,low,high", [(1e4, 8.0, 256, 1.0, 4.0), (5e5, 32.0, 8192, 1.0, 4.0),
                                                            (5e5, 8.0, 8192, 2.0, 8.0), (1e6, 4.0, 1024, 1.0, 2.0)])
def test_llama3_frequencies_are_transformers_bit_for_bit(head_dim, theta, factor, original, low, high):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                      max_position_embeddings=2 * original, rope_parameters={
                                          "rope_type": "llama3", "rope_theta": theta, "factor": factor,
                                          "low_freq_factor": low, "high_freq_factor": high,
                                          "original_max_position_embeddings": original})
    want, scale = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    llama3 = Llama3(factor, original, low, high)
    got = llama3.inv_freq(head_dim, theta)
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)
    assert llama3.scale == scale == 1.0
    # llama.cpp's rope_freqs: what each frequency is divided by, as convert_hf_to_gguf.py computes it
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    converter = []
    for freq in freqs:  # float32 scalars, as there
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            converter.append(1.0)
        elif wavelen > original / low:
            converter.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            converter.append(1 / ((1 - smooth) / factor + smooth))
    factors = llama3.freq_factors(head_dim, theta)
    assert factors.dtype == torch.float32 and torch.equal(factors, torch.tensor(converter))
    torch.testing.assert_close(freqs / factors, want, rtol=1e-6, atol=0)


def test_llama3_config_is_validated_with_one_line_messages():
    tiny = dict(vocab_size=64, d_model=32, n_layer=1, n_head=2, n_kv_head=1, max_seq_len=64)
    ok = ModelConfig(**tiny, rope_scaling="llama3", rope_factor=8.0, rope_original_max_len=8192)
    assert (ok.rope_low_freq_factor, ok.rope_high_freq_factor) == (1.0, 4.0)  # Llama 3's, and past max_seq_len
    for over, says in [
        ({"rope_low_freq_factor": 2.0}, r"model.rope_low_freq_factor=2.0 applies only with model.rope_scaling "
                                        r"llama3; set that, or leave model.rope_low_freq_factor at 1.0"),
        ({"rope_scaling": "yarn", "rope_factor": 2.0, "rope_original_max_len": 16, "rope_high_freq_factor": 8.0},
         r"model.rope_high_freq_factor=8.0 applies only with model.rope_scaling llama3"),
        ({"rope_scaling": "llama3", "rope_factor": 8.0, "rope_beta_fast": 16.0},
         r"model.rope_beta_fast=16.0 applies only with model.rope_scaling yarn"),
        ({"rope_scaling": "llama3", "rope_factor": 8.0},
         r"model.rope_original_max_len must be a positive integer .* with model.rope_scaling llama3, got 0"),
        ({"rope_scaling": "llama3", "rope_factor": 0.5, "rope_original_max_len": 16},
         r"model.rope_factor must be >= 1"),
        ({"rope_scaling": "llama3", "rope_factor": 8.0, "rope_original_max_len": 16, "rope_low_freq_factor": 4.0},
         r"model.rope_high_freq_factor \(4.0\) must exceed model.rope_low_freq_factor \(4.0\)"),
        ({"head_dim": 7}, r"model.head_dim = 7 must be even for RoPE"),
        ({"head_dim": -2}, r"model.head_dim must be >= 0 \(0 = model.d_model / model.n_head\), got -2"),
        ({"n_head": 3}, r"model.d_model \(32\) must be divisible by model.n_head \(3\), or model.head_dim set"),
    ]:
        with pytest.raises(UserError, match=f"^{says}"):
            ModelConfig(**{**tiny, **over})
    assert ModelConfig(**{**tiny, "n_head": 3, "n_kv_head": 1, "head_dim": 16}).head_dim == 16
    with pytest.raises(UserError, match=r"the model already uses llama3 RoPE scaling \(model.rope_factor=8"):
        ok.with_yarn(2.0)


# ----------------------------------------------------------------------------- configs from before the fields

# A checkpoint's config.json as nanolm wrote it before head_dim, qkv_bias and Llama 3's fields existed.
OLD_CONFIG = {"vocab_size": 400, "d_model": 64, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_hidden": 192,
              "max_seq_len": 64, "rope_theta": 1e6, "rope_scaling": "none", "rope_factor": 1.0,
              "rope_original_max_len": 0, "rope_beta_fast": 32.0, "rope_beta_slow": 1.0,
              "rope_attention_factor": 0.0, "norm_eps": 1e-5, "qk_norm": False, "dropout": 0.0,
              "tie_embeddings": True, "init_std": 0.02, "causal": True, "use_moe": False, "n_experts": 4,
              "n_shared_experts": 1, "top_k": 2, "moe_n_hidden": 192, "moe_every": 1, "norm_topk": True,
              "aux_loss_coef": 0.01}


def test_an_old_config_without_the_new_fields_loads_with_the_same_effective_values(tmp_path):
    cfg = ModelConfig.from_dict(OLD_CONFIG)
    assert (cfg.head_dim, cfg.qkv_bias, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor) == (16, False, 1.0, 4.0)
    model = Transformer(cfg)
    assert model.layers[0].self_attn.q_proj.bias is None and model.rope_cos.shape == (64, 16)
    out = ckpt.save_model(tmp_path / "m", model, tokenizer_from=None)
    written = json.loads((out / "config.json").read_text())["model"]
    # head_dim is written as "d_model / n_head" (0) and the widths as automatic (0: 192 is d_model's), so the
    # file means what an old one means
    assert written == {**OLD_CONFIG, "head_dim": 0, "qkv_bias": False, "rope_low_freq_factor": 1.0,
                       "rope_high_freq_factor": 4.0, "n_hidden": 0, "moe_n_hidden": 0}
    (out / "config.json").write_text(json.dumps({"model": OLD_CONFIG}))  # as an old checkpoint has it
    loaded, _ = ckpt.load_model(out)
    assert loaded.config == cfg
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_head_dim_follows_d_model_unless_set():
    """A preset or the defaults overridden on the command line: head_dim 0 keeps meaning d_model / n_head, and
    an explicit head_dim is kept through the run's config.json."""
    assert load_config(overrides={"model.d_model": "128"}).model.head_dim == 16  # 8 heads
    assert load_config("tiny", overrides={"model.d_model": "192", "model.n_head": "4",
                                          "model.n_kv_head": "2"}).model.head_dim == 48
    cfg = load_config(overrides={"model.d_model": "128", "model.head_dim": "32"})
    assert cfg.model.head_dim == 32 and cfg.to_dict()["model"]["head_dim"] == 32
    assert Config.from_dict(cfg.to_dict()).model == cfg.model
    explicit = ModelConfig(d_model=64, n_head=4, head_dim=16)  # = d_model / n_head: written as 0, the same model
    assert explicit.to_dict()["head_dim"] == 0 and ModelConfig.from_dict(explicit.to_dict()) == explicit


# ----------------------------------------------------------------------------- biases: LoRA, fused decoding

def biased_model(**over) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(hf_tests.model_cfg(qkv_bias=True, n_layer=2, **over))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return model


def test_a_fresh_model_starts_with_zero_biases():
    model = Transformer(hf_tests.model_cfg(qkv_bias=True))
    biases = [p for name, p in model.named_parameters() if name.endswith(".bias")]
    assert len(biases) == 3 * 4 and all(b.count_nonzero() == 0 for b in biases)
    assert model.layers[0].self_attn.o_proj.bias is None


def test_lora_on_a_biased_model_trains_only_adapters_and_merges_to_the_adapted_logits():
    model = biased_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped = apply_lora(model, rank=4, alpha=8.0, dropout=0.0)
    assert "layers.0.self_attn.q_proj" in wrapped
    assert torch.equal(model.layers[0].self_attn.q_proj.base.bias, before["layers.0.self_attn.q_proj.bias"])
    mark_only_lora_as_trainable(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    model(x[:, :-1], targets=x[:, 1:]).backward()
    opt.step()
    base = base_state_dict(model)
    assert base.keys() == before.keys() and all(torch.equal(base[k], before[k]) for k in before)
    assert all(m.lora_B.count_nonzero() > 0 for m in lora_modules(model).values())
    with torch.no_grad():
        adapted = model(x)
        with disable_adapters(model):
            assert max_diff(adapted, model(x)) > 1e-4  # the step moved the adapters off zero
        merge_lora(model)
        torch.testing.assert_close(model(x), adapted, atol=1e-5, rtol=1e-5)
    merged = model.state_dict()
    assert merged.keys() == before.keys()
    assert all(torch.equal(merged[k], before[k]) for k in before if k.endswith(".bias"))


def test_the_engine_stacks_the_biases_and_takes_new_ones():
    model = biased_model(head_dim=32).eval()
    engine = Engine(model)
    attn = engine.model.layers[0].self_attn
    assert type(attn) is FusedAttention and attn.qkv_bias.shape == ((4 + 2 * 2) * 32,)
    x = torch.randint(0, VOCAB, (3, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert max_diff(engine.model(x), model(x)) < 1e-5
        model.layers[1].self_attn.v_proj.bias.add_(1.0)
        engine.load_weights(model)  # the model's own layout, stacked by the load hook
        assert max_diff(engine.model(x), model(x)) < 1e-5


# ----------------------------------------------------------------------------- GGUF for llama.cpp

GGUF_FAMILIES = {**{k: FAMILIES[k] for k in ("qwen2-tied", "llama3-head32-untied", "llama3-tied", "qwen3-head32-tied",
                                             "qwen3-head32-untied")},
                 "qwen2-untied": ("Qwen2", {"tie_word_embeddings": False})}  # llama.cpp's qwen2: head_dim 16 only
GGUF_ARCH = {"Qwen2": "qwen2", "Llama": "llama", "Qwen3": "qwen3"}


@pytest.mark.parametrize("name,over", GGUF_FAMILIES.values(), ids=GGUF_FAMILIES.keys())
def test_gguf_of_each_family_and_its_llama_cpp_logits(name, over, tmp_path, tokenizer_dir):
    pytest.importorskip("gguf")
    from nanolm.export.gguf import export_gguf, rope_interleave
    from test_export_qwen3 import gguf_values, llama_cpp_logits, read_gguf

    _, _, out = imported(tmp_path, tokenizer_dir, name, **over)
    model, _ = ckpt.load_model(out)
    mc = model.config
    path = export_gguf(out, tmp_path / "m.gguf", outtype="f32", quiet=True)
    meta, tensors = read_gguf(path)
    arch = GGUF_ARCH[name]
    assert meta["general.architecture"] == arch and meta[f"{arch}.rope.dimension_count"] == mc.head_dim
    if mc.head_dim * mc.n_head != mc.d_model or arch == "qwen3":
        assert (meta[f"{arch}.attention.key_length"], meta[f"{arch}.attention.value_length"]) == (32, 32)
    else:
        assert f"{arch}.attention.key_length" not in meta
    assert ("output.weight" in tensors) == (not mc.tie_embeddings)
    sd = model.state_dict()
    order = rope_interleave if arch == "llama" else lambda w, n: w
    assert torch.equal(gguf_values(tensors["blk.1.attn_q.weight"]), order(sd["layers.1.self_attn.q_proj.weight"], 4))
    if mc.qkv_bias:
        for proj in "qkv":  # qwen2 rotates halves as nanolm does: rows and biases as they are
            assert torch.equal(gguf_values(tensors[f"blk.1.attn_{proj}.bias"]),
                               sd[f"layers.1.self_attn.{proj}_proj.bias"])
    else:
        assert not any(t.endswith(".bias") for t in tensors)
    if mc.rope_scaling == "llama3":  # the factors, not rope.scaling keys, carry it
        factors = gguf_values(tensors["rope_freqs.weight"])
        assert torch.equal(factors, Llama3.of(mc).freq_factors(mc.head_dim, mc.rope_theta))
        assert factors[0] == 1.0 and factors[-1] == 8.0 and not any(".rope.scaling." in k for k in meta)
    else:
        assert "rope_freqs.weight" not in tensors

    ids = torch.randint(3, 300, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        want = model(torch.tensor([ids]))[0]  # (T, V)
    got = llama_cpp_logits(path, ids)  # skips without llama-cpp-python
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.parametrize("over,says", [
    ({"qkv_bias": True, "head_dim": 32}, r"model.head_dim=32 with model.qkv_bias: llama.cpp's qwen2 sizes q, k and v"),
    ({"qkv_bias": True, "qk_norm": True}, r"model.qkv_bias with model.qk_norm: llama.cpp's architectures with q/k/v"),
    ({"qkv_bias": True, "use_moe": True, "n_experts": 2, "top_k": 1, "n_shared_experts": 0},
     r"model.qkv_bias with model.use_moe: "),
    ({"qk_norm": True, "rope_scaling": "llama3", "rope_factor": 8.0, "rope_original_max_len": 256},
     r"model.rope_scaling llama3 on a qwen3 model: llama.cpp reads Llama 3's frequency factors"),
])
def test_gguf_refuses_what_llama_cpp_cannot_run(over, says, tmp_path, tokenizer_dir):
    pytest.importorskip("gguf")
    from nanolm.export.gguf import export_gguf

    run, _ = hf_tests.make_run(tmp_path, tokenizer_dir, n_layer=1, **over)
    with pytest.raises(UserError, match=f"^{says}"):
        export_gguf(run, tmp_path / "m.gguf", quiet=True)
    assert not (tmp_path / "m.gguf").exists()


def test_a_train_config_with_the_new_fields_round_trips():
    mc = ModelConfig(vocab_size=VOCAB, d_model=64, n_layer=2, n_head=4, n_kv_head=2, head_dim=32, qkv_bias=True,
                     max_seq_len=64, rope_scaling="llama3", rope_factor=8.0, rope_original_max_len=256)
    cfg = Config(model=mc, train=TrainConfig(seq_len=64))
    assert Config.from_dict(json.loads(json.dumps(cfg.to_dict()))).model == mc
