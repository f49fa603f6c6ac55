"""Multiple-choice scoring speed: items per second of `nanolm eval --task` at a preset, on this machine.

A model of the preset (random init: the speed does not depend on the weights)
and the tokenizer of the built-in benchmark's size (a BPE trained here on the
built-in idioms corpus, `--vocab-size` tokens) score the built-in task's
first `--items` items (4 choices each, Chinese idiom explanations) through
`nanolm.eval.scoring.score_mc`, the function `nanolm eval --task` and
`train.eval_tasks` use, `--repeats` times at each `--batch-sizes`. Reported:
the median items/s and choices/s, and the tokens per forward row.

    python bench/eval_mc.py --preset minimind-26m --items 64 --repeats 5

Progress goes to stderr; stdout gets the table and, as its last line, one
JSON object with every figure. On a CPU shared with other busy processes the
numbers are lower and noisier: the load average is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="minimind-26m")
    ap.add_argument("--items", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch-sizes", default="8,32", help="rows (choices) per forward pass, comma-separated")
    ap.add_argument("--vocab-size", type=int, default=6400)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from nanolm.train.configure import load_config
    from nanolm.corpora import fetch
    from nanolm.data.kinds import iter_texts
    from nanolm.eval.builtin import idiom_task
    from nanolm.eval.scoring import encode_pair, mc_strings, score_mc
    from nanolm.model.transformer import Transformer, count_params
    from nanolm.tokenizer import train_tokenizer

    idioms = fetch("idioms", quiet=True)
    task = idiom_task(idioms, args.items)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"training a {args.vocab_size}-token tokenizer on the idioms corpus ...", file=sys.stderr)
        tok = train_tokenizer(iter_texts([idioms], format="chat"), Path(tmp) / "tok", args.vocab_size, quiet=True)
    cfg = load_config(args.preset, overrides={"model.vocab_size": tok.vocab_size}).model
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    rows = [len(c) + len(x) - 1 for it in task.items
            for c, x in (encode_pair(tok, *pair) for pair in [(mc_strings(it)[0], ch) for ch in mc_strings(it)[1]])]
    n_choices = sum(len(it.choices) for it in task.items)
    results = []
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        score_mc(model, tok, task.items[:4], batch_size=bs)  # warm-up
        times = []
        for r in range(args.repeats):
            t0 = time.perf_counter()
            score_mc(model, tok, task.items, batch_size=bs)
            times.append(time.perf_counter() - t0)
            print(f"batch {bs}: run {r + 1}/{args.repeats} {times[-1]:.2f}s", file=sys.stderr)
        med = statistics.median(times)
        results.append({"batch_size": bs, "median_s": med, "items_per_s": len(task.items) / med,
                        "choices_per_s": n_choices / med, "times_s": times})
    params = count_params(model)["total"]
    print(f"{args.preset}: {params / 1e6:.1f}M parameters, vocab {tok.vocab_size}, {len(task.items)} items x 4 "
          f"choices, {statistics.mean(rows):.0f} tokens per row (mean), {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'batch':>6} {'median s':>9} {'items/s':>8} {'choices/s':>10}")
    for r in results:
        print(f"{r['batch_size']:>6} {r['median_s']:>9.2f} {r['items_per_s']:>8.1f} {r['choices_per_s']:>10.1f}")
    print(json.dumps({"preset": args.preset, "params": params, "items": len(task.items),
                      "mean_row_tokens": statistics.mean(rows), "threads": torch.get_num_threads(),
                      "loadavg": os.getloadavg(), "results": results}))


if __name__ == "__main__":
    main()
