"""Small data used to the end of a budget: nanolm's default path against nanoGPT's README CPU recipe given the
same whole budget, on 1 MB and 5 MB of built-in English text, held-out bits per byte.

For each size (`--sizes`, millions of characters of built-in Shakespeare, its first works in order) the text,
a tokenizer trained on its first 90% and the prepared data are made as bench/quality.py makes them (the last
10% of the characters held out, as nanoGPT splits its one file). Then, for each budget (`--minutes`):

    default   `nanolm train --data DIR --train.max_minutes M`: the path a user with M minutes types. Its
              start-up line says what nanolm/train/sizing.py chose for the data and the budget (width, weight
              decay, a schedule cut where the model would see the data more than it can use); the table
              repeats it. Scored from its best checkpoint (the one a user gets).
    nanogpt   nanoGPT's README CPU recipe (bench/quality.py's NANOGPT_RECIPE, its public code run unchanged
              from a checkout given as --nanogpt DIR) with `max_iters` and `lr_decay_iters` sized to the same
              M minutes: a short run of the same recipe on the same data first times its iterations (the mean
              of its logged iteration times over one evaluation interval, the evaluation and checkpoint
              included) and its start-up, and the iterations that fit in M minutes, rounded down to whole
              evaluation intervals (it saves at each), are its schedule. Scored from its last checkpoint.

Both are scored on the whole held-out text, as bits per UTF-8 byte. The table gives each, their ratio
(default / nanogpt: the issue's target is at most 0.80), where each run's best validation fell (its step over
its last step; the target is the last fifth, >= 0.80) and how long it took.

The full sweep (about 2 x 2 x 2 x (3 + 10) minutes = 104 minutes of training with --runs 2; run it on an idle
machine, one process at a time):

    git clone https://github.com/karpathy/nanoGPT ~/src/nanoGPT
    PYTHONPATH=. .venv/bin/python bench/small_data.py --nanogpt ~/src/nanoGPT --sizes 1,5 --minutes 3,10 --runs 2

A quick look that it works: `--sizes 1 --minutes 1`. Progress goes to stderr, training logs to
<work>/runs/; stdout gets the table and, last, one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import run_nanogpt, run_one, setup  # noqa: E402  bench/, beside this

CORPUS = "shakespeare"  # built-in English text, 5.05 M characters
EVAL_INTERVAL = 100  # the recipe's --eval_interval: it saves a checkpoint at each


def nanogpt_iters(src: Path, text: Path, work: Path, minutes: float, threads: int | None) -> dict:
    """The recipe's iterations that fit in `minutes` here: one evaluation interval of it run on the same data
    (its iteration times from its log; its start-up, the rest of the process's wall time), then the whole
    intervals that fit in the budget after start-up."""
    timed = run_nanogpt(src, text, work, 60.0, 0, threads, "-timing", EVAL_INTERVAL)  # a time limit, not a budget
    log = (work / "runs" / "nanogpt-0-timing.log").read_text()
    ms = {int(m[1]): float(m[2]) for m in re.finditer(r"iter (\d+): loss [\d.]+, time ([\d.]+)ms", log)}
    per_iter = statistics.mean(ms[i] for i in range(1, EVAL_INTERVAL + 1)) / 1e3  # iteration 100's has the eval
    startup = max(0.0, timed["wall_s"] - sum(ms.values()) / 1e3)
    fit = int((minutes * 60 - startup) / per_iter) // EVAL_INTERVAL * EVAL_INTERVAL
    if fit < EVAL_INTERVAL:  # it would be stopped before its first checkpoint: nothing to score
        raise SystemExit(f"{minutes:g} minutes fit {int((minutes * 60 - startup) / per_iter)} iterations of "
                         f"nanoGPT's recipe here ({per_iter:.3f}s each after {startup:.0f}s of start-up), fewer "
                         f"than the {EVAL_INTERVAL} before its first save: give more --minutes or a quieter machine")
    return {"iters": fit, "iter_s": per_iter, "startup_s": startup}


def best_fraction_nanolm(run_log: Path, metrics: Path) -> tuple[float, str]:
    """Where the run's best validation fell (its step / the last step) and the default path's choice line."""
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    evals = [r for r in recs if "val_loss" in r]
    last = next(r for r in recs if r.get("event") == "stop")["step"]
    best = min(evals, key=lambda r: r["val_loss"])["step"] if evals else last
    choice = next((ln.strip() for ln in run_log.read_text().splitlines() if ln.strip().startswith("preset ")), "")
    return best / max(1, last), choice


def best_fraction_nanogpt(run_log: Path) -> float:
    """Where nanoGPT's best validation (its logged `val loss` at each evaluation) fell in its run."""
    evals = [(int(m[1]), float(m[2])) for m in re.finditer(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)",
                                                            run_log.read_text())]
    if not evals:
        return math.nan
    return min(evals, key=lambda e: e[1])[0] / max(1, evals[-1][0])


def sweep(args: argparse.Namespace) -> list[dict]:
    rows = []
    for mb in args.sizes:
        chars = int(mb * 1_000_000)
        work = args.work / f"{CORPUS}-{chars}-v{args.vocab_size}"
        data = setup(work, CORPUS, chars, args.vocab_size)
        text = work / f"{CORPUS}.txt"
        for minutes in args.minutes:
            for i in range(args.runs):
                tag = f"-{minutes:g}min"
                r = run_one(data, work, "default", i, ["--train.max_minutes", str(minutes)], args.threads, tag)
                r["best_at"], r["choice"] = best_fraction_nanolm(work / "runs" / f"default-{i}{tag}.log",
                                                                  work / "runs" / f"default-{i}{tag}" / "metrics.jsonl")
                sized = nanogpt_iters(args.nanogpt, text, work, minutes, args.threads)
                g = run_nanogpt(args.nanogpt, text, work, minutes, i, args.threads, tag, sized["iters"])
                g["best_at"] = best_fraction_nanogpt(work / "runs" / f"nanogpt-{i}{tag}.log")
                g.update(sized)
                for res in (r, g):
                    res.update(mb=mb, minutes=minutes)
                    print(f"{mb:g} MB, {minutes:g} min, run {i}: {res['variant']} {res['bpb']:.4f} bpb, "
                          f"{res['steps']} steps, best at {res['best_at']:.0%} ({res['wall_s']}s)",
                          file=sys.stderr, flush=True)
                rows += [r, g]
    return rows


def report(rows: list[dict], runs: int) -> None:
    print(f"\nheld-out bits per byte, built-in {CORPUS} (last 10% held out), median of {runs} run(s); best at: "
          f"the step of the run's best validation over its last step")
    print("| MB | minutes | default bpb | nanoGPT bpb | default / nanoGPT | default best at | nanoGPT best at | "
          "default steps, passes | nanoGPT iters, passes | default chose |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key in sorted({(r["mb"], r["minutes"]) for r in rows}):
        d = [r for r in rows if (r["mb"], r["minutes"]) == key and r["variant"] == "default"]
        g = [r for r in rows if (r["mb"], r["minutes"]) == key and r["variant"] == "nanogpt"]

        def med(rs: list[dict], k: str) -> float:
            return statistics.median(r[k] for r in rs)
        choice = d[-1]["choice"].split("; ", 1)[-1]
        print(f"| {key[0]:g} | {key[1]:g} | {med(d, 'bpb'):.3f} | {med(g, 'bpb'):.3f} | "
              f"{med(d, 'bpb') / med(g, 'bpb'):.2f}x | {med(d, 'best_at'):.0%} | {med(g, 'best_at'):.0%} | "
              f"{med(d, 'steps'):.0f}, {med(d, 'epochs'):.1f} | {med(g, 'steps'):.0f}, {med(g, 'epochs'):.1f} | "
              f"{choice} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nanogpt", type=Path, required=True, help="root of a karpathy/nanoGPT checkout")
    ap.add_argument("--sizes", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 5.0],
                    help="millions of characters of the built-in text, comma-separated")
    ap.add_argument("--minutes", type=lambda s: [float(x) for x in s.split(",")], default=[3.0, 10.0],
                    help="the whole budget of each run, comma-separated")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--vocab-size", type=int, default=6400, help="nanolm's tokenizer (nanoGPT's is characters)")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the training processes")
    ap.add_argument("--work", type=Path, default=Path("runs/bench-small-data"))
    args = ap.parse_args()
    args.work = args.work.resolve()
    args.nanogpt = args.nanogpt.resolve()
    if not (args.nanogpt / "train.py").is_file():
        raise SystemExit(f"--nanogpt {args.nanogpt}: no train.py there; pass the root of a nanoGPT checkout")
    rows = sweep(args)
    report(rows, args.runs)
    print(json.dumps({"corpus": CORPUS, "sizes_mb": args.sizes, "minutes": args.minutes, "runs": args.runs,
                      "load_avg": os.getloadavg(), "results": rows}))


if __name__ == "__main__":
    main()
