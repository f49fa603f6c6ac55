"""Non-finite losses and gradients: telling a bad step apart, and finding where its first NaN or inf came from.

The loop checks every step (`step_is_finite`: one host sync) and skips the
optimizer update of a step whose loss or gradient norm is NaN or inf, so a
bad batch or a spike never reaches the weights. At the first bad step of a
streak it calls `locate_nonfinite`, which replays the step's micro-batches
with a hook on every module, like `torch.autograd.detect_anomaly` but naming
a module: the first one, in execution order, whose output is not finite
while its inputs are (forward), else the first, in backward order, whose
input gradient is not finite while its output gradient is.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn


def step_is_finite(loss: torch.Tensor, grad_norm: torch.Tensor | None) -> bool:
    """Whether this step's summed loss (and global gradient norm, when given) are finite on every rank."""
    values = loss.detach().float().reshape(1)
    if grad_norm is not None:
        values = torch.cat([values, grad_norm.detach().float().reshape(1).to(values.device)])
    ok = torch.isfinite(values).all().to(torch.int32)
    if dist.is_initialized():  # the ranks must agree: all skip the step, or none
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x] if x.is_floating_point() else []
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in _tensors(item)]
    return []


def _finite(x: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in _tensors(x))


def _short(name: str) -> str:
    # Activation checkpointing wraps each block; the wrapper's inner name is not part of the model's names.
    return name.replace("._checkpoint_wrapped_module", "").replace("_checkpoint_wrapped_module.", "")


def locate_nonfinite(model: nn.Module, replay: Callable[[], list[torch.Tensor]]) -> str:
    """Where the first non-finite value of a step arises, as one phrase for the log.

    replay: runs the step's forward and backward passes again (with gradients
    accumulating into the model's .grad) and returns the losses; the caller
    zeroes the gradients afterwards.
    """
    forward: list[str] = []
    backward: list[str] = []

    def on_forward(name: str) -> Callable:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if not forward and not _finite(output) and _finite(inputs):
                forward.append(name)
        return hook

    def on_backward(name: str) -> Callable:
        def hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
            if not backward and not _finite(grad_input) and _finite(grad_output):
                backward.append(name)
        return hook

    handles = []
    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_hook(on_forward(_short(name))))
            handles.append(module.register_full_backward_hook(on_backward(_short(name))))
    try:
        with warnings.catch_warnings():  # the embedding's input is token ids: no gradient to hook there
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            losses = replay()
    finally:
        for h in handles:
            h.remove()
    if forward:
        return f"forward: first non-finite output in {forward[0]}"
    if not all(bool(torch.isfinite(t).all()) for t in losses):
        return "the loss: every layer's output is finite, the loss of it is not"
    if backward:
        return f"backward: first non-finite gradient from {backward[0]}"
    bad = [_short(n) for n, p in model.named_parameters() if p.grad is not None and not _finite(p.grad)]
    if bad:
        return f"backward: non-finite gradient of {bad[0]}" + (f" and {len(bad) - 1} more" if len(bad) > 1 else "")
    return "not reproduced when the step ran again (a transient fault, or randomness such as dropout)"


def weights_are_finite(model: nn.Module) -> bool:
    """Whether every parameter is finite on every rank (each rank checks what it holds: its shard under FSDP)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    flag = torch.stack([torch.isfinite(t).all() for t in local]).all().to(torch.int32)  # one host sync, below
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
