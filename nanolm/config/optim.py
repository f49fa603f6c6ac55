"""The optimizer and its learning-rate schedule (`OptimConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from nanolm.config.fields import check as _check


OPTIMIZERS = ("adamw", "muon")


@dataclass
class OptimConfig:
    """The optimizer (AdamW, or Muon for the hidden matrices beside AdamW; see nanolm/train/optim.py) and the
    learning-rate schedule, whose factor applies to every parameter group."""

    name: str = "adamw"  # adamw; muon: Muon for the blocks' 2-D weights, AdamW for embeddings, norms, head
    muon_lr: float = 0.02  # muon: the peak learning rate of the Muon matrices (nanochat's); lr stays AdamW's
    muon_momentum: float = 0.95  # muon: Muon's (Nesterov) momentum
    lr: float = 5e-4
    min_lr: float = 5e-5
    schedule: str = "cosine"  # cosine: linear warmup then cosine decay to min_lr; constant: warmup then lr
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping

    def __post_init__(self) -> None:
        _check(self.lr > 0, f"optim.lr must be > 0, got {self.lr}")
        _check(self.name in OPTIMIZERS, f"optim.name must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}")
        _check(self.muon_lr > 0, f"optim.muon_lr must be > 0, got {self.muon_lr}")
        _check(0 <= self.muon_momentum < 1, f"optim.muon_momentum must be in [0, 1), got {self.muon_momentum}")
        _check(0 <= self.min_lr <= self.lr, f"optim.min_lr must be in [0, optim.lr={self.lr}], got {self.min_lr}")
        _check(self.schedule in ("cosine", "constant"),
               f"optim.schedule must be 'cosine' or 'constant', got {self.schedule!r}")
        _check(self.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        _check(self.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        _check(self.eps > 0, f"optim.eps must be > 0, got {self.eps}")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1,
               f"optim.beta1 and optim.beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")
        _check(self.grad_clip >= 0, f"optim.grad_clip must be >= 0 (0 disables), got {self.grad_clip}")

