"""AdamW with decay / no-decay parameter groups."""

from __future__ import annotations

import torch
import torch.nn as nn

from nanolm.config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices (linear and embedding weights) decay; vectors (norm gains, biases) do not.

    Only trainable parameters are included, so a stage that freezes part of
    the model (LoRA) gets an optimizer over exactly what it trains.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    # The fused kernel updates every parameter in one pass over its state instead of a chain of per-tensor
    # ops: on CUDA a few launches instead of hundreds; on a 2-core CPU the step takes 12 ms instead of
    # 28 ms at minimind-26m (2% of a bf16 training step). Same update, to float rounding.
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused)
