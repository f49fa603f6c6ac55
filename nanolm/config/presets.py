"""The named presets (`--preset`): each a plain function returning a `Config`."""

from __future__ import annotations

from typing import Callable

from nanolm.config.model import ModelConfig
from nanolm.config.optim import OptimConfig
from nanolm.config.train import Config, TrainConfig
from nanolm.errors import UserError


def _preset_tiny() -> Config:
    return Config(
        model=ModelConfig(vocab_size=6400, d_model=128, n_layer=4, n_head=4, n_kv_head=2, max_seq_len=256),
        optim=OptimConfig(lr=2e-3, min_lr=2e-4, warmup_steps=20),
        train=TrainConfig(batch_size=8, seq_len=256, max_steps=300, eval_interval=50, eval_batches=8,
                          save_interval=100),
    )


# The dense presets compile the model: measured on a 2-core CPU at minimind-26m's shape (bench/RESULTS.md,
# training and decoding throughput), torch.compile raises training MFU from 79% to 86% (fp32) and 42% to 50%
# (bf16) and lowers peak memory by about a quarter, after a first step of 15-30 s. Pass --train.compile false
# for short runs.
def _preset_minimind_26m() -> Config:
    return Config(
        model=ModelConfig(vocab_size=6400, d_model=512, n_layer=8, n_head=8, n_kv_head=2, max_seq_len=512),
        optim=OptimConfig(lr=5e-4, min_lr=5e-5, warmup_steps=200),
        train=TrainConfig(compile=True, batch_size=32, seq_len=512, max_steps=10000),
    )


def _preset_minimind_104m() -> Config:
    return Config(
        model=ModelConfig(vocab_size=6400, d_model=768, n_layer=16, n_head=8, n_kv_head=2, max_seq_len=512),
        optim=OptimConfig(lr=5e-4, min_lr=5e-5, warmup_steps=500),
        train=TrainConfig(compile=True, batch_size=32, seq_len=512, max_steps=20000),
    )


def _preset_gpt2_124m() -> Config:
    # GPT-2-small sized (124M parameters with a 50304-token vocabulary), in the Llama layout.
    return Config(
        model=ModelConfig(vocab_size=50304, d_model=768, n_layer=12, n_head=12, n_kv_head=12, n_hidden=2048,
                          max_seq_len=1024, rope_theta=1e4),
        optim=OptimConfig(lr=6e-4, min_lr=6e-5, warmup_steps=700),
        train=TrainConfig(compile=True, batch_size=16, seq_len=1024, grad_accum=32, max_steps=20000),
    )


def _preset_minimind_moe() -> Config:
    # MiniMind2-MoE-like: d_model 640, 8 layers, 1 shared + 4 routed experts, top-2, in every block.
    return Config(
        model=ModelConfig(vocab_size=6400, d_model=640, n_layer=8, n_head=8, n_kv_head=2, max_seq_len=512,
                          use_moe=True, n_experts=4, n_shared_experts=1, top_k=2),
        optim=OptimConfig(lr=5e-4, min_lr=5e-5, warmup_steps=200),
        train=TrainConfig(batch_size=32, seq_len=512, max_steps=10000),
    )


def _preset_minimind_26m_moe() -> Config:
    # minimind-26m with its MLP split into fine-grained experts: a shared expert and the top-1 of 8 routed
    # experts, each half the dense width, so a token's active parameters and FLOPs equal minimind-26m's.
    return Config(
        model=ModelConfig(vocab_size=6400, d_model=512, n_layer=8, n_head=8, n_kv_head=2, max_seq_len=512,
                          use_moe=True, n_experts=8, n_shared_experts=1, top_k=1, moe_n_hidden=704),
        optim=OptimConfig(lr=5e-4, min_lr=5e-5, warmup_steps=200),
        train=TrainConfig(batch_size=32, seq_len=512, max_steps=10000),
    )


# MiniMind-3 (jingyaogong/minimind, model/model_minimind.py): Qwen3's layout at d_model 768, 8 layers, 8 query and
# 4 key/value heads of 96, QK-norm, SwiGLU of ceil(768 pi / 64) * 64 = 2432, 32768 positions at RoPE theta 1e6,
# RMSNorm eps 1e-6, tied embeddings; 63.9 M parameters. Trained here on 768-token windows (MiniMind's setting
# for its mini pretraining and SFT data); its optimiser is AdamW at 5e-4 decaying to a tenth.
_MINIMIND_3 = dict(vocab_size=6400, d_model=768, n_layer=8, n_head=8, n_kv_head=4, n_hidden=2432, max_seq_len=32768,
                   rope_theta=1e6, norm_eps=1e-6, qk_norm=True, tie_embeddings=True)


def _preset_minimind_3() -> Config:
    return Config(
        model=ModelConfig(**_MINIMIND_3),
        optim=OptimConfig(lr=5e-4, min_lr=5e-5, warmup_steps=200),
        train=TrainConfig(compile=True, batch_size=32, seq_len=768, max_steps=10000),
    )


def _preset_minimind_3_moe() -> Config:
    # MiniMind-3-MoE: the same with every MLP replaced by 4 routed experts of the dense width, top-1, no shared
    # expert, renormalised top-k weights (Qwen3-MoE's block) and MiniMind's balance-loss weight 5e-4;
    # 198.4 M parameters, 63.9 M active per token.
    return Config(
        model=ModelConfig(**_MINIMIND_3, use_moe=True, n_experts=4, top_k=1, n_shared_experts=0, moe_n_hidden=2432,
                          norm_topk=True, aux_loss_coef=5e-4),
        optim=OptimConfig(lr=5e-4, min_lr=5e-5, warmup_steps=200),
        train=TrainConfig(batch_size=32, seq_len=768, max_steps=10000),
    )


def _preset_cpu_small() -> Config:
    # What a time budget without a preset trains (BUDGET_PRESET_MINUTES): tiny's shape with Muon, which reached
    # 2.32 bits per byte against AdamW's 2.43 in 3 CPU-minutes on 1 MB of Shakespeare held out by position
    # (bench/quality.py; bench/RESULTS.md, "Quality per CPU-minute").
    return Config(
        model=ModelConfig(vocab_size=6400, d_model=128, n_layer=4, n_head=4, n_kv_head=2, max_seq_len=256),
        optim=OptimConfig(name="muon", lr=2e-3, min_lr=2e-4, warmup_steps=20),
        train=TrainConfig(batch_size=8, seq_len=256, max_steps=300, eval_interval=50, eval_batches=8,
                          save_interval=100),
    )


PRESETS: dict[str, Callable[[], Config]] = {
    "tiny": _preset_tiny,
    "cpu-small": _preset_cpu_small,
    "minimind-26m": _preset_minimind_26m,
    "minimind-104m": _preset_minimind_104m,
    "gpt2-124m": _preset_gpt2_124m,
    "minimind-moe": _preset_minimind_moe,
    "minimind-26m-moe": _preset_minimind_26m_moe,
    "minimind-3": _preset_minimind_3,
    "minimind-3-moe": _preset_minimind_3_moe,
}


def preset(name: str) -> Config:
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]()

