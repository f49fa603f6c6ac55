"""nanolm's model class beside its peers' at the same width and depth: training FLOP/s and batch-1 decoding.

The peers are nanoGPT's `GPT` (karpathy/nanoGPT, `model.py`) and MiniMind's
`MiniMindForCausalLM` (jingyaogong/minimind, `model/model_minimind.py`),
imported from checkouts you give, run unchanged (nothing of theirs is copied
here). Clone them anywhere:

    git clone https://github.com/karpathy/nanoGPT ~/src/nanoGPT
    git clone https://github.com/jingyaogong/minimind ~/src/minimind   # needs `transformers`
    PYTHONPATH=. python bench/peers.py --nanogpt ~/src/nanoGPT --minimind ~/src/minimind

Training: each model is built at the preset's shape (default `minimind-26m`:
width 512, 8 layers, 8 heads, vocabulary 6400; MiniMind with nanolm's 2 KV
heads and MLP width, nanoGPT in its own layout: 4x GELU MLP, full-width K/V,
learned positions) and trained for a few full steps on random tokens: forward
with each model's own loss, backward, gradient clipping, one `torch.optim.AdamW`
step (the same fused AdamW for all three, so the model classes are what
differ), zero_grad; bfloat16 is autocast for all three, as each trains it.
The useful work of a token is the same formula for every model, over its own
matrices: 6 x (the weights of every `nn.Linear`, the output head included)
+ 12 x layers x sequence x width (attention scores and the weighted sum,
causal masking not subtracted). GFLOP/s = that x tokens/s, and each is
printed as a fraction of the matrix-product ceiling of its dtype measured in
the same run (a `--ceiling-size`^3 matmul, timed at the start and at the end;
the better of the two), so a model class is judged against the machine's own
limit, not only against the other classes.

Decoding: greedy batch-1 decoding of `--new-tokens` after a random prompt,
nanolm's `Engine` against MiniMind's own `generate` (KV cache, `do_sample=False`),
float32 and bfloat16 weights, per token after the first, beside the
weight-pass floor (every weight matrix read once, `bench/throughput.py`),
and the dtype nanolm's `--dtype auto` picks on this CPU.
nanoGPT's `generate` has no KV cache, so it is not timed.

The machine is shared and its speed varies: the models run interleaved
(nanolm, nanoGPT, MiniMind, nanolm, ...) for `--repeats` rounds and each
keeps its best round, so one noisy neighbour does not decide a ratio. The
square-matmul ceiling is measured at the start and end of the run. Prints a
table and, as the last stdout line, one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import environment, matmul_ceiling, say, weight_pass_floor  # noqa: E402  bench/, beside this

from nanolm.config import PRESETS, SamplingParams, preset  # noqa: E402
from nanolm.infer.engine import Engine  # noqa: E402
from nanolm.model.transformer import Transformer, flops_per_token  # noqa: E402
from nanolm.runtime import autocast, decode_dtype  # noqa: E402


def load_module(path: Path, name: str) -> Any:
    """Import one file of a peer's checkout as a module, unchanged."""
    if not path.is_file():
        raise SystemExit(f"{path}: not found; pass the root of a checkout (git clone ... then --{name} DIR)")
    spec = importlib.util.spec_from_file_location(f"peer_{name}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        raise SystemExit(f"{path}: cannot import it ({e}); install what it needs (MiniMind: pip install transformers)")
    return module


def useful_flops_per_token(model: nn.Module, n_layer: int, seq_len: int, d_attn: int) -> int:
    """6 x every nn.Linear weight (each once) + 12 x layers x sequence x attention width."""
    seen: dict[int, int] = {}
    for m in model.modules():
        if isinstance(m, nn.Linear):
            seen.setdefault(id(m.weight), m.weight.numel())
    return 6 * sum(seen.values()) + 12 * n_layer * seq_len * d_attn


class Peer:
    """One model class: how to build it and how to take a loss from a (B, T + 1) batch of ids."""

    def __init__(self, name: str, build: Callable[[], nn.Module], loss: Callable[[nn.Module, torch.Tensor], torch.Tensor],
                 n_layer: int, d_attn: int) -> None:
        self.name, self.build, self.loss, self.n_layer, self.d_attn = name, build, loss, n_layer, d_attn


def peers(args: argparse.Namespace) -> list[Peer]:
    cfg = preset(args.preset).model
    cfg.max_seq_len = max(cfg.max_seq_len, args.seq_len)
    d_attn = cfg.n_head * cfg.head_dim
    out = [Peer("nanolm", lambda: Transformer(cfg),
                # nanolm trains through its fused output projection and loss (a sum; the mean is taken here).
                lambda m, seq: m(seq[:, :-1], targets=seq[:, 1:]) / seq[:, 1:].numel(), cfg.n_layer, d_attn)]
    if args.nanogpt:
        ng = load_module(Path(args.nanogpt) / "model.py", "nanogpt")
        ng_cfg = ng.GPTConfig(block_size=args.seq_len, vocab_size=cfg.vocab_size, n_layer=cfg.n_layer,
                              n_head=cfg.n_head, n_embd=cfg.d_model, dropout=0.0, bias=False)
        out.append(Peer("nanoGPT", lambda: ng.GPT(ng_cfg), lambda m, seq: m(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())[1],
                        cfg.n_layer, cfg.d_model))
    if args.minimind:
        mm = load_module(Path(args.minimind) / "model" / "model_minimind.py", "minimind")
        mm_cfg = mm.MiniMindConfig(hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layer,
                                   num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
                                   intermediate_size=cfg.n_hidden, vocab_size=cfg.vocab_size,
                                   max_position_embeddings=args.seq_len + 1, rope_theta=cfg.rope_theta, dropout=0.0)
        # MiniMind shifts its labels itself: T + 1 ids in, T predictions scored.
        out.append(Peer("MiniMind", lambda: mm.MiniMindForCausalLM(mm_cfg),
                        lambda m, seq: m(seq, labels=seq).loss, cfg.n_layer, d_attn))
    return out


def train_round(peer: Peer, dtype: torch.dtype, args: argparse.Namespace, compiled: bool) -> dict[str, Any]:
    """Median seconds of `--steps` full training steps after one warm-up, for one model class."""
    torch.manual_seed(args.seed)
    model = peer.build()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    run = torch.compile(model) if compiled else model
    vocab = preset(args.preset).model.vocab_size
    batches = [torch.randint(0, vocab, (args.batch_size, args.seq_len + 1)) for _ in range(2)]
    device = torch.device("cpu")
    times, loss = [], torch.zeros(())
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        with autocast(device, dtype):
            loss = peer.loss(run, batches[i % 2])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    tokens = args.batch_size * args.seq_len
    flops = useful_flops_per_token(model, peer.n_layer, args.seq_len, peer.d_attn)
    step_s = statistics.median(times[args.warmup:])
    return {"model": peer.name, "dtype": str(dtype).removeprefix("torch."), "compile": compiled,
            "step_s": step_s, "tokens_per_s": tokens / step_s, "flops_per_token": flops,
            "gflops": flops * tokens / step_s / 1e9, "loss": float(loss), "params": sum(p.numel() for p in model.parameters())}


@torch.inference_mode()
def decode_round(name: str, model: nn.Module, dtype: torch.dtype, prompt: list[int], new_tokens: int) -> float:
    """Seconds per decoded token after the first, greedy, batch 1."""
    if name == "nanolm":
        engine = Engine(model, torch.device("cpu"), dtype)
        stamps = [time.perf_counter()]
        for _ in engine.generate(prompt, SamplingParams(max_new_tokens=new_tokens, temperature=0)):
            stamps.append(time.perf_counter())
        return (stamps[-1] - stamps[1]) / (len(stamps) - 2)
    # MiniMind: its own generate, timed whole, minus its prefill and first token (timed alone).
    ids = torch.tensor([prompt])
    kw = dict(do_sample=False, eos_token_id=None, use_cache=True)
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, **kw)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, **kw)
    whole = time.perf_counter() - t0
    assert out.shape[1] == len(prompt) + new_tokens
    return (whole - first) / (new_tokens - 1)


def decoding(args: argparse.Namespace, all_peers: list[Peer]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    gen = torch.Generator().manual_seed(args.seed)
    vocab = preset(args.preset).model.vocab_size
    prompt = torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()
    for dname in args.dtypes.split(","):
        dtype = getattr(torch, dname)
        models: dict[str, nn.Module] = {}
        for peer in all_peers:
            if peer.name == "nanoGPT":
                continue  # no KV cache in its generate
            torch.manual_seed(args.seed)
            m = peer.build().eval()
            models[peer.name] = m if peer.name == "nanolm" else m.to(dtype)  # nanolm's Engine casts itself
        floor = weight_pass_floor(models["nanolm"], torch.device("cpu"), dtype, 2.0)["floor_s"]
        best: dict[str, float] = {}
        for r in range(args.repeats):
            for name, m in models.items():
                decode_round(name, m, dtype, prompt, 8)  # warm-up
                s = decode_round(name, m, dtype, prompt, args.new_tokens)
                best[name] = min(best.get(name, s), s)
                say(f"decode {dname} round {r + 1}: {name} {s * 1e3:.2f} ms/token")
        for name, s in best.items():
            rows.append({"model": name, "dtype": dname, "ms_per_token": s * 1e3, "floor_ms": floor * 1e3,
                         "x_floor": s / floor})
    return rows


def auto_dtype(args: argparse.Namespace) -> dict[str, str]:
    """The dtype nanolm's `--dtype auto` (generate, chat, serve) decodes this preset in on this CPU, and why."""
    model = Transformer(preset(args.preset).model)
    dtype, why = decode_dtype("auto", torch.device("cpu"), model.config)
    return {"dtype": str(dtype).removeprefix("torch."), "why": why}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nanogpt", help="root of a karpathy/nanoGPT checkout (its model.py is imported)")
    p.add_argument("--minimind", help="root of a jingyaogong/minimind checkout (model/model_minimind.py; "
                   "needs transformers)")
    p.add_argument("--preset", default="minimind-26m", choices=sorted(PRESETS))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--parts", default="train,decode", help="which of train,decode to run")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="timed training steps per round")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; each model keeps its best")
    p.add_argument("--compile", action="store_true", help="also train every model under torch.compile")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--ceiling-size", type=int, default=1024, help="n of the n^3 matmul timed as the ceiling")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not (args.nanogpt or args.minimind):
        p.error("give at least one peer: --nanogpt DIR and/or --minimind DIR (checkouts of their repositories)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    all_peers = peers(args)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    res: dict[str, Any] = {"bench": "nanolm-peers", "args": vars(args), "env": environment(device),
                           "ceiling_gflops": {}, "train": [], "decode": []}
    for dtype in dtypes:
        c = matmul_ceiling(device, dtype, [args.ceiling_size], 5, 1.0)["best_flops"] / 1e9
        res["ceiling_gflops"][str(dtype).removeprefix("torch.")] = [c]
    if "train" in args.parts:
        cfg = preset(args.preset).model
        assert useful_flops_per_token(Transformer(cfg), cfg.n_layer, args.seq_len, cfg.n_head * cfg.head_dim) \
            == flops_per_token(cfg, args.seq_len)  # the shared formula is nanolm's own MFU formula
        best: dict[tuple[str, str, bool], dict[str, Any]] = {}
        for r in range(args.repeats):
            for dtype in dtypes:
                for compiled in ([False, True] if args.compile else [False]):
                    for peer in all_peers:
                        row = train_round(peer, dtype, args, compiled)
                        say(f"train round {r + 1} {row['dtype']}{' compiled' if compiled else ''}: {peer.name} "
                            f"{row['tokens_per_s']:.0f} tok/s, {row['gflops']:.1f} GFLOP/s")
                        key = (peer.name, row["dtype"], compiled)
                        if key not in best or row["step_s"] < best[key]["step_s"]:
                            best[key] = row
        res["train"] = list(best.values())
    if "decode" in args.parts:
        res["decode"] = decoding(args, all_peers)
        res["decode_auto"] = auto_dtype(args)
    for dtype in dtypes:
        c = matmul_ceiling(device, dtype, [args.ceiling_size], 5, 1.0)["best_flops"] / 1e9
        res["ceiling_gflops"][str(dtype).removeprefix("torch.")].append(c)
    for row in res["train"]:  # against the better of the run's two ceiling timings in the row's dtype
        row["of_ceiling"] = row["gflops"] / max(res["ceiling_gflops"][row["dtype"]])
    report(res)
    print(json.dumps(res))
    return res


def report(res: dict[str, Any]) -> None:
    a = res["args"]
    print(f"nanolm beside its peers | {a['preset']} shape | {res['env']['device_name']} | "
          f"{res['env']['threads']} threads | torch {res['env']['torch']}")
    for d, (c0, c1) in res["ceiling_gflops"].items():
        print(f"  matmul ceiling {d} ({a['ceiling_size']}^3): {c0:.1f} GFLOP/s at start, {c1:.1f} at end")
    if res["train"]:
        print(f"\ntraining, batch {a['batch_size']} x {a['seq_len']}, best of {a['repeats']} interleaved rounds "
              f"(median of {a['steps']} steps each)")
        print(f"  {'model':<9} {'dtype':<9} {'compile':<8} {'params':>7} {'MFLOP/tok':>9} {'tok/s':>7} "
              f"{'GFLOP/s':>8} {'of ceiling':>10} {'vs best peer':>12}")
        for r in res["train"]:
            others = [o["gflops"] for o in res["train"] if o["model"] != "nanolm" and o["dtype"] == r["dtype"]
                      and o["compile"] == r["compile"]]
            ratio = f"{r['gflops'] / max(others):.2f}x" if r["model"] == "nanolm" and others else ""
            share = f"{r['of_ceiling']:.1%}"
            print(f"  {r['model']:<9} {r['dtype']:<9} {'yes' if r['compile'] else 'no':<8} "
                  f"{r['params'] / 1e6:6.1f}M {r['flops_per_token'] / 1e6:9.1f} {r['tokens_per_s']:7.0f} "
                  f"{r['gflops']:8.1f} {share:>10} {ratio:>12}")
    if res["decode"]:
        print(f"\ndecoding at batch 1, greedy, {a['new_tokens']} tokens after a {a['prompt_len']}-token prompt, "
              f"best of {a['repeats']} rounds")
        print(f"  {'model':<9} {'dtype':<9} {'ms/token':>8} {'floor ms':>8} {'x floor':>7} {'vs MiniMind':>11}")
        for r in res["decode"]:
            mm = next((o for o in res["decode"] if o["model"] == "MiniMind" and o["dtype"] == r["dtype"]), None)
            lead = f"{mm['ms_per_token'] / r['ms_per_token']:.2f}x" if mm and r["model"] == "nanolm" else ""
            print(f"  {r['model']:<9} {r['dtype']:<9} {r['ms_per_token']:8.2f} {r['floor_ms']:8.2f} "
                  f"{r['x_floor']:7.2f} {lead:>11}")
        auto = res["decode_auto"]
        print(f"  nanolm's --dtype auto decodes in {auto['dtype']} here ({auto['why']})")
        fastest = {m: min((r for r in res["decode"] if r["model"] == m), key=lambda r: r["ms_per_token"])
                   for m in ("nanolm", "MiniMind") if any(r["model"] == m for r in res["decode"])}
        if len(fastest) == 2 and len({r["dtype"] for r in res["decode"]}) > 1:
            n, m = fastest["nanolm"], fastest["MiniMind"]
            print(f"  each in its faster dtype: nanolm {n['ms_per_token']:.2f} ms/token ({n['dtype']}), MiniMind "
                  f"{m['ms_per_token']:.2f} ({m['dtype']}): {m['ms_per_token'] / n['ms_per_token']:.2f}x")


if __name__ == "__main__":
    main()
