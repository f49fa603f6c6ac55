"""Non-causal against causal on the built-in block tasks: held-out exact match after the same CPU time.

For each task (`nanolm data blocks --task sort|reverse`: digit strings of
--min-len to --max-len digits, sorted or reversed, every input once) it writes
--n records, trains a tokenizer on them (one token per digit) and prepares
them with `nanolm prepare --format blocks` (10% validation: inputs no
training record has). Then two models of the same size (--d-model,
--n-layer; every weight the same shape) train with `--stage blocks` for the
same wall time (`train.max_minutes`, the schedule fitted to it), seeds
interleaved:

- non-causal (`model.causal false`): reads the input block of seq_len =
  --max-len + 1 tokens and writes every output position in one pass;
- causal: reads the input block, then the output block token by token
  (2 x seq_len - 1 positions), as a decoder-only model answers.

Both are scored every --eval-every steps on the whole held-out split:
`val_exact`, the share of held-out inputs whose whole output block (its
end-of-text included) is right, greedily (for the causal model,
teacher-forced argmax, which equals greedy decoding's exact match). Prints
one row per run (steps, tokens read, held-out exact match and token accuracy
at the end, and the first time the exact match reached 50% and 90%), the
medians per task and mode, and one JSON line with every figure. Run from the
repository root:

    PYTHONPATH=. python bench/blocks.py                      # sort and reverse, 30 s each, seeds 0 1 2
    PYTHONPATH=. python bench/blocks.py --tasks sort --minutes 2 --seeds 0

On a CPU shared with other busy processes, times vary from run to run: the
seeds of both modes are interleaved so that both see the same load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def run(task_dir: Path, out: Path, causal: bool, seed: int, a: argparse.Namespace) -> dict[str, Any]:
    from nanolm.train.configure import load_config
    from nanolm.train.trainer import train
    T = a.max_len + 1
    n_val = json.loads((task_dir / "data" / "manifest.json").read_text())["blocks"]["val"]
    cfg = load_config("tiny", overrides={
        "data.path": str(task_dir / "data"), "train.out_dir": str(out), "train.stage": "blocks",
        "model.causal": causal, "model.vocab_size": a.vocab, "model.d_model": a.d_model, "model.n_layer": a.n_layer,
        "model.n_head": 4, "model.n_kv_head": 4, "model.max_seq_len": 2 * T, "train.seq_len": T,
        "model.dropout": 0.0, "train.batch_size": a.batch_size, "train.max_steps": 0, "train.max_minutes": a.minutes,
        "train.eval_interval": a.eval_every, "train.eval_batches": -(-n_val // a.batch_size),
        "train.save_interval": 0, "train.log_interval": 10, "train.seed": seed, "train.dtype": a.dtype,
        "optim.lr": a.lr, "optim.min_lr": a.lr / 10, "optim.warmup_steps": 50})
    t0 = time.perf_counter()
    res = train(cfg, quiet=True)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    elapsed = {r["step"]: r["elapsed_s"] for r in rows if "elapsed_s" in r and "loss" in r}
    vals = [(elapsed.get(r["step"]), r["val_exact"], r["val_token_acc"]) for r in rows if "val_exact" in r]

    def first(level: float) -> float | None:
        return next((t for t, e, _ in vals if e >= level and t is not None), None)
    return {"task": task_dir.name, "mode": "causal" if causal else "non-causal", "seed": seed, "steps": res.step,
            "tokens": res.tokens, "wall_s": round(wall, 1), "exact": vals[-1][1], "token_acc": vals[-1][2],
            "t50": first(0.5), "t90": first(0.9), "n_heldout": n_val}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", nargs="+", default=["sort", "reverse"], choices=["sort", "reverse"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--minutes", type=float, default=0.5, help="training time of each run")
    ap.add_argument("--n", type=int, default=20000, help="records per task (10%% held out)")
    ap.add_argument("--min-len", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--vocab", type=int, default=320)
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args()

    from nanolm.data.builtin.digit_tasks import write_digit_task
    from nanolm.data.kinds import iter_texts
    from nanolm.data.prepare import prepare
    from nanolm.tokenizer import train_tokenizer

    work = Path(a.workdir or tempfile.mkdtemp(prefix="nanolm-blocks-bench-"))
    results = []
    for task in a.tasks:
        d = work / task
        records = write_digit_task(d / f"{task}.jsonl", task, a.n, a.min_len, a.max_len, seed=0)
        train_tokenizer(iter_texts([records], format="blocks"), d / "tok", vocab_size=a.vocab, quiet=True)
        prepare([records], d / "tok", d / "data", format="blocks", val_fraction=0.1, quiet=True)
        for seed in a.seeds:
            for causal in (False, True):
                r = run(d, work / f"{task}-{'c' if causal else 'nc'}-{seed}", causal, seed, a)
                results.append(r)
                print(f"{r['task']:<8} {r['mode']:<11} seed {seed}: {r['steps']:>5} steps, {r['tokens']:>9,} tokens, "
                      f"held-out exact {r['exact']:.3f} (token acc {r['token_acc']:.3f}), 50% at "
                      f"{r['t50'] if r['t50'] is None else round(r['t50'])} s, 90% at "
                      f"{r['t90'] if r['t90'] is None else round(r['t90'])} s", flush=True)
    print("\n| task | mode | runs | steps | held-out exact match (median, range) | token accuracy | "
          "time to 50% exact | time to 90% exact |")
    print("|---|---|---|---|---|---|---|---|")
    for task in a.tasks:
        for mode in ("non-causal", "causal"):
            rs = [r for r in results if r["task"] == task and r["mode"] == mode]
            ex = [r["exact"] for r in rs]

            def med(key: str) -> str:
                got = [r[key] for r in rs if r[key] is not None]
                return f"{statistics.median(got):.0f} s ({len(got)}/{len(rs)} runs)" if got else "not reached"
            print(f"| {task} | {mode} | {len(rs)} | {statistics.median(r['steps'] for r in rs):.0f} | "
                  f"{statistics.median(ex):.3f} ({min(ex):.3f}-{max(ex):.3f}) | "
                  f"{statistics.median(r['token_acc'] for r in rs):.3f} | {med('t50')} | {med('t90')} |")
    print(json.dumps({"args": vars(a), "results": results}))


if __name__ == "__main__":
    main()
