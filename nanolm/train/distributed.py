"""Data-parallel set-up from torchrun's environment: process group, device, DDP wrapping.

Launched by `torchrun --nproc_per_node N -m nanolm train ...`, every process
reads RANK / LOCAL_RANK / WORLD_SIZE, joins one process group (NCCL on GPUs,
gloo on CPUs) and trains on its own slice of the global data stream. Without
torchrun's variables nothing is initialised and training runs as one process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

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
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", device_id=(
            device if device.type == "cuda" else None))
    return DistInfo(rank, local_rank, world, device)


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


def wrap(model: nn.Module, info: DistInfo) -> nn.Module:
    """DDP around the model when several processes train; the model itself otherwise."""
    if not info.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP
    return DDP(model, device_ids=[info.device.index] if info.device.type == "cuda" else None)


def mean_across_ranks(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The mean of a tensor over all processes (a no-op for one process)."""
    if info.enabled:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= info.world_size
    return t


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()
