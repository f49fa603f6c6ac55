"""The built-in arithmetic task end to end on a CPU: SFT, then GRPO raising the held-out answer accuracy.

In a temporary directory: `nanolm data arith --level easy --max-number 30`
(sums and differences of numbers up to 30, English and Chinese, six
templates), a tokenizer trained on the SFT set (digits split), SFT from scratch
of a 0.8M-parameter model (d_model 128, 4 layers) on 2,400 worked answers
(`17 + 5 = 22. #### 22`) for up to 6,000 steps, a checkpoint every 500; GRPO
starts from the first whose greedy accuracy on 200 of the RL prompts reaches
0.65 (`--sft-target`; a seed's SFT lands anywhere from 0.26 to 0.86 after a
fixed step count, and the gain is largest from the middle), then GRPO with
the `answer` reward on three quarters
of 1,800 prompts (1,600 RL prompts and 200 problems whose numbers SFT never
saw). The held-out prompts (the val split: the other quarter, 450 problems,
none shared with the SFT set or the prompts trained on) are decoded greedily
before and after GRPO; prints the held-out answer accuracy before -> after for each
seed, and the median. --flip-sign runs the control: every advantage negated.
One seed takes about 14 minutes (two seeds at once, a core each). Run from the repository root:

    PYTHONPATH=. python bench/grpo_arith.py                   # seeds 0 1 2
    PYTHONPATH=. python bench/grpo_arith.py --seeds 0 --flip-sign
    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/grpo_arith.py --seeds 1   # two at once share 2 cores

With `--grpo-steps 0` it stops after SFT and prints the SFT model's held-out accuracy; beside
`--no-split-digits` (a tokenizer that keeps multi-digit tokens), that measures what the digit split does
to arithmetic learnt from scratch:

    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/grpo_arith.py --sft-target 0 --grpo-steps 0 [--no-split-digits]

Without the pick (`--sft-target 0 --sft-steps 3000`: GRPO from the end of a 3,000-step SFT) the median gain
was +0.040. The earlier settings (bench/RESULTS.md): `--max-number 9 --d-model 64 --n-layer 2 --n-sft 200
--n-prompts 200 --n-heldout 50 --sft-steps 300 --sft-lr 1e-2 --grpo-steps 100 --lr 3e-4 --vocab 400`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator


def run(seed: int, a: argparse.Namespace, work: Path) -> dict[str, Any]:
    from nanolm.train.configure import load_config
    from nanolm.data.builtin.arith import write_arith
    from nanolm.data.kinds import iter_texts
    from nanolm.data.prepare import prepare
    from nanolm.tokenizer import train_tokenizer
    from nanolm.train.trainer import Trainer, train

    t0 = time.perf_counter()
    files = write_arith(work / "arith", a.n_sft, a.n_prompts, a.n_heldout, seed=seed, level=a.level,
                        max_number=a.max_number)
    train_tokenizer(iter_texts([files["sft"]], format="chat"), work / "tok", vocab_size=a.vocab, quiet=True,
                    split_digits=not a.no_split_digits)
    prepare([files["sft"]], work / "tok", work / "sft", format="chat", val_fraction=0, workers=0, quiet=True)
    # the prompts file then the held-out file; the val split (every 4th record) is the held-out set
    prepare([files["prompts"], files["heldout"]], work / "tok", work / "prompts", format="prompts",
            val_fraction=0.25, quiet=True)
    common = {"model.vocab_size": a.vocab, "model.d_model": a.d_model, "model.n_layer": a.n_layer,
              "model.n_head": a.n_head, "model.n_kv_head": a.n_head // 2, "model.max_seq_len": 96,
              "train.seq_len": 96,
              "model.dropout": 0.0, "train.eval_interval": 0, "train.save_interval": 0, "train.log_interval": 1,
              "train.seed": seed}
    every = {"train.save_interval": a.sft_every, "train.keep_last": a.sft_steps // a.sft_every} if a.sft_target else {}
    train(load_config("tiny", overrides={**common, "data.path": str(work / "sft"), "train.out_dir":
                                         str(work / "sftrun"), "train.max_steps": a.sft_steps,
                                         "train.batch_size": a.sft_batch, "optim.lr": a.sft_lr, "optim.min_lr": a.sft_lr / 10,
                                         "optim.warmup_steps": 10, **every}), quiet=True)
    t1 = time.perf_counter()

    def grpo_cfg(init_from: Path) -> Any:
        return load_config("tiny", overrides={
            **common, "data.path": str(work / "prompts"),
            "train.out_dir": str(work / "grpo"), "train.stage": "grpo", "train.init_from": str(init_from),
            "train.max_steps": max(1, a.grpo_steps), "train.batch_size": a.prompts_per_step, "train.eval_batches": 64,
            "optim.lr": a.lr, "optim.min_lr": a.lr, "grpo.group_size": a.group, "grpo.max_new_tokens": a.max_new_tokens,
            "grpo.temperature": a.temperature, "grpo.rewards": "answer", "grpo.beta": a.beta,
            "train.eval_interval": a.eval_every})

    def train_greedy(t: Any, batches: int = 1000) -> float:  # greedy decoding on the prompts GRPO trains on
        from nanolm.data.loader import iter_eval_batches
        from nanolm.data.shards import PackedData
        t.model.eval()
        got = t.objective.evaluate(t.model, iter_eval_batches(PackedData(work / "prompts", "train"), 8, 1, batches),
                                   t.compute, t.validation.token_bytes)
        t.model.train()
        return got["val_reward"]

    start, sft_pick = work / "sftrun", ""
    if a.sft_target:  # the first SFT checkpoint whose greedy accuracy on 200 of the RL prompts reaches the target
        from nanolm.checkpoint import step_dirs
        for ck in step_dirs(work / "sftrun"):
            acc = train_greedy(Trainer(grpo_cfg(ck), quiet=True), 25)
            start, sft_pick = ck, f"{ck.name} ({acc:.3f} on 200 RL prompts)"
            if acc >= a.sft_target:
                break
    t = Trainer(grpo_cfg(start), quiet=True)
    before = t.evaluate()
    if not a.grpo_steps:  # the SFT model alone: its held-out accuracy
        return {"seed": seed, "before": before["val_reward"], "sft_s": t1 - t0}
    train_before = train_greedy(t)
    t.run()
    train_after = train_greedy(t)
    rows = [json.loads(x) for x in (work / "grpo" / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["step"], r["val_reward"]) for r in rows if "val_reward" in r]
    steps = [r for r in rows if "reward" in r]
    return {"seed": seed, "before": before["val_reward"], "after": curve[-1][1], "curve": curve,
            "train_before": train_before, "train_after": train_after,
            "train_reward_first": sum(r["reward"] for r in steps[:5]) / len(steps[:5]),
            "train_reward_last": sum(r["reward"] for r in steps[-5:]) / len(steps[-5:]),
            "zero_var_first": steps[0]["zero_var_groups"], "sft_s": t1 - t0, "grpo_s": time.perf_counter() - t1,
            "sft_pick": sft_pick}


def flip_advantage_sign() -> None:
    """The control: every advantage negated (GRPO then follows the wrong answers)."""
    import nanolm.train.rl.grpo as grpo_module
    from nanolm.train.rl.formulas import group_advantages
    grpo_module.group_advantages = lambda *x, **k: -group_advantages(*x, **k)


def seed_options(p: argparse.ArgumentParser) -> None:
    """The options `per_seed` reads: --seeds, --flip-sign, --keep."""
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--flip-sign", action="store_true", help="the control: negate every advantage")
    p.add_argument("--keep", default="", help="a directory to keep each seed's files and runs in (seed<n>/)")


def per_seed(run_seed: Any, a: argparse.Namespace) -> Iterator[tuple[int, Any]]:
    """(seed, run_seed(seed, a, work)) for each of a.seeds, work being <a.keep>/seed<n> or a temporary
    directory; with a.flip_sign, every advantage is negated first (the control)."""
    if a.flip_sign:
        flip_advantage_sign()
    for s in a.seeds:
        if a.keep:
            yield s, run_seed(s, a, Path(a.keep) / f"seed{s}")
        else:
            with tempfile.TemporaryDirectory() as d:
                yield s, run_seed(s, a, Path(d))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    seed_options(p)
    p.add_argument("--n-sft", type=int, default=2400)
    p.add_argument("--n-prompts", type=int, default=1600)
    p.add_argument("--n-heldout", type=int, default=200)
    p.add_argument("--level", default="easy", choices=["easy", "standard"])
    p.add_argument("--max-number", type=int, default=30, help="numbers up to this")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--sft-batch", type=int, default=16)
    p.add_argument("--sft-steps", type=int, default=6000)
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--sft-target", type=float, default=0.65, help="start GRPO from the first SFT checkpoint (one "
                   "every --sft-every steps) whose greedy accuracy on 200 of the RL prompts reaches this; 0: the last")
    p.add_argument("--sft-every", type=int, default=500)
    p.add_argument("--grpo-steps", type=int, default=300)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=0, help="also score the held-out prompts every this many "
                   "GRPO steps (printed as a curve)")
    p.add_argument("--no-split-digits", action="store_true", help="the tokenizer without the digit split "
                   "(numbers learnt as multi-digit tokens); with --grpo-steps 0, compares digit splitting by the SFT "
                   "model's held-out accuracy")
    a = p.parse_args()
    res = []
    for s, r in per_seed(run, a):
        res.append(r)
        if not a.grpo_steps:
            print(f"seed {s}: held-out answer accuracy after SFT {r['before']:.3f} | SFT {r['sft_s']:.0f} s", flush=True)
            continue
        print(f"seed {s}: held-out answer accuracy {r['before']:.3f} -> {r['after']:.3f} | greedy on the train prompts "
              f"{r['train_before']:.3f} -> {r['train_after']:.3f} | sampled train reward (first 5 steps -> last 5) "
              f"{r['train_reward_first']:.3f} -> {r['train_reward_last']:.3f} | zero-var groups at step 1 "
              f"{r['zero_var_first']:.2f} | SFT {r['sft_s']:.0f} s, GRPO {r['grpo_s']:.0f} s"
              + (f" | GRPO from {r['sft_pick']}" if r["sft_pick"] else "")
              + (" | held out by step: " + ", ".join(f"{step}: {v:.3f}" for step, v in r["curve"]) if a.eval_every else ""),
              flush=True)
    med = statistics.median
    if not a.grpo_steps:
        print(f"median of {len(res)} seeds, held out after SFT: {med(r['before'] for r in res):.3f}")
        return
    print(f"median of {len(res)} seeds, held out: {med(r['before'] for r in res):.3f} -> "
          f"{med(r['after'] for r in res):.3f} "
          f"(gain {med(r['after'] - r['before'] for r in res):+.3f}); on the train prompts "
          f"{med(r['train_before'] for r in res):.3f} -> {med(r['train_after'] for r in res):.3f}")


if __name__ == "__main__":
    main()
