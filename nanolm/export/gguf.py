"""GGUF export: a nanolm checkpoint as one file that llama.cpp and ollama load.

GGUF holds the weights under llama.cpp's tensor names, the hyperparameters
llama.cpp reads (`llama.context_length`, `llama.attention.head_count`, ...)
and the tokenizer (byte-level BPE vocabulary, merges, special-token ids and
the ChatML chat template), so `llama-cli -m model.gguf` or an ollama
Modelfile `FROM ./model.gguf` needs nothing else.

Architectures (`gguf_architecture`):
- dense models are written as llama.cpp's "llama" architecture;
- dense models with q/k/v biases (Qwen2, Qwen2.5) are "qwen2", whose
  attention adds `attn_q.bias`, `attn_k.bias` and `attn_v.bias` to the
  projections, as nanolm does; llama.cpp sizes qwen2's projections as
  d_model x d_model, so only models whose head_dim is d_model / n_head can be
  written as it;
- MoE models whose routing llama's Mixtral path computes (no shared expert,
  top-k weights renormalised) are "llama" too, with each layer's experts
  stacked into 3-D `ffn_{gate,up,down}_exps` tensors and the router as
  `ffn_gate_inp`;
- other MoE models (a shared expert, or top-k weights not renormalised) are
  "bailingmoe", the llama.cpp architecture with Llama attention, softmax
  top-k routing with a renormalisation switch (`expert_weights_norm`) and an
  ungated shared SwiGLU expert of width n_shared * n_hidden, which is exactly
  nanolm's MoE block. llama's graph ignores shared-expert tensors and
  qwen2moe/deepseek never renormalise, so neither could carry those models.
  MoE models that mix dense and MoE blocks (model.moe_every > 1) are refused:
  none of llama.cpp's MoE architectures has that layer pattern;
- models with QK-norm (Qwen3, MiniMind-3) are "qwen3", whose attention
  RMS-normalises each head's q and k (`attn_q_norm`, `attn_k_norm`) before
  RoPE exactly as nanolm does; MoE models with QK-norm are "qwen3moe", which
  routes as llama's Mixtral path (softmax, top-k, renormalised) with no shared
  expert, so only such models (every block MoE) can be written as it;
- models with both QK-norm and q/k/v biases, and MoE models with the biases,
  are refused: no llama.cpp architecture computes them.

Head size: `{arch}.attention.key_length` / `value_length` carry head_dim for
qwen3 and qwen3moe (as llama.cpp's converter writes them), and for every
other architecture where head_dim is not d_model / n_head, llama.cpp's default.

RoPE layout: nanolm (like HF Llama) rotates the two halves of each head,
pairing dimension i with i + hs/2; llama.cpp's "llama" and "bailingmoe" graphs
use ggml's normal RoPE, which pairs dimensions 2i and 2i+1. Both rotate pair
i by the angle pos * theta^(-2i/hs), so reordering the rows of W_q and W_k
within each head (row i -> 2i, row i + hs/2 -> 2i + 1) makes ggml compute
the same rotated q and k up to one common permutation of each head's
coordinates, which leaves every q.k score unchanged. This is the permutation
llama.cpp's convert_hf_to_gguf.py applies to HF Llama checkpoints. "qwen3" and
"qwen3moe" use NEOX RoPE, which rotates halves as nanolm does, so their q/k
rows are written as they are (and the QK-norm weight, applied per head before
RoPE, needs no reordering either way).

YaRN: `rope.scaling.type` "yarn", `rope.scaling.factor`,
`rope.scaling.original_context_length` and the ramp's
`rope.scaling.yarn_beta_fast` / `yarn_beta_slow`; llama.cpp computes the same
ramp over the same pair boundaries (floor / ceil, clamped at head_dim - 1) and
scales cos/sin by 0.1 ln(factor) + 1 times `rope.scaling.attn_factor`, which is
written (as the model's attention factor divided by that default) only for a
model whose attention factor is not the default (llama.cpp of llama-cpp-python
0.3.36 reads that key, not `yarn_attn_factor`, for it).

Llama 3's scaling (`model.rope_scaling` llama3): no rope.scaling keys, but a
`rope_freqs.weight` tensor of hs/2 float32 factors that llama.cpp divides each
pair's frequency by (its ggml_rope_ext's freq_factors), computed as
convert_hf_to_gguf.py does (`Llama3.freq_factors`); llama.cpp reads it in its
"llama" architecture only, so other architectures with it are refused.

Tensor types (`tensor_type`): norms and the MoE router stay float32 (as
llama.cpp's converter and its quantizer keep them); the other matrices are
written as `outtype`, with llama.cpp's own exceptions. Q8_0 and Q4_0 quantise
rows in blocks of 32 values, so a matrix whose rows are not a multiple of 32
long is written as F16 instead (the type llama-quantize falls back to when no
quantised type fits a row). For q4_0 files, the rules of llama-quantize
(`llama_tensor_get_type` in llama.cpp's src/llama-quant.cpp) for
LLAMA_FTYPE_MOSTLY_Q4_0 are followed: the output projection (token_embd when
the embeddings are tied and the file has no `output.weight`) is kept at
higher precision: Q6_K there (Q8_0 where rows are not a multiple of Q6_K's
256-value blocks), always Q8_0 here, because the `gguf` library (0.19.0)
cannot quantise any K-type (its Q4_K/Q6_K classes only dequantise); and in
models of exactly 8 experts attn_k and attn_v are Q8_0, as there. K-quants
(q4_k_m and the like) are not written: `llama-quantize model-f16.gguf
model-q4_k_m.gguf Q4_K_M` makes one from an f16 export.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from nanolm.config.model import ModelConfig
from nanolm.errors import UserError
from nanolm.io import atomic_file, fsync_dir
from nanolm.model.transformer import Llama3, Yarn
from nanolm.progress import Progress, fmt_bytes

OUTTYPES = ("f32", "f16", "q8_0", "q4_0")
# llama.cpp's names for the pre-tokenizers nanolm's tokenizers use: GPT-2's split regex (ByteLevel alone, the
# tokenizers trained before digits were split), and "starcoder": each digit alone, then GPT-2's regex.
TOKENIZER_PRE = {False: "gpt-2", True: "starcoder"}
BLOCK = {"q8_0": 32, "q4_0": 32}  # values per quantisation block (ggml's QK8_0, QK4_0): a row holds whole blocks

# gguf's TokenType values (normal text pieces, special/control tokens, padding rows of the embedding)
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5


def rope_interleave(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection (n_heads * hs, in) from rotate-half order to ggml's interleaved order.

    Within each head, row i goes to 2i and row i + hs/2 to 2i + 1.
    """
    out_dim = w.shape[0]
    hs = out_dim // n_heads
    return w.reshape(n_heads, 2, hs // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rope_deinterleave(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of `rope_interleave`: ggml's interleaved rows back to rotate-half order."""
    hs = w.shape[0] // n_heads
    return w.reshape(n_heads, hs // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class MoELayout:
    """How a MoE model maps onto a llama.cpp architecture."""

    arch: str  # "llama" or "bailingmoe"
    n_shared: int  # shared experts written (bailingmoe needs at least one; a zero one adds nothing)


def gguf_architecture(cfg: ModelConfig) -> str:
    """The llama.cpp architecture a model is written as ("llama", "qwen2", "bailingmoe", "qwen3" or "qwen3moe");
    refuses what none of them computes."""
    if cfg.qkv_bias and (cfg.qk_norm or cfg.use_moe):
        field = "model.qk_norm" if cfg.qk_norm else "model.use_moe"
        raise UserError(f"model.qkv_bias with {field}: llama.cpp's architectures with q/k/v biases (qwen2) have no "
                        "QK-norm and no experts; export it with `nanolm export hf` instead")
    if cfg.use_moe:
        arch = _moe_layout(cfg).arch
    else:
        arch = "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"
    if arch == "qwen2" and cfg.head_dim * cfg.n_head != cfg.d_model:
        raise UserError(f"model.head_dim={cfg.head_dim} with model.qkv_bias: llama.cpp's qwen2 sizes q, k and v as "
                        f"model.d_model / model.n_head ({cfg.d_model} / {cfg.n_head}) per head; GGUF export needs "
                        "that head_dim (or `nanolm export hf`)")
    if cfg.rope_scaling == "llama3" and arch != "llama":
        raise UserError(f"model.rope_scaling llama3 on a {arch} model: llama.cpp reads Llama 3's frequency factors "
                        "(rope_freqs) only in its llama architecture (no QK-norm, q/k/v biases or shared experts); "
                        "export it with `nanolm export hf` instead")
    return arch


def _moe_layout(cfg: ModelConfig) -> MoELayout:
    if cfg.moe_every != 1:
        raise UserError(f"model.moe_every={cfg.moe_every}: GGUF export of a MoE model needs every block to be MoE "
                        "(llama.cpp's MoE architectures have no dense/MoE layer pattern); "
                        "export it with `nanolm export hf` instead")
    if cfg.qk_norm:
        if cfg.n_shared_experts or not cfg.norm_topk:
            field = (f"model.n_shared_experts={cfg.n_shared_experts}" if cfg.n_shared_experts else
                     "model.norm_topk=false")
            raise UserError(f"{field} with model.qk_norm: llama.cpp's MoE with QK-norm (qwen3moe) has no shared "
                            "expert and always renormalises the top-k weights; GGUF export needs n_shared_experts 0 "
                            "and norm_topk true")
        return MoELayout("qwen3moe", 0)
    if cfg.n_shared_experts == 0 and cfg.norm_topk:
        return MoELayout("llama", 0)
    return MoELayout("bailingmoe", max(cfg.n_shared_experts, 1))


def _interleaves(arch: str) -> bool:
    """Whether the architecture's RoPE pairs dimensions 2i, 2i+1 (ggml's normal mode), so q/k rows are reordered;
    qwen3 and qwen3moe use NEOX mode, nanolm's rotate-half."""
    return arch in ("llama", "bailingmoe")


def gguf_tensors(model: nn.Module, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """(llama.cpp name, float32 tensor) for every weight the GGUF file holds, in file order.

    Shapes are PyTorch's (out, in); GGUF lists dimensions in the reverse order,
    which is llama.cpp's {in, out}. q and k projections are RoPE-interleaved for
    llama and bailingmoe. Tied embeddings are written once (llama, qwen2 and
    qwen3 fall back to token_embd for the output), except for bailingmoe, which
    requires an `output` tensor.
    """
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    arch = gguf_architecture(cfg)
    order = rope_interleave if _interleaves(arch) else lambda w, n_heads: w
    out: list[tuple[str, torch.Tensor]] = [("token_embd.weight", sd["embed_tokens.weight"])]
    if (llama3 := Llama3.of(cfg)) is not None:
        out.append(("rope_freqs.weight", llama3.freq_factors(cfg.head_dim, cfg.rope_theta)))  # (hs/2,)
    for i in range(cfg.n_layer):
        p, b = f"layers.{i}.", f"blk.{i}."
        out += [
            (b + "attn_norm.weight", sd[p + "input_layernorm.weight"]),
            (b + "attn_q.weight", order(sd[p + "self_attn.q_proj.weight"], cfg.n_head)),
            (b + "attn_k.weight", order(sd[p + "self_attn.k_proj.weight"], cfg.n_kv_head)),
            (b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"]),
        ]
        if cfg.qkv_bias:  # a bias is reordered as its projection's rows are
            out += [(b + "attn_q.bias", order(sd[p + "self_attn.q_proj.bias"], cfg.n_head)),
                    (b + "attn_k.bias", order(sd[p + "self_attn.k_proj.bias"], cfg.n_kv_head)),
                    (b + "attn_v.bias", sd[p + "self_attn.v_proj.bias"])]
        out += [
            (b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"]),
            (b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"]),
        ]
        if cfg.qk_norm:
            out += [(b + "attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"]),
                    (b + "attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"])]
        if cfg.is_moe_layer(i):
            out += _moe_tensors(sd, p + "mlp.", b, cfg)
        else:
            out += [(b + f"ffn_{n}.weight", sd[p + f"mlp.{n}_proj.weight"]) for n in ("gate", "up", "down")]
    out.append(("output_norm.weight", sd["norm.weight"]))
    if not cfg.tie_embeddings or arch == "bailingmoe":
        out.append(("output.weight", sd["lm_head.weight"]))
    return out


def _moe_tensors(sd: dict[str, torch.Tensor], p: str, b: str, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """The router, the experts stacked to (n_experts, out, in) and, for bailingmoe, the shared expert."""
    out = [(b + "ffn_gate_inp.weight", sd[p + "gate.weight"])]  # (E, C)
    for n in ("gate", "up", "down"):
        out.append((b + f"ffn_{n}_exps.weight",
                    torch.stack([sd[p + f"experts.{e}.{n}_proj.weight"] for e in range(cfg.n_experts)])))
    layout = _moe_layout(cfg)
    if layout.arch == "bailingmoe":
        if cfg.n_shared_experts:
            shared = {n: sd[p + f"shared_expert.{n}_proj.weight"] for n in ("gate", "up", "down")}
        else:  # bailingmoe always adds a shared expert; an all-zero one contributes exactly 0
            h = cfg.moe_n_hidden
            shared = {"gate": torch.zeros(h, cfg.d_model), "up": torch.zeros(h, cfg.d_model),
                      "down": torch.zeros(cfg.d_model, h)}
        out += [(b + f"ffn_{n}_shexp.weight", shared[n]) for n in ("gate", "up", "down")]
    return out


def tensor_type(name: str, shape: tuple[int, ...], outtype: str, *, has_output: bool = True,
                n_experts: int = 0) -> str:
    """The type ("f32", "f16", "q8_0" or "q4_0") of one tensor of an `outtype` file (see the module docstring).

    shape: PyTorch's (..., out, in), so rows are shape[-1] long; has_output: whether the file has an
    `output.weight` (if not, token_embd is also the output projection); n_experts: the model's routed experts.
    """
    if len(shape) <= 1 or name.endswith("_norm.weight") or ".ffn_gate_inp." in name:
        return "f32"
    kind = outtype
    if outtype == "q4_0":
        is_output = name == "output.weight" or (name == "token_embd.weight" and not has_output)
        if is_output or (n_experts == 8 and name.endswith((".attn_k.weight", ".attn_v.weight"))):
            kind = "q8_0"
    if kind in BLOCK and shape[-1] % BLOCK[kind] != 0:
        return "f16"
    return kind


# ----------------------------------------------------------------------------- tokenizer

@dataclass
class GGUFVocab:
    """The tokenizer fields of a GGUF file: one token string and type per model vocabulary id."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    chat_template: str
    eot_id: int  # <|endoftext|>: BOS for llama.cpp's sake, and padding
    im_end_id: int  # <|im_end|>: the end of a chat turn
    pre: str = TOKENIZER_PRE[False]  # llama.cpp's pre-tokenizer name


def gguf_vocab(ckpt_dir: Path, vocab_size: int) -> GGUFVocab:
    """The tokenizer of a checkpoint as GGUF wants it: `vocab_size` tokens by id, their types, merges, template.

    Ids the tokenizer does not use (a model vocabulary larger than the
    tokenizer's) become "[PAD<id>]" tokens of type UNUSED, as llama.cpp's
    converter writes them.
    """
    from nanolm.tokenizer import CONFIG_FILE, TOKENIZER_FILE, Tokenizer

    if not (ckpt_dir / TOKENIZER_FILE).is_file():
        raise UserError(f"{ckpt_dir}: the checkpoint has no {TOKENIZER_FILE}, and GGUF carries the tokenizer; "
                        f"copy the tokenizer the model was trained with ({TOKENIZER_FILE}, {CONFIG_FILE}) into it")
    tok = Tokenizer.load(ckpt_dir)
    data = json.loads(tok.path.read_text(encoding="utf-8"))
    model = data.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise UserError(f"{tok.path}: not a BPE tokenizer; GGUF export supports tokenizers made by "
                        "`nanolm tokenizer train`")
    by_id: dict[int, tuple[str, int]] = {i: (t, TOKEN_NORMAL) for t, i in model["vocab"].items()}
    for added in data.get("added_tokens") or []:
        by_id[added["id"]] = (added["content"], TOKEN_CONTROL if added.get("special") else TOKEN_USER_DEFINED)
    too_big = [i for i in by_id if i >= vocab_size]
    if too_big:
        raise UserError(f"{tok.path}: token id {max(too_big)} is outside the model's vocabulary "
                        f"(model.vocab_size={vocab_size}); export with the tokenizer the model was trained with")
    tokens, types = [], []
    for i in range(vocab_size):
        t, kind = by_id.get(i, (f"[PAD{i}]", TOKEN_UNUSED))
        tokens.append(t)
        types.append(kind)
    # tokenizers writes merges as "a b" strings (older) or [a, b] pairs (0.20+); GGUF stores "a b".
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    # The template the tokenizer carries (its chat layout's when it has none), as transformers reads it.
    template = tok.chat_template or tok.chat_format.template
    return GGUFVocab(tokens, types, merges, template, tok.eot_id, tok.im_end_id, _pre_name(tok, data))


def _pre_name(tok: Any, data: dict) -> str:
    """llama.cpp's name of the tokenizer's pre-tokenizer: GPT-2's byte-level split, or with each digit split off
    (StarCoder's), the two `nanolm tokenizer train` makes. Another family's split (Llama 3's, Qwen2's regex) under
    either name would make llama.cpp cut text differently from the model's tokenizer, so it is refused."""
    from nanolm.tokenizer import pre_tokenizer_json
    for split, name in TOKENIZER_PRE.items():
        if data.get("pre_tokenizer") == pre_tokenizer_json(split):
            return name
    kind = (data.get("pre_tokenizer") or {}).get("type", "none")
    raise UserError(f"{tok.path}: its pre-tokenizer ({kind}) is not one GGUF export writes (GPT-2's byte-level "
                    "split, with or without digits split off, as `nanolm tokenizer train` makes them), so llama.cpp "
                    "would cut text differently; export with `nanolm export hf` and convert that with llama.cpp's "
                    "convert_hf_to_gguf.py, which knows the family's tokenizer")


# ----------------------------------------------------------------------------- writing

def _write_metadata(writer: Any, cfg: ModelConfig, vocab: GGUFVocab, name: str, outtype: str) -> None:
    import gguf

    arch = writer.arch
    # The file's nominal type, as llama-quantize records it: "mostly" that type, whatever the exceptions.
    file_types = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                  "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}
    writer.add_type("model")
    writer.add_name(name)
    writer.add_file_type(int(file_types[outtype]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    writer.add_vocab_size(cfg.vocab_size)
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.d_model)
    writer.add_block_count(cfg.n_layer)
    # llama's MoE graph sizes its experts by feed_forward_length; qwen3moe by expert_feed_forward_length.
    writer.add_feed_forward_length(cfg.moe_n_hidden if cfg.use_moe and arch != "qwen3moe" else cfg.n_hidden)
    writer.add_head_count(cfg.n_head)
    writer.add_head_count_kv(cfg.n_kv_head)
    writer.add_rope_freq_base(float(cfg.rope_theta))
    writer.add_layer_norm_rms_eps(float(cfg.norm_eps))
    writer.add_rope_dimension_count(cfg.head_dim)
    # As llama.cpp's converter writes Qwen3's head size; elsewhere llama.cpp's default is d_model / n_head.
    if arch in ("qwen3", "qwen3moe") or cfg.head_dim * cfg.n_head != cfg.d_model:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    if cfg.rope_scaling == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(cfg.rope_factor))
        writer.add_rope_scaling_orig_ctx_len(cfg.rope_original_max_len)
        writer.add_rope_scaling_yarn_beta_fast(float(cfg.rope_beta_fast))
        writer.add_rope_scaling_yarn_beta_slow(float(cfg.rope_beta_slow))
        if cfg.rope_attention_factor:  # llama.cpp multiplies its own 0.1 ln(factor) + 1 by this
            writer.add_rope_scaling_attn_factors(cfg.rope_attention_factor / Yarn.of(cfg).default_scale)
    if cfg.use_moe:
        writer.add_expert_count(cfg.n_experts)
        writer.add_expert_used_count(cfg.top_k)
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(cfg.moe_n_hidden)
        if arch == "bailingmoe":
            writer.add_expert_feed_forward_length(cfg.moe_n_hidden)
            writer.add_expert_shared_count(_moe_layout(cfg).n_shared)
            writer.add_expert_weights_norm(cfg.norm_topk)
            writer.add_expert_weights_scale(1.0)
            writer.add_leading_dense_block_count(0)

    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    # nanolm has no BOS and prepends nothing; llama.cpp wants an id, so BOS names <|endoftext|> (as Qwen2 does)
    # and add_bos_token=False keeps llama.cpp from prepending it.
    writer.add_bos_token_id(vocab.eot_id)
    writer.add_eos_token_id(vocab.im_end_id)  # a chat turn ends with <|im_end|>
    writer.add_eot_token_id(vocab.im_end_id)
    writer.add_pad_token_id(vocab.eot_id)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    writer.add_chat_template(vocab.chat_template)


def check_outtype(outtype: str) -> None:
    """UserError unless `outtype` is one GGUF export writes."""
    if outtype not in OUTTYPES:
        raise UserError(f"outtype={outtype!r}: must be one of {', '.join(OUTTYPES)} "
                        "(K-quants: run llama.cpp's llama-quantize on an f16 export)")


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise UserError("GGUF export needs the gguf package: pip install 'nanolm[gguf]'") from None
    return gguf


def export_gguf(checkpoint: str | Path, out_file: Path, *, which: str = "best", adapter: str | Path | None = None,
                outtype: str = "f16", quiet: bool = False) -> Path:
    """Write a checkpoint (a LoRA adapter merged in) as a GGUF file for llama.cpp / ollama; returns out_file.

    checkpoint: a run or checkpoint directory (its `which` checkpoint, "best"
    or "last"); adapter: a LoRA run or checkpoint to merge into it first.
    outtype: "f32", "f16", "q8_0" or "q4_0" for the weight matrices (see the
    module docstring for the tensors kept at higher precision). The file is
    written under a temporary name beside out_file and renamed into place.
    """
    from nanolm.checkpoint import load_model, require_causal

    _import_gguf()
    check_outtype(outtype)
    out_file = Path(out_file)
    if out_file.is_dir():
        raise UserError(f"{out_file}: is a directory; give the path of the .gguf file to write")
    model, ckpt_dir = load_model(checkpoint, which, "cpu", adapter)
    require_causal(model.config, "GGUF export (llama.cpp)", ckpt_dir)
    what = write_gguf(model, ckpt_dir, out_file, outtype=outtype, quiet=quiet)
    if not quiet:
        print(f"wrote {out_file} ({what}, {fmt_bytes(out_file.stat().st_size)})")
    return out_file


def write_gguf(model: nn.Module, ckpt_dir: Path, out_file: Path, *, outtype: str = "f16",
               quiet: bool = False) -> str:
    """Write a loaded model (LoRA layers are merged into it) and the tokenizer of `ckpt_dir` as a GGUF file.

    Shows a progress bar unless `quiet`; returns what was written ("llama, q4_0, 20 tensors").
    """
    from nanolm.checkpoint import run_name
    from nanolm.model.lora import merge_lora

    gguf = _import_gguf()
    check_outtype(outtype)
    cfg = model.config
    arch = gguf_architecture(cfg)  # refuses unsupported MoE layouts before any work
    merge_lora(model)
    vocab = gguf_vocab(ckpt_dir, cfg.vocab_size)
    tensors = gguf_tensors(model, cfg)

    qtypes = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
              "q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}
    has_output = any(name == "output.weight" for name, _ in tensors)
    n_experts = cfg.n_experts if cfg.use_moe else 0
    plan = []
    for name, t in tensors:
        kind = tensor_type(name, tuple(t.shape), outtype, has_output=has_output, n_experts=n_experts)
        qtype = qtypes[kind]
        nbytes = int(np.prod(gguf.quant_shape_to_byte_shape(tuple(t.shape), qtype)))
        plan.append((name, t, qtype, nbytes))

    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(None, arch)
    try:
        with atomic_file(out_file) as tmp:
            try:
                _write_metadata(writer, cfg, vocab, run_name(ckpt_dir), outtype)
                for name, t, qtype, nbytes in plan:
                    # The logical (out, in) shape and the byte count; raw_dtype tells the writer the ggml type.
                    writer.add_tensor_info(name, tuple(t.shape), np.dtype(np.float32), nbytes, raw_dtype=qtype)
                writer.write_header_to_file(tmp)
                writer.write_kv_data_to_file()
                writer.write_ti_data_to_file()
                total = sum(p[3] for p in plan)
                # Converted one tensor at a time, so only one quantised copy is in memory at once.
                with Progress(total, f"gguf {outtype}", "B", scale_bytes=True, enabled=not quiet) as bar:
                    for name, t, qtype, nbytes in plan:
                        writer.write_tensor_data(gguf.quants.quantize(t.numpy(), qtype))
                        bar.update(nbytes)
            finally:
                writer.close()
    except OSError as e:
        raise UserError(f"{out_file}: could not write the GGUF file ({e.strerror or e}); "
                        f"{fmt_bytes(shutil.disk_usage(out_file.parent).free)} free there; free some space "
                        "or choose another path") from None
    fsync_dir(out_file.parent)
    return f"{arch}, {outtype}, {len(plan)} tensors"
