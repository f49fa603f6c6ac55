"""LoRA: low-rank adapters on named linear layers, their state dicts and merging.

A `LoRALinear` wraps a frozen `nn.Linear` W and adds a trainable low-rank
update: y = W x + (alpha / r) * B A dropout(x), with A (r, in) Kaiming-uniform
and B (out, r) zeros, so a fresh adapter changes nothing (Hu et al. 2021, and
PEFT's initialisation). Layers are chosen by the last component of their
module name (`q_proj`, `down_proj`, ...), never by shape.

The adapter files (`adapter.safetensors` + `adapter_config.json`, with the
fingerprint of the base weights computed here) are written and read by
nanolm/checkpoint/adapter.py, in the owner of the on-disk layout; this module knows modules
and tensors only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanolm.errors import UserError

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_PARAMS = ("lora_A", "lora_B")


def merged_weight(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor,
                  scaling: float) -> torch.Tensor:
    """W + scaling * B @ A, computed in float32 and cast back to W's dtype.

    weight: (out, in); lora_A: (r, in); lora_B: (out, r).
    """
    delta = (lora_B.float() @ lora_A.float()) * scaling  # (out, in)
    return (weight.float() + delta).to(weight.dtype)


class LoRALinear(nn.Module):
    """A frozen nn.Linear (`.base`) plus a trainable rank-r update on a dropout of its input."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        check_settings(rank, alpha, dropout)
        self.base = base
        self.base.requires_grad_(False)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha = rank, float(alpha)
        self.scaling = self.alpha / rank
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=w.device, dtype=w.dtype))
        # Same init as PEFT (nn.Linear's default): only A is random, B is zero, so B A = 0 at the start.
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        # Dropout on the input of the low-rank path only; the frozen path sees x unchanged.
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.dropout = float(dropout)
        self.disabled = False  # True: behave as the base layer (see disable_adapters)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., in) -> (..., out), in x's dtype (a base kept in bf16 multiplies a cast of x, see cast_base)."""
        if torch.is_autocast_enabled(x.device.type) and x.is_floating_point():
            # cast once for both products (autocast would cast x for each); W and the bias it casts itself
            x = x.to(torch.get_autocast_dtype(x.device.type))
        y = frozen_linear(self.base, x)
        if self.disabled:
            return y
        h = F.linear(self.lora_dropout(x), self.lora_A) * self.scaling  # (..., r): scaled at rank size
        return y + F.linear(h, self.lora_B)  # (..., out)

    def merged_weight(self) -> torch.Tensor:
        return merged_weight(self.base.weight.detach(), self.lora_A.detach(), self.lora_B.detach(), self.scaling)

    def merge(self) -> nn.Linear:
        """A new plain nn.Linear holding W + scaling * B A (and the base bias), on the same device and dtype."""
        w = self.base.weight
        has_bias = self.base.bias is not None
        linear = torch.nn.utils.skip_init(nn.Linear, self.in_features, self.out_features, bias=has_bias,
                                          device=w.device, dtype=w.dtype)
        with torch.no_grad():
            linear.weight.copy_(self.merged_weight())
            if has_bias:
                linear.bias.copy_(self.base.bias)
        return linear

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha:g}, dropout={self.dropout:g}, disabled={self.disabled}"


# ----------------------------------------------------------------------------- settings

def normalize_targets(targets: Sequence[str] | str) -> tuple[str, ...]:
    """A list of names; a string is read as comma-separated names (as typed on a command line)."""
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",")]
    return tuple(dict.fromkeys(targets))  # drop repeats, keep order


def check_settings(rank: Any, alpha: Any, dropout: Any, targets: Any = DEFAULT_TARGETS, where: str = "") -> None:
    """Raise a UserError naming the first bad field; `where` prefixes the message (a file, or "")."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise UserError(f"{where}lora.rank must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0 or not math.isfinite(alpha):
        raise UserError(f"{where}lora.alpha must be a number > 0, got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise UserError(f"{where}lora.dropout must be in [0, 1), got {dropout!r}")
    if (isinstance(targets, str) or not isinstance(targets, (list, tuple)) or not targets
            or not all(isinstance(t, str) and t and "." not in t for t in targets)):
        raise UserError(f"{where}lora.targets must be a non-empty list of module names such as "
                        f"{', '.join(DEFAULT_TARGETS)}, got {targets!r}")


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """The model's LoRA layers by qualified name, in module order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def _linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """Plain nn.Linear modules by qualified name, not counting the frozen base inside a LoRALinear."""
    inner = {id(m.base) for m in lora_modules(model).values()}
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and id(m) not in inner}


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, new)


# ----------------------------------------------------------------------------- applying, training, merging

def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float,
               targets: Sequence[str] | str = DEFAULT_TARGETS) -> list[str]:
    """Wrap every nn.Linear whose name's last component is in `targets` in a LoRALinear, in place.

    Returns the qualified names of the wrapped modules. Nothing is changed when
    a target names no linear layer or names a layer whose weight is tied to
    another module (e.g. lm_head with tied embeddings: a LoRA there would untie
    them when merged).
    """
    targets = normalize_targets(targets)
    check_settings(rank, alpha, dropout, targets)
    if lora_modules(model):
        raise ValueError("the model already has LoRA adapters; apply_lora once per model")
    linears = _linear_layers(model)
    present = sorted({name.rpartition(".")[2] for name in linears})
    unknown = [t for t in targets if t not in present]
    if unknown:
        raise UserError(f"lora.targets: {unknown[0]!r} names no linear layer of the model; "
                        f"its linear layers are: {', '.join(present)}")
    chosen = [name for name in linears if name.rpartition(".")[2] in targets]

    owners: dict[int, list[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(pname)
    for name in chosen:
        others = [n for n in owners[id(linears[name].weight)] if n != f"{name}.weight"]
        if others:
            raise UserError(f"lora.targets: {name}.weight is tied to {others[0]}, so a LoRA on "
                            f"{name.rpartition('.')[2]} would untie them; remove it from lora.targets "
                            f"(or train with model.tie_embeddings false)")

    for name in chosen:
        _replace(model, name, LoRALinear(linears[name], rank, float(alpha), float(dropout)))
    return chosen


def frozen_linear(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`linear(x)` in x's dtype, for a layer whose weight may be kept in another dtype (cast_base): autocast
    casts for it; without autocast x is cast to the weight's dtype and the result back."""
    w = linear.weight
    if x.dtype == w.dtype or torch.is_autocast_enabled(x.device.type):
        return linear(x)
    return linear(x.to(w.dtype)).to(x.dtype)


def base_dtype(name: str, compute: torch.dtype) -> tuple[torch.dtype, str]:
    """The dtype a LoRA run keeps its frozen base's matrices in (lora.base_dtype `name`: auto, float32,
    bfloat16) when training computes in `compute`, and why (for the start-up line)."""
    if name == "bfloat16":
        return torch.bfloat16, "as configured"
    if name == "auto" and compute == torch.bfloat16:
        return torch.bfloat16, "auto: training computes in bf16, so each product casts its weight to it anyway"
    return torch.float32, "as configured" if name == "float32" else "auto: training computes in float32"


def cast_base(model: nn.Module, dtype: torch.dtype) -> int:
    """Keep the frozen base's matrices in `dtype`, in place: the LoRA layers' base projections (weight and
    bias), and the token embedding and output projection when they are frozen. Returns the number of
    elements cast.

    Under bf16 autocast every product casts its float32 weight to bf16 at each forward anyway, so the
    projections compute exactly as before, with half the weight memory and no cast per step; the embedding
    rows are rounded to bf16 once. The norms and adapters keep their dtype, and so does the residual stream
    (the model casts the embeddings to its norms' dtype).
    """
    modules = [m.base for m in lora_modules(model).values()]
    modules += [m for name in ("embed_tokens", "lm_head") if isinstance(m := getattr(model, name, None),
                                                                        (nn.Embedding, nn.Linear))
                and not any(p.requires_grad for p in m.parameters())]
    seen: set[int] = set()
    for m in modules:
        for p in m.parameters():
            seen.add(id(p))
        m.to(dtype)  # a tied weight is one Parameter: converted in place, it stays tied
    return sum(p.numel() for p in model.parameters() if id(p) in seen)


def remove_lora(model: nn.Module) -> None:
    """Put each LoRALinear's base layer back in its place, dropping the adapters (the inverse of apply_lora)."""
    for name, m in lora_modules(model).items():
        _replace(model, name, m.base)


def mark_only_lora_as_trainable(model: nn.Module) -> None:
    """requires_grad on the lora_A / lora_B tensors only; every base weight (norms, embeddings too) is frozen."""
    for name, p in model.named_parameters():
        p.requires_grad_(name.rpartition(".")[2] in LORA_PARAMS)


@contextlib.contextmanager
def disable_adapters(model: nn.Module) -> Iterator[None]:
    """Within the block the model computes as its base (e.g. a DPO reference) without a copy of the weights."""
    modules = list(lora_modules(model).values())
    before = [m.disabled for m in modules]
    for m in modules:
        m.disabled = True
    try:
        yield
    finally:
        for m, was in zip(modules, before):
            m.disabled = was


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every LoRALinear by a plain nn.Linear holding W + scaling * B A, in place; returns the model.

    The result has exactly the state-dict keys of the model before apply_lora,
    so it saves and loads as an ordinary checkpoint. The `disabled` flag is
    ignored: merging always folds the adapter in.
    """
    for name, m in lora_modules(model).items():
        _replace(model, name, m.merge())
    return model


# ----------------------------------------------------------------------------- state dicts

def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter tensors, keyed by qualified name (`layers.0.self_attn.q_proj.lora_A`); detached."""
    out: dict[str, torch.Tensor] = {}
    for name, m in lora_modules(model).items():
        out[f"{name}.lora_A"] = m.lora_A.detach()
        out[f"{name}.lora_B"] = m.lora_B.detach()
    return out


def load_lora_state_dict(model: nn.Module, sd: dict[str, torch.Tensor], source: str = "adapter") -> None:
    """Copy adapter tensors into the model's LoRA layers, strictly: every key present, none extra, same shapes.

    `source` (a file name) starts the one-line UserError raised on a mismatch.
    """
    expected = lora_state_dict(model)
    if not expected:
        raise UserError(f"{source}: the model has no LoRA layers to load the adapter into; "
                        f"call apply_lora with the adapter's settings first")
    missing = [k for k in expected if k not in sd]
    unexpected = sorted(k for k in sd if k not in expected)
    shapes = [k for k in expected if k in sd and tuple(sd[k].shape) != tuple(expected[k].shape)]
    if shapes:
        k = shapes[0]
        raise UserError(f"{source}: {k} has shape {tuple(sd[k].shape)} but the model expects "
                        f"{tuple(expected[k].shape)} ({len(shapes)} mismatch(es)); apply LoRA with the rank the "
                        f"adapter was trained with (see its adapter_config.json)")
    if missing:
        raise UserError(f"{source}: the adapter has no {missing[0]} ({len(missing)} missing) but the model has a "
                        f"LoRA layer there; apply LoRA with the targets the adapter was trained with "
                        f"(see its adapter_config.json)")
    if unexpected:
        raise UserError(f"{source}: the adapter has {unexpected[0]} ({len(unexpected)} unexpected) but the model "
                        f"has no LoRA layer there; apply LoRA with the targets the adapter was trained with "
                        f"(see its adapter_config.json)")
    bad = next((k for k in expected if not sd[k].is_floating_point()), None)
    if bad is not None:
        raise UserError(f"{source}: {bad} has dtype {sd[bad].dtype}, expected a floating-point tensor; "
                        f"the adapter file is damaged, save it again")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for k in expected:
            params[k].copy_(sd[k])


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict: adapters left out, `<name>.base.weight` renamed back to `<name>.weight`.

    Its keys are those of the model before apply_lora (tied tensors appear
    under both names, as in `state_dict()`).
    """
    lora = set(lora_modules(model))
    out: dict[str, torch.Tensor] = {}
    for key, t in model.state_dict().items():
        mod, _, leaf = key.rpartition(".")
        if mod in lora and leaf in LORA_PARAMS:
            continue
        parent, _, sub = mod.rpartition(".")
        if sub == "base" and parent in lora:
            key = f"{parent}.{leaf}"
        out[key] = t
    return out


def base_fingerprint(model: nn.Module) -> str:
    """sha256 (hex) over the base weights: names, dtypes, shapes and bytes, in sorted name order.

    LoRA tensors are excluded and a tied tensor counts once (under its first
    name in sorted order), so the value is the same before and after
    apply_lora and changes when any base weight, or its dtype, changes.
    """
    h = hashlib.sha256()
    seen: set[int] = set()
    sd = base_state_dict(model)
    for name in sorted(sd):
        t = sd[name]
        ptr = t.data_ptr()
        if t.numel() > 0 and ptr in seen:
            continue
        seen.add(ptr)
        header = json.dumps([name, str(t.dtype).removeprefix("torch."), list(t.shape)])
        h.update(header.encode("utf-8") + b"\n")
        # Raw bytes via a uint8 view, which also covers dtypes numpy lacks (bfloat16).
        flat = t.detach().cpu().contiguous().reshape(-1)
        h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return h.hexdigest()
