"""`nanolm quickstart`: every stage at tiny scale, on a CPU, in a few minutes.

fetch the built-in corpora -> train a tokenizer -> prepare shards -> pretrain
a tiny model within the time budget -> print a Chinese and an English
continuation -> say where every artefact lies. It is also the shortest
complete example of the library's API: each step is one call.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Sequence

import torch

from nanolm.config import load_config
from nanolm.datasets import resolve_sources
from nanolm.errors import UserError
from nanolm.progress import fmt_duration

SAMPLE_PROMPTS = ("话说天下大势，", "To be, or not to be,", "My fellow citizens,")


def _banner(i: int, n: int, title: str) -> None:
    print(f"\n== [{i}/{n}] {title}", flush=True)


def _truncated_copies(files: Sequence[Path], dest: Path, max_chars: int) -> list[Path]:
    """Copies of the sources holding at most `max_chars` characters each (whole documents first)."""
    from nanolm.data.formats import iter_documents
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for f in files:
        target = dest / f"{f.stem}.jsonl"
        n = 0
        with open(target, "w", encoding="utf-8") as w:
            for text in iter_documents(f):
                text = text[: max_chars - n]
                w.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                n += len(text)
                if n >= max_chars:
                    break
        out.append(target)
    return out


def _calibrate_steps_per_second(cfg, seconds: float = 3.0) -> float:
    """Time a few optimizer-step-shaped forward/backward passes of the configured model."""
    from nanolm.model.transformer import Transformer
    from nanolm.train.objectives import lm_loss
    model = Transformer(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len))
    times = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 2:
        t0 = time.perf_counter()
        for _ in range(cfg.train.grad_accum):
            lm_loss(model(x), x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return 1.0 / min(times[1:])


def quickstart(out: Path, *, minutes: float = 5.0, corpora: Sequence[str] = ("sanguo", "shakespeare", "sotu"),
               vocab_size: int = 6400, preset_name: str = "tiny", max_chars: int = 0) -> dict[str, Path]:
    """Run every stage into `out`; returns the artefact paths."""
    from nanolm.data.prepare import prepare
    from nanolm.infer.engine import Engine, SamplingParams
    from nanolm.infer.generate import complete
    from nanolm.data.formats import iter_texts
    from nanolm.tokenizer import Tokenizer, compression_report, split_by_script, train_tokenizer
    from nanolm.train.checkpoint import load_model
    from nanolm.train.loop import train

    if minutes <= 0:
        raise UserError(f"--minutes must be > 0, got {minutes}")
    t0 = time.perf_counter()
    budget = minutes * 60
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    n = 5

    _banner(1, n, "corpora")
    files = resolve_sources(list(corpora))
    if max_chars:
        files = _truncated_copies(files, out / "corpora", max_chars)
    for f in files:
        print(f"  {f} ({f.stat().st_size / 2**20:.1f} MiB)")

    _banner(2, n, f"tokenizer (byte-level BPE, {vocab_size} tokens)")
    tok_dir = out / "tokenizer"
    tok = train_tokenizer(iter_texts(files), tok_dir, vocab_size)
    zh, en = split_by_script(iter_texts(files))
    print(f"  {compression_report(tok, zh, en)}")

    _banner(3, n, "prepare token shards")
    data_dir = out / "data"
    prepare(files, tok_dir, data_dir, val_fraction=0.02, workers=2)

    _banner(4, n, "pretrain")
    run_dir = out / "run"
    if (run_dir / "config.json").is_file():
        shutil.rmtree(run_dir)  # a previous quickstart's run: start afresh so the logs tell one story
    overrides = {"data.path": str(data_dir), "train.out_dir": str(run_dir), "model.vocab_size": tok.vocab_size}
    cfg = load_config(preset_name, overrides=overrides)
    reserve = 20.0  # seconds kept for the final evaluation, checkpoint and samples
    train_seconds = max(10.0, budget - (time.perf_counter() - t0) - reserve)
    steps_per_s = _calibrate_steps_per_second(cfg)
    # The schedule decays over max_steps, so size it to what fits in the time; the time budget is the safety net.
    max_steps = max(10, int(steps_per_s * (train_seconds - 3.0) * 0.9))
    warmup = min(cfg.optim.warmup_steps, max_steps // 10)
    cfg = load_config(preset_name, overrides={
        **overrides, "train.max_steps": max_steps, "train.max_minutes": train_seconds / 60,
        "optim.warmup_steps": warmup, "train.eval_interval": max(1, max_steps // 5),
        "train.save_interval": max(1, max_steps // 5), "train.log_interval": max(1, max_steps // 20)})
    print(f"  {train_seconds:.0f}s for training: ~{steps_per_s:.2f} steps/s -> {max_steps} steps")
    result = train(cfg)

    _banner(5, n, "samples")
    model, _, ckpt_dir = load_model(run_dir, "best")
    engine = Engine(model)
    tok = Tokenizer.load(ckpt_dir)
    params = SamplingParams(max_new_tokens=80, temperature=0.8, top_k=50, top_p=0.95, seed=0)
    for prompt in SAMPLE_PROMPTS:
        print(f"\n> {prompt}", end="", flush=True)
        complete(engine, tok, prompt, params)
        print()

    artefacts = {"corpora": files[0].parent if max_chars else files[0].parent.parent, "tokenizer": tok_dir,
                 "data": data_dir, "run": run_dir, "checkpoint": ckpt_dir,
                 "metrics": run_dir / "metrics.jsonl"}
    print(f"\n== done in {fmt_duration(time.perf_counter() - t0)} "
          f"({result.step} steps, best val loss {result.best_val_loss:.3f})")
    for name, path in artefacts.items():
        print(f"  {name:<11}{path.resolve()}")
    print(f"\nnext: nanolm generate {run_dir} --prompt '话说'   |   "
          f"nanolm train --preset minimind-26m --data {data_dir} --model.vocab_size {tok.vocab_size}")
    return artefacts
