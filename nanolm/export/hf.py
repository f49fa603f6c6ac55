"""HuggingFace `transformers` export and import through one state-dict adapter.

`export_hf` writes a directory that `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load with no custom code (no
`trust_remote_code`); `import_hf` turns such a directory (or another Llama,
Qwen2 / Qwen2.5, Qwen3 or Qwen3-MoE checkpoint) into a nanolm checkpoint that `nanolm train --init-from`
starts from. Every renaming and reshaping of weights lives in `to_hf` / `from_hf`,
pure functions on state dicts and config dicts; the rest of this file moves
files. `transformers` itself is not needed by either direction.

Which architecture (`hf_config.hf_model_type`)
- A dense model becomes `LlamaForCausalLM`. nanolm's decoder is Llama's:
  the same module names (under `model.`), RMSNorm, SwiGLU, grouped-query
  attention, rotate-half RoPE, no biases. The conversion prefixes the keys and
  drops the tied head, which HF also stores once.
- A dense model with q/k/v biases (`model.qkv_bias`) becomes
  `Qwen2ForCausalLM`: Llama's layer with biases on q_proj, k_proj and v_proj
  (and none on o_proj), as Qwen2 and Qwen2.5 have them.
- A dense model with QK-norm (`model.qk_norm`, MiniMind-3) becomes
  `Qwen3ForCausalLM`: Llama's layer plus `self_attn.q_norm` / `k_norm`, an
  RMSNorm of size head_dim applied to each head before RoPE, as nanolm does.
  No transformers family has both the biases and QK-norm, and such a model is
  refused.
- `head_dim` is written for every architecture (Qwen3's default is 128, not
  hidden / heads; the others read hidden / heads without it), so a head size
  other than d_model / n_head (`model.head_dim`) reaches each of them.
- A MoE model without QK-norm becomes `Qwen2MoeForCausalLM`. Qwen2-MoE is the
  one MoE family in transformers with nanolm's exact layer: Llama attention
  (Qwen3-MoE adds QK-norm; DeepSeek-V2/V3 use latent attention),
  softmax-then-top-k routing with optional renormalisation (`norm_topk_prob`),
  routed plus shared experts (Mixtral has no shared expert) and dense layers
  interleaved (`decoder_sparse_step` = moe_every, with the same
  `(i + 1) % step == 0` rule). The remaining differences are bridged exactly:
  * Qwen2 attention has q/k/v biases: a model without them (`model.qkv_bias`
    false) gets them as zeros with `qkv_bias: true`, which every transformers
    version reads (and vLLM and llama.cpp, whose Qwen2-MoE always has the
    biases); `qkv_bias: false` would load only in transformers >= 5. On import
    all-zero biases are dropped again and any other makes `qkv_bias` true.
  * Qwen2-MoE always scales the shared expert by
    sigmoid(shared_expert_gate(x)); nanolm's shared expert is ungated, so the
    gate is written as zeros (sigmoid(0) = 0.5 exactly) and the shared
    down_proj times 2 (exact: a power of two).
  * n_shared_experts = 0: a shared expert of width 1 with zero weights,
    which adds exactly 0.
  * Experts are written one by one (`mlp.experts.{j}.gate_proj.weight`, ...),
    the layout of Qwen1.5-MoE on the Hub; transformers 5 fuses them into 3-D
    tensors as it loads and splits them again when it saves.
  * `router_aux_loss_coef`: HF's load-balancing loss is top_k times nanolm's
    and pools the MoE layers where nanolm sums them, so the coefficient is
    scaled by n_moe_layers / top_k (it matters only to training in
    transformers, with `output_router_logits`).
- A MoE model with QK-norm and no shared expert becomes `Qwen3MoeForCausalLM`:
  Qwen3 attention and Qwen2-MoE's routing without the shared expert (so no
  biases or stand-ins), experts one by one and `router_aux_loss_coef` as for
  Qwen2-MoE. With a shared expert no transformers model computes it (Qwen2-MoE
  has no QK-norm), and the export is refused.

The config.json half of the adapter (`to_hf_config`, `from_hf_config`, RoPE
included) is nanolm/export/hf_config.py.

Import reads `llama`, `qwen2`, `qwen3` and `qwen3_moe` checkpoints nanolm can
express (SiLU, plain RoPE, transformers' YaRN or Llama 3's scaling, q/k/v
biases only as Qwen2 has them, any even head_dim, full attention in every
layer), among them Llama 3.x, Qwen2.5, Qwen3-0.6B and MiniMind-3's
transformers release (Qwen3 / Qwen3-MoE written by its convert_model.py,
rope_scaling null), and `qwen2_moe` ones of the exported form (zero
shared-expert gate); anything else is a UserError naming the config field.
Experts may be stored one by one or fused into 3-D `experts.gate_up_proj` /
`experts.down_proj` tensors. Weights come only from
safetensors files, single or sharded; nothing is unpickled.

Tokenizer: nanolm needs `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` at ids
0, 1, 2. An HF tokenizer that does not have them (Llama's SentencePiece
tokenizers, Qwen's) is not copied on import: the weights still are, with a
warning, since they remain useful with the original tokenizer elsewhere, but
fine-tuning them in nanolm needs data prepared with a tokenizer nanolm loads,
and a different tokenizer means the embeddings start over.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from nanolm.checkpoint import load_model, model_state, require_causal, resolve_checkpoint, write_model_dir
from nanolm.checkpoint.weights import expected_shapes
from nanolm.config.model import ModelConfig
from nanolm.errors import UserError
from nanolm.export.hf_config import from_hf_config, moe_layers, to_hf_config
from nanolm.io import atomic_directory, check_new_directory, read_json_object, write_json_atomic
from nanolm.model.lora import merge_lora
from nanolm.tokenizer import CONFIG_FILE, SPECIAL_TOKENS, TOKENIZER_FILE, Tokenizer

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
HF_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
# The model families people know each model_type by (`nanolm import --help` names them).
FAMILIES = {"llama": "Llama, SmolLM2", "qwen2": "Qwen2, Qwen2.5", "qwen3": "Qwen3", "qwen2_moe": "Qwen2-MoE",
            "qwen3_moe": "Qwen3-MoE"}


# ----------------------------------------------------------------------------- the adapter

def _hf_name(name: str) -> str:
    """nanolm key -> HF key: everything but the head lives under the base model `model.`."""
    return name if name == "lm_head.weight" else "model." + name


def _nanolm_name(hf_name: str) -> str | None:
    """HF key -> nanolm key, or None for a key outside nanolm's naming."""
    if hf_name == "lm_head.weight":
        return hf_name
    return hf_name.removeprefix("model.") if hf_name.startswith("model.") else None


def to_hf(state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """nanolm weights and model config -> (HF state dict, HF config.json dict); see the module docstring.

    `state_dict` may hold the tied head or not; LoRA layers must be merged first.
    The HF config's dtype is that of the embedding.
    """
    sd = dict(state_dict)
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)  # it is the embedding
    shapes = expected_shapes(cfg)
    missing = [k for k in shapes if k not in sd]
    unexpected = [k for k in sd if k not in shapes]
    wrong = [f"{k} {tuple(sd[k].shape)} (config: {shapes[k]})" for k in shapes if k in sd and
             tuple(sd[k].shape) != shapes[k]]
    if missing or unexpected or wrong:
        raise ValueError(f"to_hf: the state dict does not match the model config (missing: {missing[:3]}, "
                         f"unexpected: {unexpected[:3]}, shapes: {wrong[:3]}); merge LoRA adapters first")
    dtype = sd["embed_tokens.weight"].dtype
    hf_config = to_hf_config(cfg, dtype)  # refuses what no transformers model computes, before any work
    out = {_hf_name(k): t for k, t in sd.items()}
    if hf_config["model_type"] == "qwen2_moe":
        C, hs = cfg.d_model, cfg.head_dim
        zeros = lambda *shape: torch.zeros(shape, dtype=dtype)  # noqa: E731
        for i in range(cfg.n_layer if not cfg.qkv_bias else 0):  # Qwen2-MoE's biases: zeros where nanolm has none
            attn = f"model.layers.{i}.self_attn."
            out[attn + "q_proj.bias"] = zeros(cfg.n_head * hs)
            out[attn + "k_proj.bias"] = zeros(cfg.n_kv_head * hs)
            out[attn + "v_proj.bias"] = zeros(cfg.n_kv_head * hs)
        for i in moe_layers(cfg):
            mlp = f"model.layers.{i}.mlp."
            if cfg.n_shared_experts:
                down = mlp + "shared_expert.down_proj.weight"
                out[down] = out[down] * 2  # undoes the 0.5 of the zero gate, exactly
            else:
                out[mlp + "shared_expert.gate_proj.weight"] = zeros(1, C)
                out[mlp + "shared_expert.up_proj.weight"] = zeros(1, C)
                out[mlp + "shared_expert.down_proj.weight"] = zeros(C, 1)
            out[mlp + "shared_expert_gate.weight"] = zeros(1, C)
    return out, hf_config


def from_hf(hf_state_dict: dict[str, torch.Tensor], hf_config: dict[str, Any], *,
            source: str | Path = "") -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """HF state dict and config.json dict -> (nanolm state dict, ModelConfig); the inverse of to_hf.

    `source` (the HF directory) only prefixes error messages. Raises UserError
    for a config field nanolm cannot express, naming it and what is supported.
    A tied head is left out of the result, as nanolm checkpoints store it once.
    """
    prefix = f"{source}/" if str(source) else ""
    where_cfg, where_w = f"{prefix}{HF_CONFIG}", f"{prefix}weights"
    cfg = from_hf_config(hf_config, hf_state_dict, where_cfg)
    sd = {k: t for k, t in hf_state_dict.items() if not k.endswith("rotary_emb.inv_freq")}  # derived buffers
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)  # transformers ignores a stored copy of the tied head too
    _split_fused_experts(sd, where_w)
    if hf_config["model_type"] == "qwen2_moe":
        _drop_stand_ins(sd, cfg, hf_config, where_cfg, where_w)
    return _checked_state_dict(sd, cfg, hf_config["model_type"], where_w), cfg


def _take(sd: dict[str, torch.Tensor], key: str, where_w: str) -> torch.Tensor:
    """Tensor `key`, taken out of `sd`; UserError when the checkpoint lacks it."""
    if key not in sd:
        raise UserError(f"{where_w}: missing tensor {key}; the checkpoint is incomplete")
    return sd.pop(key)


def _split_fused_experts(sd: dict[str, torch.Tensor], where_w: str) -> None:
    """Experts fused into 3-D tensors (transformers >= 5 in memory, MiniMind's conversion script), replaced in
    `sd` by the per-expert tensors of the checkpoint layout."""
    for fused in [k for k in sd if k.endswith(".mlp.experts.gate_up_proj")]:
        experts = fused.removesuffix("gate_up_proj")
        # (E, 2 moe_hidden, C): gate rows, then up rows
        gate_up, down = _take(sd, fused, where_w), _take(sd, experts + "down_proj", where_w)
        if gate_up.dim() != 3 or gate_up.shape[1] % 2 or down.dim() != 3 or down.shape[0] != gate_up.shape[0]:
            raise UserError(f"{where_w}: {fused} {tuple(gate_up.shape)} and {experts}down_proj {tuple(down.shape)} "
                            "are not (experts, 2 x width, hidden) and (experts, hidden, width)")
        for j in range(gate_up.shape[0]):
            gate, up = gate_up[j].chunk(2)
            sd[f"{experts}{j}.gate_proj.weight"], sd[f"{experts}{j}.up_proj.weight"] = gate.clone(), up.clone()
            sd[f"{experts}{j}.down_proj.weight"] = down[j].clone()  # (C, moe_hidden)


def _drop_stand_ins(sd: dict[str, torch.Tensor], cfg: ModelConfig, hf_config: dict[str, Any], where_cfg: str,
                    where_w: str) -> None:
    """Qwen2-MoE as nanolm exports it, back to nanolm's layer: the zero q/k/v biases, zero shared expert and
    zero shared-expert gate dropped, the shared down_proj halved (the gate's sigmoid(0) = 0.5)."""
    if hf_config.get("qkv_bias", True) and not cfg.qkv_bias:
        for i in range(cfg.n_layer):
            for proj in ("q_proj", "k_proj", "v_proj"):
                _take(sd, f"model.layers.{i}.self_attn.{proj}.bias", where_w)  # zeros: the stand-ins for none
    for i in moe_layers(cfg):
        mlp = f"model.layers.{i}.mlp."
        gate = _take(sd, mlp + "shared_expert_gate.weight", where_w)
        if cfg.n_shared_experts == 0:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                t = _take(sd, f"{mlp}shared_expert.{proj}.weight", where_w)
                if proj == "down_proj" and t.any():
                    raise UserError(f"{where_cfg}: shared_expert_intermediate_size = "
                                    f"{hf_config['shared_expert_intermediate_size']} is not a multiple of "
                                    f"moe_intermediate_size = {hf_config['moe_intermediate_size']}; nanolm's shared "
                                    f"experts are n_shared_experts x moe_intermediate_size wide")
        else:
            if gate.any():
                raise UserError(f"{where_w}: {mlp}shared_expert_gate.weight is not zero; nanolm's shared "
                                f"expert is ungated, so only a zero gate (as nanolm exports it) can be imported")
            down = mlp + "shared_expert.down_proj.weight"
            sd[down] = _take(sd, down, where_w) / 2  # the exported gate's sigmoid(0) = 0.5, exactly


def _checked_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig, model_type: str,
                        where_w: str) -> dict[str, torch.Tensor]:
    """`sd` under nanolm's names, every tensor the config implies present with its shape, none else."""
    shapes = expected_shapes(cfg)
    out: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        name = _nanolm_name(key)
        if name not in shapes:
            raise UserError(f"{where_w}: unexpected tensor {key} for a {model_type} model as nanolm reads it; "
                            f"only checkpoints nanolm can express are supported (see nanolm.export.hf)")
        if tuple(t.shape) != shapes[name]:
            raise UserError(f"{where_w}: {key} has shape {tuple(t.shape)} but {HF_CONFIG} implies "
                            f"{shapes[name]}; the weights and the config do not belong together")
        out[name] = t
    missing = [_hf_name(k) for k in shapes if k not in out]
    if missing:
        raise UserError(f"{where_w}: {len(missing)} tensor(s) missing, first: {missing[0]}; "
                        f"the checkpoint is incomplete")
    return out


# ----------------------------------------------------------------------------- files

def _read_json(path: Path, what: str) -> dict[str, Any]:
    return read_json_object(path, what, "pass an intact transformers model directory")


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise UserError(f"{path}: missing weights file") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path}: corrupt or truncated safetensors file ({e})") from None


def load_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF model directory: model.safetensors, or the shards its index names."""
    hf_dir = Path(hf_dir)
    index = hf_dir / WEIGHTS_INDEX
    if index.is_file():
        weight_map = _read_json(index, "shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise UserError(f"{index}: no \"weight_map\" of tensor name -> shard file; the index is damaged")
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            if Path(shard).name != shard:  # shard files sit beside the index, never elsewhere
                raise UserError(f"{index}: shard {shard!r} is not a file name in {hf_dir}")
            tensors.update(_load_safetensors(hf_dir / shard))
        absent = sorted(set(weight_map) - set(tensors))
        if absent:
            raise UserError(f"{index}: {absent[0]} is not in its shard {weight_map[absent[0]]}; the shards are "
                            f"incomplete")
        return tensors
    if (hf_dir / WEIGHTS).is_file():
        return _load_safetensors(hf_dir / WEIGHTS)
    pickled = sorted(p.name for p in hf_dir.glob("*.bin")) + sorted(p.name for p in hf_dir.glob("*.pt*"))
    if pickled:
        raise UserError(f"{hf_dir}: weights only in {pickled[0]} (a pickle, which nanolm never loads); convert it "
                        f"to safetensors first, e.g. load it in transformers and save_pretrained() it again")
    raise UserError(f"{hf_dir}: no {WEIGHTS} or {WEIGHTS_INDEX}; pass a transformers model directory")


def _tokenizer_source(dirs: list[Path]) -> Path | None:
    return next((d for d in dirs if (d / TOKENIZER_FILE).is_file()), None)


def export_hf(checkpoint: str | Path, out_dir: Path, *, which: str = "best", adapter: str | Path | None = None,
              dtype: str = "float32", tokenizer: str | Path | None = None) -> Path:
    """Write `checkpoint` as a transformers model directory at `out_dir` (created; must not hold files).

    checkpoint: a run or checkpoint directory (`which` picks best or last of a
    run); a LoRA checkpoint, or `adapter` on top of a full one, is merged into
    the weights. dtype: float32, bfloat16 or float16 for the written weights.
    tokenizer: a directory with tokenizer.json, when the checkpoint has none.
    Writes config.json, generation_config.json, model.safetensors,
    tokenizer.json and tokenizer_config.json. Returns out_dir.
    """
    if dtype not in EXPORT_DTYPES:
        raise UserError(f"--dtype {dtype}: choose one of {', '.join(EXPORT_DTYPES)}")
    out_dir = Path(out_dir)
    check_new_directory(out_dir)
    model, src = load_model(checkpoint, which, "cpu", adapter)
    require_causal(model.config, "export to transformers (a causal language model)", src)
    cfg = model.config
    candidates = [Path(tokenizer)] if tokenizer is not None else [src]
    if tokenizer is None and adapter is not None:
        candidates.append(resolve_checkpoint(adapter, which))
    tok_dir = _tokenizer_source(candidates)
    if tok_dir is None:
        raise UserError(f"{candidates[0]}: no {TOKENIZER_FILE}, and transformers needs the tokenizer beside the "
                        f"model; pass --tokenizer <directory of the tokenizer the model was trained with>")
    tok = Tokenizer.load(tok_dir)  # refuses a tokenizer without nanolm's special ids
    if tok.vocab_size > cfg.vocab_size:
        raise UserError(f"{tok.path}: the tokenizer has {tok.vocab_size} tokens but the model only "
                        f"{cfg.vocab_size}; pass the tokenizer the model was trained with")

    merge_lora(model)  # no-op without adapters; transformers gets plain weights
    sd = {k: v.to(EXPORT_DTYPES[dtype]) for k, v in model_state(model).items()}
    hf_sd, hf_cfg = to_hf(sd, cfg)
    hf_cfg.update(eos_token_id=tok.im_end_id, pad_token_id=tok.eot_id)  # the tokenizer's own ids

    with atomic_directory(out_dir) as tmp:
        save_file(hf_sd, str(tmp / WEIGHTS), metadata={"format": "pt"})
        write_json_atomic(tmp / HF_CONFIG, hf_cfg)
        # A chat turn ends with <|im_end|>, a document with <|endoftext|>: generate stops at either.
        write_json_atomic(tmp / GENERATION_CONFIG, {"eos_token_id": [tok.im_end_id, tok.eot_id],
                                                    "pad_token_id": tok.eot_id})
        tok.save(tmp)
        tok_cfg = _read_json(tmp / CONFIG_FILE, "tokenizer config")
        tok_cfg["model_max_length"] = cfg.max_seq_len
        write_json_atomic(tmp / CONFIG_FILE, tok_cfg)
    return out_dir


def import_hf(hf_dir: Path, out_dir: Path) -> Path:
    """Convert a transformers model directory into a nanolm checkpoint directory at `out_dir`.

    out_dir gets model.safetensors (float32), config.json (the nanolm model
    config made from the HF config, and nothing else: a model needs no
    training settings) and, when nanolm can use it, the tokenizer. Train from it with
    `nanolm train --config <out_dir>/config.json --init-from <out_dir> ...`.
    The tokenizer's chat template (tokenizer_config.json's, or chat_template.jinja's, which wins as in
    transformers) is written into the checkpoint's tokenizer_config.json.
    Warns (and copies no tokenizer) when the HF tokenizer lacks nanolm's
    ChatML tokens (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`). Returns out_dir.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if not hf_dir.is_dir():
        raise UserError(f"{hf_dir}: no such directory; pass a transformers model directory (config.json + "
                        f"safetensors weights)")
    check_new_directory(out_dir)
    hf_config = _read_json(hf_dir / HF_CONFIG, "model config")
    sd, model_cfg = from_hf(load_hf_weights(hf_dir), hf_config, source=hf_dir)
    sd = {k: v.float().contiguous() for k, v in sd.items()}  # nanolm trains float32 master weights

    problem = None
    if not (hf_dir / TOKENIZER_FILE).is_file():
        problem = f"{hf_dir} has no {TOKENIZER_FILE}"
    else:
        try:
            tok = Tokenizer.load(hf_dir)
        except UserError as e:
            problem = str(e).partition("; ")[0]
        else:
            if tok.vocab_size > model_cfg.vocab_size:
                problem = f"its {tok.vocab_size} tokens exceed the model's vocab_size {model_cfg.vocab_size}"
    if problem:
        warnings.warn(f"{out_dir}: imported the weights without a tokenizer ({problem}); nanolm needs "
                      f"{', '.join(SPECIAL_TOKENS)} as special tokens. The weights belong to the original tokenizer: "
                      f"fine-tuning them in nanolm with another one starts the embeddings over", stacklevel=2)

    if problem:
        return write_model_dir(out_dir, sd, model_cfg, tokenizer_from=None, metadata={"imported_from": str(hf_dir)})
    # The tokenizer as nanolm saves it: a chat_template.jinja (transformers 5's place for the template) folded into
    # tokenizer_config.json, which every checkpoint made from this one copies, so the model keeps its own layout.
    with tempfile.TemporaryDirectory() as tok_dir:
        tok.save(tok_dir)
        return write_model_dir(out_dir, sd, model_cfg, tokenizer_from=Path(tok_dir),
                               metadata={"imported_from": str(hf_dir)})
