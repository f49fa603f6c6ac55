"""Tokenization throughput of `nanolm prepare` on every built-in corpus.

Fetches the built-in corpora (from the cache when they are there), trains one
byte-level BPE tokenizer on the text corpora, then prepares each corpus with
`--workers` processes (text corpora as pretraining documents, chat corpora as
conversations with their loss masks), each into a fresh directory. Reports per
corpus and in total: the MB of UTF-8 text read, seconds, MB/s and tokens/s,
the median of `--repeats` runs. The clock covers the whole `prepare` call:
starting the worker processes, reading and validating the JSONL, tokenizing,
writing the shards and the manifest.

    python bench/prepare.py                    # 2 workers, vocabulary 6400, 3 repeats
    python bench/prepare.py --workers 1 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from nanolm import corpora
from nanolm.data.kinds import iter_texts
from nanolm.data.prepare import prepare
from nanolm.tokenizer import train_tokenizer


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=6400)
    p.add_argument("--repeats", type=int, default=3, help="timed prepare runs per corpus (median)")
    args = p.parse_args(argv)

    names = list(corpora.REGISTRY)
    paths = {name: corpora.fetch(name, quiet=True) for name in names}
    kinds = {name: corpora.REGISTRY[name].records for name in names}
    results: dict = {"workers": args.workers, "vocab_size": args.vocab_size, "corpora": {}}
    with tempfile.TemporaryDirectory(prefix="nanolm-bench-prepare-") as tmp:
        t0 = time.perf_counter()
        text_sources = [paths[n] for n in names if kinds[n] == "text"]
        tok_dir = Path(tmp) / "tok"
        train_tokenizer(iter_texts(text_sources), tok_dir, args.vocab_size, quiet=True)
        results["tokenizer_s"] = time.perf_counter() - t0
        print(f"tokenizer: {args.vocab_size} tokens trained on {len(text_sources)} text corpora in "
              f"{results['tokenizer_s']:.1f}s", file=sys.stderr)
        for name in names:
            runs = []
            for r in range(args.repeats):
                out = Path(tmp) / f"{name}-{r}"
                t = time.perf_counter()
                m = prepare([paths[name]], tok_dir, out, format=kinds[name], workers=args.workers, quiet=True)
                runs.append(time.perf_counter() - t)
                shutil.rmtree(out)
            secs = statistics.median(runs)
            nbytes, ntok = m.totals["bytes"], m.totals["n_tokens"]
            results["corpora"][name] = {"kind": kinds[name], "bytes": nbytes, "tokens": ntok, "seconds": secs,
                                        "runs": runs, "mb_per_s": nbytes / secs / 1e6, "tokens_per_s": ntok / secs}
            print(f"{name}: {runs}", file=sys.stderr)
    c = results["corpora"]
    total_b, total_s = sum(v["bytes"] for v in c.values()), sum(v["seconds"] for v in c.values())
    results["total"] = {"bytes": total_b, "seconds": total_s, "mb_per_s": total_b / total_s / 1e6,
                        "tokens_per_s": sum(v["tokens"] for v in c.values()) / total_s}
    print(f"nanolm prepare, {args.workers} worker(s), vocabulary {args.vocab_size}, median of {args.repeats}")
    print(f"  {'corpus':<12}{'kind':<6}{'MB':>8}{'tokens':>12}{'s':>8}{'MB/s':>8}{'tokens/s':>12}")
    for name, v in list(c.items()) + [("all", {**results["total"], "kind": "",
                                               "tokens": sum(v["tokens"] for v in c.values())})]:
        print(f"  {name:<12}{v['kind']:<6}{v['bytes'] / 1e6:>8.1f}{v['tokens']:>12,}{v['seconds']:>8.2f}"
              f"{v['mb_per_s']:>8.2f}{v['tokens_per_s']:>12,.0f}")
    print(f"tokenizer training on the text corpora: {results['tokenizer_s']:.1f}s")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
