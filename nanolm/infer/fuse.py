"""Fused inference modules, applied from outside the model: one product for q/k/v, one for gate/up.

A decoded token multiplies one activation row by every weight matrix, and on a CPU each product has
a fixed cost besides its weight traffic (~10 us per bf16 product on 2 cores): one product where there
were three (two) makes a minimind-26m token ~10% faster in bf16. `fuse_projections` replaces, in a
model that only decodes from then on (the Engine's own copy), each attention and SwiGLU MLP by a
subclass that overrides only the step that computes the projections (`Attention.project`,
`MLP.hidden`); the attention itself (KV cache, masks, SDPA), the activation and the output
projections stay the architecture's own code, and RoPE is its apply_rope, run once for q and k (after
the attention's own QK-norm modules, when it has them).

A fused module keeps the stacked matrix as its only copy of those weights (no separate q/k/v or
gate/up remain, so nothing can wrap or update them behind the fused product), and it is an ordinary
module: `.to()` converts the matrix, and load_state_dict takes the model's own layout
(`q_proj.weight`, ...), which is how `Engine.load_weights` refreshes it. Its own state_dict is in the
fused layout; checkpoints are written from the training model, never from this copy. q/k/v biases
(Qwen2's) are stacked the same way, into one bias added to the one product. An attention or MLP with a
projection that is not a plain nn.Linear (a LoRA adapter: W x + s B A x) is left as it is and runs its
separate products.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanolm.model.transformer import MLP, Attention, apply_rope, swiglu


# A product with 2 to SMALL_ROWS activation rows on a CPU can run in float32 as (W @ x.T).T, the rows on the right
# of W (copied out contiguous: the strided view slowed every operation after it, a 16-row step of tiny 3.05 against
# 2.43 ms), which MKL computes faster on some CPUs and slower on others; every other product (one row, a
# matrix-vector product; long prefills; bf16) is F.linear. The rule without timing, which every process takes alike
# (as RL's rollouts need): rows on the right on AVX2, where MKL's product with few rows on the left of W.T took
# 2-2.5x the time (2-16 rows, minimind-26m's matrices, 2 cores: 33-42 ms against 13-26 ms per weight pass);
# F.linear on AVX-512, where one EPYC decoded 16 rows faster so (tiny 2.7 against 3.1 ms a step, minimind-26m 23
# against 25.5) and another slower (minimind-26m 16.7 against 20.0 ms, tiny 2.43 against 2.49), as did a Xeon with
# AMX at minimind-26m. So the server times both forms on the model's own matrices (`choose_product_form`) and keeps
# the faster; a form per matrix shape was tried and mixed the forms to no gain.
SMALL_ROWS = 32
ROWS_ON_THE_RIGHT = torch.backends.cpu.get_cpu_capability() == "AVX2"

# On a CPU whose bf16 (fp16) products oneDNN does not run (no AVX-512: `_is_mkldnn_bf16_supported` false), PyTorch
# multiplies a bf16 weight by one or two rows as fast as memory allows, half float32's bytes, but by more rows in a
# slow fallback. Measured on a 2-core AVX2 EPYC, one pass over minimind-26m's matrices (ms, float32 / bf16 / bf16
# widened to float32 on the way): 1 row 8.2 / 3.5 / 13.8, 2 rows 12.8 / 5.8 / 8.5, 4 rows 15.5 / 11.5 / 12.3, 16 rows
# 16.0 / 44.9 / 15.5, 64 rows 31.4 / 174.5 / 32.8; a 1024^3 product ran at 0.8 GFLOP/s in bf16 against 150 in
# float32. So there, a half-precision product of more than HALF_ROWS rows widens its weight and rows to float32
# (a prefill, a batch of rows) and returns its result in their dtype: bf16 weights decode one row twice as fast and
# lose nothing elsewhere.
HALF_ROWS = 4


def _onednn_has(check: str) -> bool:
    """Whether this PyTorch's oneDNN runs a dtype's products on this CPU; a build without oneDNN (or without the
    check) is taken to have its own kernels, and nothing is widened."""
    try:
        return bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):
        return True


HALF_NATIVE = {torch.bfloat16: _onednn_has("_is_mkldnn_bf16_supported"),
               torch.float16: _onednn_has("_is_mkldnn_fp16_supported")}


def widens(weight: torch.Tensor, rows: int) -> bool:
    """Whether a product of `rows` rows by `weight` runs on float32 copies: more than HALF_ROWS rows of a bf16 (fp16)
    weight on a CPU without oneDNN's half-precision products."""
    return rows > HALF_ROWS and weight.device.type == "cpu" and not HALF_NATIVE.get(weight.dtype, True)


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  right: bool | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for x (..., in), weight (out, in) and bias (out,); with 2 to SMALL_ROWS float32 rows on
    a CPU and `right` (None: this CPU's rule, ROWS_ON_THE_RIGHT), as (weight @ x.T).T; with more than HALF_ROWS rows
    of a bf16 (fp16) weight on a CPU without oneDNN's half-precision products, in float32 (the result in x's
    dtype)."""
    rows = x.numel() // x.shape[-1]
    if widens(weight, rows):
        return decode_linear(x.float(), weight.float(), None if bias is None else bias.float(), right).to(x.dtype)
    if ((ROWS_ON_THE_RIGHT if right is None else right) and 1 < rows <= SMALL_ROWS and x.device.type == "cpu"
            and weight.dtype == torch.float32):
        y = (weight @ x.reshape(rows, -1).T).T.contiguous().reshape(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class DecodeLinear(nn.Linear):
    """A bias-free nn.Linear computing through `decode_linear`; holds the same weight Parameter (a tied
    weight stays tied)."""

    product = "weight"  # the matrix its product multiplies by (choose_product_form times it)
    rows_on_the_right: bool | None = None  # the form of its few-row products; None: the CPU's rule

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", None)
        self.train(linear.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return decode_linear(x, self.weight, right=self.rows_on_the_right)


def _stacked(*linears: nn.Linear, part: str = "weight") -> nn.Parameter | None:
    """The linears' weights (or biases) stacked by rows: (sum of their out_features, in_features), no gradient;
    None for biases the linears do not have."""
    if getattr(linears[0], part) is None:
        return None
    return nn.Parameter(torch.cat([getattr(m, part).detach() for m in linears]), requires_grad=False)


def _load_stock_layout(module: nn.Module, state_dict: dict[str, torch.Tensor], prefix: str, *_: Any) -> None:
    """load_state_dict pre-hook: the stacked linears' weights (biases), in the model's own layout, become the
    entry of the fused matrix (vector), rows in order, which load_state_dict then checks and copies in place.

    Where one of them is absent nothing is changed, so a strict load names the missing fused key.
    """
    for fused, names in module.stacks.items():
        part = fused.rpartition("_")[2]  # "weight" or "bias"
        keys = [f"{prefix}{name}.{part}" for name in names]
        if all(k in state_dict for k in keys):
            state_dict[prefix + fused] = torch.cat([state_dict.pop(k) for k in keys])  # one layer at a time


class FusedAttention(Attention):
    """Attention whose q, k and v come from one product and whose q and k turn in one RoPE.

    qkv_weight: ((nh + 2 nkv) * hs, C), the rows of q_proj, k_proj and v_proj in that order; qkv_bias:
    ((nh + 2 nkv) * hs,), their biases in the same order, or None without biases. The QK-norm modules
    (q_norm, k_norm), when the attention has them, are the attention's own.
    """

    stacks = {"qkv_weight": ("q_proj", "k_proj", "v_proj"), "qkv_bias": ("q_proj", "k_proj", "v_proj")}
    product = "qkv_weight"
    rows_on_the_right: bool | None = None

    def __init__(self, attn: Attention) -> None:
        nn.Module.__init__(self)  # not Attention.__init__, which would make new projections to throw away
        self.n_head, self.n_kv_head, self.head_dim = attn.n_head, attn.n_kv_head, attn.head_dim
        self.dropout, self.causal = attn.dropout, attn.causal
        self.qkv_weight = _stacked(attn.q_proj, attn.k_proj, attn.v_proj)
        self.qkv_bias = _stacked(attn.q_proj, attn.k_proj, attn.v_proj, part="bias")
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        self.o_proj = attn.o_proj
        self.train(attn.training)
        self.register_load_state_dict_pre_hook(_load_stock_layout)

    def project(self, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (B, T, C) -> q (B, nh, T, hs), k and v (B, nkv, T, hs), with QK-norm (if any) then RoPE applied
        to q and k."""
        B, T, _ = x.shape
        qkv = decode_linear(x, self.qkv_weight, self.qkv_bias, self.rows_on_the_right)  # (B, T, (nh+2nkv)*hs)
        qkv = qkv.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh+2nkv, T, hs)
        qk = qkv[:, :self.n_head + self.n_kv_head]  # (B, nh+nkv, T, hs)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :self.n_head]), self.k_norm(qk[:, self.n_head:])], dim=1)
        qk = apply_rope(qk, cos, sin)
        q, k = qk.split([self.n_head, self.n_kv_head], dim=1)
        return q, k, qkv[:, self.n_head + self.n_kv_head:]


class FusedMLP(MLP):
    """SwiGLU whose gate and up come from one product.

    gate_up_weight: (2 n_hidden, C), the rows of gate_proj then up_proj.
    """

    stacks = {"gate_up_weight": ("gate_proj", "up_proj")}
    product = "gate_up_weight"
    rows_on_the_right: bool | None = None

    def __init__(self, mlp: MLP) -> None:
        nn.Module.__init__(self)  # not MLP.__init__, which would make new projections to throw away
        self.gate_up_weight = _stacked(mlp.gate_proj, mlp.up_proj)
        self.down_proj = mlp.down_proj
        self.train(mlp.training)
        self.register_load_state_dict_pre_hook(_load_stock_layout)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, C) -> silu(gate(x)) * up(x), (B, T, n_hidden)."""
        gate, up = decode_linear(x, self.gate_up_weight, right=self.rows_on_the_right).chunk(2, dim=-1)
        return swiglu(gate, up)


def _plain(*modules: nn.Module) -> bool:
    return all(type(m) is nn.Linear and m.bias is None for m in modules)


def _plain_with_biases(*modules: nn.Module) -> bool:
    """Plain nn.Linear modules that all have a bias, or none has."""
    return all(type(m) is nn.Linear for m in modules) and len({m.bias is None for m in modules}) == 1


def _fused_class(module: nn.Module) -> type[nn.Module] | None:
    """The fused class for an architecture Attention or MLP whose projections are plain, else None."""
    if type(module) is Attention and _plain_with_biases(module.q_proj, module.k_proj, module.v_proj):
        return FusedAttention
    if type(module) is MLP and _plain(module.gate_proj, module.up_proj):
        return FusedMLP
    return None


def fuse_projections(model: nn.Module) -> int:
    """Replace, in place, each Attention and MLP of `model` that can be fused by its fused module.

    For a model that only decodes from now on: the fused modules have no gradient path to the
    separate weights, which are gone. Modules are replaced one at a time and only their parents are
    held meanwhile, so each old module, and its projections, is freed as its replacement takes its
    place: one module's q/k/v (or gate/up) is held twice at most. Every other plain bias-free
    nn.Linear becomes a DecodeLinear holding the same weight (nothing is copied). Returns the number of
    attentions and MLPs fused.
    """
    sites = [(parent, name, cls) for parent in model.modules() for name, child in parent.named_children()
             if (cls := _fused_class(child)) is not None]
    for parent, name, cls in sites:
        setattr(parent, name, cls(getattr(parent, name)))
    # The remaining plain projections (o_proj, down_proj, the LM head, a MoE's experts) compute through
    # decode_linear too; a LoRA-wrapped one is left as it is.
    linears = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
               if _plain(child)]
    for parent, name in linears:
        setattr(parent, name, DecodeLinear(getattr(parent, name)))
    return len(sites)


PRODUCTS = (DecodeLinear, FusedAttention, FusedMLP)


def choose_product_form(model: nn.Module, rows: int = 16, rounds: int = 5) -> tuple[bool, str]:
    """Time one pass of `rows` float32 rows through every product of a fused `model` (fuse_projections) in both
    forms, alternated over `rounds`, and make every product take the faster (the best round of each); returns
    whether the rows go on the right and a line saying what was measured. A model that is not float32 on a CPU
    (or bf16 / fp16 widened to it there, which the form applies to as well) keeps F.linear for every product."""
    modules = [m for m in model.modules() if isinstance(m, PRODUCTS)]
    weights = [getattr(m, m.product) for m in modules]
    if not weights or weights[0].device.type != "cpu" or (weights[0].dtype != torch.float32
                                                          and not widens(weights[0], rows)):
        return False, "F.linear (the rows' form applies to float32 on a CPU only)"
    g = torch.Generator().manual_seed(0)
    xs = {w.shape[1]: torch.randn(rows, 1, w.shape[1], generator=g).to(weights[0].dtype) for w in weights}

    def one_pass(right: bool) -> float:
        t0 = time.perf_counter()
        for w in weights:
            decode_linear(xs[w.shape[1]], w, right=right)
        return time.perf_counter() - t0

    best = {True: float("inf"), False: float("inf")}
    with torch.inference_mode():
        for right in (True, False):  # warm-up
            one_pass(right)
        for _ in range(rounds):
            for right in (True, False):
                best[right] = min(best[right], one_pass(right))
    right = best[True] < best[False]
    for m in modules:
        m.rows_on_the_right = right
    form = "(W @ x.T).T" if right else "F.linear"
    return right, (f"{rows}-row products as {form}: a pass took {best[True] * 1e3:.2f} ms with the rows on the "
                   f"right, {best[False] * 1e3:.2f} ms with F.linear")
