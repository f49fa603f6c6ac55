"""The optimizer: AdamW with decay / no-decay parameter groups, or Muon for the hidden matrices beside AdamW.

`optim.name = "muon"` trains the 2-D weight matrices inside the blocks (the
attention and MLP projections, MoE experts included; not the MoE router) with
`torch.optim.Muon` (momentum, then an approximate orthogonalisation of the
update by Newton-Schulz iterations), as nanochat and the modded-nanoGPT
speedruns do, and everything else (the embedding, which is also the head when
tied, an untied head, the norm gains, the router) with AdamW. Both live in one
`MuonAdamW`: one optimizer object, so the loop, gradient accumulation, DDP,
checkpoints and resume handle it as they handle AdamW (one state dict, keyed
by parameter, groups in a fixed order).

Learning rates: the schedule's factor applies to every group; a group's
`lr_scale` multiplies it. Muon's groups take `optim.muon_lr` (default 0.02,
nanochat's value for its Muon matrices; torch's "original" adjustment scales
it by sqrt(max(1, rows / cols))) at the schedule's peak, i.e. lr_scale =
muon_lr / lr, and a weight decay that shrinks their weights by the same
fraction per step as AdamW's would (weight_decay * lr / muon_lr, as torch's
Muon decays by lr * weight_decay).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from nanolm.config import OptimConfig


def param_groups(params: nn.Module | list[nn.Parameter], weight_decay: float) -> list[dict]:
    """Matrices (linear and embedding weights) decay; vectors (norm gains, biases) do not.

    Of a module, only its trainable parameters are included, so a stage that freezes part of the model (LoRA)
    gets an optimizer over exactly what it trains.
    """
    if isinstance(params, nn.Module):
        params = [p for p in params.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def is_hidden_matrix(name: str, p: nn.Parameter) -> bool:
    """A parameter Muon trains: a 2-D weight inside the transformer blocks, other than an MoE router."""
    return p.dim() == 2 and name.startswith("layers.") and ".mlp.gate." not in name


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon over `muon_groups` and AdamW over `adamw_groups`, stepped together as one optimizer.

    The two share this optimizer's param_groups (Muon's first) and its state, so `state_dict` and
    `load_state_dict` (and torch.distributed.checkpoint's full optimizer state) see one optimizer.
    """

    def __init__(self, muon_groups: list[dict], adamw_groups: list[dict], muon_kw: dict[str, Any],
                 adamw_kw: dict[str, Any]) -> None:
        self.muon = torch.optim.Muon([g for g in muon_groups if g["params"]], **muon_kw)
        self.adamw = torch.optim.AdamW([g for g in adamw_groups if g["params"]], **adamw_kw)
        self.n_muon = len(self.muon.param_groups)
        super().__init__(self.muon.param_groups + self.adamw.param_groups, {})
        self._link()

    def _link(self) -> None:
        """Point both optimizers at this one's groups and state (again after load_state_dict replaced them)."""
        self.muon.param_groups = self.param_groups[:self.n_muon]
        self.adamw.param_groups = self.param_groups[self.n_muon:]
        self.muon.state = self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("MuonAdamW.step takes no closure")
        self.muon.step()
        self.adamw.step()


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer of `cfg.name` over the model's trainable parameters (a stage that freezes part of the model,
    such as LoRA, gets an optimizer over exactly what it trains)."""
    # The fused kernel updates every parameter in one pass over its state instead of a chain of per-tensor
    # ops: on CUDA a few launches instead of hundreds; on a 2-core CPU the step takes 12 ms instead of
    # 28 ms at minimind-26m (2% of a bf16 training step). Same update, to float rounding.
    fused = device.type in ("cuda", "cpu")
    adamw_kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if cfg.name == "adamw":
        return torch.optim.AdamW(param_groups([p for _, p in named], cfg.weight_decay), **adamw_kw)
    hidden = [p for n, p in named if is_hidden_matrix(n, p)]
    rest = [p for n, p in named if not is_hidden_matrix(n, p)]
    scale = cfg.muon_lr / cfg.lr
    muon_groups = [{"params": hidden, "lr": cfg.muon_lr, "lr_scale": scale, "weight_decay": cfg.weight_decay / scale}]
    adamw_groups = [{**g, "lr_scale": 1.0} for g in param_groups(rest, cfg.weight_decay)]
    return MuonAdamW(muon_groups, adamw_groups, dict(lr=cfg.muon_lr, momentum=cfg.muon_momentum, nesterov=True),
                     adamw_kw)
