"""Will a run fit? What a training run needs in memory, estimated from its config before anything is built,
against what the device has free: a run that cannot fit stops at start-up with the figures and the fix,
not minutes later in the kernel's out-of-memory killer.

The estimate is a lower bound: the parts known exactly from the config (the weights as loaded and as kept,
gradients and optimizer states of what trains, and the models the stage keeps beside them: the references,
distillation teacher, rollout engine and critic of its `copies` in nanolm/train/stages.py) plus the activations
one micro-batch must save for backward in any implementation (each block's inputs, q/k/v, the attention output
and the MLP's hidden products; nanolm saves more). Allocator slack, the loader, the kernels' workspaces and the
interpreter come on top, so a run refused here would certainly not have fit; one let through may still be tight
(the start-up line says how much is left).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanolm.errors import UserError
from nanolm.model import lora
from nanolm.train import stages

GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes, per process."""

    loaded: int  # every weight as a checkpoint is loaded (float32): the peak while the model is built
    kept: int  # the weights as trained (a LoRA run keeps its frozen base in bf16 under bf16 training)
    states: int  # gradients and optimizer states of the trained parameters
    copies: int  # frozen references, a distillation teacher, the rollout engine's copy, a critic with its states
    activations: int  # a lower bound on what one micro-batch saves for backward
    processes: int  # processes of this run sharing the device's memory (torchrun ranks on one CPU)

    @property
    def per_process(self) -> int:
        return max(self.loaded, self.kept + self.states + self.copies + self.activations)

    @property
    def total(self) -> int:
        return self.processes * self.per_process

    def describe(self) -> str:
        parts = [f"weights {self.kept / GIB:.2f}", f"gradients + optimizer {self.states / GIB:.2f}"]
        if self.copies:
            parts.append(f"reference/teacher/rollout copies {self.copies / GIB:.2f}")
        parts.append(f"activations >= {self.activations / GIB:.2f}")
        each = f" x {self.processes} processes" if self.processes > 1 else ""
        return f"at least {self.total / GIB:.2f} GiB ({', '.join(parts)} GiB{each})"


def _param_counts(cfg) -> tuple[int, int, int, int]:
    """(all parameters, trained ones, the frozen base's matrices a LoRA run may keep in bf16, trained matrices)
    of the run's model, counted on the meta device (nothing is allocated)."""
    from nanolm.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg.model)
        if cfg.uses_lora:
            lora.apply_lora(model, cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.targets)
            lora.mark_only_lora_as_trainable(model)
    params = {id(p): p for p in model.parameters()}.values()  # a tied tensor once
    total = sum(p.numel() for p in params)
    trained = sum(p.numel() for p in params if p.requires_grad)
    castable = lora.cast_base(model, torch.bfloat16) if cfg.uses_lora else 0
    trained_matrices = sum(p.numel() for p in params if p.requires_grad and p.dim() >= 2)
    return total, trained, castable, trained_matrices


def _activation_floor(cfg, compute_bytes: int) -> int:
    """A lower bound on the activations one micro-batch saves for backward (see the module doc)."""
    m, tc = cfg.model, cfg.train
    tokens = stages.get(tc.stage).activation_tokens(cfg)  # 0 for rollouts, whose lengths the config does not fix
    hidden = m.n_hidden if not m.use_moe else m.top_k * (m.moe_n_hidden or m.n_hidden)
    kv = 2 * m.n_kv_head * m.head_dim
    per_token_layer = 4 * m.d_model + m.n_head * m.head_dim + kv + 3 * hidden  # inputs, q/k/v, attention, MLP
    if tc.activation_checkpointing:  # each block's input kept, one block's saved at a time
        return tokens * (m.n_layer * m.d_model * 4 + per_token_layer * compute_bytes)
    return tokens * m.n_layer * per_token_layer * compute_bytes


def estimate(cfg, device: torch.device, dtype: torch.dtype, world_size: int = 1) -> MemoryEstimate:
    """The run's lower-bound memory per process (module doc). dtype: the compute dtype (autocast)."""
    tc = cfg.train
    total, trained, castable, trained_matrices = _param_counts(cfg)
    loaded = 4 * total
    base_bf16 = cfg.uses_lora and lora.base_dtype(cfg.lora.base_dtype, dtype)[0] == torch.bfloat16
    kept = loaded - (2 * castable if base_bf16 else 0)
    # a gradient per trained parameter; AdamW keeps two moments, Muon one momentum per matrix (AdamW the rest)
    moments = 2 * trained - (trained_matrices if cfg.optim.name == "muon" else 0)
    states = 4 * (trained + moments)
    shards = world_size if tc.parallel == "fsdp" and world_size > 1 else 1
    kept, states = kept // shards, states // shards
    copies = stages.get(tc.stage).copies(cfg, device, total)
    compute_bytes = 2 if dtype in (torch.bfloat16, torch.float16) else 4
    processes = world_size if device.type == "cpu" else 1  # torchrun's CPU ranks share one machine's memory
    return MemoryEstimate(loaded, kept, states, copies, _activation_floor(cfg, compute_bytes), processes)


def available(device: torch.device) -> int | None:
    """Bytes free for this run on `device`: a GPU's free memory; on a CPU the smaller of the kernel's
    MemAvailable and what the cgroup's limit leaves; None where neither can be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    free = []
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="utf-8") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current", encoding="utf-8") as f:
                free.append(int(limit) - int(f.read().strip()))
    except (OSError, ValueError):
        pass
    return min(free) if free else None


def check_fit(cfg, device: torch.device, dtype: torch.dtype, world_size: int = 1,
              free: int | None = None) -> str:
    """The start-up line about memory; raises UserError when the run cannot fit. free: bytes, for tests."""
    est = estimate(cfg, device, dtype, world_size)
    free = available(device) if free is None else free
    if free is None:
        return f"memory: needs {est.describe()}; this device's free memory is unknown"
    if est.total > free:
        tc, fixes = cfg.train, []
        if est.activations > est.total // 4:
            fixes.append(f"a smaller micro-batch (--train.batch_size {max(1, tc.batch_size // 2)} --train.grad_accum "
                         f"{2 * tc.grad_accum} keeps the step's batch)")
            if not tc.activation_checkpointing:
                fixes.append("--train.activation_checkpointing true")
        if not cfg.uses_lora and stages.get(tc.stage).fine_tunes:
            fixes.append("LoRA adapters instead of every weight (--stage lora, or --lora.enabled)")
        if cfg.uses_lora and lora.base_dtype(cfg.lora.base_dtype, dtype)[0] != torch.bfloat16:
            fixes.append("--lora.base_dtype bfloat16 (half the frozen base)")
        fixes.append("a smaller model")
        raise UserError(f"this run will not fit in memory: it needs {est.describe()}, and {free / GIB:.2f} GiB is "
                        f"free on {device}; try " + ", or ".join(fixes))
    return f"memory: needs {est.describe()} of {free / GIB:.2f} GiB free"
