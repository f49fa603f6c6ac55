"""Qwen3-layout models (QK-norm, YaRN, Qwen3-MoE) out to transformers and llama.cpp, and in from transformers.

The real consumers decide: transformers loads each export with no custom code
and computes nanolm's logits (1e-4), also past a YaRN model's original
context; a Qwen3 / Qwen3-MoE that transformers itself made and saved
(MiniMind-3's release layout among them) imports into the same logits;
llama.cpp runs the GGUF export of each as its qwen3 / qwen3moe architecture.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanolm import checkpoint as ckpt
from nanolm.config import ModelConfig
from nanolm.errors import UserError
from nanolm.export.hf import export_hf, from_hf, import_hf, to_hf
from nanolm.model.transformer import Transformer

import test_export_hf as hf_tests  # noqa: E402
from test_export_hf import load_hf  # noqa: E402

transformers = pytest.importorskip("transformers")

VOCAB = 400  # the conftest tokenizer's requested size
YARN = {"rope_scaling": "yarn", "rope_factor": 4.0, "rope_original_max_len": 16}
DENSE = {"tied": {}, "untied-mha": {"tie_embeddings": False, "n_kv_head": 4},
         "yarn": YARN, "yarn-attention-factor": {**YARN, "rope_attention_factor": 1.0, "rope_beta_fast": 16.0}}
MOE = {"every-layer": {"use_moe": True, "n_experts": 4, "top_k": 2, "n_shared_experts": 0},
       "top1-every-2nd-untied": {"use_moe": True, "n_experts": 4, "top_k": 1, "n_shared_experts": 0, "moe_every": 2,
                                 "norm_topk": False, "moe_n_hidden": 32, "tie_embeddings": False},
       "yarn": {"use_moe": True, "n_experts": 3, "top_k": 2, "n_shared_experts": 0, **YARN}}


QWEN3 = {"qk_norm": True, "norm_eps": 1e-6}


def model_cfg(**over) -> ModelConfig:
    return hf_tests.model_cfg(**{**QWEN3, **over})


def make_run(root: Path, tokenizer_dir: Path, seed: int = 0, **over) -> tuple[Path, Transformer]:
    """test_export_hf's random-model run, QK-norm on unless `over` says otherwise."""
    return hf_tests.make_run(root, tokenizer_dir, seed, **{**QWEN3, **over})


def max_logit_diff(ours: torch.nn.Module, hf: torch.nn.Module) -> float:
    """Over a full context: for a YaRN model 64 positions, four times its original 16."""
    return hf_tests.max_logit_diff(ours, hf, T=64)


# ----------------------------------------------------------------------------- export to transformers

@pytest.mark.parametrize("over", DENSE.values(), ids=DENSE.keys())
def test_qk_norm_export_is_a_qwen3_with_the_same_logits(over, tmp_path, tokenizer_dir):
    run, model = make_run(tmp_path, tokenizer_dir, **over)
    out = export_hf(run, tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    mc = model.config
    assert (cfg["model_type"], cfg["architectures"], cfg["head_dim"], cfg["tie_word_embeddings"]) == \
        ("qwen3", ["Qwen3ForCausalLM"], 16, mc.tie_embeddings)
    weights = load_file(str(out / "model.safetensors"))
    for i in range(4):
        for n in ("q_norm", "k_norm"):
            assert torch.equal(weights[f"model.layers.{i}.self_attn.{n}.weight"],
                               model.state_dict()[f"layers.{i}.self_attn.{n}.weight"])
    assert ("lm_head.weight" in weights) == (not mc.tie_embeddings)
    hf = load_hf(out)
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    if mc.rope_scaling == "yarn":
        yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                "beta_fast": mc.rope_beta_fast, "beta_slow": 1.0,
                **({"attention_factor": 1.0} if mc.rope_attention_factor else {})}
        assert cfg["rope_scaling"] == yarn and cfg["rope_parameters"] == {**yarn, "rope_theta": mc.rope_theta}
        # transformers computes nanolm's frequencies and attention factor, bit for bit.
        rotary = hf.model.rotary_emb
        assert rotary.attention_scaling == (1.0 if mc.rope_attention_factor else 1 + 0.1 * torch.log(
            torch.tensor(4.0, dtype=torch.float64)).item())
        from nanolm.model.transformer import Yarn
        assert torch.equal(rotary.inv_freq, Yarn.of(mc).inv_freq(16, mc.rope_theta))
    else:
        assert "rope_scaling" not in cfg and cfg["rope_parameters"]["rope_type"] == "default"
    assert max_logit_diff(model, hf) < 1e-4


@pytest.mark.parametrize("over", MOE.values(), ids=MOE.keys())
def test_qk_norm_moe_export_is_a_qwen3_moe_with_the_same_logits(over, tmp_path, tokenizer_dir):
    run, model = make_run(tmp_path, tokenizer_dir, **over)
    out = export_hf(run, tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    mc = model.config
    assert (cfg["model_type"], cfg["architectures"]) == ("qwen3_moe", ["Qwen3MoeForCausalLM"])
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
            cfg["decoder_sparse_step"], cfg["norm_topk_prob"], cfg["head_dim"]) == \
        (mc.n_experts, mc.top_k, mc.moe_n_hidden, mc.moe_every, mc.norm_topk, 16)
    assert "shared_expert_intermediate_size" not in cfg and "qkv_bias" not in cfg
    weights = load_file(str(out / "model.safetensors"))
    assert not any("shared_expert" in k or k.endswith(".bias") for k in weights)
    hf = load_hf(out)
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    n_sparse = sum(type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers)
    assert n_sparse == 4 // mc.moe_every
    assert max_logit_diff(model, hf) < 1e-4


def test_a_yarn_llama_is_exported_with_yarn_too(tmp_path, tokenizer_dir):
    run, model = make_run(tmp_path, tokenizer_dir, qk_norm=False, **YARN)
    out = export_hf(run, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert max_logit_diff(model, load_hf(out)) < 1e-4


def test_qk_norm_moe_with_a_shared_expert_is_refused(tmp_path, tokenizer_dir):
    run, _ = make_run(tmp_path, tokenizer_dir, use_moe=True, n_experts=2, top_k=1, n_shared_experts=1, n_layer=1)
    with pytest.raises(UserError, match=r"^model.n_shared_experts=1 with model.qk_norm: Qwen3-MoE, .* has no shared "
                                        r"expert .*nanolm export gguf`$"):
        export_hf(run, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("over", [DENSE["untied-mha"], DENSE["yarn-attention-factor"], MOE["top1-every-2nd-untied"],
                                  MOE["yarn"]], ids=["dense", "dense-yarn", "moe", "moe-yarn"])
def test_import_of_an_export_is_weight_identical(over, tmp_path, tokenizer_dir):
    run, model = make_run(tmp_path, tokenizer_dir, **over)
    back = import_hf(export_hf(run, tmp_path / "hf"), tmp_path / "back")
    reloaded, _ = ckpt.load_model(back)
    assert reloaded.config == model.config
    a, b = model.state_dict(), reloaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- import from transformers

def hf_qwen3(moe: bool = False, **over):
    """A random transformers Qwen3 (or Qwen3-MoE) with norm weights away from 1."""
    torch.manual_seed(0)
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
              tie_word_embeddings=True, initializer_range=0.1)
    if moe:
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    kw.update(over)
    hf = (transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**kw)) if moe else
          transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kw))).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return hf


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3-moe"])
@pytest.mark.parametrize("rope", [{"rope_theta": 1e6},
                                  {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                       "original_max_position_embeddings": 16}}],
                         ids=["plain", "yarn"])
def test_import_of_a_qwen3_written_by_transformers(moe, rope, tmp_path):
    hf = hf_qwen3(moe, **rope)
    src = tmp_path / "hf"
    hf.save_pretrained(src)
    with pytest.warns(UserWarning, match="imported the weights without a tokenizer"):
        out = import_hf(src, tmp_path / "nano")
    model, _ = ckpt.load_model(out)
    cfg = model.config
    assert (cfg.qk_norm, cfg.use_moe, cfg.head_dim, cfg.n_hidden, cfg.norm_eps, cfg.tie_embeddings) == \
        (True, moe, 16, 96, 1e-6, True)
    if "rope_parameters" in rope:
        assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max_len, cfg.rope_theta) == \
            ("yarn", 4.0, 16, 1e4)
    if moe:
        assert (cfg.n_experts, cfg.top_k, cfg.n_shared_experts, cfg.moe_n_hidden, cfg.norm_topk) == (4, 2, 0, 32, True)
    assert max_logit_diff(model, hf) < 1e-4


def test_import_of_fused_experts(tmp_path):
    """Experts stored as transformers >= 5 holds them in memory (and MiniMind's conversion builds them):
    experts.gate_up_proj (E, 2 I, C) and experts.down_proj (E, C, I)."""
    hf = hf_qwen3(moe=True)
    src = tmp_path / "hf"
    hf.save_pretrained(src)
    fused = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    save_file(fused, str(src / "model.safetensors"))
    with pytest.warns(UserWarning):
        model, _ = ckpt.load_model(import_hf(src, tmp_path / "nano"))
    assert max_logit_diff(model, hf) < 1e-4


@pytest.mark.parametrize("moe", [False, True], ids=["minimind-3", "minimind-3-moe"])
def test_import_of_minimind_3s_transformers_release_layout(moe, tmp_path):
    """What MiniMind's scripts/convert_model.py writes with transformers 5: a Qwen3 (or Qwen3-MoE) saved in
    float16, then its config.json given rope_theta and rope_scaling null and its rope_parameters deleted."""
    hf = hf_qwen3(moe, rope_theta=1e6).to(torch.float16)
    src = tmp_path / "minimind-3"
    hf.save_pretrained(src)
    config = json.loads((src / "config.json").read_text())
    config["rope_theta"], config["rope_scaling"] = 1e6, None
    del config["rope_parameters"]
    (src / "config.json").write_text(json.dumps(config))
    assert config["architectures"] == ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"]
    with pytest.warns(UserWarning):
        model, _ = ckpt.load_model(import_hf(src, tmp_path / "nano"))
    assert (model.config.rope_theta, model.config.rope_scaling, model.config.qk_norm) == (1e6, "none", True)
    assert model.embed_tokens.weight.dtype == torch.float32
    assert max_logit_diff(model, load_hf(src, dtype=torch.float32)) < 1e-4


def exported_config(tmp_path: Path, tokenizer_dir: Path) -> Path:
    run, _ = make_run(tmp_path, tokenizer_dir, n_layer=1)
    return export_hf(run, tmp_path / "hf")


@pytest.mark.parametrize("field, value, says", [
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.7},
     "rope_scaling"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "truncate": False}, "rope_parameters"),
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, "rope_scaling"),
    ("layer_types", ["full_attention", "sliding_attention"], "layer_types"),
    ("head_dim", 0, "head_dim"),
])
def test_import_refuses_qwen3_settings_nanolm_cannot_express(field, value, says, tmp_path, tokenizer_dir):
    src = exported_config(tmp_path, tokenizer_dir)
    cfg = json.loads((src / "config.json").read_text())
    if value is None:
        del cfg[field]
    else:
        cfg[field] = value
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=rf"config\.json: {says} = .* is not supported; "):
        import_hf(src, tmp_path / "nano")
    assert not (tmp_path / "nano").exists()


def test_import_without_head_dim_takes_qwen3s_default_and_refuses_weights_of_another(tmp_path, tokenizer_dir):
    """Qwen3Config's head_dim is 128 when config.json has none: the 16-wide heads of these weights then do not
    fit, and the message says so."""
    src = exported_config(tmp_path, tokenizer_dir)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["head_dim"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"weights: model\.layers\.0\.self_attn\.k_norm\.weight has shape \(16,\) "
                                        r"but config\.json implies \(128,\); the weights and the config do not"):
        import_hf(src, tmp_path / "nano")
    assert not (tmp_path / "nano").exists()


def test_adapter_is_pure_and_inverse_for_qwen3_moe_with_yarn():
    mc = model_cfg(**MOE["yarn"])
    sd = ckpt.model_state(Transformer(mc))
    hf_sd, hf_cfg = to_hf(sd, mc)
    assert hf_cfg["rope_scaling"]["original_max_position_embeddings"] == 16
    back, mc2 = from_hf(hf_sd, hf_cfg)
    assert mc2 == mc and back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    # transformers < 5 reads only rope_scaling, >= 5 rope_scaling first: it alone decides.
    only_scaling = {k: v for k, v in hf_cfg.items() if k != "rope_parameters"}
    assert from_hf(hf_sd, only_scaling)[1] == mc


# ----------------------------------------------------------------------------- GGUF for llama.cpp

GGUF_MOE = {"top2": {"use_moe": True, "n_experts": 4, "top_k": 2, "n_shared_experts": 0, "moe_n_hidden": 32},
            "top1-yarn": {"use_moe": True, "n_experts": 4, "top_k": 1, "n_shared_experts": 0, "moe_n_hidden": 32,
                          **YARN}}


def gguf_run(tmp_path: Path, tokenizer_dir: Path, **over) -> tuple[Path, Transformer]:
    # d_model 64 and n_hidden 96: every row a multiple of 32 long, so q8_0 quantises every matrix.
    return make_run(tmp_path, tokenizer_dir, n_layer=2, n_hidden=96, **over)


def read_gguf(path: Path) -> tuple[dict, dict]:
    gguf = pytest.importorskip("gguf")
    r = gguf.GGUFReader(path)
    return ({k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")},
            {t.name: t for t in r.tensors})


def gguf_values(t) -> torch.Tensor:
    gguf = pytest.importorskip("gguf")
    shape = tuple(int(d) for d in reversed(t.shape))
    return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).copy()).float()


def llama_cpp_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """llama.cpp's logits (T, V) on `ids`, with an f32 KV cache (its default is f16)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, n_ubatch=64, logits_all=True, n_threads=2,
                          type_k=0, type_v=0, verbose=False)
    try:
        llm.eval(ids)
        return torch.tensor(llm.scores[: len(ids)])
    finally:
        llm.close()


GGUF_CASES = {**{k: v for k, v in DENSE.items()}, **{"moe-" + k: v for k, v in GGUF_MOE.items()}}


@pytest.mark.parametrize("over", GGUF_CASES.values(), ids=GGUF_CASES.keys())
def test_gguf_of_a_qk_norm_model_is_qwen3_and_llama_cpp_computes_nanolms_logits(over, tmp_path, tokenizer_dir):
    pytest.importorskip("gguf")
    from nanolm.export.gguf import export_gguf

    run, model = gguf_run(tmp_path, tokenizer_dir, **over)
    mc = model.config
    out = export_gguf(run, tmp_path / "m.gguf", outtype="f32", quiet=True)
    meta, tensors = read_gguf(out)
    arch = "qwen3moe" if mc.use_moe else "qwen3"
    assert meta["general.architecture"] == arch
    assert (meta[f"{arch}.attention.key_length"], meta[f"{arch}.attention.value_length"],
            meta[f"{arch}.rope.dimension_count"], meta[f"{arch}.context_length"]) == (16, 16, 16, 64)
    sd = model.state_dict()
    for i in range(2):
        for ours, theirs in (("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm"), ("q_proj", "attn_q"),
                             ("k_proj", "attn_k")):
            # NEOX RoPE: q and k rows as they are, not interleaved as for llama
            assert torch.equal(gguf_values(tensors[f"blk.{i}.{theirs}.weight"]),
                               sd[f"layers.{i}.self_attn.{ours}.weight"])
    assert ("output.weight" in tensors) == (not mc.tie_embeddings)
    if mc.use_moe:
        assert (meta["qwen3moe.expert_count"], meta["qwen3moe.expert_used_count"],
                meta["qwen3moe.expert_feed_forward_length"]) == (4, mc.top_k, 32)
        assert tensors["blk.0.ffn_gate_exps.weight"].shape.tolist() == [64, 32, 4]
    if mc.rope_scaling == "yarn":
        assert (meta[f"{arch}.rope.scaling.type"], meta[f"{arch}.rope.scaling.factor"],
                meta[f"{arch}.rope.scaling.original_context_length"],
                meta[f"{arch}.rope.scaling.yarn_beta_fast"], meta[f"{arch}.rope.scaling.yarn_beta_slow"]) == \
            ("yarn", 4.0, 16, mc.rope_beta_fast, 1.0)
        if mc.rope_attention_factor:  # llama.cpp's own default factor times this is the model's
            assert meta[f"{arch}.rope.scaling.attn_factor"] == pytest.approx(1.0 / (1 + 0.1 * math.log(4)), rel=1e-7)
        else:
            assert f"{arch}.rope.scaling.attn_factor" not in meta
    else:
        assert not any(".rope.scaling." in k for k in meta)

    ids = torch.randint(3, 300, (64,), generator=torch.Generator().manual_seed(0)).tolist()  # the whole context
    with torch.no_grad():
        want = model(torch.tensor([ids]))[0]  # (T, V)
    got = llama_cpp_logits(out, ids)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_gguf_of_a_yarn_llama_keeps_the_interleaved_rows_and_runs_in_llama_cpp(tmp_path, tokenizer_dir):
    """Without QK-norm the model stays "llama" (normal RoPE, q/k rows interleaved): YaRN's ramp is over the same
    pairs there, and an explicit attention factor reaches llama.cpp too."""
    pytest.importorskip("gguf")
    from nanolm.export.gguf import export_gguf, rope_interleave

    run, model = gguf_run(tmp_path, tokenizer_dir, qk_norm=False, **YARN, rope_attention_factor=1.0)
    out = export_gguf(run, tmp_path / "m.gguf", outtype="f32", quiet=True)
    meta, tensors = read_gguf(out)
    assert meta["general.architecture"] == "llama" and meta["llama.rope.scaling.type"] == "yarn"
    assert torch.equal(gguf_values(tensors["blk.0.attn_q.weight"]),
                       rope_interleave(model.state_dict()["layers.0.self_attn.q_proj.weight"], 4))
    ids = torch.randint(3, 300, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        want = model(torch.tensor([ids]))[0]
    assert (llama_cpp_logits(out, ids) - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.parametrize("over, says", [
    ({"use_moe": True, "n_experts": 2, "top_k": 1, "n_shared_experts": 1}, r"model.n_shared_experts=1 with"),
    ({"use_moe": True, "n_experts": 2, "top_k": 1, "n_shared_experts": 0, "norm_topk": False},
     r"model.norm_topk=false with"),
])
def test_gguf_refuses_qk_norm_moe_llama_cpp_cannot_run(over, says, tmp_path, tokenizer_dir):
    pytest.importorskip("gguf")
    from nanolm.export.gguf import export_gguf

    run, _ = gguf_run(tmp_path, tokenizer_dir, **over)
    with pytest.raises(UserError, match=rf"^{says} model.qk_norm: llama.cpp's MoE with QK-norm \(qwen3moe\)"):
        export_gguf(run, tmp_path / "m.gguf", quiet=True)
    assert not (tmp_path / "m.gguf").exists()
