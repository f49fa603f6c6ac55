"""Batch -> loss functions: each training stage is one of these plus a rule for what trains."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -1  # a target equal to this contributes no loss


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy. logits (B, T, V) any dtype, targets (B, T) int64.

    Computed in float32 whatever the autocast dtype, since a bf16 log-softmax
    over thousands of classes loses visible precision.
    """
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                           ignore_index=IGNORE_INDEX, reduction=reduction)
