"""Decoding a real model against the machine's own memory floor, beside transformers' `generate`, in one run.

For a built-in model (default SmolLM2-135M-Instruct, imported from its GGUF) or a checkpoint, this measures:
- the machine's read bandwidth: summing a 1 GiB float32 tensor, the median of several passes;
- the weight bytes one decoded token reads, per dtype: every matrix of the engine's copy once (a tied head is the
  embedding, read whole by the head; an untied embedding gives one row, not counted) and the norms;
- the floor: those bytes over that bandwidth, the least time a token can take when every weight is read once;
- one row's ms a token: 144 against 16 new tokens after a 32-token prompt, greedy, the difference over 128 (so
  the prefill and start-up cancel), for nanolm's Engine and for transformers' `generate` on the same weights
  (nanolm's own HF export of the checkpoint), each as "x the floor"; runs alternate between the two;
- 16 rows decoded together: their tokens a second against one row's, the same 144 - 16 difference.
Each figure is the median of --runs runs. --profile prints torch.profiler's top operations (by self CPU time) of
one decode step of one row after the prompt, per dtype. Run from the repository root:

    PYTHONPATH=. python bench/decode_real.py                       # float32 and bfloat16, 5 runs
    PYTHONPATH=. python bench/decode_real.py --dtypes float32 --runs 3 --no-hf
    PYTHONPATH=. python bench/decode_real.py --profile --runs 1
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

PROMPT, SHORT, LONG = 32, 16, 144
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def read_bandwidth(passes: int = 7) -> float:
    """Bytes a second this machine reads, summing a 1 GiB float32 tensor: the median of `passes` after a warm-up."""
    big = torch.ones(2**28, dtype=torch.float32)  # 1 GiB
    big.sum()
    times = []
    for _ in range(passes):
        t0 = time.perf_counter()
        big.sum()
        times.append(time.perf_counter() - t0)
    return big.numel() * big.element_size() / statistics.median(times)


def token_bytes(model: nn.Module) -> int:
    """The bytes of the weights a decoded token reads in `model` (the engine's copy): each parameter once, less
    an untied embedding table, of which a token reads one row."""
    seen = {id(p): p for p in model.parameters()}
    emb = model.embed_tokens.weight
    tied = any(p is emb for m in model.modules() if m is not model.embed_tokens
               for p in m.parameters(recurse=False))
    return sum(p.numel() * p.element_size() for i, p in seen.items() if tied or i != id(emb))


def per_token_ms(run: Callable[[int], object]) -> float:
    """ms a token: run(LONG) against run(SHORT) new tokens, the difference over LONG - SHORT."""
    t0 = time.perf_counter()
    run(SHORT)
    short = time.perf_counter() - t0
    t0 = time.perf_counter()
    run(LONG)
    return (time.perf_counter() - t0 - short) * 1e3 / (LONG - SHORT)


def nanolm_runner(engine, prompts: list[list[int]]) -> Callable[[int], object]:
    from nanolm.config.sampling import SamplingParams

    def run(new: int) -> object:
        params = SamplingParams(max_new_tokens=new, temperature=0.0)
        if len(prompts) == 1:
            got = engine.generate_all(prompts[0], params)
        else:
            got = engine.generate_many(prompts, params)
            got = [t for reply in got for t in reply]
        assert len(got) == new * len(prompts), "a row stopped early"
        return got
    return run


def hf_runner(model, prompt: list[int]) -> Callable[[int], object]:
    ids = torch.tensor([prompt])

    def run(new: int) -> object:
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0)
        assert out.shape[1] == len(prompt) + new
        return out
    return run


def profile_step(engine, prompt: list[int], top: int = 25) -> None:
    """torch.profiler's operations of one decode step of one row after `prompt`, by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    from nanolm.model.transformer import KVCache

    cache = KVCache.empty(engine.model.config, 1, len(prompt) + 8, "cpu", engine.cache_dtype)
    x = torch.tensor([prompt])
    with torch.inference_mode():
        engine.model(x, cache)
        step = torch.tensor([[prompt[-1]]])
        for _ in range(3):  # warm-up, then one step profiled
            cache.pos = len(prompt)
            engine.decode(step, cache)
        cache.pos = len(prompt)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.decode(step, cache)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="a built-in model or a checkpoint directory")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--runs", type=int, default=5, help="runs per figure (the median is printed)")
    p.add_argument("--rows", type=int, default=16, help="rows decoded together for the many-row figure")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    p.add_argument("--no-rows", action="store_true", help="skip the many-row figure")
    p.add_argument("--profile", action="store_true", help="print a profile of one decode step per dtype")
    p.add_argument("--threads", type=int, default=0, help="torch's intra-op threads (0: its default)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    from nanolm.checkpoint import load_model
    from nanolm.export.gguf_import import resolve_model
    from nanolm.infer.engine import Engine

    torch.manual_seed(0)
    ckpt = resolve_model(a.model, quiet=True)
    model, _ = load_model(ckpt, "best", "cpu")
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg.vocab_size, (PROMPT,), generator=g).tolist() for _ in range(a.rows)]
    bw = read_bandwidth()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
          f", {torch.get_num_threads()} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}; load average "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"model: {a.model} ({cfg.n_layer} layers, width {cfg.d_model}, vocabulary {cfg.vocab_size}); "
          f"read bandwidth {bw / 2**30:.1f} GiB/s (summing 1 GiB, median of 7)")
    hf_dir = None
    with tempfile.TemporaryDirectory() as tmp:
        if not a.no_hf:
            from nanolm.export.hf import export_hf
            hf_dir = export_hf(ckpt, Path(tmp) / "hf")
        for name in a.dtypes:
            dtype = DTYPES[name]
            engine = Engine(model, "cpu", dtype)
            nbytes = token_bytes(engine.model)
            floor = nbytes / bw * 1e3
            print(f"\n{name}: a token reads {nbytes / 1e6:.1f} MB of weights; floor {floor:.2f} ms a token")
            if a.profile:
                profile_step(engine, prompts[0])
            one = nanolm_runner(engine, prompts[:1])
            many = nanolm_runner(engine, prompts)
            hf = None
            if hf_dir is not None:
                from transformers import AutoModelForCausalLM
                hf = hf_runner(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval(), prompts[0])
            one(4)
            if hf is not None:
                hf(4)
            ours, theirs, rows = [], [], []
            for _ in range(a.runs):  # alternated, so a change of load touches both alike
                ours.append(per_token_ms(one))
                if hf is not None:
                    theirs.append(per_token_ms(hf))
                if not a.no_rows:
                    rows.append(per_token_ms(many))
            m = statistics.median(ours)
            print(f"  nanolm Engine, one row: {m:.2f} ms a token = {m / floor:.2f}x the floor "
                  f"(runs {', '.join(f'{t:.1f}' for t in ours)})")
            if theirs:
                t = statistics.median(theirs)
                print(f"  transformers generate, one row: {t:.2f} ms a token = {t / floor:.2f}x the floor "
                      f"(runs {', '.join(f'{x:.1f}' for x in theirs)}); nanolm {t / m:.2f}x as fast")
            if rows:
                r = statistics.median(rows)
                print(f"  nanolm Engine, {a.rows} rows: {a.rows * 1e3 / r:.0f} tokens/s = "
                      f"{a.rows * m / r:.2f}x one row's {1e3 / m:.1f} (a step {r:.2f} ms)")
    print(f"\nload average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
