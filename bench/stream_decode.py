"""Time per streamed token as a reply grows: the old re-decoding StreamDecoder against the incremental one.

The old `StreamDecoder.push` decoded the whole reply so far on every token
(kept below as `RedecodingStreamDecoder`, for this comparison only), so a
token's cost grew with its position and a reply cost quadratic time. The
incremental decoder (nanolm/infer/text.py) feeds one token's bytes to an
incremental UTF-8 decoder: its cost should not depend on the position.

One run trains a byte-level BPE on the test corpus's sentences (or loads
`--tokenizer`), makes a `--tokens`-token reply of mixed Chinese, English and
emoji, pushes it through each decoder, checks that both give
`tokenizer.decode(ids)`, and prints the median time per push of the first and
the last 1,000 pushes (over `--repeats` passes), then one JSON object with the
figures:

    python bench/stream_decode.py                # --tokens 4000 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from nanolm.infer.text import StreamDecoder
from nanolm.tokenizer import Tokenizer, train_tokenizer

SENTENCES = ["话说天下大势，分久必合，合久必分。", "滚滚长江东逝水，浪花淘尽英雄。", "To be, or not to be, that is the question.",
             "All the world's a stage, and all the men and women merely players.", "一壶浊酒喜相逢 🍶😀",
             "We hold these truths to be self-evident, that all men are created equal."]


class RedecodingStreamDecoder:
    """The decoder before the incremental one: decodes every id so far on each push."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self.emitted = 0

    def push(self, token_id: int) -> str:
        if not 0 <= token_id < self.tok.vocab_size:
            return ""
        self.ids.append(token_id)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece = text[self.emitted:]
        self.emitted = len(text)
        return piece

    def flush(self) -> str:
        return self.tok.decode(self.ids)[self.emitted:]


def reply_ids(tok: Tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    k = 0
    while len(ids) < n:
        ids += tok.encode(SENTENCES[k % len(SENTENCES)] + " ")
        k += 1
    return ids[:n]


def time_pushes(make, ids: list[int], expected: str) -> list[float]:
    """Seconds of each push in one pass; checks the text."""
    dec = make()
    times, pieces = [], []
    for i in ids:
        t0 = time.perf_counter()
        pieces.append(dec.push(i))
        times.append(time.perf_counter() - t0)
    pieces.append(dec.flush())
    assert "".join(pieces) == expected, "the decoder's text differs from tokenizer.decode"
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4000, help="length of the reply")
    ap.add_argument("--window", type=int, default=1000, help="pushes at the start and at the end to compare")
    ap.add_argument("--repeats", type=int, default=5, help="passes per decoder; each push's time is its median")
    ap.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer directory (default: train a small one)")
    args = ap.parse_args(argv)
    if args.tokens < 2 * args.window:
        ap.error("--tokens must be at least twice --window")

    with tempfile.TemporaryDirectory() as tmp:
        tok = (Tokenizer.load(args.tokenizer) if args.tokenizer else
               train_tokenizer(SENTENCES * 50, Path(tmp) / "tok", vocab_size=400, quiet=True))
        ids = reply_ids(tok, args.tokens)
        expected = tok.decode(ids)
        report: dict[str, object] = {"tokens": args.tokens, "window": args.window, "vocab_size": tok.vocab_size}
        print(f"{args.tokens}-token reply, {len(expected)} characters; median us per push")
        print(f"{'decoder':<12}{'first ' + str(args.window):>14}{'last ' + str(args.window):>14}{'ratio':>8}")
        for name, make in (("re-decoding", lambda: RedecodingStreamDecoder(tok)),
                           ("incremental", lambda: StreamDecoder(tok))):
            passes = [time_pushes(make, ids, expected) for _ in range(args.repeats)]
            per_push = [statistics.median(p[i] for p in passes) for i in range(args.tokens)]
            first = statistics.median(per_push[:args.window]) * 1e6
            last = statistics.median(per_push[-args.window:]) * 1e6
            print(f"{name:<12}{first:>14.2f}{last:>14.2f}{last / first:>8.2f}")
            report[name] = {"first_us": round(first, 3), "last_us": round(last, 3), "ratio": round(last / first, 2)}
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
