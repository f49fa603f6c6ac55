"""Training telemetry: console lines, metrics.jsonl, throughput and MFU.

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
from typing import Any

import torch

# Dense tensor-core peaks (FLOP/s) for bf16/fp16; fp32 uses TF32 where the GPU has it.
_GPU_PEAKS = {
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "A10G": 125e12, "L40S": 362e12, "L4": 121e12,
    "4090": 165e12, "3090": 71e12, "V100": 125e12, "T4": 65e12,
}


@lru_cache(maxsize=None)
def measured_matmul_flops(device_type: str, dtype: torch.dtype, n: int = 1024, seconds: float = 0.5) -> float:
    """FLOP/s of an n x n x n matrix multiply on this device, best of repeated timings."""
    device = torch.device(device_type)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
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


class MetricsWriter:
    """Appends one JSON object per event to <run>/metrics.jsonl; only rank 0 writes."""

    def __init__(self, run_dir: Path, enabled: bool = True) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self._f = None

    def truncate_after(self, step: int) -> None:
        """On resume: drop records of steps that will be trained again."""
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

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def log(msg: str, enabled: bool = True) -> None:
    if enabled:
        print(msg, file=sys.stdout, flush=True)
