"""Training telemetry: console lines, metrics.jsonl, TensorBoard, W&B and SwanLab, throughput and MFU.

Every run writes metrics.jsonl (read back through `nanolm.metrics_log`); `train.track` adds trackers that receive
the same records: TensorBoard (event files in <run>/tensorboard, one scalar
per key at global_step = step), Weights & Biases (a run whose files go to
<run>/wandb, offline by default; its id is kept in <run>/wandb_run.json so
that `--resume` continues the same W&B run) and SwanLab (a run in
<run>/swanlog, local by default). Benchmark scores of train.eval_tasks come
in the validation records as `task/<name>/acc` and the like. Lists such as the MoE
expert_load become one scalar per entry; strings are not sent.

MFU (model FLOPs utilisation) is achieved model FLOPs per second over the
device's peak. For known CUDA GPUs the peak is the datasheet's dense figure;
elsewhere (CPUs, unknown GPUs) it is measured once with a large matrix
multiply, so MFU on a CPU reads as "fraction of what this machine's matmul
reaches", which is the ceiling a training step can hope for.
"""

from __future__ import annotations

import json
import math
import sys
import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch

from nanolm.config import Config
from nanolm.errors import UserError
from nanolm.io import write_json_atomic

# Dense tensor-core peaks (FLOP/s) for bf16/fp16; fp32 uses TF32 where the GPU has it.
_GPU_PEAKS = {
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "A10G": 125e12, "L40S": 362e12, "L4": 121e12,
    "4090": 165e12, "3090": 71e12, "V100": 125e12, "T4": 65e12,
}


@lru_cache(maxsize=None)
def measured_matmul_flops(device_type: str, dtype: torch.dtype, n: int = 1024, seconds: float = 0.5) -> float:
    """FLOP/s of an n x n x n matrix multiply on this device, best of repeated timings."""
    device = torch.device(device_type)
    # Its own generator: drawing from the global one would shift a run's dropout masks after a resume.
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        a @ b
    sync()
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        a @ b
        sync()
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s, where the figure comes from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in _GPU_PEAKS.items():
            if key in name:
                return peak, f"{name} datasheet"
    return measured_matmul_flops(device.type, dtype), f"measured {device.type} {str(dtype).removeprefix('torch.')} matmul"


# What each nesting level of a list-valued metric counts, for the scalar names it becomes.
_INDEX_NAMES = {"expert_load": ("moe_layer", "expert")}


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics record, by name, as trackers take them.

    `step` is the x-axis, not a value; event records (the stop marker) give
    nothing; nested lists are flattened: expert_load[i][j] becomes
    `expert_load/moe_layer_i/expert_j`. Non-finite values pass through, so a
    diverged loss shows.
    """
    if "event" in record:
        return {}
    out: dict[str, float] = {}

    def add(name: str, value: Any, depth: int, levels: tuple[str, ...]) -> None:
        if isinstance(value, bool) or value is None or isinstance(value, str):
            return
        if isinstance(value, (int, float)):
            out[name] = float(value)
        elif isinstance(value, (list, tuple)):
            level = levels[depth] if depth < len(levels) else "i"
            for i, v in enumerate(value):
                add(f"{name}/{level}_{i}", v, depth + 1, levels)

    for key, value in record.items():
        if key != "step":
            add(key, value, 0, _INDEX_NAMES.get(key, ()))
    return out


class Tracker(Protocol):
    """A metrics sink beside metrics.jsonl. `start` is called once, before the first record."""

    def describe(self) -> str: ...

    def start(self, resume_step: int | None) -> None: ...

    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Scalars into <run>/tensorboard, one tag per metric, at global_step = the record's step."""

    def __init__(self, run_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError("train.track includes tensorboard, which is not installed; "
                            "pip install 'nanolm[track]' (or drop it from --train.track)") from None
        self._writer_cls = SummaryWriter
        self.log_dir = Path(run_dir) / "tensorboard"
        self._writer: Any = None

    def describe(self) -> str:
        return f"tensorboard -> {self.log_dir} (view: tensorboard --logdir {self.log_dir})"

    def start(self, resume_step: int | None) -> None:
        # On resume, the steps after the checkpoint are trained again: purge_step hides their old
        # events from TensorBoard, as truncate_after drops their old lines from metrics.jsonl.
        purge = None if resume_step is None else resume_step + 1
        self._writer = self._writer_cls(log_dir=str(self.log_dir), purge_step=purge)

    def log(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        for name, value in scalars(record).items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()  # a record every log_interval steps: cheap, and nothing is lost to a crash

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbTracker:
    """A Weights & Biases run with files in <run>/wandb; `--resume` continues the run whose id is stored.

    Metrics are plotted against our `step` (define_metric), not W&B's own
    call counter, so the steps trained again after a resume are kept rather
    than dropped as out of order.
    """

    ID_FILE = "wandb_run.json"

    def __init__(self, run_dir: Path, project: str, mode: str, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise UserError("train.track includes wandb, which is not installed; "
                            "pip install 'nanolm[wandb]' (or drop it from --train.track)") from None
        self._wandb = wandb
        self.run_dir = Path(run_dir)
        self.project = project
        self.mode = mode
        self.config = config
        self._run: Any = None

    def describe(self) -> str:
        sync = "; upload later with `wandb sync`" if self.mode == "offline" else ""
        return f"wandb ({self.mode}) -> project {self.project}, files in {self.run_dir / 'wandb'}{sync}"

    def _stored_id(self) -> str | None:
        try:
            return str(json.loads((self.run_dir / self.ID_FILE).read_text(encoding="utf-8"))["id"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def start(self, resume_step: int | None) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        kwargs: dict[str, Any] = {"project": self.project, "dir": str(self.run_dir), "mode": self.mode,
                                  "config": self.config, "name": self.run_dir.resolve().name}
        run_id = self._stored_id() if resume_step is not None else None
        if run_id is not None:
            kwargs.update(id=run_id, resume="allow")
        self._run = self._wandb.init(**kwargs)
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")
        write_json_atomic(self.run_dir / self.ID_FILE, {"id": self._run.id, "project": self.project,
                                                         "mode": self.mode})

    def log(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        if values:
            self._run.log({"step": int(record.get("step", 0)), **values})

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


class SwanLabTracker:
    """A SwanLab run (MiniMind's default tracker, reachable where W&B is not) with files in <run>/swanlog.

    mode local / offline write the run there and nothing leaves the machine (view it with `swanlab watch
    <run>/swanlog`; an offline run can be uploaded later with `swanlab sync`); online uploads as it goes
    (after `swanlab login`).
    Metrics are logged at our `step`. On `--resume`, the steps after the checkpoint are logged again.
    """

    def __init__(self, run_dir: Path, project: str, mode: str, config: dict[str, Any]) -> None:
        try:
            import swanlab
        except ImportError:
            raise UserError("train.track includes swanlab, which is not installed; "
                            "pip install 'nanolm[swanlab]' (or drop it from --train.track)") from None
        self._swanlab = swanlab
        self.run_dir = Path(run_dir)
        self.log_dir = self.run_dir / "swanlog"
        self.project = project
        self.mode = mode
        self.config = config
        self._run: Any = None

    def describe(self) -> str:
        return f"swanlab ({self.mode}) -> project {self.project}, files in {self.log_dir} (view: swanlab watch " \
               f"{self.log_dir})"

    def start(self, resume_step: int | None) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._run = self._swanlab.init(project=self.project, name=self.run_dir.resolve().name, config=self.config,
                                       log_dir=str(self.log_dir), mode=self.mode, reinit=True)

    def log(self, record: dict[str, Any]) -> None:
        values = {k: v for k, v in scalars(record).items() if math.isfinite(v)}
        if values:
            self._run.log(values, step=int(record.get("step", 0)))

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def make_trackers(cfg: Config, run_dir: Path) -> list[Tracker]:
    """The trackers `train.track` asks for; a UserError naming the extra to install when one is missing."""
    trackers: list[Tracker] = []
    for name in cfg.train.track:
        if name == "tensorboard":
            trackers.append(TensorBoardTracker(run_dir))
        elif name == "wandb":
            trackers.append(WandbTracker(run_dir, cfg.train.wandb_project, cfg.train.wandb_mode, cfg.to_dict()))
        elif name == "swanlab":
            trackers.append(SwanLabTracker(run_dir, cfg.train.swanlab_project, cfg.train.swanlab_mode,
                                           cfg.to_dict()))
    return trackers


class MetricsWriter:
    """Appends one JSON object per event to <run>/metrics.jsonl and hands it to the trackers; only rank 0 writes.

    Trackers start with the first record, knowing whether the run resumed
    (`truncate_after` was called), and stop at `close`.
    """

    def __init__(self, run_dir: Path, enabled: bool = True, trackers: Sequence[Tracker] = ()) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self.trackers: list[Tracker] = list(trackers) if enabled else []
        self._f = None
        self._resume_step: int | None = None
        self._started = False

    def truncate_after(self, step: int) -> None:
        """On resume: drop records of steps that will be trained again."""
        self._resume_step = step
        if not self.enabled or not self.path.exists():
            return
        keep = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
        tmp.replace(self.path)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._f is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a", encoding="utf-8")
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._f.write(json.dumps(clean) + "\n")
        self._f.flush()
        if not self._started:
            self._started = True
            for tracker in self.trackers:
                tracker.start(self._resume_step)
        for tracker in self.trackers:
            tracker.log(record)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        if self._started:
            for tracker in self.trackers:
                tracker.close()
        self.trackers, self._started = [], False


def log(msg: str, enabled: bool = True) -> None:
    if enabled:
        print(msg, file=sys.stdout, flush=True)
