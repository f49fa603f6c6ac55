"""A transformers config.json and nanolm's ModelConfig, both ways: the config half of the HF adapter.

`to_hf_config` writes the config.json of the transformers architecture a
nanolm model is exported as (`hf_model_type`); `from_hf_config` reads one back
into a ModelConfig, refusing a field nanolm cannot express with a UserError
that names it and what is supported. nanolm/export/hf.py holds the weights half
(renaming and reshaping the tensors) and the files; its docstring says which
architecture each model becomes and how the two differ.

RoPE: `rope_theta` and `rope_parameters` are written for every architecture
(transformers < 5 reads the first, >= 5 the second); a scaled model also gets
`rope_scaling`, which both read: rope_type "yarn" with factor,
original_max_position_embeddings, beta_fast, beta_slow and attention_factor
when it is not the default, or rope_type "llama3" (Llama 3.1 / 3.2) with
factor, low_freq_factor, high_freq_factor and original_max_position_embeddings.
transformers computes the same frequencies from them (nanolm's are its, bit
for bit).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from nanolm.config.model import ModelConfig
from nanolm.errors import UserError
from nanolm.tokenizer import EOT_ID, IM_END_ID

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
# model_type -> architecture, for each (use_moe, qk_norm, qkv_bias) a nanolm model can have.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# The settings nanolm reads from rope_scaling / rope_parameters for each rope_type, besides rope_type and
# rope_theta (YaRN's truncate only as true, mscale and mscale_all_dim only as null: transformers' default YaRN).
ROPE_KEYS = {"default": set(),
             "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
                      "truncate", "mscale", "mscale_all_dim"},
             "llama3": {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"}}


def moe_layers(cfg: ModelConfig) -> list[int]:
    """The indices of the layers whose MLP is a mixture of experts."""
    return [i for i in range(cfg.n_layer) if cfg.is_moe_layer(i)]


# ----------------------------------------------------------------------------- nanolm -> transformers

def hf_model_type(cfg: ModelConfig) -> str:
    """The transformers model_type a nanolm model is exported as; UserError for a model none of them computes."""
    if cfg.qkv_bias and cfg.qk_norm:
        raise UserError("model.qkv_bias with model.qk_norm: no transformers family has both (Qwen2 has the q/k/v "
                        "biases, Qwen3 the QK-norm); export a model with one of them, or use `nanolm export gguf`")
    if not cfg.use_moe:
        return "qwen2" if cfg.qkv_bias else "qwen3" if cfg.qk_norm else "llama"
    if not cfg.qk_norm:
        return "qwen2_moe"
    if cfg.n_shared_experts:
        raise UserError(f"model.n_shared_experts={cfg.n_shared_experts} with model.qk_norm: Qwen3-MoE, the one "
                        "transformers MoE with QK-norm and nanolm's routing, has no shared expert (Qwen2-MoE has one "
                        "but no QK-norm); export a model with n_shared_experts 0, or use `nanolm export gguf`")
    return "qwen3_moe"


def _rope_config(cfg: ModelConfig) -> dict[str, Any]:
    """The RoPE fields of config.json: transformers < 5 reads rope_theta and rope_scaling, >= 5 rope_parameters
    (or rope_scaling first when it is set); all are written, with the same values."""
    if cfg.rope_scaling == "none":
        return {"rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}
    scaling: dict[str, Any] = {"rope_type": cfg.rope_scaling, "factor": cfg.rope_factor,
                               "original_max_position_embeddings": cfg.rope_original_max_len}
    if cfg.rope_scaling == "llama3":
        scaling.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor)
    else:
        scaling.update(beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow)
        if cfg.rope_attention_factor:  # else transformers computes the same default, 0.1 ln(factor) + 1
            scaling["attention_factor"] = cfg.rope_attention_factor
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling,
            "rope_parameters": {**scaling, "rope_theta": cfg.rope_theta}}


def to_hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json dict of the transformers model `cfg` is exported as, its weights in `dtype`; UserError for a
    model no transformers architecture computes (`hf_model_type`)."""
    dtype_name = str(dtype).removeprefix("torch.")
    model_type = hf_model_type(cfg)
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.n_hidden,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        **_rope_config(cfg),
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        # No bos: nanolm prepends nothing. eos is <|im_end|>, as in tokenizer_config.json (Qwen2-Instruct's roles).
        "bos_token_id": None,
        "eos_token_id": IM_END_ID,
        "pad_token_id": EOT_ID,
        "use_cache": True,
        "torch_dtype": dtype_name,  # transformers < 5
        "dtype": dtype_name,
    }
    if model_type == "llama":
        out.update({"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1})
        return out
    out.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layer})
    if model_type == "qwen2_moe":
        out["qkv_bias"] = True  # the model's biases, or zeros: see nanolm/export/hf.py's docstring
    elif model_type != "qwen2":  # Qwen2's attention always has its q/k/v biases
        out["attention_bias"] = False
    if model_type in ("qwen2", "qwen3"):
        return out
    n_moe = len(moe_layers(cfg))
    out.update({
        "decoder_sparse_step": cfg.moe_every,
        "mlp_only_layers": [],
        "num_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.top_k,
        "moe_intermediate_size": cfg.moe_n_hidden,
        "norm_topk_prob": cfg.norm_topk,
        "router_aux_loss_coef": cfg.aux_loss_coef * n_moe / cfg.top_k,
        "output_router_logits": False,
    })
    if model_type == "qwen2_moe":
        out["shared_expert_intermediate_size"] = cfg.n_shared_experts * cfg.moe_n_hidden or 1
    return out


# ----------------------------------------------------------------------------- transformers -> nanolm

class _Fields:
    """A config.json dict read field by field, each error naming the file (`where`) and the field."""

    def __init__(self, hf_config: dict[str, Any], where: str) -> None:
        self.raw, self.where = hf_config, where

    def get(self, name: str, default: Any = None) -> Any:
        return self.raw.get(name, default)

    def unsupported(self, name: str, value: Any, supported: str) -> UserError:
        return UserError(f"{self.where}: {name} = {json.dumps(value)} is not supported; {supported}")

    def integer(self, name: str, default: int | None = None, value: Any = None) -> int:
        v = self.raw.get(name, default) if value is None else value
        if isinstance(v, bool) or not isinstance(v, int):
            raise UserError(f"{self.where}: {name} must be an integer, got {json.dumps(v)}; "
                            f"is this a transformers config.json?")
        return v

    def number(self, name: str, default: float | None, value: Any = None) -> float:
        v = self.raw.get(name, default) if value is None else value
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise UserError(f"{self.where}: {name} must be a number, got {json.dumps(v)}; "
                            f"is this a transformers config.json?")
        return float(v)


def _round(x: float) -> float:
    """Drop the last bits of float noise that a scale-and-unscale leaves (x * a / a)."""
    return float(f"{x:.12g}")


def _model_type(f: _Fields) -> str:
    """The model_type, one nanolm imports, with SwiGLU's activation."""
    model_type = f.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        raise f.unsupported("model_type", model_type, "nanolm imports llama (LlamaForCausalLM), qwen2 "
                            "(Qwen2ForCausalLM), qwen3 (Qwen3ForCausalLM), qwen3_moe (Qwen3MoeForCausalLM) and "
                            "qwen2_moe (Qwen2MoeForCausalLM, as nanolm exports it)")
    act = f.get("hidden_act", "silu")
    if act != "silu":
        raise f.unsupported("hidden_act", act, "nanolm's MLP is SwiGLU (hidden_act \"silu\")")
    return model_type


def _rope_fields(f: _Fields) -> tuple[Any, dict[str, Any]]:
    """(rope_theta as written, ModelConfig's scaling fields) from rope_scaling or rope_parameters: plain RoPE,
    transformers' default YaRN or Llama 3's scaling."""
    theta = f.get("rope_theta", 10000.0)  # transformers' default base
    # transformers >= 5 takes rope_scaling when it is set, else rope_parameters; < 5 reads rope_scaling only.
    rope_key = "rope_scaling" if f.get("rope_scaling") else "rope_parameters"
    rope = f.get(rope_key)
    if rope is None:
        return theta, {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else None
    kind = kind if isinstance(kind, str) and kind in ROPE_KEYS else None
    extra = set(rope) - {"rope_type", "type", "rope_theta"} - ROPE_KEYS.get(kind, set()) \
        if isinstance(rope, dict) else set()
    # truncate false (gpt-oss) and mscale (DeepSeek) change YaRN's formula; nanolm computes transformers'
    # default one.
    if kind is None or extra or rope.get("truncate", True) is not True or \
            rope.get("mscale") or rope.get("mscale_all_dim"):
        raise f.unsupported(rope_key, rope, "nanolm uses plain RoPE ({\"rope_type\": \"default\"}), YaRN "
                            "({\"rope_type\": \"yarn\", \"factor\": ..., \"original_max_position_embeddings\": ..., "
                            "optionally beta_fast, beta_slow, attention_factor}) or Llama 3's ({\"rope_type\": "
                            "\"llama3\", \"factor\": ..., \"low_freq_factor\": ..., \"high_freq_factor\": ..., "
                            "\"original_max_position_embeddings\": ...})")
    theta = rope.get("rope_theta", theta)
    if kind not in ("yarn", "llama3"):
        return theta, {}

    def number(key: str, default: float | None) -> float:
        return f.number(f"{rope_key}.{key}", default, rope.get(key))

    # transformers' original length: a top-level original_max_position_embeddings first (Phi-3 keeps
    # it there), then the rope dict's, then max_position_embeddings.
    original = "original_max_position_embeddings"
    fields = dict(
        rope_scaling=kind, rope_factor=number("factor", None),
        rope_original_max_len=f.integer(original if original in f.raw else f"{rope_key}.{original}",
                                        f.get("max_position_embeddings"), f.get(original, rope.get(original))))
    if kind == "yarn":
        attention = rope.get("attention_factor")
        fields.update(
            rope_beta_fast=number("beta_fast", 32.0), rope_beta_slow=number("beta_slow", 1.0),
            rope_attention_factor=0.0 if attention is None else number("attention_factor", None))
    else:  # transformers requires both; Llama 3.x's values are these
        fields.update(rope_low_freq_factor=number("low_freq_factor", 1.0),
                      rope_high_freq_factor=number("high_freq_factor", 4.0))
    return theta, fields


def _check_layers(f: _Fields, model_type: str) -> None:
    """No o_proj or MLP bias, no sliding window: what nanolm's layer does not compute."""
    if model_type not in ("qwen2", "qwen2_moe"):
        if f.get("attention_bias"):
            raise f.unsupported("attention_bias", f.raw["attention_bias"], "it adds an o_proj bias, which "
                                "nanolm's attention lacks (nanolm has q/k/v biases as Qwen2 has them: qwen2)")
    if f.get("mlp_bias"):
        raise f.unsupported("mlp_bias", f.raw["mlp_bias"], "nanolm's MLP has no bias (mlp_bias false)")
    if f.get("use_sliding_window"):
        raise f.unsupported("use_sliding_window", True, "nanolm attends to the whole context (false)")
    layer_types = f.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list) or set(layer_types) - {"full_attention"}):
        raise f.unsupported("layer_types", layer_types, "nanolm attends to the whole context in every layer "
                            "(\"full_attention\")")


def _dense_fields(f: _Fields, model_type: str, hf_state_dict: dict[str, torch.Tensor], theta: Any,
                  rope_fields: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's fields of a dense model (a MoE model's too, before its experts')."""
    d_model, n_head = f.integer("hidden_size"), f.integer("num_attention_heads")
    # Qwen3Config's head_dim defaults to 128 whatever the width; the others' to hidden_size / heads (0 here).
    head_dim = f.get("head_dim", 128 if model_type == "qwen3" else None)
    if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0
                                 or head_dim % 2):
        raise f.unsupported("head_dim", head_dim, "nanolm's heads are a positive even size (RoPE rotates pairs)")
    # Qwen2's attention always has q/k/v biases; Qwen2-MoE's unless qkv_bias is false, and all-zero ones are
    # the stand-ins nanolm exports for none.
    bias_keys = [k for k in hf_state_dict if k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))]
    qkv_bias = model_type == "qwen2" or (model_type == "qwen2_moe" and bool(f.get("qkv_bias", True))
                                         and any(hf_state_dict[k].any() for k in bias_keys))
    n_layer = f.integer("num_hidden_layers")
    kv = f.get("num_key_value_heads")
    return dict(
        vocab_size=f.integer("vocab_size"), d_model=d_model, n_layer=n_layer, n_head=n_head,
        n_kv_head=n_head if kv is None else f.integer("num_key_value_heads"), head_dim=head_dim or 0,
        qkv_bias=qkv_bias,
        n_hidden=f.integer("intermediate_size"),
        max_seq_len=f.integer("max_position_embeddings", 2048), rope_theta=f.number("rope_theta", 0.0, theta),
        **rope_fields,
        norm_eps=f.number("rms_norm_eps", 1e-6), qk_norm=model_type in ("qwen3", "qwen3_moe"), dropout=0.0,
        tie_embeddings=bool(f.get("tie_word_embeddings", False)),
        init_std=f.number("initializer_range", 0.02),
    )


def _moe_fields(f: _Fields, model_type: str, n_layer: int) -> dict[str, Any]:
    """ModelConfig's expert fields of a Qwen2-MoE or Qwen3-MoE model."""
    if f.get("mlp_only_layers"):
        raise f.unsupported("mlp_only_layers", f.raw["mlp_only_layers"], "nanolm places MoE layers by "
                            "decoder_sparse_step only (mlp_only_layers [])")
    step = f.integer("decoder_sparse_step", 1)
    top_k = f.integer("num_experts_per_tok")
    n_moe = sum(1 for i in range(n_layer) if step > 0 and (i + 1) % step == 0)
    moe_hidden = f.integer("moe_intermediate_size")
    # Qwen3-MoE has no shared expert; in Qwen2-MoE a width that is no multiple of the expert width is the
    # zero stand-in for "no shared expert".
    shared = f.integer("shared_expert_intermediate_size") if model_type == "qwen2_moe" else 0
    # transformers >= 5 saves Qwen3-MoE's expert count as num_local_experts.
    n_experts = "num_local_experts" if "num_experts" not in f.raw and "num_local_experts" in f.raw \
        else "num_experts"
    return dict(
        use_moe=True, n_experts=f.integer(n_experts), top_k=top_k, moe_n_hidden=moe_hidden, moe_every=step,
        n_shared_experts=shared // moe_hidden if moe_hidden > 0 and shared % moe_hidden == 0 else 0,
        norm_topk=bool(f.get("norm_topk_prob", False)),
        aux_loss_coef=_round(f.number("router_aux_loss_coef", 0.001) * top_k / max(n_moe, 1)),
    )


def from_hf_config(hf_config: dict[str, Any], hf_state_dict: dict[str, torch.Tensor], where: str) -> ModelConfig:
    """The ModelConfig of a transformers model from its config.json dict (and, for Qwen2-MoE's q/k/v biases,
    whether its weights hold any but zeros); `where` (the config file) starts every error. UserError for a
    field nanolm cannot express, naming it and what is supported."""
    f = _Fields(hf_config, where)
    model_type = _model_type(f)
    theta, rope_fields = _rope_fields(f)
    _check_layers(f, model_type)
    fields = _dense_fields(f, model_type, hf_state_dict, theta, rope_fields)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        fields.update(_moe_fields(f, model_type, fields["n_layer"]))
    try:
        return ModelConfig(**fields)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
