"""GGUF import: a llama.cpp model file (or nanolm's own GGUF export) as a nanolm checkpoint directory.

The reading side of `gguf.py` (which writes GGUF); `nanolm import gguf FILE OUT`.

Architectures: `llama`, `qwen2` and `qwen3`, dense, as `nanolm export gguf`
and llama.cpp's convert_hf_to_gguf.py write them. Each tensor is turned back
into its transformers name and the file's metadata into a transformers
config.json dict, and `hf.from_hf` (the one owner of the family mapping) makes
the nanolm state dict and ModelConfig from them, so a GGUF file imports
exactly as the same model saved by transformers would:

- token_embd, blk.N.attn_{q,k,v,output}, attn_norm, ffn_{gate,up,down},
  ffn_norm, output_norm, output (none: the embeddings are tied), the q/k/v
  biases of qwen2 and attn_{q,k}_norm of qwen3;
- llama.cpp's "llama" graph uses ggml's interleaved RoPE, so its converter
  (and nanolm's export) reorders the rows of W_q and W_k within each head;
  `gguf.rope_deinterleave` undoes that exactly, as transformers' GGUF loader
  does (its `_reverse_permute_weights`, by n_kv_head for k); qwen2 and qwen3
  use NEOX RoPE (rotate-half, as nanolm) and are read as they are;
- every tensor type the `gguf` package dequantizes (`gguf.quants.dequantize`:
  F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants, the IQ types)
  becomes float32; an F32 tensor is taken bit for bit;
- hyper-parameters from `{arch}.*`: context length, embedding length, block
  count, feed-forward length, heads, kv heads, key length (head size), RoPE
  base, RMS epsilon (float32 in the file, kept as the shortest decimal that
  is the same float32, so 1e-05 stays 1e-05). A RoPE that scales (YaRN,
  Llama 3's `rope_freqs`), a rotary dimension smaller than the head, MoE and
  other architectures are refused with a UserError naming the key.

The tokenizer is made through transformers' own GGUF tokenizer conversion
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`, then `save_pretrained`),
so the imported tokenizer.json cuts text exactly as transformers' tokenizer
of the same file does; the chat template of `tokenizer.chat_template` goes
into tokenizer_config.json (with bos/eos). As with `nanolm import hf`, a
tokenizer without nanolm's ChatML tokens is left out with a warning.

Built-in models (`nanolm.corpora.models`) are imported once into the cache by
`builtin_checkpoint`, and `resolve_model` lets their names stand wherever a
checkpoint directory does.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nanolm.checkpoint import write_model_dir
from nanolm.errors import UserError
from nanolm.export.gguf import rope_deinterleave
from nanolm.export.hf import from_hf
from nanolm.io import check_crc32, check_new_directory, crc32_of, remove_directory, write_json_atomic

ARCHITECTURES = ("llama", "qwen2", "qwen3")
IMPORTER_VERSION = 1  # bump when an import of the same file would come out different: cached imports are redone

# llama.cpp's per-block tensor name -> transformers' (under model.layers.N.)
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def _gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise UserError("GGUF import needs the gguf package: pip install 'nanolm[gguf]'") from None
    return gguf


def _f32(x: float) -> float:
    """A float32 read from the file as the shortest decimal that is the same float32 (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _metadata(reader: Any, path: Path) -> dict[str, Any]:
    """The file's scalar and short-array metadata by key (the token list and merges are left to transformers)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.scores"):
            continue
        try:
            meta[key] = field.contents()
        except Exception as e:  # a field gguf cannot decode: only a problem if we need it
            meta[key] = UserError(f"{path}: metadata {key} cannot be read ({e})")
    return meta


def hf_config_of(meta: dict[str, Any], tensor_names: set[str], path: Path) -> dict[str, Any]:
    """A transformers config.json dict for the model a GGUF file's metadata describes (refusing what nanolm
    cannot compute)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UserError(f"{path}: general.architecture is {arch!r}; nanolm imports the GGUF architectures "
                        f"{', '.join(ARCHITECTURES)} (dense Llama, Qwen2, Qwen3)")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if isinstance(value, UserError):
            raise value
        if value is None:
            raise UserError(f"{path}: metadata {arch}.{key} is missing; the file is incomplete or not a model")
        return value

    if any(".ffn_gate_exps." in n or ".ffn_gate_inp." in n for n in tensor_names) or meta.get(f"{arch}.expert_count"):
        raise UserError(f"{path}: a mixture-of-experts model; GGUF import reads dense {arch} models only "
                        "(import the transformers checkpoint with `nanolm import hf` instead)")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in tensor_names:
        what = f"{arch}.rope.scaling.type = {scaling!r}" if scaling not in ("none", None) else "rope_freqs.weight"
        raise UserError(f"{path}: {what}: GGUF import reads models with plain RoPE only; import the transformers "
                        "checkpoint with `nanolm import hf`, which reads YaRN and Llama 3 scaling")
    d_model, n_head = int(get("embedding_length")), int(get("attention.head_count"))
    n_kv = int(get("attention.head_count_kv", n_head))
    head_dim = int(get("attention.key_length", d_model // n_head))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise UserError(f"{path}: {arch}.attention.value_length differs from key_length; nanolm's heads have one "
                        "size")
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise UserError(f"{path}: {arch}.rope.dimension_count = {get('rope.dimension_count')} but the heads are "
                        f"{head_dim} wide; nanolm rotates whole heads")
    embd = "token_embd.weight"
    vocab = meta.get(f"{arch}.vocab_size")
    return {
        "model_type": arch,
        "hidden_act": "silu",
        "vocab_size": int(vocab) if vocab is not None else None,  # else filled from token_embd's rows
        "hidden_size": d_model,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "max_position_embeddings": int(get("context_length")),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": "output.weight" not in tensor_names and embd in tensor_names,
    }


def read_gguf(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(transformers state dict in float32, transformers config dict) of a GGUF model file."""
    gguf = _gguf()
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file; pass a .gguf model file")
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, KeyError, IndexError) as e:
        raise UserError(f"{path}: not a GGUF file gguf can read ({e}); pass a .gguf model file") from None
    meta = _metadata(reader, path)
    names = {t.name for t in reader.tensors}
    cfg = hf_config_of(meta, names, path)
    interleaved = cfg["model_type"] == "llama"  # ggml's normal RoPE: q/k rows were reordered on the way in
    sd: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists (in, out); PyTorch (out, in)
        try:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise UserError(f"{path}: tensor {t.name} is {t.tensor_type.name}, which the gguf package cannot "
                            "dequantize; requantize the file with llama-quantize (to Q8_0, say)") from None
        w = torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))  # a writable copy
        if t.name in _TOP_NAMES:
            sd[_TOP_NAMES[t.name]] = w
            continue
        m = _BLOCK.fullmatch(t.name)
        if m is None or m.group(2) not in _BLOCK_NAMES:
            raise UserError(f"{path}: unexpected tensor {t.name} for a dense {cfg['model_type']} model; "
                            "GGUF import reads the tensors llama.cpp's converter writes for llama, qwen2 and qwen3")
        i, what = m.groups()
        if interleaved and what.startswith(("attn_q.", "attn_k.")):
            w = rope_deinterleave(w, cfg["num_attention_heads"] if what.startswith("attn_q.")
                                  else cfg["num_key_value_heads"])
        sd[f"model.layers.{i}.{_BLOCK_NAMES[what]}"] = w
    if cfg["vocab_size"] is None and "model.embed_tokens.weight" in sd:
        cfg["vocab_size"] = sd["model.embed_tokens.weight"].shape[0]
    return sd, cfg


def _gguf_tokenizer(path: Path, dest: Path) -> None:
    """tokenizer.json and tokenizer_config.json (chat template, bos/eos) in `dest`, by transformers' GGUF
    tokenizer conversion."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UserError("GGUF import makes the tokenizer with transformers' GGUF conversion: "
                        "pip install 'nanolm[gguf,hf]'") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, OSError, NotImplementedError) as e:
        raise UserError(f"{path}: transformers cannot make a tokenizer of this file ({str(e).splitlines()[0]}); "
                        "import the transformers checkpoint with `nanolm import hf`") from None
    tok.save_pretrained(str(dest))
    config_file = dest / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    jinja = dest / "chat_template.jinja"
    if jinja.is_file():  # transformers 5 saves it beside; a model directory carries tokenizer_config.json
        config["chat_template"] = jinja.read_text(encoding="utf-8")
    elif getattr(tok, "chat_template", None):
        config["chat_template"] = tok.chat_template
    write_json_atomic(config_file, config)


def _tokenizer_problem(directory: Path, vocab_size: int) -> str | None:
    """Why nanolm cannot use the tokenizer made in `directory` for a model of `vocab_size` tokens, or None."""
    from nanolm.tokenizer import Tokenizer
    try:
        tok = Tokenizer.load(directory)
    except UserError as e:
        return str(e).partition("; ")[0]
    if tok.vocab_size > vocab_size:
        return f"its {tok.vocab_size} tokens exceed the model's vocab_size {vocab_size}"
    return None


def import_gguf(gguf_file: Path, out_dir: Path, *, quiet: bool = False) -> Path:
    """Convert a GGUF model file into a nanolm checkpoint directory at `out_dir` (written whole or not at all).

    out_dir gets model.safetensors (float32), config.json (the model config)
    and, when nanolm can use it, the tokenizer (see the module docstring).
    Returns out_dir.
    """
    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    check_new_directory(out_dir)
    t0 = time.perf_counter()
    hf_sd, hf_config = read_gguf(gguf_file)
    sd, cfg = from_hf(hf_sd, hf_config, source=gguf_file)
    sd = {k: v.contiguous() for k, v in sd.items()}
    with tempfile.TemporaryDirectory(prefix=".gguf-tokenizer-", dir=out_dir.parent if out_dir.parent.is_dir()
                                     else None) as tmp:
        _gguf_tokenizer(gguf_file, Path(tmp))
        problem = _tokenizer_problem(Path(tmp), cfg.vocab_size)
        if problem:
            warnings.warn(f"{out_dir}: imported the weights without a tokenizer ({problem}); nanolm needs its "
                          "ChatML special tokens. The weights belong to the file's tokenizer: fine-tuning them in "
                          "nanolm with another one starts the embeddings over", stacklevel=2)
        write_model_dir(out_dir, sd, cfg, tokenizer_from=None if problem else Path(tmp),
                        metadata={"imported_from": str(gguf_file)})
    if not quiet:
        n = sum(t.numel() for t in sd.values())
        print(f"{gguf_file.name}: {hf_config['model_type']}, {n / 1e6:.1f}M parameters -> {out_dir} "
              f"({time.perf_counter() - t0:.1f}s)", file=sys.stderr, flush=True)
    return out_dir


# ----------------------------------------------------------------------------- built-in models

IMPORTED = "checkpoint.json"  # beside the checkpoint in the model's cache folder: what it was made from, CRC-32s


def builtin_checkpoint(name: str, *, quiet: bool = False) -> Path:
    """The nanolm checkpoint of built-in model `name`: its file fetched and verified (sha256), imported into the
    cache on first use, and the imported files checked against the CRC-32s recorded then on every later use."""
    from nanolm.corpora.models import fetch_model, lookup_model, model_dir

    model = lookup_model(name)
    gguf_file = fetch_model(name, quiet=quiet)
    home = model_dir(name)
    ckpt, record_file = home / "checkpoint", home / IMPORTED
    try:
        record = json.loads(record_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        record = None
    if isinstance(record, dict) and record.get("sha256") == model.sha256 and \
            record.get("importer") == IMPORTER_VERSION and isinstance(record.get("crc32"), dict):
        for file, crc in record["crc32"].items():
            if not (ckpt / file).is_file():
                raise UserError(f"{ckpt / file}: missing, though {record_file} lists it; delete {ckpt} and "
                                f"{record_file} and it is imported again")
            check_crc32(ckpt / file, crc, str(record_file), f"delete {ckpt} and {record_file} and it is imported "
                                                            "again")
        return ckpt
    # Absent, from another pin or importer, or left by an interrupted import (the record is written last).
    record_file.unlink(missing_ok=True)
    if ckpt.exists():
        remove_directory(ckpt)
    import_gguf(gguf_file, ckpt, quiet=quiet)
    crcs = {f.name: crc32_of(f) for f in sorted(ckpt.iterdir()) if f.is_file()}
    write_json_atomic(record_file, {"name": name, "file": gguf_file.name, "sha256": model.sha256,
                                    "importer": IMPORTER_VERSION, "crc32": crcs})
    return ckpt


def resolve_model(spec: str | Path | None, *, quiet: bool = False) -> str | Path | None:
    """`spec` itself, unless it names a built-in model and no such path exists: then that model's checkpoint."""
    from nanolm.corpora.models import MODELS

    if spec is None or Path(spec).exists() or str(spec) not in MODELS:
        return spec
    return builtin_checkpoint(str(spec), quiet=quiet)

