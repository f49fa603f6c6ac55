"""GRPO step time at minimind-26m: rollout tokens/s, update time, and the share of a step spent generating.

Builds everything in a temporary directory: the arithmetic task (`nanolm data
arith`), a tokenizer trained on it, the RL prompts (`prepare --format
prompts`), and a minimind-26m checkpoint (d_model 512, 8 layers; random
initialisation, one pretraining step of one row so that the stage has a
checkpoint to start from). Then it runs --steps GRPO steps through the one
training loop (`Trainer`) with --prompts prompts per step, --group
completions each of at most --max-new-tokens tokens, and reports per step,
from metrics.jsonl, the median (and range) of:

- rollout tokens/s: completion tokens of the step over the engine's
  generation time (the batched engine, each prompt prefilled once);
- generate_s, score_s (rewards, and the behaviour/reference log-probs),
  update_s (forward, backward and optimizer step(s) of the rollout batch);
- generate share: generate_s / (generate_s + score_s + update_s).

A random model rarely stops, so nearly every completion runs to
--max-new-tokens: the figures are for full-length completions. Run from the
repository root:

    PYTHONPATH=. python bench/rl.py                       # 5 steps, 4 prompts x 8, 64 tokens, beta 0.04
    PYTHONPATH=. python bench/rl.py --beta 0 --steps 7    # no reference forward
    PYTHONPATH=. python bench/rl.py --compile-rollouts    # the decode step compiled (grpo.compile_rollouts)

The first step is left out of the medians (warm-up; with --compile-rollouts
it holds the compile, whose time the report gives as the first step's
generate_s). On a CPU shared with
other busy processes, times vary from run to run: quote medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step (train.batch_size)")
    ap.add_argument("--group", type=int, default=8, help="grpo.group_size")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--compile-rollouts", action="store_true",
                    help="grpo.compile_rollouts: the rollouts' decode step compiled at the first step")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()

    from nanolm.train.configure import load_config
    from nanolm.data.builtin.arith import write_arith
    from nanolm.data.kinds import iter_texts
    from nanolm.data.prepare import prepare
    from nanolm.tokenizer import train_tokenizer
    from nanolm.train.trainer import Trainer, train

    work = Path(args.workdir or tempfile.mkdtemp(prefix="nanolm-rl-bench-"))
    t0 = time.perf_counter()
    files = write_arith(work / "arith", 400, 200, 20, seed=0)
    train_tokenizer(iter_texts([files["sft"]], format="chat"), work / "tok", vocab_size=1000, quiet=True)
    prepare([files["sft"]], work / "tok", work / "sft", format="chat", val_fraction=0, workers=0, quiet=True)
    prepare([files["prompts"]], work / "tok", work / "prompts", format="prompts", val_fraction=0, quiet=True)
    common = {"train.compile": False, "train.device": args.device, "model.dropout": 0.0}
    train(load_config("minimind-26m", overrides={**common, "data.path": str(work / "sft"),
                                                 "train.out_dir": str(work / "base"), "train.max_steps": 1,
                                                 "train.batch_size": 1, "train.seq_len": 64,
                                                 "train.eval_interval": 0, "train.save_interval": 0}), quiet=True)
    print(f"set-up {time.perf_counter() - t0:.0f}s in {work}", file=sys.stderr, flush=True)

    cfg = load_config("minimind-26m", overrides={
        **common, "data.path": str(work / "prompts"), "train.out_dir": str(work / "grpo"), "train.stage": "grpo",
        "train.init_from": str(work / "base"), "train.max_steps": args.steps, "train.batch_size": args.prompts,
        "train.seq_len": 64, "train.eval_interval": 0, "train.save_interval": 0, "train.log_interval": 1,
        "grpo.group_size": args.group, "grpo.max_new_tokens": args.max_new_tokens, "grpo.beta": args.beta,
        "grpo.rewards": "answer:1.0,length:0.1", "grpo.compile_rollouts": args.compile_rollouts})
    trainer = Trainer(cfg, quiet=True)
    trainer.run()
    recs = [json.loads(x) for x in (work / "grpo" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in recs if "generate_s" in r)  # the first step warms up (and compiles, if asked)
    steps = [r for r in recs if "generate_s" in r][1:]
    keys = ("rollout_tok_s", "generate_s", "score_s", "update_s", "generate_share", "completion_len")
    table = {k: (statistics.median(r[k] for r in steps), min(r[k] for r in steps), max(r[k] for r in steps))
             for k in keys}
    print(f"GRPO at minimind-26m on {trainer.device}: {args.prompts} prompts x {args.group} completions, "
          f"max {args.max_new_tokens} new tokens, beta {args.beta}, rollouts "
          f"{'compiled' if args.compile_rollouts else 'uncompiled'}; medians of {len(steps)} steps (min-max); the "
          f"first step generated for {first['generate_s']:.1f} s")
    for k, (med, lo, hi) in table.items():
        print(f"  {k:<16} {med:10.3f}   ({lo:.3f} - {hi:.3f})")
    print(json.dumps({"device": str(trainer.device), "prompts": args.prompts, "group": args.group,
                      "max_new_tokens": args.max_new_tokens, "beta": args.beta, "steps": len(steps),
                      "compile_rollouts": args.compile_rollouts, "first_generate_s": first["generate_s"],
                      **{k: v[0] for k, v in table.items()}}))


if __name__ == "__main__":
    main()
