"""Throughput of nanolm on this machine: matmul ceiling, training tokens/s and MFU, generation speed.

One run measures, on one device (CUDA when present, else the CPU):

1. The matrix-multiply ceiling per dtype: FLOP/s of square `a @ b` over a sweep
   of sizes, the median of several timed repeats per size; the best size counts.
2. Training throughput for a preset and batch shape: full optimizer steps
   (forward with the fused output projection and loss, backward, gradient
   clipping, the preset's optimizer step, zero_grad) on random tokens, per
   dtype (bf16 = autocast, as `nanolm train` does it).
   Tokens/s is the median over the timed steps; MFU divides the achieved model
   FLOP/s (`flops_per_token`) by this run's ceiling of the same dtype.
3. Generation at batch 1 through `Engine.generate` (KV cache, greedy): prefill
   time and decode tokens/s, against a memory-bound floor: one matrix-vector
   pass over every weight matrix the model multiplies by per token.
4. Batched generation (`--parts batch`): B sequences decoded together in one
   `Engine.batch()` (different 64-token prompts, greedy, nothing stops them
   early), for B in `--batch-sizes`: the median time of a decode step and the
   aggregate decode tokens/s, and their ratio to B = 1 measured in the same run.
   With `--batch-sampled`, every row samples with the default sampling
   parameters (temperature, top-k, top-p) and its own seed, as the server's
   and GRPO's rows do. The engine first times its few-row products in both
   forms and keeps the faster, as `nanolm serve` does (`--product-form rule`:
   the CPU's untimed rule, as RL's rollouts decode).
5. With `--compile`, training again under `torch.compile` (a failure is
   reported, not raised).
6. With `--breakdown`, one step's time part by part beside each part's matmul
   floor (bench/breakdown.py), per dtype, and with `--compile` each part compiled.

Peak memory is per phase: on CUDA `max_memory_allocated` above what was
allocated when the phase began; on Linux CPUs the growth of
`getrusage(RUSAGE_SELF).ru_maxrss` over the resident set at the phase start,
with the high-water mark reset through /proc/self/clear_refs so each phase is
seen alone (elsewhere ru_maxrss is a lifetime maximum, so later phases only
show what they add beyond earlier peaks).

Run from the repository root with nanolm installed (`make bench`, or
`pip install -e .`; `PYTHONPATH=.` works too):

    python bench/throughput.py --preset minimind-26m --seq-len 512 --batch-size 4

Progress goes to stderr; stdout gets the tables and, as its last line, one
JSON object with every figure (`--json-out FILE` also writes it to FILE).
On a CPU shared with other busy processes, OpenMP threads wait on each other
and small operations (decoding) slow down many times over. The load average
and, per phase, the CPU cores this process kept busy (process CPU time over
wall time; near the thread count on a quiet machine) are reported so such
runs can be told apart; compare `--threads 1`.
"""

from __future__ import annotations

import argparse
import dataclasses
import ctypes
import ctypes.util
import gc
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanolm.config import PRESETS, Config, SamplingParams, preset
from nanolm.io import first_line, write_json_atomic
from nanolm.infer.engine import Engine
from nanolm.model.transformer import Transformer, count_params, flops_per_token
from nanolm.progress import fmt_bytes
from nanolm.runtime import DTYPES, autocast, resolve_device
from nanolm.train.metrics import peak_flops
from nanolm.train.optim import build_optimizer
from procfs import status_kib  # bench/procfs.py, beside this script

_T0 = time.perf_counter()


def say(msg: str) -> None:
    """Progress line on stderr, so stdout holds only the report."""
    print(f"[{time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------- memory

def _ru_maxrss_bytes() -> int:
    # Linux reports KiB, macOS bytes.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc), so a phase that reuses them shows up in its RSS peak."""
    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: peaks may then undercount a phase that reuses memory an earlier one freed


_LIFETIME_RSS_PEAK = [0]  # ru_maxrss is reset per phase; this keeps the largest value seen before each reset


def lifetime_rss_peak() -> int:
    _LIFETIME_RSS_PEAK[0] = max(_LIFETIME_RSS_PEAK[0], _ru_maxrss_bytes())
    return _LIFETIME_RSS_PEAK[0]


class PeakMemory:
    """Peak memory a phase adds over what was in use when it began (`.peak_bytes`, `.method`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base = 0
        self.peak_bytes = 0
        self.method = ""
        self.process_peak_bytes = 0  # ru_maxrss at the end of the phase (CPU)

    def __enter__(self) -> "PeakMemory":
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            self.method = "cuda max_memory_allocated"
            return self
        lifetime_rss_peak()
        _release_free_memory()
        try:
            # "5" resets only the peak-RSS counter (VmHWM, which ru_maxrss reads), nothing else.
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
            rss_kib = status_kib("VmRSS")
            self.base = rss_kib * 1024 if rss_kib is not None else _ru_maxrss_bytes()
            self.method = "ru_maxrss growth over phase-start RSS (peak reset per phase)"
        except OSError:
            self.base = _ru_maxrss_bytes()
            self.method = "ru_maxrss growth (lifetime high-water mark: shows only growth beyond earlier peaks)"
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self.base
            self.process_peak_bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            self.process_peak_bytes = _ru_maxrss_bytes()
            self.peak_bytes = max(0, self.process_peak_bytes - self.base)


# ----------------------------------------------------------------------------- 1. matmul ceiling

def _timed_repeats(fn: Callable[[], Any], device: torch.device, repeats: int, seconds: float,
                   min_repeat_s: float = 0.02) -> float:
    """Median seconds per call of fn: a short warm-up, then 3..`repeats` timed repeats within about `seconds`.

    Each repeat runs fn enough times to last `min_repeat_s`, so that fast GPU
    kernels are not timed at launch/sync resolution.
    """
    # Warm up for a few calls (thread pools, kernel choice), but not more than one call when a call takes long.
    start = time.perf_counter()
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        once = max(time.perf_counter() - t0, 1e-9)
        if time.perf_counter() - start > 0.25:
            break
    inner = max(1, math.ceil(min_repeat_s / once))
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < repeats and (len(times) < 3 or time.perf_counter() < deadline):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync(device)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def matmul_ceiling(device: torch.device, dtype: torch.dtype, sizes: list[int], repeats: int,
                   seconds: float) -> dict[str, Any]:
    """FLOP/s of n x n x n matmuls per size; the best size gives the ceiling."""
    per_size: dict[str, float] = {}
    best, best_n = 0.0, 0
    c0, t0 = time.process_time(), time.perf_counter()
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        flops = 2 * n**3 / _timed_repeats(lambda: a @ b, device, repeats, seconds)
        per_size[str(n)] = flops
        say(f"matmul {dtype_name(dtype)} {n}: {flops / 1e9:.1f} GFLOP/s")
        del a, b
        if flops > best:
            best, best_n = flops, n
    cores = (time.process_time() - c0) / (time.perf_counter() - t0)
    return {"best_flops": best, "best_size": best_n, "per_size": per_size, "cpu_cores_busy": cores}


# ----------------------------------------------------------------------------- 2. training

def train_throughput(cfg: Config, device: torch.device, dtype: torch.dtype, batch_size: int, seq_len: int,
                     warmup: int, steps: int, compile_model: bool, seed: int) -> dict[str, Any]:
    """Median tokens/s of full optimizer steps on random tokens."""
    torch.manual_seed(seed)
    tokens = batch_size * seq_len
    step_times: list[float] = []
    with PeakMemory(device) as mem:
        model = Transformer(cfg.model).to(device)
        model.train()
        optimizer = build_optimizer(model, cfg.optim, device)
        train_model = torch.compile(model) if compile_model else model
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        # A few distinct batches (B, T+1) reused in turn: data loading is not what is measured.
        batches = []
        for _ in range(min(warmup + steps, 4)):
            seq = torch.randint(0, cfg.model.vocab_size, (batch_size, seq_len + 1), device=device)
            batches.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))  # (B, T) inputs, targets
        loss = torch.zeros(())
        cpu_timed = 0.0
        for i in range(warmup + steps):
            x, y = batches[i % len(batches)]
            c0 = time.process_time()
            sync(device)
            t0 = time.perf_counter()
            with autocast(device, dtype):  # the fused output projection and loss, as nanolm train runs it
                loss = train_model(x, targets=y) / y.numel()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync(device)
            step_times.append(time.perf_counter() - t0)
            if i >= warmup:
                cpu_timed += time.process_time() - c0
            phase = "warm-up" if i < warmup else "timed"
            say(f"train {dtype_name(dtype)}{' compiled' if compile_model else ''}: {phase} step "
                f"{i + 1}/{warmup + steps} {step_times[-1]:.2f}s ({tokens / step_times[-1]:.0f} tok/s)")
        final_loss = float(loss.item())
        del model, optimizer, train_model, batches, loss
    timed = step_times[warmup:]
    step_s = statistics.median(timed)
    return {
        "dtype": dtype_name(dtype), "compile": compile_model, "tokens_per_step": tokens,
        "step_s_median": step_s, "step_s": timed, "first_step_s": step_times[0],
        "tokens_per_s": tokens / step_s, "peak_mem_bytes": mem.peak_bytes, "mem_method": mem.method,
        "process_peak_bytes": mem.process_peak_bytes, "final_loss": final_loss,
        "cpu_cores_busy": cpu_timed / sum(timed), "error": None,
    }


def trainer_throughput(preset_name: str, device: torch.device, dtype: torch.dtype, batch_size: int, seq_len: int,
                       warmup: int, steps: int, compile_model: bool, seed: int, workdir: Path) -> dict[str, Any]:
    """Median tokens/s of `nanolm train` itself, end to end: the loader reading a prepared token set, the
    step, the NaN guard, logging every step to metrics.jsonl. The loop's own tokens/s of each logged step
    (its wall time from the previous log line to this one) is what is taken, after the warm-up steps."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bigdata import write_token_set  # bench/bigdata.py: random ids in `nanolm prepare`'s format

    from nanolm.train.configure import load_config
    from nanolm.train.trainer import train

    data = workdir / "data"
    if not (data / "manifest.json").is_file():
        write_token_set(data, (warmup + steps + 4) * batch_size * (seq_len + 1) * 2, vocab_size=6400, seed=seed)
    run = workdir / f"run-{dtype_name(dtype)}{'-compiled' if compile_model else ''}"
    cfg = load_config(preset_name, overrides={
        "data.path": str(data), "train.out_dir": str(run), "train.device": device.type,
        "train.dtype": dtype_name(dtype), "train.compile": compile_model, "train.batch_size": batch_size,
        "train.seq_len": seq_len, "train.grad_accum": 1, "train.max_steps": warmup + steps,
        "train.log_interval": 1, "train.eval_interval": 0, "train.save_interval": 0, "train.seed": seed})
    say(f"trainer {dtype_name(dtype)}{' compiled' if compile_model else ''}: nanolm train for "
        f"{warmup + steps} steps")
    train(cfg, quiet=True)
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    tok_s = [r["tokens_per_s"] for r in recs if "tokens_per_s" in r][warmup:]
    return {"dtype": dtype_name(dtype), "compile": compile_model, "tokens_per_s": statistics.median(tok_s),
            "tokens_per_s_steps": tok_s}


# ----------------------------------------------------------------------------- 3. generation

def weight_matrices(model: nn.Module) -> list[torch.Tensor]:
    """Every matrix a decode step multiplies by (each nn.Linear weight once; a tied LM head is the embedding)."""
    seen: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear):
            seen.setdefault(id(module.weight), module.weight.detach())
    return list(seen.values())


@torch.inference_mode()
def weight_pass_floor(model: nn.Module, device: torch.device, dtype: torch.dtype, seconds: float) -> dict[str, Any]:
    """Seconds to read every weight matrix once in a batch-1 matrix-vector pass, weights held in `dtype`.

    This is the memory-bound floor of a decoded token: every weight has to be
    read once. Three ways are timed and the fastest is the floor: `W @ v` per
    matrix, `F.linear` per matrix (the op the model runs, a different kernel
    on some CPUs), and one `W @ v` per input width over the matrices stacked
    (no per-call overhead, which on a GPU would otherwise dominate).
    """
    weights = [w.to(dtype).contiguous() for w in weight_matrices(model)]
    vecs = [torch.randn(w.shape[1], device=device, dtype=dtype) for w in weights]
    rows = [v.view(1, -1) for v in vecs]  # (1, in): a batch-1 activation
    by_width: dict[int, list[torch.Tensor]] = {}
    for w in weights:
        by_width.setdefault(w.shape[1], []).append(w)
    stacked = [torch.cat(ws) for ws in by_width.values()]  # (sum of out, in) per input width
    stacked_vecs = [torch.randn(w.shape[1], device=device, dtype=dtype) for w in stacked]
    times = {
        "matvec_s": _timed_repeats(lambda: [w @ v for w, v in zip(weights, vecs)], device, 50, seconds),
        "linear_s": _timed_repeats(lambda: [F.linear(r, w) for w, r in zip(weights, rows)], device, 50, seconds),
        "stacked_matvec_s": _timed_repeats(lambda: [w @ v for w, v in zip(stacked, stacked_vecs)], device, 50,
                                           seconds),
    }
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    floor = min(times.values())
    return {"floor_s": floor, **times, "weight_bytes": nbytes, "bandwidth_bytes_per_s": nbytes / floor}


def generation_throughput(model: nn.Module, device: torch.device, dtype: torch.dtype, prompt_len: int,
                          new_tokens: int, repeats: int, seed: int) -> dict[str, Any]:
    """Prefill time and decode tokens/s of greedy batch-1 generation (medians over repeats)."""
    engine = Engine(model, device, dtype)
    gen = torch.Generator().manual_seed(seed)
    # Ids >= 3 keep the special tokens out of the prompt; nothing stops generation early (no stop ids).
    prompt = torch.randint(3, model.config.vocab_size, (prompt_len,), generator=gen).tolist()
    engine.generate_all(prompt, SamplingParams(max_new_tokens=min(8, new_tokens), temperature=0))  # warm-up
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0)
    prefill, per_token, total, produced = [], [], [], 0
    with PeakMemory(device) as mem:
        c0 = time.process_time()
        for r in range(repeats):
            stamps = [time.perf_counter()]
            for _ in engine.generate(prompt, params):
                stamps.append(time.perf_counter())  # the engine's .item() syncs, so this is wall time per token
            produced = len(stamps) - 1
            prefill.append(stamps[1] - stamps[0])
            per_token.append((stamps[-1] - stamps[1]) / max(produced - 1, 1))
            total.append(stamps[-1] - stamps[0])
            say(f"generate {dtype_name(dtype)}: run {r + 1}/{repeats}: prefill {prefill[-1] * 1e3:.1f} ms, "
                f"{per_token[-1] * 1e3:.2f} ms/token")
        cpu = time.process_time() - c0
    decode_s = statistics.median(per_token)
    return {
        "dtype": dtype_name(dtype), "prompt_len": prompt_len, "new_tokens": produced,
        "prefill_s": statistics.median(prefill), "decode_s_per_token": decode_s,
        "decode_tokens_per_s": 1.0 / decode_s, "e2e_tokens_per_s": produced / statistics.median(total),
        "decode_s_per_token_runs": per_token, "peak_mem_bytes": mem.peak_bytes, "mem_method": mem.method,
        "cpu_cores_busy": cpu / sum(total),
    }


def batched_generation(model: nn.Module, device: torch.device, dtype: torch.dtype, prompt_len: int,
                       new_tokens: int, batch_sizes: list[int], seed: int, sampled: bool = False,
                       timed_form: bool = True) -> dict[str, Any]:
    """Per batch size B: B different prompts added to one Engine.batch() and decoded together, greedy (or
    sampled with the default parameters, each row seeded), to new_tokens each. The prefill is the first step
    (the prompts prefilled together and their first tokens drawn); the decode step's time is the median over
    the steps after it; aggregate decode tokens/s = B / that time."""
    engine = Engine(model, device, dtype)
    form = engine.time_products() if timed_form else "the CPU's rule"
    say(f"batch {dtype_name(dtype)}: {form}")
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0)
    engine.generate_all(list(range(3, 3 + prompt_len)), SamplingParams(max_new_tokens=8, temperature=0))  # warm-up
    rows = []
    for b in batch_sizes:
        prompts = [torch.randint(3, model.config.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(b)]
        with PeakMemory(device) as mem:
            batch = engine.batch()
            t0 = time.perf_counter()
            for i, prompt in enumerate(prompts):
                batch.add(prompt, SamplingParams(max_new_tokens=new_tokens, seed=seed + i) if sampled else params)
            made = sum(out.token is not None for out in batch.step())
            prefill_s = time.perf_counter() - t0
            steps = []
            while batch:
                t = time.perf_counter()
                made += sum(out.token is not None for out in batch.step())  # .item() inside syncs
                steps.append(time.perf_counter() - t)
        step_s = statistics.median(steps)
        rows.append({"batch": b, "prefill_s": prefill_s, "step_s": step_s, "tokens": made,
                     "tokens_per_s": b / step_s, "peak_mem_bytes": mem.peak_bytes})
        say(f"batch {dtype_name(dtype)} x{b}{' sampled' if sampled else ''}: {step_s * 1e3:.2f} ms/step, "
            f"{b / step_s:.0f} tokens/s")
    one = next((r for r in rows if r["batch"] == 1), None)
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / one["tokens_per_s"] if one else None
    return {"dtype": dtype_name(dtype), "prompt_len": prompt_len, "new_tokens": new_tokens, "sampled": sampled,
            "product_form": form, "rows": rows}


# ----------------------------------------------------------------------------- report

def environment(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
        except OSError:
            pass
    return {
        "device": device.type, "device_name": name, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "python": platform.python_version(),
    }


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def print_report(res: dict[str, Any]) -> None:
    env, m = res["env"], res["model"]
    load = {k: "?" if v is None else f"{v:.2f}" for k, v in res["load_avg_1m"].items()}
    print(f"nanolm throughput | {m['preset']}: {m['params']['total'] / 1e6:.1f}M params "
          f"({m['params']['non_embedding'] / 1e6:.1f}M non-embedding) | {env['device']}: {env['device_name']} | "
          f"{env['threads']} threads | torch {env['torch']}")
    print(f"load average (1 min) at start {load['start']} / end {load['end']} on {env['cpu_count']} cpus")

    if res["matmul"]:
        print("\nmatmul ceiling (square a @ b, median of timed repeats, best size)")
        print(f"  {'dtype':<10}{'size':>6}{'GFLOP/s':>10}   per size (GFLOP/s)")
        for name, c in res["matmul"].items():
            sweep = "  ".join(f"{n}: {f / 1e9:.1f}" for n, f in c["per_size"].items())
            print(f"  {name:<10}{c['best_size']:>6}{c['best_flops'] / 1e9:>10.1f}   {sweep}")
            ref = c.get("reference_flops")
            if ref:
                print(f"  {'':<10}{'':>6}{'':>10}   nanolm train divides by {ref[0] / 1e9:.1f} GFLOP/s ({ref[1]})")

    if res["train"]:
        t = res["train_shape"]
        print(f"\ntraining: batch {t['batch_size']} x {t['seq_len']} = {t['batch_size'] * t['seq_len']} tokens/step, "
              f"{m['flops_per_token'] / 1e6:.1f} MFLOP/token, median of {t['steps']} steps after {t['warmup']} warm-up")
        print(f"  {'dtype':<10}{'compile':<9}{'step s':>8}{'tok/s':>10}{'GFLOP/s':>10}{'MFU':>8}"
              f"{'peak mem':>12}{'1st step s':>12}{'loss':>7}{'cores':>7}")
        for r in res["train"]:
            tag = "yes" if r["compile"] else "no"
            if r["error"]:
                print(f"  {r['dtype']:<10}{tag:<9}failed: {r['error']}")
                continue
            print(f"  {r['dtype']:<10}{tag:<9}{r['step_s_median']:>8.2f}{r['tokens_per_s']:>10.0f}"
                  f"{r['achieved_flops'] / 1e9:>10.1f}{_pct(r['mfu']):>8}{fmt_bytes(r['peak_mem_bytes']):>12}"
                  f"{r['first_step_s']:>12.2f}{r['final_loss']:>7.3f}{r['cpu_cores_busy']:>7.2f}")

    if res["trainer"]:
        print("\nnanolm train end to end (loader, step, NaN guard, a metrics line per step) vs the model-only "
              "steps above")
        print(f"  {'dtype':<10}{'compile':<9}{'tok/s':>10}{'model-only':>12}{'ratio':>8}")
        for r in res["trainer"]:
            ref = r["model_only_tokens_per_s"]
            print(f"  {r['dtype']:<10}{'yes' if r['compile'] else 'no':<9}{r['tokens_per_s']:>10.0f}"
                  f"{'-' if ref is None else f'{ref:.0f}':>12}{_pct(r['ratio']):>8}")

    if res["generate"]:
        g0 = res["generate"][0]
        print(f"\ngeneration: batch 1, KV cache, greedy, prompt {g0['prompt_len']}, {g0['new_tokens']} new tokens; "
              f"floor = fastest batch-1 matvec pass over all weights, held in that dtype")
        print(f"  {'dtype':<10}{'prefill ms':>11}{'ms/token':>10}{'tok/s':>9}{'e2e tok/s':>11}"
              f"{'floor ms':>10}{'floor GB/s':>12}{'x floor':>9}{'overhead':>10}{'peak mem':>12}{'cores':>7}")
        for r in res["generate"]:
            print(f"  {r['dtype']:<10}{r['prefill_s'] * 1e3:>11.1f}{r['decode_s_per_token'] * 1e3:>10.2f}"
                  f"{r['decode_tokens_per_s']:>9.1f}{r['e2e_tokens_per_s']:>11.1f}{r['floor_s'] * 1e3:>10.2f}"
                  f"{r['bandwidth_bytes_per_s'] / 1e9:>12.1f}{r['floor_ratio']:>9.2f}"
                  f"{r['overhead_s_per_token'] * 1e3:>10.2f}{fmt_bytes(r['peak_mem_bytes']):>12}"
                  f"{r['cpu_cores_busy']:>7.2f}")
        print("  overhead: ms/token of the same depth and heads at width 64 (Python, dispatch, small ops: the "
              "part of a token that is not weight traffic)")
    if res["breakdown"]:
        from breakdown import print_breakdown
        t = res["train_shape"]
        for b in res["breakdown"]:
            whole = next((r["step_s_median"] for r in res["train"] if r["dtype"] == b["dtype"]
                          and r["compile"] == b["compile"] and not r.get("error")), None)
            print_breakdown(b, whole, t["batch_size"] * t["seq_len"])
    for g in res["batch"]:
        how = "sampled" if g.get("sampled") else "greedy"
        print(f"\nbatched generation, {g['dtype']}: B different {g['prompt_len']}-token prompts decoded together, "
              f"{how}, {g['new_tokens']} new tokens each; step = median decode step")
        print(f"  products: {g['product_form']}")
        print(f"  {'B':>4}{'prefill s':>11}{'ms/step':>10}{'tok/s':>10}{'x B=1':>8}{'peak mem':>12}")
        for r in g["rows"]:
            speed = "-" if r["speedup"] is None else f"{r['speedup']:.2f}"
            print(f"  {r['batch']:>4}{r['prefill_s']:>11.2f}{r['step_s'] * 1e3:>10.2f}{r['tokens_per_s']:>10.0f}"
                  f"{speed:>8}{fmt_bytes(r['peak_mem_bytes']):>12}")
    print(f"\nprocess peak RSS (ru_maxrss) {fmt_bytes(res['ru_maxrss_bytes'])}; total {res['elapsed_s']:.0f}s")
    for w in res["warnings"]:
        print(f"warning: {w}")


def contention_warnings(res: dict[str, Any], device: torch.device) -> list[str]:
    """Say which figures look disturbed: CPU phases starved by other processes, MFU above 100%."""
    out = []
    if device.type == "cpu":
        threads = res["env"]["threads"]
        phases = [(f"matmul {k}", c) for k, c in res["matmul"].items()]
        phases += [(f"train {r['dtype']}{' compiled' if r['compile'] else ''}", r) for r in res["train"]]
        phases += [(f"generate {r['dtype']}", r) for r in res["generate"]]
        starved = [name for name, r in phases if r.get("cpu_cores_busy", threads) < 0.85 * threads]
        if starved:
            out.append(f"this process kept under 85% of its {threads} threads busy during: {', '.join(starved)}; "
                       f"other processes took CPU time, so those figures are low; rerun on a quiet machine")
    for r in res["train"]:
        if (r.get("mfu") or 0) > 1:
            out.append(f"train {r['dtype']}: MFU above 100% means the {r['dtype']} ceiling was measured low "
                       f"(disturbed); rerun")
    return out


# ----------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", default="minimind-26m", choices=list(PRESETS))
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help="comma-separated compute dtypes (float32 = no autocast); float16 runs without a grad scaler")
    p.add_argument("--parts", default="matmul,train,trainer,generate",
                   help="which of matmul,train,trainer,generate,batch to run (trainer: `nanolm train` end to end; "
                        "batch: many sequences decoded together)")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32", help="sequences decoded together, for --parts batch")
    p.add_argument("--batch-sampled", action="store_true",
                   help="--parts batch: rows sample with the default parameters, each seeded, instead of greedy")
    p.add_argument("--product-form", default="timed", choices=["timed", "rule"],
                   help="--parts batch: few-row products in the faster form timed at start-up (as the server), or "
                        "the CPU's rule (as RL's rollouts)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--matmul-sizes", default="",
                   help="comma-separated square sizes (default 1024,2048,3072,4096; on CUDA up to 8192)")
    p.add_argument("--matmul-repeats", type=int, default=5, help="timed repeats per size (at least 3)")
    p.add_argument("--matmul-seconds", type=float, default=2.0, help="stop repeating a size after this long")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1, help="untimed training steps per configuration")
    p.add_argument("--steps", type=int, default=5, help="timed training steps per configuration (median)")
    p.add_argument("--compile", action="store_true", help="also time training under torch.compile")
    p.add_argument("--breakdown", action="store_true",
                   help="also time a training step part by part (bench/breakdown.py), per dtype (and, with "
                        "--compile, each part compiled), beside each part's matmul floor")
    p.add_argument("--breakdown-repeats", type=int, default=5, help="timed repeats of each part (median)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--gen-repeats", type=int, default=3, help="timed generations per dtype (median)")
    p.add_argument("--json-out", type=Path, default=None, help="also write the JSON results to this file")
    args = p.parse_args(argv)

    cfg = preset(args.preset)
    parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    if not parts or any(s not in ("matmul", "train", "trainer", "generate", "batch") for s in parts):
        p.error(f"--parts: choose from matmul,train,trainer,generate,batch, got {args.parts!r}")
    try:
        args.batch_size_list = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
    except ValueError:
        p.error(f"--batch-sizes: expected comma-separated integers, got {args.batch_sizes!r}")
    if not args.batch_size_list or min(args.batch_size_list) <= 0:
        p.error(f"--batch-sizes: sizes must be positive, got {args.batch_sizes!r}")
    dtypes = [s.strip() for s in args.dtypes.split(",") if s.strip()]
    if not dtypes or any(s not in DTYPES for s in dtypes):
        p.error(f"--dtypes: choose from {','.join(DTYPES)}, got {args.dtypes!r}")
    if args.matmul_sizes:
        try:
            sizes = [int(s) for s in args.matmul_sizes.split(",") if s.strip()]
        except ValueError:
            p.error(f"--matmul-sizes: expected comma-separated integers, got {args.matmul_sizes!r}")
        if not sizes or min(sizes) <= 0:
            p.error(f"--matmul-sizes: sizes must be positive, got {args.matmul_sizes!r}")
    for name in ("batch_size", "seq_len", "steps", "prompt_len", "gen_repeats", "matmul_repeats"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.warmup < 0 or args.new_tokens < 1 or args.threads < 0:
        p.error("--warmup and --threads must be >= 0 and --new-tokens >= 1")
    if "train" in parts and args.seq_len > cfg.model.max_seq_len:
        p.error(f"--seq-len {args.seq_len} exceeds preset {args.preset}'s model.max_seq_len "
                f"{cfg.model.max_seq_len}; pass --seq-len <= {cfg.model.max_seq_len}")
    if ("generate" in parts or "batch" in parts) and args.prompt_len + args.new_tokens > cfg.model.max_seq_len:
        p.error(f"--prompt-len + --new-tokens = {args.prompt_len + args.new_tokens} exceeds preset "
                f"{args.preset}'s model.max_seq_len {cfg.model.max_seq_len}; shorten one of them")
    args.parts_list, args.dtype_list = parts, dtypes
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtypes = [DTYPES[name] for name in args.dtype_list]
    if device.type == "cpu" and torch.float16 in dtypes:
        raise SystemExit("--dtypes float16 is for CUDA; on CPU use float32 and/or bfloat16")
    if args.matmul_sizes:
        sizes = [int(s) for s in args.matmul_sizes.split(",") if s.strip()]
    else:
        sizes = [1024, 2048, 3072, 4096] + ([8192] if device.type == "cuda" else [])
    cfg = preset(args.preset)
    fpt = flops_per_token(cfg.model, args.seq_len)
    res: dict[str, Any] = {
        "bench": "nanolm-throughput", "args": {k: (str(v) if isinstance(v, Path) else v)
                                                for k, v in vars(args).items() if not k.endswith("_list")},
        "env": environment(device), "load_avg_1m": {"start": _loadavg(), "end": None},
        "model": {"preset": args.preset, "config": asdict(cfg.model),
                  "params": count_params(Transformer(cfg.model)), "flops_per_token": fpt},
        "train_shape": {"batch_size": args.batch_size, "seq_len": args.seq_len, "warmup": args.warmup,
                        "steps": args.steps},
        "matmul": {}, "train": [], "trainer": [], "generate": [], "batch": [], "breakdown": [],
    }
    say(f"{args.preset} on {device} ({torch.get_num_threads()} threads), dtypes {','.join(args.dtype_list)}")

    if "matmul" in args.parts_list:
        for dtype in dtypes:
            c = matmul_ceiling(device, dtype, sizes, args.matmul_repeats, args.matmul_seconds)
            # What `nanolm train` divides by for its MFU (a datasheet figure on known GPUs).
            ref_flops, ref_src = peak_flops(device, dtype)
            if device.type != "cuda":
                ref_src += ", n=1024, best single timing"
            c["reference_flops"] = [ref_flops, ref_src]
            res["matmul"][dtype_name(dtype)] = c

    if "train" in args.parts_list:
        runs = [(dtype, False) for dtype in dtypes] + ([(dtype, True) for dtype in dtypes] if args.compile else [])
        for dtype, compiled in runs:
            try:
                r = train_throughput(cfg, device, dtype, args.batch_size, args.seq_len, args.warmup, args.steps,
                                     compiled, args.seed)
            except Exception as e:  # noqa: BLE001 -- a failed torch.compile is a result to report
                if not compiled:
                    raise
                first = first_line(e)
                say(f"train {dtype_name(dtype)} compiled failed: {type(e).__name__}: {first}")
                r = {"dtype": dtype_name(dtype), "compile": True, "error": f"{type(e).__name__}: {first}"}
            finally:
                if compiled:
                    torch._dynamo.reset()
            if not r["error"]:
                ceiling = res["matmul"].get(dtype_name(dtype), {}).get("best_flops")
                r["achieved_flops"] = r["tokens_per_s"] * fpt
                r["mfu"] = r["achieved_flops"] / ceiling if ceiling else None
            res["train"].append(r)

    if args.breakdown:
        from breakdown import step_breakdown  # bench/breakdown.py, beside this script
        for compiled in [False] + ([True] if args.compile else []):
            for dtype in dtypes:
                say(f"breakdown {dtype_name(dtype)}{' compiled' if compiled else ''}")
                ceiling = res["matmul"].get(dtype_name(dtype), {}).get("best_flops")
                res["breakdown"].append(step_breakdown(cfg, device, dtype, args.batch_size, args.seq_len, compiled,
                                                       args.breakdown_repeats, ceiling))

    if "trainer" in args.parts_list:
        import tempfile
        runs = [(dtype, False) for dtype in dtypes] + ([(dtype, True) for dtype in dtypes] if args.compile else [])
        with tempfile.TemporaryDirectory(prefix="nanolm-bench-") as tmp:
            for dtype, compiled in runs:
                r = trainer_throughput(args.preset, device, dtype, args.batch_size, args.seq_len,
                                       args.warmup + (1 if compiled else 0), args.steps, compiled, args.seed,
                                       Path(tmp))
                if compiled:
                    torch._dynamo.reset()
                model_only = next((m for m in res["train"] if m.get("dtype") == r["dtype"]
                                   and m.get("compile") == compiled and not m.get("error")), None)
                r["model_only_tokens_per_s"] = model_only["tokens_per_s"] if model_only else None
                r["ratio"] = r["tokens_per_s"] / model_only["tokens_per_s"] if model_only else None
                res["trainer"].append(r)

    if "generate" in args.parts_list:
        torch.manual_seed(args.seed)
        model = Transformer(cfg.model).to(device)
        for dtype in dtypes:
            r = generation_throughput(model, device, dtype, args.prompt_len, args.new_tokens, args.gen_repeats,
                                      args.seed)
            floor = weight_pass_floor(model, device, dtype, seconds=1.0)
            say(f"floor {dtype_name(dtype)}: {floor['floor_s'] * 1e3:.2f} ms per weight pass")
            r.update(floor)
            r["floor_ratio"] = r["decode_s_per_token"] / floor["floor_s"]
            # The per-token cost that is not weight traffic (Python, op dispatch, small kernels): the same
            # depth and heads at width 64, whose matmuls are too small to matter.
            narrow = dataclasses.replace(cfg.model, d_model=64, n_hidden=0, moe_n_hidden=0)
            thin = generation_throughput(Transformer(narrow).to(device), device, dtype, args.prompt_len,
                                         args.new_tokens, args.gen_repeats, args.seed)
            r["overhead_s_per_token"] = thin["decode_s_per_token"]
            res["generate"].append(r)
        del model

    if "batch" in args.parts_list:
        torch.manual_seed(args.seed)
        model = Transformer(cfg.model).to(device)
        for dtype in dtypes:
            res["batch"].append(batched_generation(model, device, dtype, args.prompt_len, args.new_tokens,
                                                   args.batch_size_list, args.seed, args.batch_sampled,
                                                   args.product_form == "timed"))
        del model

    res["warnings"] = contention_warnings(res, device)
    res["load_avg_1m"]["end"] = _loadavg()
    res["ru_maxrss_bytes"] = lifetime_rss_peak()
    res["elapsed_s"] = time.perf_counter() - _T0
    print_report(res)
    line = json.dumps(res)
    print(line, flush=True)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(args.json_out, res)
        say(f"wrote {args.json_out}")
    return res


if __name__ == "__main__":
    main()
