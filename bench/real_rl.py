"""Agentic GRPO on a real model: held-out `calc2` and `calc` before and after, over seeds, with the sign control.

Per seed: the real model's quickstart (`nanolm quickstart --model smollm2-135m-instruct`, or an existing one
with `--from`, `{seed}` in it replaced), then calculator prompts for RL, half of one operation
(`calculator_prompts`) and half of two (`calculator_prompts2`), in phrasings and over numbers no benchmark
uses, prepared with the model's own tokenizer, and GRPO from the quickstart's LoRA run (new adapters on the
merged model, as `nanolm train --stage grpo --lora.enabled` trains them) with the built-in calculator in the
loop (`grpo.tools builtin`, up to two rounds of calls) and the `answer` reward, for `--minutes` of training.
The held-out `calc2` and `calc` benchmarks (their first `--items` items, scored as `nanolm eval --task` scores
them) are measured on the LoRA model and on the GRPO run's last checkpoint; prints both for each seed and the
medians. `--flip-sign` runs the control: every advantage negated (the benchmarks must fall). Run from the
repository root:

    PYTHONPATH=. python bench/real_rl.py --seeds 0 1 2                    # a quickstart per seed, then GRPO
    PYTHONPATH=. python bench/real_rl.py --seeds 0 1 2 --from /tmp/smol   # one existing quickstart for all
    PYTHONPATH=. python bench/real_rl.py --seeds 0 --from /tmp/smol --flip-sign
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODEL = "smollm2-135m-instruct"


def scores(run: Path, which: str, items: int, out: Path) -> dict[str, float]:
    """calc2's and calc's accuracy on their first `items` items (and calc2's misses by kind)."""
    from nanolm.eval.runner import run_eval
    res = run_eval(run, [f"calc2:n={items}", f"calc:n={items}"], which=which, out=out)["tasks"]
    return {"calc2": res[0]["acc"], "calc": res[1]["acc"], "calc2_misses": res[0]["misses"]}


def run(seed: int, a: argparse.Namespace, work: Path) -> dict[str, Any]:
    from nanolm.train.configure import load_config
    from nanolm.data.prepare import prepare
    from nanolm.data.builtin.tooluse import calculator_prompts, calculator_prompts2
    from nanolm.infer.tools import calculator
    from nanolm.quickstart_model import LORA, SEQ_LEN, base_checkpoint
    from nanolm.train.trainer import train

    t0 = time.perf_counter()
    qs = Path(a.from_dir.format(seed=seed)) if a.from_dir else work / "qs"
    if not a.from_dir:
        subprocess.run([sys.executable, "-m", "nanolm", "quickstart", "--model", a.model, "--out", str(qs)],
                       check=True, stdout=subprocess.DEVNULL)
    base = base_checkpoint(a.model)
    work.mkdir(parents=True, exist_ok=True)
    one = calculator_prompts(work / "rl1.jsonl", a.prompts // 2, 1000 + seed, calculator=calculator)
    two = calculator_prompts2(work / "rl2.jsonl", a.prompts // 2, 1000 + seed, calculator=calculator)
    prepare([one, two], base, work / "prompts", format="prompts", val_fraction=0.05, workers=0, quiet=True)
    cached = qs / "eval" / f"rl-bench-before-{a.items}.json"
    if cached.is_file():  # the LoRA model's scores do not depend on the seed
        before = json.loads(cached.read_text(encoding="utf-8"))
    else:
        before = scores(qs / "lora", "best", a.items, work / "before.json")
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(before), encoding="utf-8")
    cfg = load_config(config_file=base / "config.json", overrides={
        "data.path": str(work / "prompts"), "train.out_dir": str(work / "grpo"), "train.stage": "grpo",
        "train.init_from": str(qs / "lora"), "train.seq_len": SEQ_LEN, "train.batch_size": a.batch,
        "train.max_minutes": a.minutes, "train.eval_interval": 0, "train.save_interval": 0,
        "train.log_interval": 1, "train.seed": seed, **LORA, "optim.lr": a.lr, "optim.min_lr": a.lr / 10,
        "grpo.group_size": a.group, "grpo.max_new_tokens": a.max_new_tokens, "grpo.temperature": a.temperature,
        "grpo.tools": "builtin", "grpo.max_rounds": 2, "grpo.rewards": "answer",
        **dict(kv.split("=", 1) for kv in a.set)})
    t1 = time.perf_counter()
    train(cfg, quiet=True)
    t2 = time.perf_counter()
    after = scores(work / "grpo", "last", a.items, work / "after.json")
    rows = [json.loads(line) for line in (work / "grpo" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward" in r]
    k = max(1, len(steps) // 4)
    return {"seed": seed, "before": before, "after": after, "steps": len(steps), "grpo_s": t2 - t1,
            "total_s": time.perf_counter() - t0,
            "reward_first": statistics.mean(r["reward"] for r in steps[:k]),
            "reward_last": statistics.mean(r["reward"] for r in steps[-k:])}


def main() -> None:
    from grpo_arith import per_seed, seed_options  # bench/ is the script's directory
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    seed_options(p)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--from", dest="from_dir", default="", help="an existing real-model quickstart ({seed} replaced)")
    p.add_argument("--minutes", type=float, default=12.0, help="GRPO's training time per seed")
    p.add_argument("--prompts", type=int, default=800)
    p.add_argument("--items", type=int, default=100, help="held-out calc2 and calc items scored before and after")
    p.add_argument("--batch", type=int, default=4, help="prompts per step")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4, help="the adapters' peak learning rate")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=96, help="the model's tokens over a whole trajectory")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other setting of the GRPO run (repeatable), e.g. grpo.beta=0.1")
    a = p.parse_args()
    res = []
    for s, r in per_seed(run, a):
        res.append(r)
        b, f = r["before"], r["after"]
        print(f"seed {s}: held-out calc2 {b['calc2']:.3f} -> {f['calc2']:.3f}, calc {b['calc']:.3f} -> "
              f"{f['calc']:.3f} | sampled reward (first quarter -> last) {r['reward_first']:.3f} -> "
              f"{r['reward_last']:.3f} over {r['steps']} steps | GRPO {r['grpo_s']:.0f} s, the seed in all "
              f"{r['total_s']:.0f} s", flush=True)
        print("  calc2 missed, before -> after: " + ", ".join(
            f"{k} {b['calc2_misses'][k]} -> {f['calc2_misses'][k]}" for k in b["calc2_misses"]))
    med = lambda key, side: statistics.median(r[side][key] for r in res)  # noqa: E731
    print(f"median of {len(res)} seeds{' (advantages negated)' if a.flip_sign else ''}: calc2 "
          f"{med('calc2', 'before'):.3f} -> {med('calc2', 'after'):.3f} (gain "
          f"{statistics.median(r['after']['calc2'] - r['before']['calc2'] for r in res):+.3f}); calc "
          f"{med('calc', 'before'):.3f} -> {med('calc', 'after'):.3f} (gain "
          f"{statistics.median(r['after']['calc'] - r['before']['calc'] for r in res):+.3f})")


if __name__ == "__main__":
    main()
