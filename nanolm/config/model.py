"""The model's architecture (`ModelConfig`), saved with every checkpoint."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from nanolm.config.fields import build_config, check as _check


@dataclass
class ModelConfig:
    """A Llama-style decoder: RoPE (optionally YaRN- or Llama-3-scaled), RMSNorm, SwiGLU, grouped-query attention
    (optionally with Qwen3's QK-norm, Qwen2's q/k/v biases, a head size other than d_model / n_head), dense or
    mixture-of-experts MLPs."""

    vocab_size: int = 6400
    d_model: int = 512
    n_layer: int = 8
    n_head: int = 8
    n_kv_head: int = 2  # grouped-query attention; == n_head is plain multi-head attention
    # Size of each attention head: q_proj is d_model -> n_head * head_dim, o_proj n_head * head_dim -> d_model.
    # 0 = d_model / n_head (and reads back as that value); Qwen3-0.6B has 128 at d_model 1024 and 16 heads.
    head_dim: int = 0
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2, Qwen2.5); o_proj has none
    n_hidden: int = 0  # SwiGLU hidden size; 0 = 8/3 * d_model rounded up to a multiple of 64
    max_seq_len: int = 512  # longest context the model is trained and served at
    rope_theta: float = 1e6
    # YaRN (Peng et al. 2023) stretches RoPE to a context rope_factor times the one the model was trained at,
    # computed as transformers computes it: dimensions that turn more than rope_beta_fast times over the
    # original context keep their frequency, those that turn fewer than rope_beta_slow times are divided by
    # rope_factor, a linear ramp blends the ones between, and cos/sin are scaled by rope_attention_factor.
    # Llama 3 (rope_scaling "llama3", Llama 3.1 / 3.2's rope_type) computes transformers' frequencies too:
    # dimensions whose wavelength is below rope_original_max_len / rope_high_freq_factor keep their frequency,
    # those above rope_original_max_len / rope_low_freq_factor are divided by rope_factor, and a ramp in
    # original_len / wavelength blends the ones between; cos/sin are not scaled.
    rope_scaling: str = "none"  # none: plain RoPE; yarn; llama3
    rope_factor: float = 1.0  # yarn: how many times the trained context is stretched, e.g. 4 for 512 -> 2048; llama3
    rope_original_max_len: int = 0  # yarn, llama3: the context length the model was (pre)trained at
    rope_beta_fast: float = 32.0  # yarn
    rope_beta_slow: float = 1.0  # yarn
    rope_attention_factor: float = 0.0  # yarn: the cos/sin scale; 0 = 0.1 ln(rope_factor) + 1, as in the paper
    rope_low_freq_factor: float = 1.0  # llama3 (Llama 3.x: 1)
    rope_high_freq_factor: float = 4.0  # llama3 (Llama 3.x: 4)
    norm_eps: float = 1e-5
    qk_norm: bool = False  # RMSNorm each head's queries and keys before RoPE (Qwen3, MiniMind-3)
    dropout: float = 0.0
    tie_embeddings: bool = True
    init_std: float = 0.02
    # false: every position attends to the whole input block (bd4sur's Nano's non-causal mode): the model reads a
    # block and writes the next block in one pass, trained with --stage blocks; no KV cache, no token-by-token decoding.
    causal: bool = True
    # Mixture of experts: routed SwiGLU experts (+ shared ones) replace the MLP of every moe_every-th block.
    use_moe: bool = False
    n_experts: int = 4  # routed experts per MoE layer
    n_shared_experts: int = 1  # experts every token goes through
    top_k: int = 2  # routed experts per token
    moe_n_hidden: int = 0  # width of each expert; 0 = n_hidden
    moe_every: int = 1  # block i is MoE when (i + 1) % moe_every == 0 (HF Qwen2-MoE's decoder_sparse_step)
    norm_topk: bool = True  # renormalise the top-k router probabilities to sum to 1
    aux_loss_coef: float = 0.01  # weight of the load-balancing loss added to the training loss

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layer", "n_head", "n_kv_head", "max_seq_len"):
            _check(getattr(self, name) > 0, f"model.{name} must be a positive integer, got {getattr(self, name)}")
        _check(self.head_dim >= 0, f"model.head_dim must be >= 0 (0 = model.d_model / model.n_head), got "
               f"{self.head_dim}")
        if self.head_dim == 0:
            _check(self.d_model % self.n_head == 0,
                   f"model.d_model ({self.d_model}) must be divisible by model.n_head ({self.n_head}), or "
                   f"model.head_dim set")
            _check((self.d_model // self.n_head) % 2 == 0,
                   f"model.d_model / model.n_head = {self.d_model // self.n_head} must be even for RoPE")
            self.head_dim = self.d_model // self.n_head
        _check(self.head_dim % 2 == 0, f"model.head_dim = {self.head_dim} must be even for RoPE")
        _check(self.n_head % self.n_kv_head == 0,
               f"model.n_head ({self.n_head}) must be a multiple of model.n_kv_head ({self.n_kv_head})")
        _check(self.n_hidden >= 0, f"model.n_hidden must be >= 0 (0 = automatic), got {self.n_hidden}")
        _check(0.0 <= self.dropout < 1.0, f"model.dropout must be in [0, 1), got {self.dropout}")
        _check(self.rope_theta > 0, f"model.rope_theta must be > 0, got {self.rope_theta}")
        self._check_rope_scaling()
        _check(self.norm_eps > 0, f"model.norm_eps must be > 0, got {self.norm_eps}")
        _check(self.init_std >= 0, f"model.init_std must be >= 0, got {self.init_std}")
        if self.n_hidden == 0:
            self.n_hidden = auto_hidden(self.d_model)
        if self.use_moe:
            _check(self.n_experts >= 1, f"model.n_experts must be >= 1, got {self.n_experts}")
            _check(1 <= self.top_k <= self.n_experts,
                   f"model.top_k must be in [1, model.n_experts={self.n_experts}], got {self.top_k}")
            _check(self.n_shared_experts >= 0, f"model.n_shared_experts must be >= 0, got {self.n_shared_experts}")
            _check(self.moe_n_hidden >= 0, f"model.moe_n_hidden must be >= 0 (0 = n_hidden), got {self.moe_n_hidden}")
            _check(1 <= self.moe_every <= self.n_layer,
                   f"model.moe_every must be in [1, model.n_layer={self.n_layer}], got {self.moe_every}")
            _check(self.aux_loss_coef >= 0, f"model.aux_loss_coef must be >= 0, got {self.aux_loss_coef}")
            if self.moe_n_hidden == 0:
                self.moe_n_hidden = self.n_hidden

    def _check_rope_scaling(self) -> None:
        _check(self.rope_scaling in ROPE_SCALINGS,
               f"model.rope_scaling must be one of {', '.join(ROPE_SCALINGS)}, got {self.rope_scaling!r}")
        for name, (default, kinds) in _ROPE_SCALING_FIELDS.items():
            _check(self.rope_scaling in kinds or getattr(self, name) == default,
                   f"model.{name}={getattr(self, name)} applies only with model.rope_scaling {' or '.join(kinds)}; "
                   f"set that, or leave model.{name} at {default}")
        if self.rope_scaling == "none":
            return
        _check(self.rope_factor >= 1,
               f"model.rope_factor must be >= 1 (how many times the context is stretched), got {self.rope_factor}")
        if self.rope_scaling == "llama3":
            # Llama 3.2 keeps its original 8192 whatever context it is served at, so no bound by max_seq_len.
            _check(self.rope_original_max_len > 0,
                   f"model.rope_original_max_len must be a positive integer (the context the model was pretrained "
                   f"at, 8192 for Llama 3.x) with model.rope_scaling llama3, got {self.rope_original_max_len}")
            _check(self.rope_high_freq_factor > self.rope_low_freq_factor > 0,
                   f"model.rope_high_freq_factor ({self.rope_high_freq_factor}) must exceed "
                   f"model.rope_low_freq_factor ({self.rope_low_freq_factor}), and both be > 0 (Llama 3's: 4 and 1)")
            return
        _check(0 < self.rope_original_max_len <= self.max_seq_len,
               f"model.rope_original_max_len must be in [1, model.max_seq_len={self.max_seq_len}] (the context the "
               f"model was trained at) with model.rope_scaling yarn, got {self.rope_original_max_len}")
        _check(self.rope_beta_fast > self.rope_beta_slow > 0,
               f"model.rope_beta_fast ({self.rope_beta_fast}) must exceed model.rope_beta_slow "
               f"({self.rope_beta_slow}), and both be > 0 (YaRN's defaults: 32 and 1)")
        _check(self.rope_attention_factor >= 0,
               f"model.rope_attention_factor must be >= 0 (0 = 0.1 ln(rope_factor) + 1), got "
               f"{self.rope_attention_factor}")

    def with_yarn(self, factor: float, trained_len: int | None = None) -> "ModelConfig":
        """This model with its context stretched `factor` times by YaRN, for a model trained without it:
        rope_original_max_len is `trained_len` (the window it was trained on; default max_seq_len) and
        max_seq_len becomes trained_len * factor, rounded down. The weights are unchanged."""
        kind = "YaRN" if self.rope_scaling == "yarn" else f"{self.rope_scaling} RoPE scaling"
        _check(self.rope_scaling == "none",
               f"the model already uses {kind} (model.rope_factor={self.rope_factor:g}, model.rope_original_max_len="
               f"{self.rope_original_max_len}); it cannot be stretched again")
        _check(math.isfinite(factor) and factor > 1, f"the YaRN factor must be > 1, got {factor:g}")
        trained_len = self.max_seq_len if trained_len is None else trained_len
        _check(0 < trained_len <= self.max_seq_len,
               f"the trained length must be in [1, model.max_seq_len={self.max_seq_len}], got {trained_len}")
        return dataclasses.replace(self, rope_scaling="yarn", rope_factor=float(factor),
                                   rope_original_max_len=trained_len, max_seq_len=math.floor(trained_len * factor))

    def is_moe_layer(self, i: int) -> bool:
        return self.use_moe and (i + 1) % self.moe_every == 0

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "ModelConfig":
        """A model config alone (a checkpoint's "model" section), validated as in a whole Config."""
        return build_config(cls, d, source, prefix="model.")

    def to_dict(self) -> dict[str, Any]:
        """The fields as saved in config.json: head_dim as 0 where it is d_model / n_head, n_hidden as 0 where it
        is the automatic width of d_model, moe_n_hidden as 0 where it is n_hidden, so that a file, or a preset
        overridden by `--model.d_model`, keeps meaning "follow d_model" as the defaults do."""
        d = dataclasses.asdict(self)
        if self.d_model % self.n_head == 0 and self.head_dim == self.d_model // self.n_head:
            d["head_dim"] = 0
        if self.n_hidden == auto_hidden(self.d_model):
            d["n_hidden"] = 0
        if self.moe_n_hidden == self.n_hidden:
            d["moe_n_hidden"] = 0
        return d


def auto_hidden(d_model: int) -> int:
    """The SwiGLU width that model.n_hidden 0 means: 8/3 of d_model, rounded up to a multiple of 64."""
    return 64 * math.ceil(8 * d_model / 3 / 64)


ROPE_SCALINGS = ("none", "yarn", "llama3")
# The scaling fields: each one's value under plain RoPE, and the scalings it applies to.
_ROPE_SCALING_FIELDS = {
    "rope_factor": (1.0, ("yarn", "llama3")), "rope_original_max_len": (0, ("yarn", "llama3")),
    "rope_beta_fast": (32.0, ("yarn",)), "rope_beta_slow": (1.0, ("yarn",)), "rope_attention_factor": (0.0, ("yarn",)),
    "rope_low_freq_factor": (1.0, ("llama3",)), "rope_high_freq_factor": (4.0, ("llama3",)),
}
