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
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--variants", default="default,adamw,fp32,tiny,default-26m")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the training processes")
    ap.add_argument("--work", type=Path, default=Path("runs/bench-quality"))
    ap.add_argument("--tag", default="", help="appended to the run directories' names (several invocations)")
    args = ap.parse_args()
    work = args.work / f"{args.corpus}-{args.chars}-v{args.vocab_size}"
    data = setup(work, args.corpus, args.chars, args.vocab_size)
    budget = ["--train.max_tokens", str(args.tokens)] if args.tokens else ["--train.max_minutes", str(args.minutes)]
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    results: list[dict] = []
    for i in range(args.runs):
        for name in names:
            r = run_one(data, work, name, i, budget, args.threads, args.tag)
            print(f"{name} run {i}: {r['bpb']:.4f} bpb, {r['steps']} steps, {r['tokens_per_s']:.0f} tok/s "
                  f"({r['wall_s']}s)", file=sys.stderr, flush=True)
            results.append(r)
    what = f"{args.tokens:,} tokens" if args.tokens else f"{args.minutes:g} min"
    print(f"\nheld-out bits per byte, {args.corpus} first {args.chars:,} chars (last 10% held out), vocab "
          f"{args.vocab_size}, {what} per run, median of {args.runs}")
    print("| variant | bpb (median) | runs | steps | epochs | params | tok/s | dtype | optim |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in names:
        rs = [r for r in results if r["variant"] == name]
        med = statistics.median(r["bpb"] for r in rs)
        each = ", ".join(f"{r['bpb']:.3f}" for r in rs)
        last = rs[-1]
        print(f"| {name} | {med:.3f} | {each} | {statistics.median(r['steps'] for r in rs):.0f} | "
              f"{statistics.median(r['epochs'] for r in rs):.2f} | {last['params'] / 1e6:.2f}M | "
              f"{statistics.median(r['tokens_per_s'] for r in rs):.0f} | {last['dtype']} | {last['optim']} |")
    print(json.dumps({"corpus": args.corpus, "chars": args.chars, "vocab_size": args.vocab_size, "budget": what,
                      "load_avg": os.getloadavg(), "results": results}))


if __name__ == "__main__":
    main()
