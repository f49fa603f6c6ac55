"""A LoRA fine-tuning step on a real model, SmolLM2-135M-Instruct with its real weights: nanolm against
transformers + peft on the same tokens, each step's useful FLOP/s as a fraction of the matrix-product ceiling
measured in the same process and dtype.

The model is nanolm's built-in `smollm2-135m-instruct` (fetched and imported once by
`nanolm models fetch smollm2-135m-instruct`; 134.5 M parameters, 30 layers, width 576, 9 / 3 heads, MLP 1,536,
vocabulary 49,152, tied head). nanolm trains its checkpoint; transformers loads the same weights written by
`nanolm export hf` (float32, into --work) with `AutoModelForCausalLM.from_pretrained`, as a peft user loads a
model. Both wrap the same projections (q, k, v, o, gate, up, down) in rank-16 adapters (alpha 32), train them
with AdamW (the base frozen) on the same batch: the first batch x (seq + 1) tokens of built-in Shakespeare
through the model's own tokenizer. float32, or `bfloat16`: bf16 autocast with the frozen base kept in bf16 on
both sides (nanolm's `lora.base_dtype` auto: the frozen projections in bf16; transformers loaded with
`dtype=torch.bfloat16`; peft's adapters in float32).

Each variant x sequence length x dtype runs in a process of its own (the variants interleaved `--rounds`
times, alternating which goes first), which
  - times a square product (--ceiling-size, default 1024, as bench/peers.py) in the step's dtype first, as
    `F.linear` (see ceiling_flops): the ceiling;
  - loads the model, then resets the kernel's peak-resident mark (/proc/self/clear_refs) and times `--steps`
    steps after `--warmup`: peak memory is the process's resident high-water mark during training (the same
    method for both variants), beside its resident memory before the first step;
  - counts useful FLOPs per token: 4 x the frozen matrices' weights (forward, and the input gradient backward;
    the output head included), 6 x the adapters' weights, 12 x layers x sequence x attention width (scores and
    weighted sum, forward and backward; causal masking not subtracted, as nanolm's MFU counts it).

peft is for the comparison only (not a nanolm dependency); without it, its column is left out:

    .venv/bin/pip install peft
    .venv/bin/python -m nanolm models fetch smollm2-135m-instruct
    PYTHONPATH=. .venv/bin/python bench/lora_real.py --rounds 5 --steps 5 --seq-lens 256,512 --dtypes float32,bfloat16

bf16 targets are for CPUs with native bf16 (AVX-512 BF16 / AMX); on an AVX2-only CPU torch emulates it.
Prints one line per process, a table, and a JSON summary (medians) as its last line.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procfs import status_kib  # noqa: E402  bench/, beside this

MODEL = "smollm2-135m-instruct"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def reset_peak_rss() -> bool:
    """Reset this process's resident high-water mark (VmHWM) to its current RSS; False where Linux says no."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def useful_flops_per_token(cfg, n_lora: int, seq_len: int) -> int:
    """A LoRA step's useful FLOPs per token for nanolm ModelConfig `cfg` (the same model on both sides): the
    frozen matrices (the tied head included) forward + input gradient, the adapters' forward and both gradients,
    attention scores and weighted sum forward and backward."""
    d_attn = cfg.n_head * cfg.head_dim
    layer = cfg.d_model * cfg.head_dim * (cfg.n_head + 2 * cfg.n_kv_head) + d_attn * cfg.d_model \
        + 3 * cfg.d_model * cfg.n_hidden  # q, k, v; o; gate, up, down
    n_frozen = cfg.n_layer * layer + cfg.vocab_size * cfg.d_model
    return 4 * n_frozen + 6 * n_lora + 12 * cfg.n_layer * seq_len * d_attn


def ceiling_flops(dtype, size: int, seconds: float = 2.0) -> float:
    """FLOP/s of a size^3 product in `dtype` here: the median of 3 to 20 timed calls within about `seconds` (one
    call where one alone takes longer). Timed as `F.linear`, the product every projection of both models makes:
    on an AVX2 CPU without bf16, torch 2.13's bf16 `a @ b` ran at 0.16 GFLOP/s and `F.linear` at 3.3 in the
    same process (float32: 11.2 and 10.0), so `a @ b` would not be the ceiling of the step's products."""
    import torch
    import torch.nn.functional as F
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    F.linear(a, b)  # warm-up
    times, t_end = [], time.perf_counter() + seconds
    while not times or (time.perf_counter() < t_end and len(times) < 20) or (len(times) < 3 and times[0] < seconds):
        t0 = time.perf_counter()
        F.linear(a, b)
        times.append(time.perf_counter() - t0)
    return 2 * size**3 / statistics.median(times)


def build(variant: str, dtype_name: str, rank: int, hf_dir: Path):
    """(model with adapters, loss function of (x, y), the adapters' weights)."""
    import torch
    bf16 = dtype_name == "bfloat16"
    if variant == "nanolm":
        from nanolm.checkpoint import load_model
        from nanolm.export.gguf_import import builtin_checkpoint
        from nanolm.model import lora
        model, _ = load_model(builtin_checkpoint(MODEL, quiet=True))
        lora.apply_lora(model, rank, 2 * rank, 0.0, TARGETS)
        lora.mark_only_lora_as_trainable(model)
        if bf16:  # lora.base_dtype auto under bf16 training: the frozen projections in bf16
            lora.cast_base(model, torch.bfloat16)

        def loss_of(x, y):
            return model(x, targets=y) / y.numel()  # the fused head's summed cross-entropy, as a mean
    else:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM
        base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16 if bf16 else torch.float32,
                                                    attn_implementation="sdpa")
        base.config.use_cache = False
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                target_modules=list(TARGETS)))

        def loss_of(x, y):
            return model(input_ids=x, labels=x).loss  # transformers shifts the labels itself
    n_lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return model, loss_of, n_lora


def timed_steps(loss_of, opt, x, y, autocast, warmup: int, steps: int) -> tuple[list[float], list[float]]:
    """Seconds of each of `steps` optimizer steps after `warmup` untimed ones, and every step's loss."""
    times, losses = [], []
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        with autocast:
            loss = loss_of(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    return times, losses


def child(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    if args.variant == "peft":
        import peft  # noqa: F401  (imported before anything is measured, as nanolm's modules are)
        import transformers  # noqa: F401
    ceiling = ceiling_flops(dtype, args.ceiling_size)
    model, loss_of, n_lora = build(args.variant, args.dtype, args.rank, args.work / "hf")
    model.train()
    ids = torch.from_numpy(np.fromfile(args.work / "ids.bin", dtype=np.int64))
    seq = ids[:args.batch * (args.seq_len + 1)].view(args.batch, args.seq_len + 1)
    x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()  # (B, T) inputs, targets
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
    rss_before = status_kib("VmRSS")
    measured = reset_peak_rss()
    times, losses = timed_steps(loss_of, opt, x, y, autocast, args.warmup, args.steps)
    step_s = statistics.median(times)
    tokens_per_s = args.batch * args.seq_len / step_s
    from nanolm.checkpoint import read_model_config
    from nanolm.export.gguf_import import builtin_checkpoint
    fpt = useful_flops_per_token(read_model_config(builtin_checkpoint(MODEL, quiet=True)), n_lora, args.seq_len)
    peak = status_kib("VmHWM") if measured else None
    print(json.dumps({"variant": args.variant, "dtype": args.dtype, "seq_len": args.seq_len, "step_s": step_s,
                      "tokens_per_s": tokens_per_s, "flops_per_token": fpt, "gflops": fpt * tokens_per_s / 1e9,
                      "ceiling_gflops": ceiling / 1e9, "of_ceiling": fpt * tokens_per_s / ceiling,
                      "peak_mib": peak / 1024 if peak else None,
                      "rss_before_mib": rss_before / 1024 if rss_before else None,
                      "trainable": n_lora, "first_loss": losses[0], "last_loss": losses[-1]}), flush=True)


def prepare(work: Path, batch: int, seq_len: int) -> None:
    """The tokens both variants train on (ids.bin, int64) and the model as transformers loads it (hf/)."""
    import numpy as np

    from nanolm.corpora import fetch
    from nanolm.export.gguf_import import builtin_checkpoint
    from nanolm.export.hf import export_hf
    from nanolm.tokenizer import Tokenizer
    work.mkdir(parents=True, exist_ok=True)
    ckpt = builtin_checkpoint(MODEL, quiet=True)
    need = batch * (seq_len + 1)
    if not (work / "ids.bin").is_file() or (work / "ids.bin").stat().st_size < 8 * need:
        tok = Tokenizer.load(ckpt)
        ids: list[int] = []
        with open(fetch("shakespeare", quiet=True), encoding="utf-8") as f:
            for line in f:
                ids += tok.encode(json.loads(line)["text"])
                if len(ids) >= need:
                    break
        np.asarray(ids[:need], dtype=np.int64).tofile(work / "ids.bin")
    if not (work / "hf" / "config.json").is_file():
        export_hf(ckpt, work / "hf")


def run_child(args: argparse.Namespace, variant: str, dtype: str, seq_len: int) -> dict:
    cmd = [sys.executable, __file__, "--variant", variant, "--dtype", dtype, "--seq-len", str(seq_len),
           "--work", str(args.work), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--batch", str(args.batch), "--rank", str(args.rank), "--threads", str(args.threads),
           "--ceiling-size", str(args.ceiling_size)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{variant} {dtype} {seq_len} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(rows: list[dict], args: argparse.Namespace, variants: list[str]) -> dict:
    keys = ("tokens_per_s", "step_s", "gflops", "ceiling_gflops", "of_ceiling", "peak_mib", "rss_before_mib")
    med: dict[str, dict] = {}
    for r in rows:
        med.setdefault(f"{r['variant']} {r['dtype']} {r['seq_len']}", []).append(r)
    summary = {k: {m: statistics.median(r[m] for r in rs) if all(r[m] is not None for r in rs) else None
                   for m in keys} for k, rs in med.items()}
    print(f"\nLoRA r{args.rank} on {MODEL} (real weights), batch {args.batch}, median of {args.rounds} rounds x "
          f"{args.steps} steps; ceiling: a {args.ceiling_size}^3 F.linear in the step's dtype, same process")
    print("| dtype | seq | variant | tokens/s | s/step | GFLOP/s | ceiling GFLOP/s | of ceiling | peak MiB "
          "(RSS before) | vs peft |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        for seq_len in (int(s) for s in args.seq_lens.split(",")):
            for v in variants:
                m = summary[f"{v} {dtype} {seq_len}"]
                p = summary.get(f"peft {dtype} {seq_len}")
                vs = (f"{m['tokens_per_s'] / p['tokens_per_s']:.2f}x speed, "
                      f"{m['peak_mib'] / p['peak_mib']:.2f}x memory" if v == "nanolm" and p and m["peak_mib"]
                      and p["peak_mib"] else "")
                peak = f"{m['peak_mib']:.0f} ({m['rss_before_mib']:.0f})" if m["peak_mib"] else "n/a"
                print(f"| {dtype} | {seq_len} | {v} | {m['tokens_per_s']:.1f} | {m['step_s']:.2f} | "
                      f"{m['gflops']:.1f} | {m['ceiling_gflops']:.1f} | {m['of_ceiling']:.1%} | {peak} | {vs} |")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=("nanolm", "peft"), help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--seq-len", type=int, default=256, help=argparse.SUPPRESS)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--seq-lens", default="256,512")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--ceiling-size", type=int, default=1024, help="n of the n^3 matmul timed as the ceiling")
    ap.add_argument("--work", type=Path, default=Path("runs/bench-lora-real"))
    args = ap.parse_args()
    args.work = args.work.resolve()
    if args.variant:
        child(args)
        return
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    prepare(args.work, args.batch, max(seq_lens))
    try:
        import peft  # noqa: F401
        variants = ["nanolm", "peft"]
    except ImportError:
        print("peft is not installed: its column is left out (.venv/bin/pip install peft)", file=sys.stderr)
        variants = ["nanolm"]
    rows: list[dict] = []
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else variants[::-1]  # interleaved, alternating which goes first
        for dtype in args.dtypes.split(","):
            for seq_len in seq_lens:
                for v in order:
                    res = run_child(args, v, dtype, seq_len)
                    rows.append(res)
                    print(f"round {r + 1} {dtype} {seq_len} {v:>6}: {res['tokens_per_s']:.1f} tokens/s, "
                          f"{res['gflops']:.1f} GFLOP/s = {res['of_ceiling']:.1%} of {res['ceiling_gflops']:.1f}, "
                          f"peak {res['peak_mib'] or 0:.0f} MiB, loss {res['first_loss']:.3f} -> "
                          f"{res['last_loss']:.3f}", file=sys.stderr, flush=True)
    summary = report(rows, args, variants)
    print(json.dumps({"model": MODEL, "batch": args.batch, "rank": args.rank, "rounds": args.rounds,
                      "steps": args.steps, "ceiling_size": args.ceiling_size, "load_avg": os.getloadavg(),
                      "median": summary, "runs": rows}))


if __name__ == "__main__":
    main()
