"""Time of choosing the next token for a step of B rows (`nanolm.infer.sampling.sample_rows`), by setting.

The draw runs once per decoded token for every row, after the model's forward: at a small model's
vocabulary it is part of every step of chat, the server and RL's rollouts. For each number of rows
and each setting (greedy; the chat and server defaults, temperature 0.8, top-k 50, top-p 0.95; RL's
rollouts, temperature 0.7 with no cut), the median over --repeats of the mean of --calls calls on
random logits over --vocab ids, every row seeded. Run from the repository root:

    PYTHONPATH=. python bench/sampling.py                  # rows 1, 16, 64 at vocabulary 6,400
    PYTHONPATH=. python bench/sampling.py --vocab 151936   # Qwen's vocabulary
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from nanolm.config.sampling import SamplingParams
from nanolm.infer.sampling import sample_rows

SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "chat defaults": SamplingParams(),
    "rl (no cut)": SamplingParams(temperature=0.7, top_k=0, top_p=1.0),
}


def time_draw(rows: int, vocab: int, params: SamplingParams, calls: int, repeats: int) -> float:
    """Median over repeats of the seconds per sample_rows call."""
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)) * 3
    temperature = torch.full((rows,), params.temperature)
    top_k = torch.full((rows,), params.top_k, dtype=torch.long)
    top_p = torch.full((rows,), params.top_p)
    generators = [torch.Generator().manual_seed(i) for i in range(rows)]
    sample_rows(logits, temperature, top_k, top_p, generators)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            sample_rows(logits, temperature, top_k, top_p, generators)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--vocab", type=int, default=6400)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    print(f"sample_rows at vocabulary {args.vocab}, {torch.get_num_threads()} threads: us per step (median of "
          f"{args.repeats})")
    print(f"{'setting':>16} " + " ".join(f"{f'B={b}':>10}" for b in rows))
    results = {}
    for name, params in SETTINGS.items():
        us = [time_draw(b, args.vocab, params, args.calls, args.repeats) * 1e6 for b in rows]
        results[name] = dict(zip(map(str, rows), us))
        print(f"{name:>16} " + " ".join(f"{u:>10.0f}" for u in us))
    print(json.dumps({"bench": "nanolm-sampling", "vocab": args.vocab, "us_per_step": results}))


if __name__ == "__main__":
    main()
