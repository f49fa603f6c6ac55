"""A weights file checked against the model config it claims, before anything is allocated.

A model is built from its model config alone, and a safetensors file is read
against that config from its header (tensor names and shapes, no tensor read):
the counts of repeated parts (layers, experts) from the names first, then
every shape against a model of the config built on the meta device. So a
config.json that claims 100,000,000 layers is a one-line error naming
`model.n_layer`, not an allocation that runs until the process is killed, and
a shape that differs names the config fields that set it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from nanolm.config import ModelConfig
from nanolm.errors import UserError
from nanolm.io import first_line


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of `cfg` stores, with its shape (a tied head is not stored), computed on the meta
    device: no memory, no initialisation. Call `check_weights` first for a config read from a file: a model
    of a huge config takes long to build even there."""
    from nanolm.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:
        del shapes["lm_head.weight"]
    return shapes


def read_header(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a safetensors file, from its header: no tensor is read."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except FileNotFoundError:
        raise UserError(f"{path}: missing weights; the checkpoint is incomplete, use another one") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path}: corrupt or truncated weights ({first_line(e)}); use another checkpoint") from None


def _count(names: Sequence[str], pattern: str) -> int:
    """How many distinct indices `pattern` (a regex with one group) finds in the tensor names."""
    rx = re.compile(pattern)
    return len({m.group(1) for n in names if (m := rx.match(n))})


# Which config fields set each dimension of a tensor, by the end of its name, to name them in a mismatch.
_DIMS = {"embed_tokens.weight": ("vocab_size", "d_model"), "lm_head.weight": ("vocab_size", "d_model"),
         "q_proj.weight": ("n_head x head_dim", "d_model"), "k_proj.weight": ("n_kv_head x head_dim", "d_model"),
         "v_proj.weight": ("n_kv_head x head_dim", "d_model"), "o_proj.weight": ("d_model", "n_head x head_dim"),
         "q_proj.bias": ("n_head x head_dim",), "k_proj.bias": ("n_kv_head x head_dim",),
         "v_proj.bias": ("n_kv_head x head_dim",),
         "mlp.gate_proj.weight": ("n_hidden", "d_model"), "mlp.up_proj.weight": ("n_hidden", "d_model"),
         "mlp.down_proj.weight": ("d_model", "n_hidden"), "mlp.gate.weight": ("n_experts", "d_model"),
         "experts.0.gate_proj.weight": ("moe_n_hidden", "d_model"),
         "shared_expert.gate_proj.weight": ("n_shared_experts x moe_n_hidden", "d_model"),
         "q_norm.weight": ("head_dim",), "k_norm.weight": ("head_dim",),
         "norm.weight": ("d_model",), "layernorm.weight": ("d_model",)}


def _fields_of(name: str, have: tuple[int, ...], want: tuple[int, ...]) -> str:
    dims = next((d for end, d in _DIMS.items() if name.endswith(end)), None)
    if dims is None or len(dims) != len(want) or len(have) != len(want):
        return ""
    differ = [dims[i] for i in range(len(want)) if have[i] != want[i]]
    return f" (model.{', model.'.join(differ)})" if differ else ""


def check_weights(path: Path, cfg: ModelConfig, config_file: Path | str) -> None:
    """UserError unless the weights file at `path` holds exactly the tensors `cfg` describes, read from its
    header before anything is allocated; the message names the config field that disagrees and the
    config file (`config_file`) to mend.

    The counts of repeated parts (layers, experts) are compared first, from the tensor names alone, so a
    config claiming millions of layers is refused without building its model even on the meta device.
    """
    header = read_header(path)

    def mismatch(what: str) -> UserError:
        return UserError(f"{path}: checkpoint does not match the model config ({what}); use the {config_file} the "
                         f"weights were saved with")
    layers = _count(list(header), r"^layers\.(\d+)\.")
    if layers != cfg.n_layer:
        raise mismatch(f"model.n_layer is {cfg.n_layer}, the file holds {layers} layers")
    experts = _count(list(header), r"^layers\.\d+\.mlp\.experts\.(\d+)\.")
    if experts != (cfg.n_experts if cfg.use_moe else 0):
        field = f"model.n_experts is {cfg.n_experts}" if cfg.use_moe else "model.use_moe is false"
        raise mismatch(f"{field}, the file holds {experts} routed experts per MoE layer")
    want = expected_shapes(cfg)
    # A tied head is stored once; a file that also holds it (an untied save of a tied model) still loads.
    have = {k: v for k, v in header.items() if not (cfg.tie_embeddings and k == "lm_head.weight")}
    wrong = [k for k in want if k in have and have[k] != want[k]]
    if wrong:
        k = wrong[0]
        raise mismatch(f"{len(wrong)} shape mismatch(es), first: {k} {have[k]} vs model {want[k]}"
                       f"{_fields_of(k, have[k], want[k])}")
    missing, unexpected = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or unexpected:
        raise mismatch("; ".join(([f"{len(missing)} missing, first: {missing[0]}"] if missing else []) +
                                 ([f"{len(unexpected)} unexpected, first: {unexpected[0]}"] if unexpected else [])))
