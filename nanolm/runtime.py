"""Device, precision and seeding choices shared by training and inference.

`auto` means: CUDA when present (bf16 autocast where the GPU supports it,
else fp16 with a gradient scaler), Apple MPS next, else the CPU in float32;
for training (`train_dtype`) a CPU with native bf16 matrix instructions
(AVX512-BF16 or AMX-BF16 in /proc/cpuinfo's flags) trains in bf16 autocast
when the model is wide enough for bf16 matmuls to pay for their casts, and
decoding (`decode_dtype`) holds bf16 weights where one row through a decode
step's products at the model's own widths times faster so, on CPUs without
native bf16 too (for wider models there).
"""

from __future__ import annotations

import contextlib
import functools
import random
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from nanolm.errors import UserError

if TYPE_CHECKING:
    from nanolm.config.model import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device=cuda but no CUDA GPU is visible; use --train.device cpu or auto")
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise UserError("train.device=mps but Apple MPS is not available; use --train.device cpu or auto")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The compute dtype for autocast; float32 means no autocast."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    dtype = DTYPES[name]
    if dtype == torch.float16 and device.type == "cpu":
        raise UserError("train.dtype=float16 is for CUDA (it needs a gradient scaler); on CPU use bfloat16 or float32")
    return dtype


# CPU flags (as /proc/cpuinfo spells them) of native bf16 matrix instructions, the first found is named.
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# Below this width bf16 autocast trains no faster than float32 on a CPU even with native bf16: the casts of
# weights and activations cost what the smaller matmuls save. Measured on a 2-core AVX512-BF16 CPU, 4 layers,
# batch 8 x 256, 1 thread: d_model 64 1.0x, 128 1.2x, 256 1.6x the float32 tokens/s (bench/RESULTS.md, bf16 training on a CPU).
BF16_MIN_D_MODEL = 128


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none, as on macOS)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def native_bf16(flags: set[str] | None = None) -> str | None:
    """The first of CPU_BF16_FLAGS the CPU has (flags: the CPU's, for tests), or None."""
    flags = cpu_flags() if flags is None else flags
    return next((f for f in CPU_BF16_FLAGS if f in flags), None)


def train_dtype(name: str, device: torch.device, d_model: int,
                flags: set[str] | None = None) -> tuple[torch.dtype, str]:
    """The compute dtype for training and why it was chosen (for the start-up line). flags: the CPU's, for tests."""
    dtype = resolve_dtype(name, device)
    if name != "auto":
        return dtype, "as configured"
    if device.type != "cpu":
        return dtype, f"auto on {device.type}"
    native = native_bf16(flags)
    if native is None:
        return torch.float32, "auto: this CPU has no native bf16 (no avx512_bf16 or amx_bf16)"
    if d_model < BF16_MIN_D_MODEL:
        return torch.float32, (f"auto: this CPU has {native}, but at d_model {d_model} < {BF16_MIN_D_MODEL} bf16 "
                               "autocast is no faster than float32")
    return torch.bfloat16, f"auto: this CPU has {native} (native bf16 matmuls)"


# Decoding reads every weight once per token: bf16 weights halve that traffic, but below this width a token is
# mostly Python and small operations, which bf16 only slows. Measured at batch 1 on a 2-core AVX512-BF16 CPU
# (ms per token, float32 / bf16): width 128 1.53 / 2.06, 256 3.35 / 2.75, 384 6.3 / 5.5 (8 layers),
# 512 (minimind-26m) 12.2 / 8.0 (bench/throughput.py --parts generate).
BF16_DECODE_MIN_D_MODEL = 256
# Whether bf16 pays at that width is the CPU's one-row kernels', not its flags': on a 2-core Xeon with AMX a
# one-row product at width 512 takes 1.5-3x as long in bf16 as in float32 (minimind-26m 5.9 against 4.95 ms a
# token), and on a 2-core AVX2 EPYC without any native bf16 half as long (a pass over minimind-26m's matrices 3.5
# against 8.2 ms; its many-row products widen to float32, infer/fuse.py). So auto times what a decode step's
# products do (`decode_step_seconds`: one row through the model's own matrices, a layer's widths and the head's,
# distinct copies past the caches, the memory traffic of a token), in both dtypes, once per process (an earlier
# probe timed one row through (4 d_model, d_model) matrices holding the model's weights: on SmolLM2-135M, whose
# head alone is 28 M of its 134.5 M weights, it measured something other than its decode step), and takes bf16 only where it is at least
# BF16_DECODE_MARGIN times as fast: a close call stays float32. RL's rollouts, many rows, take the untimed rule
# (timer=None: bf16 on native bf16 only), so that every rank and a resumed run decode alike.
BF16_DECODE_MARGIN = 1.15
# Without native bf16 a bf16 token's small operations cost more (each converts), so bf16 pays from a wider model:
# measured on a 2-core AVX2 EPYC, ms a step in float32 / bf16 at 1 and at 16 rows: cpu-small (256 wide) 1.98 /
# 1.97 and 3.85 / 4.42, minimind-26m (512 wide) 12.0 / 7.1 and 20.7 / 21.8.
BF16_DECODE_MIN_D_MODEL_EMULATED = 512
# many_rows: a server decodes many rows at once, whose products widen bf16 weights to float32 without native
# bf16: measured serving minimind-26m on a 2-core AVX2 EPYC (1 decoding thread, bench/server_load.py --scaling
# 1,16, two runs of each), 16 requests kept in flight made 267-277 tokens/s with bf16 weights against 309-342 in
# float32, one alone 89-102 against 68-85. So the server keeps float32 on such CPUs; generate and chat take the
# timing.
# The most weights the timed layers hold: 32 M (128 MB in float32) is past a 2-core machine's caches, so the layers
# of a deeper model time as its own would (scaled to its depth).
TIMED_WEIGHTS = 32 * 2**20


@dataclass(frozen=True)
class DecodeShape:
    """The matrices (out, in) one decoded token multiplies one row by, at a model's own widths: a layer's, as the
    engine runs them (q/k/v stacked, o, gate/up stacked, down; a MoE layer's as its active experts' widths side
    by side, every layer counted so), `n_layer` such layers, and the head (vocabulary, width)."""

    layer: tuple[tuple[int, int], ...]
    n_layer: int
    head: tuple[int, int]

    @classmethod
    def of(cls, cfg: "ModelConfig") -> "DecodeShape":
        c, hs = cfg.d_model, cfg.head_dim
        hidden = cfg.moe_n_hidden * (cfg.top_k + cfg.n_shared_experts) if cfg.use_moe else cfg.n_hidden
        layer = (((cfg.n_head + 2 * cfg.n_kv_head) * hs, c), (c, cfg.n_head * hs), (2 * hidden, c), (c, hidden))
        return cls(layer, cfg.n_layer, (cfg.vocab_size, c))

    @property
    def layer_weights(self) -> int:
        return sum(o * i for o, i in self.layer)

    @property
    def weights(self) -> int:
        return self.layer_weights * self.n_layer + self.head[0] * self.head[1]

    @property
    def timed_layers(self) -> int:
        """How many distinct layers the timer multiplies by: as many as TIMED_WEIGHTS holds, 1 to n_layer."""
        return max(1, min(self.n_layer, TIMED_WEIGHTS // self.layer_weights))

    def describe(self) -> str:
        layer = ", ".join(f"{o}x{i}" for o, i in self.layer)
        timed = "" if self.timed_layers == self.n_layer else f", {self.timed_layers} timed and scaled"
        return (f"{self.n_layer} layers of {layer}{timed}, and the {self.head[0]}x{self.head[1]} head: "
                f"{self.weights / 1e6:.1f} M weights")


@functools.lru_cache(maxsize=None)
def decode_step_seconds(shape: DecodeShape, dtype: torch.dtype) -> float:
    """The median time on this CPU, in `dtype`, of one row through a decode step's products at `shape`'s widths:
    `shape.timed_layers` distinct layers' matrices, scaled to n_layer layers, and the head's; 7 rounds after a
    warm-up, measured once per process and shape."""
    g = torch.Generator().manual_seed(0)
    layers = [[torch.randn(o, i, generator=g).to(dtype) for o, i in shape.layer] for _ in range(shape.timed_layers)]
    head = torch.randn(*shape.head, generator=g).to(dtype)
    rows = {i: torch.randn(1, i, generator=g).to(dtype) for _, i in (*shape.layer, shape.head)}
    scale = shape.n_layer / shape.timed_layers

    def step() -> float:
        t0 = time.perf_counter()
        for ws in layers:
            for w in ws:
                torch.nn.functional.linear(rows[w.shape[1]], w)
        t1 = time.perf_counter()
        torch.nn.functional.linear(rows[head.shape[1]], head)
        return (t1 - t0) * scale + time.perf_counter() - t1

    with torch.inference_mode():
        for _ in range(2):
            step()
        return statistics.median(step() for _ in range(7))


def decode_dtype(name: str, device: torch.device, cfg: "ModelConfig", flags: set[str] | None = None, *,
                 timer: Callable[[DecodeShape, torch.dtype], float] | None = decode_step_seconds,
                 many_rows: bool = False) -> tuple[torch.dtype, str]:
    """The dtype an Engine holds its weights in for `generate`, `chat`, `serve` and RL's rollouts, and why (printed
    at start-up), for a model of config `cfg`. auto: bf16 on a GPU that has it; on a CPU, where the model is at
    least BF16_DECODE_MIN_D_MODEL wide (BF16_DECODE_MIN_D_MODEL_EMULATED without native bf16) and `timer` finds one
    row through a decode step's products at the model's widths (`DecodeShape`) BF16_DECODE_MARGIN times as fast in
    bf16 as in float32; else float32. timer None: no timing, bf16 wherever the CPU has native bf16 matmuls and the
    width allows (a choice every process makes alike). many_rows (the server): float32 on a CPU without native
    bf16, whose many-row products widen to float32 (measured: the many_rows note above). flags, timer: the CPU's,
    for tests."""
    if name != "auto":
        if name not in DTYPES:
            raise UserError(f"--dtype {name}: unknown; use auto, float32, bfloat16 or float16")
        return DTYPES[name], "as asked"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "auto: this GPU has bf16"
        return torch.float32, "auto: this GPU has no bf16"
    if device.type != "cpu":
        return torch.float32, f"auto on {device.type}"
    d_model = cfg.d_model
    if d_model < BF16_DECODE_MIN_D_MODEL:
        return torch.float32, f"auto: at width {d_model} < {BF16_DECODE_MIN_D_MODEL} float32 decodes faster"
    native = native_bf16(flags)
    has = f"this CPU has {native}" if native else "this CPU has no native bf16"
    if timer is None:
        if native is None:
            return torch.float32, f"auto: {has}"
        return torch.bfloat16, f"auto: {has} and the model is {d_model} wide"
    if native is None and many_rows:
        return torch.float32, f"auto: {has}, and a server's many rows decode faster in float32"
    if native is None and d_model < BF16_DECODE_MIN_D_MODEL_EMULATED:
        return torch.float32, (f"auto: {has}, and at width {d_model} < {BF16_DECODE_MIN_D_MODEL_EMULATED} float32 "
                               "decodes as fast")
    shape = DecodeShape.of(cfg)
    bf16, fp32 = timer(shape, torch.bfloat16), timer(shape, torch.float32)
    measured = (f"one row through a decode step's products ({shape.describe()}) took {bf16 * 1e3:.2f} ms in bf16, "
                f"{fp32 * 1e3:.2f} ms in float32")
    if bf16 * BF16_DECODE_MARGIN <= fp32:
        return torch.bfloat16, f"auto: {has}; {measured}"
    return torch.float32, f"auto: {has}, and {measured}"


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Mixed precision for matmuls in `dtype`; weights and optimizer stay float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# The attention kernels scaled_dot_product_attention may be limited to (train.sdpa_backend).
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "math": "MATH"}


def attention_kernel(name: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                     masked: bool) -> Callable[[], contextlib.AbstractContextManager]:
    """A context factory that limits attention to one SDPA kernel ("auto": PyTorch's own choice).

    The choice is tried once on a tiny input here, so a kernel that this
    device, dtype or mask cannot use (flash needs CUDA or a CPU build with it
    and plain causal masks on CUDA; efficient and cudnn need CUDA) stops the
    run at start with a message instead of failing at the first step.
    masked: the data packs several conversations per row, so attention gets an explicit mask.
    """
    if name == "auto":
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, SDPA_BACKENDS[name])
    q = torch.zeros(1, 1, 8, head_dim, device=device, dtype=dtype)  # (B, nh, T, hs)
    mask = torch.ones(8, 8, dtype=torch.bool, device=device).tril() if masked else None
    try:
        with sdpa_kernel([backend]):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask, is_causal=not masked)
    except RuntimeError:
        what = f"{device.type} in {str(dtype).removeprefix('torch.')}" + (
            " with the masks of packed conversations" if masked else "")
        raise UserError(f"train.sdpa_backend={name}: PyTorch has no {name} attention kernel for {what}; "
                        f"use --train.sdpa_backend auto (or math)") from None
    return lambda: sdpa_kernel([backend])
