"""Agentic GRPO from the quickstart's fine-tuned model: held-out `calc` before and after.

Per seed: `nanolm quickstart --out DIR` (or an existing quickstart directory with `--from`, `{seed}` in it
replaced), then the built-in calculator prompts (`nanolm data tools --prompts`, `nanolm.data.builtin.tooluse`: the
question, and the calculator's result as the reference answer, in phrasings that neither the fine-tuning set
nor the `calc` benchmark uses; `--phrasings tooluse` takes questions of the fine-tuning set's own phrasings
instead; the benchmark's number pairs are never among them), prepared as prompts, and GRPO from the
quickstart's SFT run with the built-in tools in the loop (`grpo.tools builtin`: each trajectory's calls are
run and their results fed back, up to `--max-rounds` replies) and the `answer` reward. The held-out `calc`
benchmark (its first `--items` items, scored as `nanolm eval --task calc` scores them) is measured on the SFT
model and on the GRPO run's last checkpoint; prints both for each seed (with the misses by kind and each
held-out phrasing's count, before and after) and the median gain. So are `--fresh` questions in the GRPO
prompts' own phrasings over numbers the prompts do not use (greedy, scored as `calc` scores): what GRPO learnt
where it trained, apart from whether it carries to the benchmark's phrasings. `--pass-rates K` first samples K answers to
GRPO prompts and to held-out items at the rollout's temperature: the share the SFT model gets never, sometimes
and always right (only prompts answered sometimes give a group something to learn from). `--set KEY=VALUE`
changes any other setting of the GRPO run; `--written-out` keeps only the prompts that write their operation
out ("23 + 95 等于几？"). `--flip-sign` runs the control: every advantage negated. Run from the repository root:

    PYTHONPATH=. python bench/agent_calc.py --seeds 0 1 2                      # a quickstart per seed
    PYTHONPATH=. python bench/agent_calc.py --seeds 0 --from /tmp/qs           # an existing quickstart
    PYTHONPATH=. python bench/agent_calc.py --seeds 0 --from /tmp/qs --flip-sign
    PYTHONPATH=. python bench/agent_calc.py --seeds 0 --from /tmp/qs --pass-rates 8 --set grpo.beta=0.2
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


WRITTEN_OUT = re.compile(r"\d+ [-+*x/] \d+")  # a question that writes its operation out: "23 + 95 等于几？"


def calc_prompts(out: Path, n: int, seed: int, phrasings: str = "rl", written_out: bool = False) -> Path:
    """n calculator prompts, {"prompt": question, "answer": result}: with phrasings "rl", the built-in RL prompts
    (`nanolm.data.builtin.tooluse.calculator_prompts`: phrasings neither fine-tuning nor the benchmark uses); with
    "tooluse", or with written_out, questions of the fine-tuning set's own phrasings, with written_out only those
    that write their operation out (WRITTEN_OUT), none that names it in words."""
    from nanolm.data.builtin.tooluse import build_calculator_conversations, calculator_prompts
    from nanolm.infer.tools import BUILTIN_TOOLS, calculator
    if phrasings == "rl" and not written_out:
        return calculator_prompts(out, n, seed, calculator=calculator)
    convs = build_calculator_conversations(out.with_suffix(".tools.jsonl"), (20 if written_out else 2) * n, seed,
                                           calculator=calculator, tools=BUILTIN_TOOLS)
    lines = []
    for line in convs.read_text(encoding="utf-8").splitlines():
        m = json.loads(line)["messages"]
        # a question answered through the calculator
        if len(m) == 4 and len(lines) < n and (not written_out or WRITTEN_OUT.search(m[0]["content"])):
            lines.append(json.dumps({"prompt": m[0]["content"], "answer": m[2]["content"]}, ensure_ascii=False) + "\n")
    out.write_text("".join(lines), encoding="utf-8")
    return out


def calc_accuracy(run: Path, which: str, items: int, work: Path) -> dict[str, float]:
    from nanolm.eval.runner import run_eval
    res = run_eval(run, [f"calc:n={items}"], which=which, out=work / f"calc-{run.name}.json")["tasks"][0]
    return {k: res[k] for k in ("acc", "called", "computed", "misses", "by_phrasing")}


def fresh_items(prompts: Path, n: int, seed: int, a: argparse.Namespace) -> list[Any]:
    """n questions in the GRPO prompts' own phrasings over other numbers (the same generator, another seed; a
    question that is also a GRPO prompt is left out), as `calc` items: what GRPO learnt on its own phrasings,
    apart from whether it carries to the benchmark's."""
    from nanolm.data.builtin.tooluse import CalcItem
    seen = {json.loads(line)["prompt"] for line in prompts.read_text(encoding="utf-8").splitlines()}
    extra = calc_prompts(prompts.with_name("fresh_prompts.jsonl"), 2 * n, seed, phrasings=a.phrasings,
                         written_out=a.written_out)
    records = [json.loads(line) for line in extra.read_text(encoding="utf-8").splitlines()]
    return [CalcItem(r["prompt"], "", r["answer"]) for r in records if r["prompt"] not in seen][:n]


def fresh_accuracy(run: Path, which: str, items: list[Any]) -> float:
    """Greedy accuracy on `items` (fresh_items), scored as `calc` scores its items."""
    from nanolm.checkpoint import load_model
    from nanolm.eval.calc import score_calc
    from nanolm.infer.engine import Engine
    from nanolm.tokenizer import Tokenizer
    model, ckpt = load_model(run, which, "cpu")
    return score_calc(Engine(model), Tokenizer.load(ckpt), items, rows=32)["acc"]


def pass_rates(run: Path, prompts: Path, k: int, items: int, temperature: float) -> dict[str, dict[str, Any]]:
    """How often the SFT model samples a right answer, at the rollout's temperature, k tries each: over the first
    `items` GRPO prompts and the first `items` held-out `calc` items, the share never right, sometimes right and
    always right; and per held-out phrasing, [items never right, items]. Only prompts answered sometimes give
    a group whose rewards differ, something to learn from."""
    from nanolm.checkpoint import load_model
    from nanolm.data.builtin.tooluse import CalcItem
    from nanolm.eval.calc import calc_task, score_calc
    from nanolm.infer.engine import Engine
    from nanolm.tokenizer import Tokenizer
    model, ckpt = load_model(run, "best", "cpu")
    engine, tok = Engine(model), Tokenizer.load(ckpt)
    rl = [json.loads(line) for line in prompts.read_text(encoding="utf-8").splitlines()[:items]]
    sets = {"GRPO prompts": [CalcItem(r["prompt"], "", r["answer"]) for r in rl],
            "held-out calc": list(calc_task(items).items)}
    out = {}
    for name, its in sets.items():
        res = score_calc(engine, tok, [it for it in its for _ in range(k)], rows=32, temperature=temperature)
        right = [sum(p["correct"] for p in res["items"][i * k:(i + 1) * k]) for i in range(len(its))]
        out[name] = {"never": sum(r == 0 for r in right) / len(its), "always": sum(r == k for r in right) / len(its)}
        out[name]["sometimes"] = 1 - out[name]["never"] - out[name]["always"]
        for it, r in zip(its, right):
            if it.phrasing:  # the held-out items: their phrasings' items never sampled right
                count = out.setdefault("held-out phrasings", {}).setdefault(it.phrasing, [0, 0])
                count[0] += r == 0
                count[1] += 1
    return out


def run(seed: int, a: argparse.Namespace, work: Path) -> dict[str, Any]:
    from nanolm.train.configure import load_config
    from nanolm.data.prepare import prepare
    from nanolm.tokenizer import Tokenizer
    from nanolm.train.trainer import train

    t0 = time.perf_counter()
    qs = Path(a.from_dir.format(seed=seed)) if a.from_dir else work / "qs"
    if not a.from_dir:
        subprocess.run([sys.executable, "-m", "nanolm", "quickstart", "--out", str(qs)], check=True,
                       stdout=subprocess.DEVNULL)
    quickstart_s = time.perf_counter() - t0
    tok_dir = qs / "tokenizer"
    work.mkdir(parents=True, exist_ok=True)
    prompts = calc_prompts(work / "calc_prompts.jsonl", a.prompts, seed=1000 + seed, phrasings=a.phrasings,
                           written_out=a.written_out)
    prepare([prompts], tok_dir, work / "prompts", format="prompts", val_fraction=0.05, workers=0, quiet=True)
    before = calc_accuracy(qs / "sft", "best", a.items, work)
    fresh = fresh_items(prompts, a.fresh, 3000 + seed, a)
    fresh_before = fresh_accuracy(qs / "sft", "best", fresh)
    rates = pass_rates(qs / "sft", prompts, a.pass_rates, a.pass_items, a.temperature) if a.pass_rates else {}
    seq = 2 * load_config(a.preset).train.seq_len  # the quickstart's fine-tuning length
    cfg = load_config(a.preset, overrides={
        "data.path": str(work / "prompts"), "train.out_dir": str(work / "agent"), "train.stage": "grpo",
        "train.init_from": str(qs / "sft"), "model.vocab_size": Tokenizer.load(tok_dir).vocab_size,
        "model.max_seq_len": seq, "train.max_steps": a.steps, "train.batch_size": a.batch,
        "train.eval_interval": 0, "train.save_interval": 0, "train.log_interval": 1, "train.seed": seed,
        "optim.name": "adamw", "optim.lr": a.lr, "optim.min_lr": a.lr,  # the preset's Muon at 0.02 wrecks RL
        "grpo.group_size": a.group, "grpo.max_new_tokens": a.max_new_tokens,
        "grpo.temperature": a.temperature, "grpo.tools": "builtin", "grpo.max_rounds": a.max_rounds,
        "grpo.rewards": "answer", **dict(kv.split("=", 1) for kv in a.set)})
    t1 = time.perf_counter()  # GRPO's time is the training run's alone
    train(cfg, quiet=True)
    t2 = time.perf_counter()
    after = calc_accuracy(work / "agent", "last", a.items, work)
    fresh_after = fresh_accuracy(work / "agent", "last", fresh)
    rows = [json.loads(line) for line in (work / "agent" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward" in r]
    return {"seed": seed, "before": before, "after": after, "fresh": [fresh_before, fresh_after, len(fresh)],
            "pass_rates": rates, "quickstart_s": quickstart_s,
            "grpo_s": t2 - t1, "total_s": time.perf_counter() - t0,
            "reward_first": statistics.mean(r["reward"] for r in steps[:10]),
            "reward_last": statistics.mean(r["reward"] for r in steps[-10:])}


def main() -> None:
    from grpo_arith import per_seed, seed_options  # bench/ is the script's directory
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    seed_options(p)
    p.add_argument("--from", dest="from_dir", default="", help="an existing quickstart directory ({seed} replaced)")
    p.add_argument("--preset", default="cpu-small", help="the quickstart's preset")
    p.add_argument("--prompts", type=int, default=2000)
    p.add_argument("--items", type=int, default=200, help="held-out calc items scored before and after")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-5, help="AdamW's, for every weight")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-new-tokens", type=int, default=256, help="the model's tokens over a whole trajectory")
    p.add_argument("--max-rounds", type=int, default=2)
    p.add_argument("--phrasings", choices=("rl", "tooluse"), default="rl",
                   help="the GRPO prompts' phrasings: the built-in RL prompts' own (rl) or the fine-tuning set's")
    p.add_argument("--written-out", action="store_true",
                   help="only prompts of the fine-tuning set's phrasings that write their operation out (23 + 95)")
    p.add_argument("--fresh", type=int, default=200,
                   help="questions in the GRPO prompts' phrasings over numbers they do not use, scored before and after")
    p.add_argument("--pass-rates", type=int, default=0, metavar="K",
                   help="first sample K answers to each of --pass-items GRPO prompts and held-out items at the "
                        "rollout's temperature: the share the SFT model gets never, sometimes and always right")
    p.add_argument("--pass-items", type=int, default=100)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other setting of the GRPO run (repeatable), e.g. grpo.beta=0.1")
    a = p.parse_args()
    res = []
    for s, r in per_seed(run, a):
        res.append(r)
        b, f = r["before"], r["after"]
        print(f"seed {s}: held-out calc {b['acc']:.3f} -> {f['acc']:.3f} (called {b['called']:.2f} -> "
              f"{f['called']:.2f}, computed {b['computed']:.3f} -> {f['computed']:.3f}) | sampled reward (first 10 "
              f"steps -> last 10) {r['reward_first']:.3f} -> {r['reward_last']:.3f} | quickstart "
              f"{r['quickstart_s']:.0f} s, GRPO {r['grpo_s']:.0f} s, the seed in all {r['total_s']:.0f} s", flush=True)
        fb, fa, fn = r["fresh"]
        print(f"  the GRPO prompts' phrasings over other numbers ({fn} questions, greedy): {fb:.3f} -> {fa:.3f}")
        print("  missed, before -> after: " + ", ".join(f"{k} {b['misses'][k]} -> {f['misses'][k]}"
                                                     for k in b["misses"]))
        rates = r["pass_rates"]
        for name in ("GRPO prompts", "held-out calc"):
            if name in rates:
                pr = rates[name]
                print(f"  {name}, {a.pass_rates} samples each at temperature {a.temperature}: never right "
                      f"{pr['never']:.0%}, sometimes {pr['sometimes']:.0%}, always {pr['always']:.0%}")
        never = rates.get("held-out phrasings", {})
        print("  held-out calc right, before -> after" + (f" (items never right in {a.pass_rates} samples)"
                                                         if never else "") + ":")
        for phrasing, c in b["by_phrasing"].items():
            extra = f" ({never[phrasing][0]} of {never[phrasing][1]})" if phrasing in never else ""
            after = f["by_phrasing"][phrasing]["correct"]
            print(f"  {c['correct']:>3} -> {after:>3} of {c['n']:<3}{extra:10} {phrasing}")
    gains = [r["after"]["acc"] - r["before"]["acc"] for r in res]
    print(f"median of {len(res)} seeds: held-out calc {statistics.median(r['before']['acc'] for r in res):.3f} -> "
          f"{statistics.median(r['after']['acc'] for r in res):.3f} (gain {statistics.median(gains):+.3f}); the GRPO "
          f"prompts' phrasings over other numbers: gain {statistics.median(r['fresh'][1] - r['fresh'][0] for r in res):+.3f}")


if __name__ == "__main__":
    main()
