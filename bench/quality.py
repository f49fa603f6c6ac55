"""Quality per CPU-minute: held-out bits per byte after a fixed training budget, for nanolm's options.

The text is one .txt file made from a built-in corpus (its first works, in
order, joined until `--chars` characters), so `nanolm prepare` splits it by
position: the last 10% of its characters are the validation text, which no
training step sees, as nanoGPT splits its one file. A tokenizer is trained on
the first 90% only (`--vocab-size`, default nanolm's 6400). Each variant is
then one `nanolm train` process (the user's command, with `--train.max_minutes`
or `--train.max_tokens` and the variant's options), scored by `nanolm eval`'s
function on the whole validation split: every held-out token predicted once,
bits per byte over the UTF-8 bytes of the held-out text.

Variants (`--variants`, comma-separated):

    default        no preset, only the budget: the path a user with N minutes types (a budget of at most 30
                   minutes trains the cpu-small preset: Muon + AdamW, bf16 autocast where the CPU has it; 256
                   wide instead of 128 where the budget would see the data many times, nanolm/train/sizing.py)
    default-26m    the same with the model nanolm's defaults built before budget sizing (minimind-26m shape)
    adamw, muon    the default path with --optim.name adamw / muon
    fp32, bf16     the default path with --train.dtype float32 / bfloat16
    tiny, cpu-small  --preset tiny / cpu-small with the budget
    key=value;...  any overrides, e.g. "model.d_model=192;optim.lr=3e-3" (named as given)
    nanogpt        nanoGPT's README CPU recipe (karpathy/nanoGPT, a checkout given as --nanogpt DIR, its public
                   code run unchanged) on the same characters, split where nanolm splits them: its own
                   data/shakespeare_char/prepare.py copied beside the text into DIR/data/<name>/, then its
                   train.py for --minutes (it saves at every evaluation, 100 iterations, so the newest weights
                   are on disk when the time is up), its last checkpoint scored on the whole held-out text

With `--equal-time`, `--tokens` is the first variant's budget and every other
variant gets the tokens it trains in the same time: `--tokens` times its step
rate over the first's (`nanolm/train/sizing.py`'s `step_rate`, each variant
timed in this process (a learning rate or weight decay changes no step's cost:
variants that differ only in those share one timing), alternately, with `--rate-threads` threads (default
`--threads`), before any run).
A shape that costs more per token then trains on fewer tokens, as it would in
a time budget, while the result no longer depends on the machine's load
during the runs (two runs can share the machine). Its variants name a preset.

Each variant runs `--runs` times, interleaved (variant A, B, ..., then A, B
again) so that a shared machine's load falls on all alike; the table gives
the median and each run's value, with steps, parameters and tokens/s.

    python bench/quality.py --corpus shakespeare --minutes 3 --runs 3 --threads 1 --variants default,adamw,fp32

Progress and the training logs go to <work>/runs/<variant>-<run>.log; stdout gets the table and, last, one JSON
line with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

NAMED = {
    "default": [],
    "default-26m": ["--model.d_model", "512", "--model.n_layer", "8", "--model.n_head", "8", "--model.n_kv_head", "2"],
    "adamw": ["--optim.name", "adamw"],
    "muon": ["--optim.name", "muon"],
    "fp32": ["--train.dtype", "float32"],
    "bf16": ["--train.dtype", "bfloat16"],
    "tiny": ["--preset", "tiny"],
    "cpu-small": ["--preset", "cpu-small"],
}


def make_text(corpus: str, chars: int, out: Path) -> tuple[str, int]:
    """The corpus's first works joined by a blank line until `chars` characters, written to `out`; returns the
    text and the cut (the first character of the validation part, as prepare and nanoGPT's split place it)."""
    from nanolm.corpora import fetch
    parts, n = [], 0
    with open(fetch(corpus, quiet=True), encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"].replace("\r\n", "\n").strip() + "\n"
            parts.append(text)
            n += len(text)
            if n >= chars:
                break
    text = "\n".join(parts)
    out.write_text(text, encoding="utf-8", newline="\n")
    return text, int(len(text) * 0.9)


def setup(work: Path, corpus: str, chars: int, vocab_size: int) -> Path:
    """Text, tokenizer (trained on the first 90%) and prepared data in `work`; returns the data directory."""
    from nanolm.data.prepare import prepare
    from nanolm.tokenizer import train_tokenizer
    work.mkdir(parents=True, exist_ok=True)
    text, cut = make_text(corpus, chars, work / f"{corpus}.txt")
    data = work / "data"
    if not (data / "manifest.json").is_file():
        train_tokenizer([text[:cut]], work / "tokenizer", vocab_size=vocab_size, quiet=True)
        prepare([work / f"{corpus}.txt"], work / "tokenizer", data, val_fraction=0.1, workers=1, quiet=True)
    from nanolm.data.shards import Manifest
    policy = Manifest.read(data).split_policy
    assert policy["by_position"] == 1, policy  # one document, split by position
    return data


def variant_args(name: str) -> list[str]:
    if name in NAMED:
        return NAMED[name]
    args = []
    for item in filter(None, name.split(";")):
        key, _, value = item.partition("=")
        if not value:
            raise SystemExit(f"--variants: {item!r} is neither a named variant ({', '.join(NAMED)}) nor key=value")
        args += [f"--{key.removeprefix('--')}", value]
    return args


# Settings that change no step's cost: variants that differ only in these share one timing.
COST_FREE = {"--optim.lr", "--optim.min_lr", "--optim.muon_lr", "--optim.weight_decay", "--optim.warmup_steps",
             "--train.seed"}


def cost_key(name: str) -> str:
    """The variant's settings without the COST_FREE ones: variants with the same key cost the same per step."""
    args = variant_args(name)
    return ";".join(f"{k}={v}" for k, v in sorted(zip(args[::2], args[1::2])) if k not in COST_FREE)


def variant_config(name: str):
    """The Config a variant trains (its preset and overrides; the budget left out)."""
    from nanolm.train.configure import load_config
    args, preset, over = variant_args(name), None, {}
    for key, value in zip(args[::2], args[1::2]):
        if key == "--preset":
            preset = value
        else:
            over[key.removeprefix("--")] = value
    if preset is None:
        raise SystemExit(f"--equal-time: variant {name!r} names no preset (e.g. \"preset=cpu-small;...\")")
    return load_config(preset, overrides={**over, "train.max_tokens": 1})


def equal_time_tokens(names: list[str], tokens: int, threads: int | None, rates_file: Path | None = None,
                      rounds: int = 3) -> dict[str, int]:
    """Each variant's token budget: `tokens` times its step rate over the first variant's. A rate is the median
    of `rounds` alternated timings (sizing.step_rate) in this process, one per cost (cost_key: a learning rate
    or weight decay changes nothing); those already in `rates_file` (JSON, cost key -> tokens/s) are read from
    it, and the file gets the new ones."""
    import torch
    from nanolm.train.sizing import step_rate
    if threads:
        torch.set_num_threads(threads)
    known = json.loads(rates_file.read_text()) if rates_file and rates_file.is_file() else {}
    keys = {n: cost_key(n) for n in names}
    todo = {k: variant_config(n) for n, k in keys.items() if k not in known}
    timed: dict[str, list[float]] = {k: [] for k in todo}
    for _ in range(rounds):
        for k, cfg in todo.items():
            timed[k].append(step_rate(cfg))
    rate = {**known, **{k: statistics.median(r) for k, r in timed.items()}}
    if rates_file:
        rates_file.write_text(json.dumps(rate, indent=1) + "\n")
    first = rate[keys[names[0]]]
    budget = {n: round(tokens * rate[keys[n]] / first) for n in names}
    for n in names:
        k = keys[n]
        how = f"timed {', '.join(f'{r:,.0f}' for r in timed[k])}" if k in timed else f"from {rates_file}"
        print(f"{n}: {rate[k]:,.0f} tokens/s ({how}), {rate[k] / first:.3f} of the first: {budget[n]:,} tokens",
              file=sys.stderr, flush=True)
    return budget


NANOGPT_RECIPE = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
                  "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
                  "--n_embd=128", "--dropout=0.0", "--eval_interval=100", "--always_save_checkpoint=True"]


def run_nanogpt(src: Path, text: Path, work: Path, minutes: float, i: int, threads: int | None,
                tag: str = "", iters: int = 2000) -> dict:
    """nanoGPT's README CPU recipe on `text` for `minutes`, its last checkpoint scored on the held-out part:
    every character after the held-out part's first predicted once, in windows of its block size (64), as
    nats / ln 2 over the UTF-8 bytes predicted."""
    import math
    import shutil

    import numpy as np
    import torch
    if not (src / "train.py").is_file():
        raise SystemExit(f"--nanogpt {src}: no train.py there; pass the root of a nanoGPT checkout")
    ds = f"nanolm_{work.name}"
    d = src / "data" / ds
    if not (d / "val.bin").is_file():
        d.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(text, d / "input.txt")
        shutil.copyfile(src / "data" / "shakespeare_char" / "prepare.py", d / "prepare.py")
        subprocess.run([sys.executable, "prepare.py"], cwd=d, check=True, stdout=subprocess.DEVNULL)
    out = (work / "runs" / f"nanogpt-{i}{tag}").resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    log = out.parent / f"{out.name}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "train.py", *NANOGPT_RECIPE, f"--max_iters={iters}",
                                 f"--lr_decay_iters={iters}", f"--dataset={ds}", f"--out_dir={out}"],
                                cwd=src, stdout=f, stderr=subprocess.STDOUT, env=env)
        try:
            proc.wait(timeout=minutes * 60 + 10)  # its start (imports, data) takes a few seconds
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    wall = time.perf_counter() - t0
    from peers import load_module  # bench/peers.py
    model_py = load_module(src / "model.py", "nanogpt")
    ckpt = torch.load(out / "ckpt.pt", map_location="cpu", weights_only=True)
    model = model_py.GPT(model_py.GPTConfig(**ckpt["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
    model.eval()
    val = torch.from_numpy(np.fromfile(d / "val.bin", dtype=np.uint16).astype(np.int64))
    block = ckpt["model_args"]["block_size"]
    nats = 0.0
    with torch.no_grad():
        for a in range(0, len(val) - 1, block):
            x, y = val[a:a + block], val[a + 1:a + block + 1]
            logits, _ = model(x[None, :len(y)], targets=y[None])
            nats += torch.nn.functional.cross_entropy(logits[0].float(), y, reduction="sum").item()
    whole = text.read_text(encoding="utf-8")
    cut = int(len(whole) * 0.9)  # prepare.py's split
    n_bytes = len(whole[cut + 1:].encode("utf-8"))
    seen = ckpt["iter_num"] * ckpt["config"]["batch_size"] * block  # characters trained on
    return {"variant": "nanogpt", "run": i, "bpb": nats / math.log(2) / n_bytes, "val_tokens": len(val) - 1,
            "val_bytes": n_bytes, "steps": ckpt["iter_num"], "tokens": seen, "epochs": seen / cut,
            "stop": "max_iters" if ckpt["iter_num"] >= iters else "time",
            "tokens_per_s": 0.0, "params": sum(p.numel() for p in model.parameters()), "dtype": "float32",
            "optim": "adamw", "wall_s": round(wall, 1), "model": ckpt["model_args"],
            "batch": [ckpt["config"]["batch_size"], block], "lr": ckpt["config"]["learning_rate"]}


def run_one(data: Path, work: Path, name: str, i: int, budget: list[str], threads: int | None,
            tag: str = "") -> dict:
    from nanolm.eval.loss import evaluate
    out = work / "runs" / f"{name.replace('/', '_').replace(';', '+')}-{i}{tag}"
    if out.exists():
        import shutil
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "nanolm", "train", "--data", str(data), "--train.out_dir", str(out), *budget,
           *variant_args(name)]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    log = out.parent / f"{out.name}.log"  # not with_suffix: a value such as 4e-3 has a dot
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"{name} run {i} failed (exit {rc}); see {log}")
    res = evaluate(out, [data], which="best", batch_size=8, quiet=True)
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r and "tokens_per_s" in r]
    stop = next(r for r in recs if r.get("event") == "stop")
    cfg = json.loads((out / "config.json").read_text())
    from nanolm.config import ModelConfig
    from nanolm.model.transformer import Transformer, count_params
    params = count_params(Transformer(ModelConfig.from_dict(cfg["model"])))["total"]
    text = log.read_text()
    dtype = next((ln.split("compute dtype: ")[1].split(" ")[0] for ln in text.splitlines() if "compute dtype" in ln),
                 "?")
    train_tokens = json.loads((data / "manifest.json").read_text())["splits"]["train"]["n_tokens"]
    return {"variant": name, "run": i, "bpb": res["bpb"], "val_tokens": res["tokens"], "val_bytes": res["bytes"],
            "steps": stop["step"], "tokens": stop["tokens"], "epochs": stop["tokens"] / train_tokens,
            "stop": stop["reason"],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps[1:] or steps) if steps else 0.0,
            "params": params, "dtype": dtype, "optim": cfg["optim"]["name"], "wall_s": round(wall, 1),
            "model": {k: cfg["model"][k] for k in ("vocab_size", "d_model", "n_layer", "n_head", "n_kv_head")},
            "batch": [cfg["train"]["batch_size"], cfg["train"]["seq_len"]], "lr": cfg["optim"]["lr"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default="shakespeare", help="a built-in text corpus (nanolm data list)")
    ap.add_argument("--chars", type=int, default=1_000_000, help="characters of the corpus to use (~1 MB)")
    ap.add_argument("--vocab-size", type=int, default=6400)
    ap.add_argument("--minutes", type=float, default=3.0, help="the training budget of each run")
    ap.add_argument("--tokens", type=int, default=0, help="a token budget instead of --minutes")
    ap.add_argument("--equal-time", action="store_true",
                    help="with --tokens: the first variant's budget; the others get the tokens their timed step "
                         "rate buys in the same time")
    ap.add_argument("--rate-threads", type=int, default=None,
                    help="threads of the --equal-time timings (default --threads): the machine the budget stands for")
    ap.add_argument("--rates", type=Path, default=None,
                    help="a JSON file of --equal-time step rates (settings -> tokens/s): those in it are not timed "
                         "again, new ones are added (time once, then run invocations side by side; --runs 0 "
                         "only times)")
    ap.add_argument("--nanogpt", type=Path, default=None, help="a nanoGPT checkout, for the nanogpt variant")
    ap.add_argument("--nanogpt-iters", type=int, default=2000,
                    help="the nanogpt variant's max_iters and lr_decay_iters (its README recipe's: 2000)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--variants", default="default,adamw,fp32,tiny,default-26m")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the training processes")
    ap.add_argument("--work", type=Path, default=Path("runs/bench-quality"))
    ap.add_argument("--tag", default="", help="appended to the run directories' names (several invocations)")
    args = ap.parse_args()
    work = args.work / f"{args.corpus}-{args.chars}-v{args.vocab_size}"
    data = setup(work, args.corpus, args.chars, args.vocab_size)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.equal_time and not args.tokens:
        raise SystemExit("--equal-time needs --tokens (the first variant's budget)")
    if args.equal_time:
        tokens = equal_time_tokens(names, args.tokens, args.rate_threads or args.threads, args.rates)
        budgets = {n: ["--train.max_tokens", str(t)] for n, t in tokens.items()}
    else:
        budgets = {n: ["--train.max_tokens", str(args.tokens)] if args.tokens else
                   ["--train.max_minutes", str(args.minutes)] for n in names}
    results: list[dict] = []
    for i in range(args.runs):
        for name in names:
            if name == "nanogpt":
                if not args.nanogpt or args.tokens:
                    raise SystemExit("the nanogpt variant needs --nanogpt DIR and a time budget (--minutes)")
                r = run_nanogpt(args.nanogpt, work / f"{args.corpus}.txt", work, args.minutes, i, args.threads,
                                args.tag, args.nanogpt_iters)
            else:
                r = run_one(data, work, name, i, budgets[name], args.threads, args.tag)
            print(f"{name} run {i}: {r['bpb']:.4f} bpb, {r['steps']} steps, {r['tokens_per_s']:.0f} tok/s "
                  f"({r['wall_s']}s)", file=sys.stderr, flush=True)
            results.append(r)
    if not results:
        return
    what = (f"{args.tokens:,} tokens for the first variant, the others the same time" if args.equal_time else
            f"{args.tokens:,} tokens" if args.tokens else f"{args.minutes:g} min")
    print(f"\nheld-out bits per byte, {args.corpus} first {args.chars:,} chars (last 10% held out), vocab "
          f"{args.vocab_size}, {what} per run, median of {args.runs}")
    print("| variant | bpb (median) | runs | steps | tokens | epochs | params | tok/s | dtype | optim |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        rs = [r for r in results if r["variant"] == name]
        med = statistics.median(r["bpb"] for r in rs)
        each = ", ".join(f"{r['bpb']:.3f}" for r in rs)
        last = rs[-1]
        print(f"| {name} | {med:.3f} | {each} | {statistics.median(r['steps'] for r in rs):.0f} | "
              f"{statistics.median(r['tokens'] for r in rs):,.0f} | "
              f"{statistics.median(r['epochs'] for r in rs):.2f} | {last['params'] / 1e6:.2f}M | "
              f"{statistics.median(r['tokens_per_s'] for r in rs):.0f} | {last['dtype']} | {last['optim']} |")
    print(json.dumps({"corpus": args.corpus, "chars": args.chars, "vocab_size": args.vocab_size, "budget": what,
                      "load_avg": os.getloadavg(), "results": results}))


if __name__ == "__main__":
    main()
