"""How the model is laid out over processes: torchrun's process group, DDP or FSDP2, activation checkpointing.

Launched by `torchrun --nproc_per_node N -m nanolm train ...`, every process
reads RANK / LOCAL_RANK / WORLD_SIZE, joins one process group (NCCL on GPUs,
gloo on CPUs) and trains on its own slice of the global data stream. Without
torchrun's variables nothing is initialised and training runs as one process.

`parallelize` applies everything that wraps the model from outside, in the
order the wrappers need: activation checkpointing of each block, then DDP
(every process holds all weights; gradients are all-reduced) or FSDP2
(`fully_shard` per block and at the root: weights, gradients and optimizer
state are split over the processes and gathered one block at a time).

Checkpoints are always full and unsharded whatever the layout, so a run saved
with N processes loads in one process, in generation and export, or resumes
with M processes: `full_model_state` and `full_optimizer_state` gather them
(every rank must call them; rank 0 gets the tensors), and the optimizer state
is keyed by parameter names, not by position, so it fits any layout.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, overload

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from nanolm.errors import UserError
from nanolm.runtime import resolve_device


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def setup(device_name: str) -> DistInfo:
    """Join torchrun's process group if launched by torchrun; pick this process's device."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return DistInfo(0, 0, 1, resolve_device(device_name))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    device = resolve_device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # The group's keys go under this attempt's prefix: workers that torchrun restarted (--max-restarts) can
        # meet in a store that still holds the dead attempt's addresses, and would dial those (seen with gloo).
        store, _, _ = next(dist.rendezvous("env://", rank, world))
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", device_id=(
            device if device.type == "cuda" else None), store=dist.PrefixStore(f"attempt-{restart_count()}", store),
            rank=rank, world_size=world)
    return DistInfo(rank, local_rank, world, device)


def restart_count() -> int:
    """How many times torchrun has restarted this job's workers (`--max-restarts`; 0 on the first attempt and
    outside torchrun)."""
    try:
        return max(0, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    except ValueError:
        return 0


def teardown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


def per_rank_accum(grad_accum: int, info: DistInfo) -> int:
    """Micro-batches per optimizer step on each rank, so the global batch is what the config says."""
    if grad_accum % info.world_size:
        raise UserError(f"train.grad_accum ({grad_accum}) must be a multiple of the number of processes "
                        f"({info.world_size}), so that every step sees the configured global batch; "
                        f"set --train.grad_accum {max(1, grad_accum // info.world_size) * info.world_size}")
    return grad_accum // info.world_size


def parallelize(model: nn.Module, info: DistInfo, *, parallel: str = "ddp",
                activation_checkpointing: bool = False) -> nn.Module:
    """Wrap `model` (already on its device, weights loaded) for training; returns the module to call.

    FSDP2 changes `model` in place (its parameters become sharded DTensors), so
    build the optimizer from `model` after this. DDP returns a wrapper around
    `model`, whose own parameters stay the ones the optimizer updates.
    """
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
        blocks = tuple(type(b) for b in model.layers)
        # Each block keeps only its input for backward and runs its forward again there.
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, blocks))
    if not info.enabled:
        return model
    if parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(info.device.type, (info.world_size,))
        for block in model.layers:  # a block's weights are gathered just before it runs, freed after
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)  # the rest: embedding (tied to the LM head), final norm
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP
    return DDP(model, device_ids=[info.device.index] if info.device.type == "cuda" else None)


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


@contextmanager
def grad_sync(train_model: nn.Module, sync: bool) -> Iterator[None]:
    """Gradient accumulation: reduce gradients over the ranks only in the backward of the last micro-batch."""
    if sync or not dist.is_initialized():
        yield
    elif is_sharded(train_model):
        train_model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            train_model.set_requires_gradient_sync(True)
    else:
        with train_model.no_sync():
            yield


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a (replicated) DTensor, such as the gradient norm of sharded parameters."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _aliases(model: nn.Module) -> set[str]:
    """Names of parameters that are another name's tensor (the LM head tied to the embedding)."""
    seen: set[int] = set()
    out = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            out.add(name)
        seen.add(id(p))
    return out


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights of an FSDP model on the CPU, tied tensors once (safetensors refuses shared storage).

    A collective: every rank calls it; only rank 0 gets the tensors, the others {}. (An unsharded model's
    weights are `checkpoint.model_state(model)`.)
    """
    aliases = _aliases(model)
    return {k: v.contiguous() for k, v in get_model_state_dict(model, options=_FULL).items() if k not in aliases}


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state keyed by parameter name, unsharded, on the CPU (a collective under FSDP)."""
    return get_optimizer_state_dict(model, optimizer, options=_FULL)


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a `full_optimizer_state` into this layout (every rank passes the same full state)."""
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


@overload
def sum_across_ranks(value: int, info: DistInfo) -> int: ...
@overload
def sum_across_ranks(value: torch.Tensor, info: DistInfo) -> torch.Tensor: ...
def sum_across_ranks(value: int | torch.Tensor, info: DistInfo) -> int | torch.Tensor:
    """The sum of a count or a tensor over all processes (the value itself for one process)."""
    if not info.enabled:
        return value
    if isinstance(value, int):
        return int(sum_across_ranks(torch.tensor(value, device=info.device), info).item())
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def average_gradients(params: list[nn.Parameter], info: DistInfo) -> None:
    """Average the gradients of parameters outside the DDP-wrapped model (a module trained beside it, such as
    PPO's critic) over the ranks, as DDP averages the model's: one all-reduce of them all, flattened."""
    if not info.enabled or not params:
        return
    for p in params:  # every rank reduces the same tensors
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= info.world_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()
