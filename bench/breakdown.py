"""Where one training step's time goes, part by part, beside each part's matrix-product floor.

`bench/throughput.py --breakdown` calls `step_breakdown` for each dtype (and, with --compile, each part
compiled on its own). Every part is timed alone, forward and forward + backward, on inputs of the shapes a
step of the preset gives it, and multiplied by how often a step runs it (a layer's parts n_layer times):

- embedding: the token lookup and its gradient;
- norms: the RMSNorms (two per layer and the final one);
- projections: q, k, v and o;
- attention: the rest of the attention module (QK-norm, RoPE, SDPA), its whole time minus the projections';
- MLP: gate, up, SwiGLU, down (MoE layers: router and experts);
- output + loss: the output projection and cross-entropy as `nanolm train` runs them (fused and chunked,
  nanolm.model.linear_ce), and beside it the plain `cross_entropy(lm_head(h).float(), y)` for comparison;
- optimizer: gradient clipping, the optimizer's step and zero_grad over the whole model;
- loader: `DataStream.next_batch` on a prepared token set (random ids in `nanolm prepare`'s format) and
  the batch's move to the device;
- logging: one metrics.jsonl record written by the trainer's MetricsWriter.

The loader and logging run around the step, on the host, so they are listed but not summed with the rest.

The floor of a part is its matrix-product FLOPs (forward + backward = 3x forward) at the matmul ceiling
measured in the same run; parts with no matrix products have none. The whole step, timed as the
`train` part of throughput.py times it, is printed with the sum of the parts; what the sum does not cover
(residual adds, dropout, casts between parts, Python between modules) is the "other" row.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from nanolm.config import Config
from nanolm.model.linear_ce import linear_cross_entropy
from nanolm.model.moe import moe_param_counts
from nanolm.model.transformer import Transformer
from nanolm.runtime import autocast
from nanolm.train.losses import lm_loss
from nanolm.train.optim import build_optimizer


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    fn()  # warm-up (and, compiled, the compile)
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fwd_bwd(part: Callable[..., torch.Tensor], inputs: list[torch.Tensor], device: torch.device,
             dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    """(forward s, backward s) of part(*inputs) under the step's autocast; backward = (fwd + bwd) - fwd."""
    grad_out: list[torch.Tensor] = []

    def forward() -> torch.Tensor:
        with autocast(device, dtype):
            return part(*inputs)

    def both() -> None:
        out = forward()
        if not grad_out:
            grad_out.append(torch.randn_like(out) if out.dim() else torch.ones_like(out))
        out.backward(grad_out[0])
        for t in inputs:
            t.grad = None

    fwd = _median_s(forward, device, repeats)
    total = _median_s(both, device, repeats)
    return fwd, max(total - fwd, 0.0)


def _loader_s(cfg: Config, device: torch.device, batch_size: int, seq_len: int, repeats: int) -> float:
    from bigdata import write_token_set  # bench/bigdata.py, beside this file
    from nanolm.train.configure import load_config
    from nanolm.data.stream import DataStream
    with tempfile.TemporaryDirectory(prefix="nanolm-breakdown-") as tmp:
        write_token_set(Path(tmp), (repeats + 4) * batch_size * (seq_len + 1) * 4, vocab_size=cfg.model.vocab_size)
        run_cfg = load_config(None, overrides={"data.path": tmp, "train.batch_size": batch_size,
                                               "train.seq_len": seq_len, "model.vocab_size": cfg.model.vocab_size})
        data = DataStream.from_config(run_cfg, rank=0, world_size=1)
        return _median_s(lambda: data.next_batch().to(device, non_blocking=True), device, repeats)


def _logging_s(repeats: int) -> float:
    from nanolm.train.metrics import MetricsWriter
    with tempfile.TemporaryDirectory(prefix="nanolm-breakdown-") as tmp:
        writer = MetricsWriter(Path(tmp))
        record = {"step": 1, "tokens": 2048, "loss": 3.14159, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1e4,
                  "mfu": 0.3, "elapsed_s": 1.0}
        s = _median_s(lambda: writer.write(record), torch.device("cpu"), repeats)
        writer.close()
        return s


def step_breakdown(cfg: Config, device: torch.device, dtype: torch.dtype, batch_size: int, seq_len: int,
                   compile_parts: bool, repeats: int, ceiling: float | None) -> dict[str, Any]:
    """The table's rows (part, calls per step, forward s, backward s, floor s) for one dtype and compile mode."""
    mc = cfg.model
    torch.manual_seed(0)
    model = Transformer(mc).to(device)
    model.train()
    layer = model.layers[0]
    attn = layer.self_attn
    B, T, C, L = batch_size, seq_len, mc.d_model, mc.n_layer
    tokens = B * T
    maybe = (lambda f: torch.compile(f)) if compile_parts else (lambda f: f)

    def hidden() -> torch.Tensor:  # the residual stream a part reads: float32 (B, T, C)
        return torch.randn(B, T, C, device=device, requires_grad=True)

    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    ids = torch.randint(0, mc.vocab_size, (B, T), device=device)
    targets = torch.randint(0, mc.vocab_size, (B * T,), device=device)
    y_in = torch.randn(B, T, mc.n_head * mc.head_dim, device=device, requires_grad=True)

    class Projections(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            return q.sum() + k.sum() + v.sum() + attn.o_proj(y).float().sum()

    if mc.is_moe_layer(0):
        mlp_flops = moe_param_counts(C, mc.moe_n_hidden, mc.n_experts, mc.top_k, mc.n_shared_experts)["active"]
    else:
        mlp_flops = 3 * C * mc.n_hidden
    proj_params = C * mc.head_dim * (mc.n_head + 2 * mc.n_kv_head) + mc.n_head * mc.head_dim * C
    # part -> (calls per step, matmul FLOPs of one call forward + backward)
    flops = {"embedding": (1, 0), "norms": (2 * L + 1, 0),
             "projections": (L, 6 * tokens * proj_params),
             "attention (QK-norm, RoPE, SDPA)": (L, 3 * 2 * 2 * tokens * T * mc.n_head * mc.head_dim),
             "MLP": (L, 6 * tokens * mlp_flops),
             "output + loss (fused, as trained)": (1, 6 * tokens * mc.vocab_size * C),
             "output + loss (plain, not in the step)": (1, 6 * tokens * mc.vocab_size * C)}
    h = torch.randn(B * T, C, device=device, requires_grad=True)
    parts: dict[str, tuple[Callable[..., torch.Tensor], list[torch.Tensor]]] = {
        "embedding": (maybe(model.embed_tokens), [ids]),
        "norms": (maybe(layer.input_layernorm), [hidden()]),
        "projections": (maybe(Projections()), [hidden(), y_in]),
        "attention (QK-norm, RoPE, SDPA)": (maybe(lambda x: attn(x, cos, sin)), [hidden()]),
        "MLP": (maybe(layer.mlp), [hidden()]),
        "output + loss (fused, as trained)": (maybe(lambda x: linear_cross_entropy(x, model.lm_head.weight,
                                                                                   targets)), [h]),
        "output + loss (plain, not in the step)": (maybe(lambda x: lm_loss(model.lm_head(x)[None], targets[None], "sum")),
                                                   [h]),
    }
    rows = []
    times: dict[str, tuple[float, float]] = {}
    for name, (fn, inputs) in parts.items():
        times[name] = _fwd_bwd(fn, inputs, device, dtype, repeats)  # embedding: the backward into its weight
    # The attention module's own time includes its projections: the row is the rest.
    pf, pb = times["projections"]
    af, ab = times["attention (QK-norm, RoPE, SDPA)"]
    times["attention (QK-norm, RoPE, SDPA)"] = (max(af - pf, 0.0), max(ab - pb, 0.0))
    for name, (fwd, bwd) in times.items():
        calls, f = flops[name]
        rows.append({"part": name, "calls": calls, "forward_s": fwd * calls, "backward_s": bwd * calls,
                     "floor_s": f * calls / ceiling if (ceiling and f) else None, "in_step": "plain" not in name})
    model.zero_grad(set_to_none=True)
    optimizer = build_optimizer(model, cfg.optim, device)

    def opt_step() -> None:
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # kept, so each repeat times the same work

    rows.append({"part": "optimizer (clip, step, zero_grad)", "calls": 1,
                 "forward_s": _median_s(opt_step, device, repeats), "backward_s": 0.0, "floor_s": None,
                 "in_step": True})
    rows.append({"part": "loader (next_batch, to device)", "calls": 1,
                 "forward_s": _loader_s(cfg, device, B, T, repeats), "backward_s": 0.0, "floor_s": None,
                 "in_step": False})
    rows.append({"part": "logging (a metrics.jsonl record)", "calls": 1, "forward_s": _logging_s(repeats),
                 "backward_s": 0.0, "floor_s": None, "in_step": False})
    if compile_parts:
        torch._dynamo.reset()
    return {"dtype": str(dtype).removeprefix("torch."), "compile": compile_parts, "rows": rows}


def print_breakdown(b: dict[str, Any], whole_step_s: float | None, tokens: int) -> None:
    print(f"\nstep breakdown, {b['dtype']}{' (each part compiled)' if b['compile'] else ''}: ms per step of "
          f"{tokens} tokens; floor = the part's matmul FLOPs at this run's matmul ceiling")
    print(f"  {'part':<42}{'calls':>6}{'fwd ms':>9}{'bwd ms':>9}{'total':>9}{'floor':>8}{'x floor':>9}")
    counted = 0.0
    for r in b["rows"]:
        total = r["forward_s"] + r["backward_s"]
        if r["in_step"]:
            counted += total
        floor = "-" if r["floor_s"] is None else f"{r['floor_s'] * 1e3:.1f}"
        ratio = "-" if not r["floor_s"] else f"{total / r['floor_s']:.1f}"
        print(f"  {r['part']:<42}{r['calls']:>6}{r['forward_s'] * 1e3:>9.1f}{r['backward_s'] * 1e3:>9.1f}"
              f"{total * 1e3:>9.1f}{floor:>8}{ratio:>9}")
    print("  (the plain output + loss is shown for comparison; loader and logging run around the step, not in it)")
    print(f"  {'sum of the model and optimizer parts':<42}{'':>6}{'':>9}{'':>9}{counted * 1e3:>9.1f}")
    if whole_step_s is not None:
        print(f"  {'whole step (train, same dtype)':<42}{'':>6}{'':>9}{'':>9}{whole_step_s * 1e3:>9.1f}")
        print(f"  {'other (residual adds, casts, Python)':<42}{'':>6}{'':>9}{'':>9}"
              f"{(whole_step_s - counted) * 1e3:>9.1f}")
