"""Digit splitting in the tokenizer: tokens per byte, and held-out bits per byte at an equal token budget.

Two tokenizers are trained on the text the quickstart trains its tokenizer on
(the sanguo, shakespeare and sotu corpora cut to their first `--max-chars`
characters, the idioms and chatterbot chats cut to 500,000, and the built-in
tool-use set), with `split_digits` True and False, at `--vocab-size`. Each is
measured in tokens per UTF-8 byte on text neither saw:

- `shakespeare-tail`, `sotu-tail`, `idioms-tail`: the records right after
  the cut, up to `--heldout-chars` characters each (sanguo is whole in the
  cut, so it has none);
- `arith`: the arithmetic task's worked problems (`nanolm data arith`,
  seed 0: question, then the worked reply), numbers throughout.

With `--steps N`, each tokenizer's text corpora are also prepared as the
quickstart prepares them (2% validation) and a `tiny` model is pretrained for
N steps (the same token budget, seed and batches for both, `--runs` seeds
interleaved), then scored by `nanolm eval`'s function in bits per byte on the
validation split and on the held-out texts above.

    .venv/bin/python bench/digits.py --out /tmp/digits
    .venv/bin/python bench/digits.py --out /tmp/digits --steps 150 --runs 2 --threads 1

stdout gets one table per measurement and, last, one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path

from nanolm.quickstart import CHAT_CORPORA, TEXT_CORPORA, TOOL_CONVERSATIONS, truncated_copies

VARIANTS = {"split": True, "nosplit": False}  # name -> split_digits


def _write_docs(texts: list[str], out: Path) -> Path:
    with open(out, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
    return out


def _tail(src: Path, skip_chars: int, max_chars: int, chat: bool) -> list[str]:
    """The texts of the records `truncated_copies(..., skip_chars)` leaves out, up to `max_chars` characters."""
    texts, n, seen = [], 0, 0
    with open(src, encoding="utf-8") as f:
        for line in f:
            if seen < skip_chars:  # the records the cut copies (it stops once it has copied skip_chars)
                seen += len(line)
                continue
            rec = json.loads(line)
            text = "\n".join(m["content"] for m in rec.get("messages") or rec["conversations"]) if chat else rec["text"]
            texts.append(text)
            n += len(text)
            if n >= max_chars:
                break
    return texts


def setup(work: Path, max_chars: int, chat_max_chars: int, heldout_chars: int) -> tuple[list[Path], list[Path],
                                                                                          dict[str, Path]]:
    """The quickstart's tokenizer text (text files, chat files) and the held-out texts, each a text JSONL."""
    from nanolm.corpora import resolve_sources
    from nanolm.data.builtin.arith import write_arith
    from nanolm.data.builtin.tooluse import build_calculator_conversations
    from nanolm.infer.tools import BUILTIN_TOOLS, calculator

    src = {name: resolve_sources([name])[0] for name in (*TEXT_CORPORA, *CHAT_CORPORA)}
    text_src, chat_src = [src[n] for n in TEXT_CORPORA], [src[n] for n in CHAT_CORPORA]
    text_files = truncated_copies(text_src, work / "corpora" / "text", max_chars)
    chat_files = truncated_copies(chat_src, work / "corpora" / "chat", chat_max_chars)
    chat_files.append(build_calculator_conversations(work / "corpora" / "tools.jsonl", TOOL_CONVERSATIONS,
                                                     calculator=calculator, tools=BUILTIN_TOOLS))
    held = work / "heldout"
    held.mkdir(parents=True, exist_ok=True)
    heldout: dict[str, Path] = {}
    for corpus, skip, chat in [("shakespeare", max_chars, False), ("sotu", max_chars, False),
                               ("idioms", chat_max_chars, True)]:
        name = f"{corpus}-tail"
        texts = _tail(src[corpus], skip, heldout_chars, chat)
        if texts:
            heldout[name] = _write_docs(texts, held / f"{name}.jsonl")
    arith = write_arith(work / "arith", 2000, 0, 0, seed=0)["sft"]
    docs = []
    with open(arith, encoding="utf-8") as f:
        for line in f:
            q, a = (m["content"] for m in json.loads(line)["messages"])
            docs.append(f"{q}\n{a}")
    heldout["arith"] = _write_docs(docs, held / "arith.jsonl")
    return text_files, chat_files, heldout


def read_docs(file: Path) -> list[str]:
    with open(file, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def tokens_per_byte(tok, texts: list[str]) -> tuple[float, int, int]:
    n_tokens = sum(len(ids) for ids in tok.encode_batch(texts))
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    return n_tokens / n_bytes, n_tokens, n_bytes


def pretrain(work: Path, name: str, tok_dir: Path, text_files: list[Path], steps: int, seed: int,
             heldout: dict[str, Path]) -> dict:
    """Prepare (once per tokenizer) and pretrain `tiny` for `steps`; bits per byte on val and the held-out texts."""
    from nanolm.train.configure import load_config
    from nanolm.data.prepare import prepare
    from nanolm.eval.loss import evaluate
    from nanolm.tokenizer import Tokenizer
    from nanolm.train.trainer import train

    data = work / "data" / name
    if not (data / "manifest.json").is_file():
        prepare(text_files, tok_dir, data, val_fraction=0.02, workers=1, quiet=True)
    run = work / "runs" / f"{name}-seed{seed}"
    cfg = load_config("tiny", overrides={"data.path": str(data), "train.out_dir": str(run),
                                         "model.vocab_size": Tokenizer.load(tok_dir).vocab_size,
                                         "train.max_steps": steps, "train.seed": seed})
    t0 = time.perf_counter()
    train(cfg, quiet=True)
    seconds = time.perf_counter() - t0
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl", encoding="utf-8")]
    logged = [m["val_bpb"] for m in metrics if "val_bpb" in m]
    out = {"seconds": round(seconds, 1), "tokens": steps * cfg.train.batch_size * cfg.train.seq_len,
           "logged_val_bpb": logged[-1] if logged else None,
           "bpb": {"val": evaluate(run, [str(data)], which="last", quiet=True)["bpb"]}}
    for hname, file in heldout.items():
        out["bpb"][hname] = evaluate(run, [str(file)], which="last", quiet=True)["bpb"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="work directory (corpora copies, tokenizers, shards, runs)")
    ap.add_argument("--vocab-size", type=int, default=6400)
    ap.add_argument("--max-chars", type=int, default=2_000_000, help="text corpora cut, as the quickstart's")
    ap.add_argument("--chat-max-chars", type=int, default=500_000, help="chat corpora cut, as the quickstart's")
    ap.add_argument("--heldout-chars", type=int, default=200_000)
    ap.add_argument("--steps", type=int, default=0, help="pretrain tiny for this many steps (0: tokenizers only)")
    ap.add_argument("--runs", type=int, default=1, help="pretraining runs per variant (seeds 0, 1, ...)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)

    from nanolm.data.kinds import iter_texts
    from nanolm.tokenizer import Tokenizer, train_tokenizer

    work = Path(args.out)
    text_files, chat_files, heldout = setup(work, args.max_chars, args.chat_max_chars, args.heldout_chars)
    result: dict = {"load_before": os.getloadavg()[0], "tokenizers": {}, "tokens_per_byte": {}, "pretrain": {}}
    toks = {}
    for name, split in VARIANTS.items():
        tok_dir = work / "tok" / name
        if (tok_dir / "tokenizer.json").is_file():
            tok = Tokenizer.load(tok_dir)
        else:
            t0 = time.perf_counter()
            texts = itertools.chain(iter_texts(text_files), iter_texts(chat_files, format="chat"))
            tok = train_tokenizer(texts, tok_dir, args.vocab_size, split_digits=split, quiet=True)
            result["tokenizers"][name] = {"seconds": round(time.perf_counter() - t0, 1)}
        digit_tokens = sum(1 for b in tok.token_bytes() if any(48 <= c <= 57 for c in b))
        result["tokenizers"].setdefault(name, {}).update(vocab=tok.vocab_size, tokens_with_digits=digit_tokens)
        toks[name] = tok
    samples = {hname: read_docs(file) for hname, file in heldout.items()}
    print(f"{'text':18} {'bytes':>9} {'digit bytes':>11} " + " ".join(f"{n + ' tok/B':>12}" for n in VARIANTS))
    for hname, texts in samples.items():
        digit_bytes = sum(sum(c.isdigit() and c.isascii() for c in t) for t in texts)
        row = {name: tokens_per_byte(toks[name], texts) for name in VARIANTS}
        n_bytes = next(iter(row.values()))[2]
        result["tokens_per_byte"][hname] = {"bytes": n_bytes, "ascii_digit_bytes": digit_bytes,
                                            **{n: {"tokens_per_byte": round(v[0], 4), "tokens": v[1]}
                                               for n, v in row.items()}}
        print(f"{hname:18} {n_bytes:>9} {digit_bytes:>11} " + " ".join(f"{row[n][0]:>12.4f}" for n in VARIANTS))
    print("tokenizers: " + json.dumps(result["tokenizers"]))

    if args.steps:
        for seed in range(args.runs):
            for name in VARIANTS:  # interleaved, so a shared machine's load falls on both alike
                got = pretrain(work, name, work / "tok" / name, text_files, args.steps, seed, heldout)
                result["pretrain"][f"{name}-seed{seed}"] = got
                print(f"{name} seed {seed}: {got['seconds']} s, {got['tokens']} tokens, logged val_bpb "
                      f"{got['logged_val_bpb']:.4f}, bpb " + ", ".join(f"{k} {v:.4f}" for k, v in got["bpb"].items()),
                      flush=True)
    result["load_after"] = os.getloadavg()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
