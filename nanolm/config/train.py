"""The training loop's settings (`TrainConfig`) and a run's whole configuration (`Config`), saved as
config.json in the run directory."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from nanolm.config.registry import default_name as default_stage, find as find_stage, get as get_stage, \
    sections as stage_sections
from nanolm.config.data import DataConfig, format_data_set
from nanolm.config.fields import build_config, check as _check, field_type, shown
from nanolm.config.model import ModelConfig
from nanolm.config.optim import OptimConfig
from nanolm.errors import UserError


DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda", "mps")
TRACKERS = ("tensorboard", "wandb", "swanlab")
WANDB_MODES = ("offline", "online")
SWANLAB_MODES = ("local", "offline", "online")
TASK_METRICS = ("acc", "acc_norm", "acc_mutual_info", "centred")
PARALLEL = ("ddp", "fsdp")
SDPA_BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")


def _joined_task_specs(items: tuple[str, ...]) -> tuple[str, ...]:
    """Task specs as given; on the command line the list is comma-separated, so a `key=value` item after a
    spec is one more option of that spec (`idioms:n=64,chat=true,arc.jsonl` is two specs)."""
    out: list[str] = []
    for item in items:
        if out and re.fullmatch(r"[a-z_]+=[^:/]*", item):
            out[-1] += "," + item
        else:
            out.append(item)
    return tuple(out)


@dataclass
class TrainConfig:
    """The training loop: batch shape, budget, evaluation, checkpoints, precision."""

    stage: str = field(default_factory=default_stage)  # a registered stage (nanolm/train/stages.py)
    out_dir: str = "runs/nanolm"
    batch_size: int = 8  # sequences per micro-batch (per process)
    seq_len: int = 512
    grad_accum: int = 1  # micro-batches per optimizer step
    # Optimizer steps; the schedule decays over these. 0 = fitted to the budget: ceil(max_tokens / tokens per step),
    # or what max_minutes holds at the step rate timed in the first steps (recorded in state.json for --resume).
    # A budget given on the command line or in a file without max_steps means 0.
    max_steps: int = 1000
    max_tokens: int = 0  # stop after this many training tokens (0 = no token budget)
    max_minutes: float = 0.0  # stop after this much wall-clock time (0 = no time budget)
    eval_interval: int = 100  # steps between validation passes (0 = only at the end)
    eval_batches: int = 20  # micro-batches per validation pass
    log_interval: int = 10
    save_interval: int = 100  # steps between `last` checkpoints (0 = only at the end)
    keep_last: int = 2  # step checkpoints to keep (the best one is always kept)
    dtype: str = "auto"  # auto: bfloat16 autocast on CUDA with bf16 support, else float32
    device: str = "auto"
    compile: bool = False  # torch.compile the model: faster steps after a compile at start (15-30 s at 26M here)
    activation_checkpointing: bool = False  # recompute each block in backward: less memory, one more forward
    # attention kernel: auto (on a CPU nanolm's blocked causal attention where it applies, else PyTorch picks),
    # or one of PyTorch's: flash, efficient, cudnn (CUDA), math
    sdpa_backend: str = "auto"
    parallel: str = "ddp"  # with torchrun: ddp (a full copy per process) or fsdp (FSDP2: all state sharded)
    seed: int = 1337
    max_nonfinite_steps: int = 3  # steps with a NaN/inf loss or gradient are skipped; this many in a row stop the run
    init_from: str = ""  # a checkpoint to start from (weights only)
    track: tuple[str, ...] = ()  # extra metric sinks beside metrics.jsonl: tensorboard, wandb, swanlab
    wandb_project: str = "nanolm"
    wandb_mode: str = "offline"  # offline: logs under <run>/wandb, upload later with `wandb sync`
    swanlab_project: str = "nanolm"
    swanlab_mode: str = "local"  # local/offline: files under <run>/swanlog (`swanlab watch`); online: uploads
    # Benchmarks scored at each validation (`nanolm eval --task` specs: idioms, a task file, `:n=...`), each on
    # its first eval_task_items items unless its spec gives n; logged as task/<name>/acc, acc_norm,
    # acc_mutual_info, centred.
    eval_tasks: tuple[str, ...] = ()
    eval_task_items: int = 100
    degeneration_samples: int = 0  # sampled continuations of val-split prompts per validation (0 = none)
    best_metric: str = "val_loss"  # what picks the best checkpoint: val_loss (lowest), or task/<name>/<metric>

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len", "grad_accum", "eval_batches", "log_interval", "keep_last",
                     "max_nonfinite_steps"):
            _check(getattr(self, name) > 0, f"train.{name} must be a positive integer, got {getattr(self, name)}")
        for name in ("max_tokens", "eval_interval", "save_interval"):
            _check(getattr(self, name) >= 0, f"train.{name} must be >= 0, got {getattr(self, name)}")
        _check(self.max_minutes >= 0, f"train.max_minutes must be >= 0, got {self.max_minutes}")
        _check(self.max_steps >= 0, f"train.max_steps must be >= 0 (0 = fitted to the budget), got {self.max_steps}")
        _check(self.max_steps > 0 or bool(self.max_tokens or self.max_minutes),
               "train.max_steps 0 fits the schedule to a budget; give --train.max_minutes or --train.max_tokens, "
               "or a max_steps > 0")
        # torch.manual_seed takes at most 64 bits and numpy's generators no negative seed.
        _check(0 <= self.seed < 2**63, f"train.seed must be in [0, 2**63), got {self.seed}")
        _check(self.dtype in DTYPES, f"train.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _check(self.device in DEVICES, f"train.device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        _check(self.parallel in PARALLEL, f"train.parallel must be one of {', '.join(PARALLEL)}, got {self.parallel!r}")
        _check(self.sdpa_backend in SDPA_BACKENDS,
               f"train.sdpa_backend must be one of {', '.join(SDPA_BACKENDS)}, got {self.sdpa_backend!r}")
        self.track = tuple(dict.fromkeys(self.track))  # a list from code or a file; repeats dropped
        for name in self.track:
            _check(name in TRACKERS, f"train.track: unknown tracker {name!r}; choose from {', '.join(TRACKERS)}")
        _check(self.wandb_mode in WANDB_MODES,
               f"train.wandb_mode must be one of {', '.join(WANDB_MODES)}, got {self.wandb_mode!r}")
        _check(bool(self.wandb_project.strip()), "train.wandb_project must not be empty")
        _check(self.swanlab_mode in SWANLAB_MODES,
               f"train.swanlab_mode must be one of {', '.join(SWANLAB_MODES)}, got {self.swanlab_mode!r}")
        _check(bool(self.swanlab_project.strip()), "train.swanlab_project must not be empty")
        self.eval_tasks = _joined_task_specs(tuple(self.eval_tasks))
        _check(self.eval_task_items > 0, f"train.eval_task_items must be a positive integer, got {self.eval_task_items}")
        _check(self.degeneration_samples >= 0,
               f"train.degeneration_samples must be >= 0, got {self.degeneration_samples}")
        m = re.fullmatch(r"task/(.+)/([a-z_]+)", self.best_metric)
        _check(self.best_metric == "val_loss" or (m is not None and m.group(2) in TASK_METRICS),
               f"train.best_metric must be val_loss or task/<name>/<{'|'.join(TASK_METRICS)}> of a task in "
               f"train.eval_tasks, got {self.best_metric!r}")
        _check(m is None or bool(self.eval_tasks),
               f"train.best_metric={self.best_metric} needs that task in train.eval_tasks (e.g. --train.eval_tasks "
               f"{m.group(1) if m else ''})")


def _stage_sections() -> dict[str, Any]:
    return {name: section() for name, section in stage_sections().items()}


@dataclass
class Config:
    """Everything a training run needs; saved as config.json in the run directory.

    Beside the loop's own sections (model, data, optim, train), each stage with settings of its own (LoRA's
    adapters, DPO, distillation, GRPO, PPO, or a stage registered from outside) brings a section: a dataclass
    its stage registers (nanolm/config/registry.py), built, validated, saved and printed under the stage's name,
    and read as `cfg.<name>` (`cfg.grpo.group_size`).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sections: dict[str, Any] = field(default_factory=_stage_sections)  # the stages' own, by stage name


    def __post_init__(self) -> None:
        # How the config was chosen where the user did not say (load_config's budget preset): an attribute of this
        # instance, not a field, so it is not saved with the run.
        self.note: str = ""
        _check(self.train.seq_len <= self.model.max_seq_len,
               f"train.seq_len ({self.train.seq_len}) must not exceed model.max_seq_len ({self.model.max_seq_len})")
        own = stage_sections()
        for name, section in self.sections.items():
            if not isinstance(section, own.get(name, ())):
                raise TypeError(f"Config.sections[{name!r}]: not the settings of a registered stage's section")
        self.sections = {name: self.sections.get(name) or section() for name, section in own.items()}

    def __getattr__(self, name: str) -> Any:  # a stage's section: cfg.grpo
        sections = self.__dict__.get("sections")
        if sections is not None and name in sections:
            return sections[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def section_types(cls) -> dict[str, type]:
        """Each section's name and dataclass: the loop's own, then the registered stages' (in their order)."""
        own = {f.name: field_type(cls, f) for f in fields(cls) if f.name != "sections"}
        return {**own, **stage_sections()}

    @property
    def uses_lora(self) -> bool:
        stage = find_stage(self.train.stage)
        return (stage is not None and stage.adapters) or self.lora.enabled

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        sections = d.pop("sections")
        return {**d, "model": self.model.to_dict(), **sections}

    def summary(self) -> list[str]:
        """One line per section, `section: field=value ...`, for the start-of-run print."""
        def fmt(v: Any) -> str:
            if isinstance(v, (tuple, list)):  # names, or data sets (as --data spells them)
                return " ".join(map(format_data_set, v)) if v and isinstance(v[0], dict) else ",".join(v)
            return repr(v) if v == "" else str(v)
        def shows(name: str) -> bool:  # a stage's section only where its stage says it applies
            return name not in self.sections or get_stage(name).shows_section(self)
        return [f"{name}: " + " ".join(f"{k}={fmt(v)}" for k, v in section.items())
                for name, section in self.to_dict().items() if shows(name)]

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "Config":
        if not isinstance(d, dict):
            return build_config(cls, d, source, prefix="")  # its one-line error
        known, own = cls.section_types(), stage_sections()
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise UserError(f"{source}: unknown field {shown(unknown[0])}; known fields: {', '.join(known)}")
        sections = {name: build_config(section, d[name], source, prefix=f"{name}.")
                    for name, section in own.items() if name in d}
        return build_config(cls, {**{k: v for k, v in d.items() if k not in own}, "sections": sections}, source,
                            prefix="")
