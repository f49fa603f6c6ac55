"""The Llama-style decoder: architecture only.

Token embedding -> n_layer x [RMSNorm -> grouped-query attention with RoPE ->
residual, RMSNorm -> SwiGLU MLP (or MoE) -> residual] -> RMSNorm -> LM head
(optionally tied to the embedding).

Options make it the decoder of the small model families people already have:
- `qk_norm` (Qwen3, MiniMind-3): each head's queries and keys go through an
  RMSNorm over the head dimension before RoPE, one learned weight of size
  head_dim for q and one for k per layer, shared by the heads
  (`self_attn.q_norm`, `self_attn.k_norm`). It keeps the attention logits
  bounded whatever the scale of the projections. Without it a model has no
  such modules, so older checkpoints load unchanged.
- `qkv_bias` (Qwen2, Qwen2.5): q_proj, k_proj and v_proj have biases
  (`self_attn.q_proj.bias`, ...); o_proj has none, as in Qwen2.
- `head_dim` other than d_model / n_head (Qwen3-0.6B: 128 at 1024 / 16):
  q_proj is d_model -> n_head * head_dim and o_proj the way back.
- `rope_scaling = "yarn"`: the RoPE frequencies of YaRN (`Yarn`), computed in
  float32 exactly as transformers computes them, with cos/sin scaled by the
  attention factor, so a model trained at one context length runs at a longer
  one (`ModelConfig.with_yarn` stretches a trained model at load time).
- `rope_scaling = "llama3"`: Llama 3.1 / 3.2's frequencies (`Llama3`), also
  computed as transformers computes them.

Module names follow HuggingFace's Llama / Qwen3 (`layers.N.self_attn.q_proj`,
...) and RoPE uses the same rotate-half convention, so export to
`transformers` is a renaming of keys, not a permutation of weights.
Optimizers, data, logging and distribution live elsewhere; this file knows
tensors only.

Shapes: B batch, T new tokens, S cached+new tokens, C d_model, nh heads,
nkv key/value heads, hs head size, V vocabulary.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanolm.config.model import ModelConfig
from nanolm.model import cpu_attention
from nanolm.model.linear_ce import linear_cross_entropy
from nanolm.model.lora import frozen_linear
from nanolm.model.moe import MoE, moe_param_counts


# PyTorch's CPU flash attention takes longer for its bf16 backward than for float32 at small head sizes (measured
# on a CPU with AMX, forward and backward of one layer at tiny's shape, head size 32: 19.8 ms bf16, 14.3 ms
# float32; at head size 64 the two are level), so training under bf16 autocast on a CPU runs attention in float32
# below this head size.
SDPA_CPU_BF16_MIN_HEAD_DIM = 64


def sdpa_unrestricted() -> bool:
    """False while a run limits scaled_dot_product_attention to some of its kernels (train.sdpa_backend, through
    torch.nn.attention.sdpa_kernel): such a run gets PyTorch's kernel, not nanolm's CPU one."""
    b = torch.backends.cuda
    return b.flash_sdp_enabled() and b.mem_efficient_sdp_enabled() and b.math_sdp_enabled()


class _RMSNormCPU(torch.autograd.Function):
    """x * rsqrt(mean(x^2) + eps) * w over the last dimension, with a backward of a few whole-tensor passes.

    On a CPU, PyTorch's rms_norm takes 1.7x as long for its forward and backward (a `minimind-26m` step's 17
    norms: 7.1 against 4.3 ms each, 2 threads); on other devices its fused kernel is the faster.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        r = torch.rsqrt(x.square().mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, w, r)
        return x * r * w

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, w, r = ctx.saved_tensors
        xh = x * r  # the normalised input
        dw = (g * xh).flatten(0, -2).sum(0) if ctx.needs_input_grad[1] else None
        gw = g * w
        # d/dx of xh * w: r * (g w - xh * mean(g w xh))
        dx = gw.sub_(xh.mul_((gw * xh).mean(-1, keepdim=True))).mul_(r) if ctx.needs_input_grad[0] else None
        return dx, dw, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 (as Llama does) and cast back, so bf16 autocast keeps its precision here.
        if x.device.type == "cpu" and torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _RMSNormCPU.apply(x.float(), self.weight.float(), self.eps).to(x.dtype)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


@dataclass(frozen=True)
class Yarn:
    """YaRN's RoPE scaling (Peng et al. 2023, "YaRN: Efficient Context Window Extension"), as transformers has it.

    Dimension pair i turns original_max_len * f_i / (2 pi) times over the trained context. Pairs that turn more
    than beta_fast times keep their frequency f_i (they already saw every angle), pairs that turn fewer than
    beta_slow times are interpolated to f_i / factor (positions squeezed into the trained range), and a linear
    ramp over the pair index blends the ones between. cos and sin are multiplied by the attention factor,
    0.1 ln(factor) + 1 unless given, which sharpens the attention that the longer context flattens.
    """

    factor: float
    original_max_len: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 0.0  # 0 = 0.1 ln(factor) + 1

    @classmethod
    def of(cls, cfg: ModelConfig) -> "Yarn | None":
        if cfg.rope_scaling != "yarn":
            return None
        return cls(cfg.rope_factor, cfg.rope_original_max_len, cfg.rope_beta_fast, cfg.rope_beta_slow,
                   cfg.rope_attention_factor)

    @property
    def default_scale(self) -> float:
        """The paper's attention factor 0.1 ln(factor) + 1 (1 for factor <= 1), transformers' and llama.cpp's
        default."""
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

    @property
    def scale(self) -> float:
        """What cos and sin are multiplied by (transformers' attention_scaling)."""
        return self.attention_factor or self.default_scale

    def inv_freq(self, head_dim: int, theta: float) -> torch.Tensor:
        """The scaled frequencies (hs/2,) float32: transformers' `_compute_yarn_parameters`, operation by
        operation in the same order and precision, so an exported model's frequencies are bit-identical."""
        def pair_turning(turns: float) -> float:  # the (fractional) pair index that turns `turns` times
            return head_dim * math.log(self.original_max_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

        # Clamped at head_dim - 1, not hs/2 - 1, as transformers and llama.cpp do (it matters only when the
        # slow boundary falls past the last pair, where the ramp then never reaches 1).
        low = max(math.floor(pair_turning(self.beta_fast)), 0)
        high = min(math.ceil(pair_turning(self.beta_slow)), head_dim - 1)
        if low == high:
            high += 0.001  # a step instead of a ramp, without dividing by zero
        base = theta ** (torch.arange(0, head_dim, 2).to(torch.float32) / head_dim)  # (hs/2,) 1 / f_i
        kept = 1 - torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        return 1.0 / (self.factor * base) * (1 - kept) + 1.0 / base * kept


@dataclass(frozen=True)
class Llama3:
    """Llama 3.1 / 3.2's RoPE scaling (rope_type "llama3"), as transformers has it.

    A dimension pair of wavelength w = 2 pi / f_i keeps f_i where w < original_max_len / high_freq_factor (it
    turns often enough over the pretraining context), gets f_i / factor where w > original_max_len /
    low_freq_factor, and between them (1 - s) f_i / factor + s f_i with s = (original_max_len / w -
    low_freq_factor) / (high_freq_factor - low_freq_factor). cos and sin are not scaled.
    """

    factor: float
    original_max_len: int
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    scale = 1.0  # what cos and sin are multiplied by

    @classmethod
    def of(cls, cfg: ModelConfig) -> "Llama3 | None":
        if cfg.rope_scaling != "llama3":
            return None
        return cls(cfg.rope_factor, cfg.rope_original_max_len, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor)

    def inv_freq(self, head_dim: int, theta: float) -> torch.Tensor:
        """The scaled frequencies (hs/2,) float32: transformers' `_compute_llama3_parameters`, operation by
        operation in the same order and precision, so an exported model's frequencies are bit-identical."""
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))
        low_wavelen = self.original_max_len / self.low_freq_factor
        high_wavelen = self.original_max_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_len / wavelen - self.low_freq_factor) / (self.high_freq_factor -
                                                                             self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)

    def freq_factors(self, head_dim: int, theta: float) -> torch.Tensor:
        """What each pair's frequency is divided by, (hs/2,) float32: 1, factor, or 1 / ((1 - s) / factor + s)
        between; llama.cpp reads these as the `rope_freqs` tensor. Computed as convert_hf_to_gguf.py computes
        them, in float32 in the same order, so the values are the converter's."""
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        wavelen = 2 * math.pi / inv_freq
        smooth = (self.original_max_len / wavelen - self.low_freq_factor) / (self.high_freq_factor -
                                                                             self.low_freq_factor)
        out = torch.where(wavelen > self.original_max_len / self.low_freq_factor, self.factor,
                          1 / ((1 - smooth) / self.factor + smooth))
        return torch.where(wavelen < self.original_max_len / self.high_freq_factor, 1.0, out)


def rope_scaling(cfg: ModelConfig) -> Yarn | Llama3 | None:
    """The RoPE scaling of a model config, or None for plain RoPE."""
    return Yarn.of(cfg) or Llama3.of(cfg)


def rope_tables(head_dim: int, max_len: int, theta: float,
                scaling: Yarn | Llama3 | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables of shape (max_len, head_dim) in the rotate-half layout, scaled by `scaling` (YaRN or
    Llama 3's) when it is given.

    The angles and their cos/sin are computed in float64 and rounded once to float32.
    """
    if scaling is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))  # (hs/2,)
        scale = 1.0
    else:
        inv_freq, scale = scaling.inv_freq(head_dim, theta).double(), scaling.scale
    t = torch.arange(max_len, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)  # (max_len, hs/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (max_len, hs)
    return (emb.cos() * scale).float(), (emb.sin() * scale).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, n, T, hs); cos/sin: (T, hs), or (B, 1, T, hs) when positions differ per row."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


@dataclass
class KVCache:
    """Preallocated keys/values for every layer; `pos` is how many positions are filled.

    Rows of different lengths (batched decoding: prompts of different lengths, rows that joined at
    different steps) set `lengths` (B,), each row's filled positions; `pos` is then unused, one token
    per row is decoded at a time, written at its row's own position and rotated by it, and each row
    attends to its own filled positions only (never to another row's padding). The engine's model
    decodes such a cache (infer/rows.py); the architecture's forward takes `pos` alone.

    Its dtype may differ from the weights': attention then runs in the cache's dtype and its output
    is cast back (the Engine keeps a float32 cache for bf16/fp16 weights on a CPU).
    """

    k: list[torch.Tensor]  # n_layer x (B, nkv, max_len, hs)
    v: list[torch.Tensor]
    pos: int = 0
    lengths: torch.Tensor | None = None  # (B,) int64, rows filled to different lengths

    @classmethod
    def empty(cls, cfg: ModelConfig, batch_size: int, max_len: int, device: torch.device | str,
              dtype: torch.dtype) -> "KVCache":
        shape = (batch_size, cfg.n_kv_head, max_len, cfg.head_dim)
        return cls([torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)],
                   [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)])

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE: project (q/k/v heads, QK-normed, rotated) -> attention -> o_proj.

    `project` is a method of its own so that a module applied from outside (the fused products of
    infer/fuse.py) overrides only the projections. Every path (training, prefill, decoding, and the
    engine's rows of different lengths in infer/rows.py) goes through it, so QK-norm and RoPE are
    applied the same way in all of them.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_head * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)
        # QK-norm (Qwen3): one weight over the head dimension, shared by the heads.
        self.q_norm: RMSNorm | None = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm: RMSNorm | None = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.dropout = cfg.dropout
        self.causal = cfg.causal

    def project(self, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (B, T, C) -> q (B, nh, T, hs), k and v (B, nkv, T, hs), with QK-norm (if any) then RoPE applied
        to q and k."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None, layer: int = 0, mask: torch.Tensor | None = None) -> torch.Tensor:
        """mask: optional (B, 1, T, S) boolean, True where a query may attend a key (packed sequences)."""
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        start = 0
        if cache is not None:
            start = cache.pos
            cache.k[layer][:, :, start:start + T] = k
            cache.v[layer][:, :, start:start + T] = v
            k = cache.k[layer][:, :, :start + T]  # (B, nkv, S, hs)
            v = cache.v[layer][:, :, :start + T]
            q = q.to(k.dtype)  # attention runs in the cache's dtype (float32 under bf16 weights on a CPU)

        # On a CPU, training and scoring take nanolm's blocked attention where it applies (model/cpu_attention.py:
        # 1.6-2x PyTorch's kernel here)
        blocked = cache is None and self.causal and (self.dropout == 0.0 or not self.training) \
            and sdpa_unrestricted() and cpu_attention.usable(q, q.dtype)
        precision = contextlib.nullcontext()
        if (cache is None and not blocked and q.dtype == torch.bfloat16 and x.device.type == "cpu"
                and self.head_dim < SDPA_CPU_BF16_MIN_HEAD_DIM):
            q, k, v = q.float(), k.float(), v.float()
            precision = torch.autocast("cpu", enabled=False)  # autocast would cast them back to bf16
        # Grouped-query attention: each key/value head serves n_head / n_kv_head query heads. SDPA reads
        # the shared heads in place (enable_gqa) instead of copying them out to n_head heads.
        sdpa = partial(F.scaled_dot_product_attention, dropout_p=self.dropout if self.training else 0.0,
                       enable_gqa=self.n_kv_head != self.n_head)
        if blocked:
            y = cpu_attention.causal_attention(q, k.to(q.dtype), v.to(q.dtype), mask)
        elif start == 0:
            with precision:
                y = sdpa(q, k, v, attn_mask=mask) if mask is not None else \
                    sdpa(q, k, v, is_causal=self.causal and T > 1)
        elif mask is not None:
            y = sdpa(q, k, v, attn_mask=mask)
        elif T == 1:  # one new token sees the whole cache
            y = sdpa(q, k, v)
        else:
            # T new tokens after `start` cached ones: token i sees positions <= start + i.
            mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(diagonal=start)
            y = sdpa(q, k, v, attn_mask=mask)  # (B, nh, T, hs)
        y = y.to(x.dtype).transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, T, nh*hs)
        return self.o_proj(y)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The SwiGLU activation silu(gate) * up, elementwise."""
    return F.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), as hidden (the gated units) -> down.

    `hidden` is a method of its own so that a module applied from outside (infer/fuse.py) overrides
    only how gate and up are computed.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.n_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.n_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.n_hidden, cfg.d_model, bias=False)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, C) -> silu(gate(x)) * up(x), (B, T, n_hidden)."""
        return swiglu(self.gate_proj(x), self.up_proj(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.hidden(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if cfg.is_moe_layer(index):
            self.mlp: nn.Module = MoE(cfg.d_model, cfg.moe_n_hidden, cfg.n_experts, cfg.top_k,
                                      cfg.n_shared_experts, norm_topk=cfg.norm_topk)
        else:
            self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None, layer: int = 0, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.dropout(self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, mask))
        x = x + self.dropout(self.mlp(self.post_attention_layernorm(x)))
        return x


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, rope_scaling(cfg))
        # Not saved in checkpoints: they are derived from the config.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights; residual output projections scaled by 1/sqrt(2 n_layer) (GPT-2); norm
        weights ones and biases zeros."""
        std = self.config.init_std
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            elif p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.config.n_layer))
            else:
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None, pos: torch.Tensor | None = None,
                seg: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                last: torch.Tensor | None = None, at: torch.Tensor | None = None) -> torch.Tensor:
        """idx: (B, T) token ids -> logits (B, T, V); with `targets` (B, T), their summed cross-entropy instead;
        with `last` (B,), only the logits at position last[b] of each row, (B, 1, V) (a prefill needs no more);
        with `at` (N,), only those of the positions it lists in the flattened (B * T) order, (N, V): a loss over
        a few positions of each row (RL's completions after their prompts) computes no output projection for
        the others.

        With a cache, idx are the tokens after cache.pos. For packed sequences
        (several conversations in one row), `seg` (B, T) gives each token's
        segment id, and tokens attend only to earlier tokens of their own
        segment; `pos` (B, T) gives each token's position within its segment.
        A non-causal model (`model.causal` false) lets every token attend to
        every token of its row (of its segment, with `seg`), and the logits at
        position i are its prediction of the output block's token i.
        With targets, the float32 sum of the next-token cross-entropy over the
        positions whose target is not negative is returned, computed by
        `linear_cross_entropy` without writing the logits out (a LoRA-wrapped
        output projection goes through its module and the plain loss), over
        those positions alone (uncompiled: the masked prompts of chat data
        cost no output projection).
        """
        B, T = idx.shape
        if cache is not None and not self.config.causal:
            raise ValueError("model.causal is false: a non-causal model writes its output block in one pass and "
                             "decodes nothing token by token, so it takes no KV cache")
        if cache is not None and cache.lengths is not None:
            raise ValueError("rows of different lengths (cache.lengths) are decoded by the engine's model "
                             "(nanolm.infer.rows.rows_model), not by the architecture's forward")
        start = cache.pos if cache is not None else 0
        if start + T > self.config.max_seq_len:
            raise ValueError(f"sequence of {start + T} tokens exceeds model.max_seq_len={self.config.max_seq_len}")
        if pos is None:
            cos = self.rope_cos[start:start + T]  # (T, hs)
            sin = self.rope_sin[start:start + T]
        else:
            cos = self.rope_cos[pos].unsqueeze(1)  # (B, 1, T, hs)
            sin = self.rope_sin[pos].unsqueeze(1)
        mask = None
        if seg is not None:
            mask = seg[:, :, None] == seg[:, None, :]  # (B, T, T)
            if self.config.causal:
                mask = mask & torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
            mask = mask.unsqueeze(1)  # (B, 1, T, T)
        x = self.dropout(self._embed(idx))  # (B, T, C)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, mask)
        if cache is not None:
            cache.pos += T
        if targets is not None:
            h, t = x.flatten(0, 1), targets.flatten()  # (B*T, C), (B*T,)
            if not torch.compiler.is_compiling():
                # Only the positions with a target are projected: a chat's prompts (a tool list's hundreds of
                # tokens), which the loss masks, cost no output projection. Compiled, every position is (a shape
                # that depends on the data would break the graph).
                kept = (t >= 0).nonzero().squeeze(-1)
                if kept.numel() < t.numel():
                    h, t = h.index_select(0, kept), t.index_select(0, kept)
            h = self.norm(h)
            if type(self.lm_head) is nn.Linear:
                return linear_cross_entropy(h, self.lm_head.weight, t)
            return F.cross_entropy(self.lm_head(h).float(), t.clamp_min(-1), ignore_index=-1, reduction="sum")
        if last is not None:
            x = x[torch.arange(B, device=x.device), last].unsqueeze(1)  # (B, 1, C)
        elif at is not None:
            x = x.flatten(0, 1).index_select(0, at)  # (N, C)
        return self._head(self.norm(x))  # (B, T, V), (B, 1, V) or (N, V)

    def _embed(self, idx: torch.Tensor) -> torch.Tensor:
        """The token embeddings in the residual stream's dtype, that of the norms (a LoRA run may keep its frozen
        embedding table in bf16 while the stream stays float32: lora.cast_base)."""
        return self.embed_tokens(idx).to(self.norm.weight.dtype)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of the normed stream h (..., C), in h's dtype; a head kept in another dtype (lora.cast_base)
        multiplies a cast of h where autocast does not cast for it."""
        return frozen_linear(self.lm_head, h) if type(self.lm_head) is nn.Linear else self.lm_head(h)


# ----------------------------------------------------------------------------- reports

def count_params(model: nn.Module) -> dict[str, int]:
    """Total, trainable and active-per-token parameters (shared tensors counted once), and the embedding's share.

    Active = what one token's forward uses: for MoE layers, the router, the
    shared expert and top_k of the routed experts. Norm weights count, QK-norm's
    (2 head_dim per layer) among them.
    """
    seen: set[int] = set()
    total = trainable = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    emb = model.embed_tokens.weight.numel() if hasattr(model, "embed_tokens") else 0
    inactive = sum(sum(p.numel() for p in m.experts[0].parameters()) * (m.n_experts - m.top_k)
                   for m in model.modules() if isinstance(m, MoE))
    return {"total": total, "trainable": trainable, "active": total - inactive, "embedding": emb,
            "non_embedding": total - emb}


def head_flops_per_token(cfg: ModelConfig) -> int:
    """Training FLOPs per token of the output projection alone (part of flops_per_token): 3 x 2 x vocab x d_model."""
    return 3 * 2 * cfg.vocab_size * cfg.d_model


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward = 3x forward).

    Each weight of a matrix multiply costs 2 FLOPs per token forward; the LM head
    counts even when tied (the lookup is free, the projection is not).
    For MoE layers only the active experts count (MFU measures useful work).
    Norms (QK-norm included), biases and RoPE are elementwise and not counted.
    Attention scores and the weighted sum cost 2 * 2 * n_layer * seq_len * n_head * head_dim
    (d_model unless head_dim says otherwise) forward (causal masking is not subtracted, as in
    the PaLM/nanoGPT convention).
    """
    attn = cfg.d_model * cfg.head_dim * (cfg.n_head + 2 * cfg.n_kv_head) + cfg.n_head * cfg.head_dim * cfg.d_model
    dense_mlp = 3 * cfg.d_model * cfg.n_hidden  # gate, up, down
    moe_mlp = moe_param_counts(cfg.d_model, cfg.moe_n_hidden, cfg.n_experts, cfg.top_k,
                               cfg.n_shared_experts)["active"] if cfg.use_moe else 0  # active experts + router
    matmul_params = sum(attn + (moe_mlp if cfg.is_moe_layer(i) else dense_mlp) for i in range(cfg.n_layer))
    attn = 2 * cfg.n_layer * seq_len * cfg.n_head * cfg.head_dim
    return 3 * (2 * matmul_params + 2 * attn) + head_flops_per_token(cfg)
