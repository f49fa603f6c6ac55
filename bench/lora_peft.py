"""A LoRA fine-tuning step at Qwen2.5-0.5B's shape: nanolm against transformers + peft, in the same run.

Both build the model with random weights locally (nothing is downloaded) at the same shape: Qwen2.5-0.5B's
(vocabulary 151,936, hidden 896, 24 layers, 14 query and 2 key/value heads of 64, SwiGLU 4,864, q/k/v
biases, tied embeddings), or a smaller one with `--layers`. Both wrap the same projections (q, k, v, o,
gate, up, down) in rank-16 adapters (alpha 32), train them with AdamW (the base frozen), on the same batch
shape of random token ids, in float32, or with `--dtype bfloat16` under bf16 autocast with the frozen base
kept in bf16 on both sides (nanolm's `lora.base_dtype` auto: the frozen projections in bf16, norms and
embeddings in float32; transformers' model loaded in bf16 as `torch_dtype=torch.bfloat16` does, peft's
adapters in float32): nanolm with its fused
output projection and loss (`Transformer(..., targets=)`), transformers with `labels=` as a peft user
writes it. Each variant runs in a process of its own, the two interleaved `--rounds` times; each process
times `--steps` steps after `--warmup` and reports its peak resident memory (the process's high-water
mark, and that mark less the memory after imports, before the model is built).

    pip install peft                       # transformers + peft, for the comparison only
    PYTHONPATH=. python bench/lora_peft.py --rounds 3 --steps 3 --seq-len 256

Prints one line per process and a JSON summary (medians) as its last line.

The same on a real model (SmolLM2-135M-Instruct's weights, sequences 256 and 512, against the matmul ceiling):
bench/lora_real.py.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys

QWEN25_05B = dict(vocab=151_936, hidden=896, layers=24, heads=14, kv_heads=2, head_dim=64, ffn=4864)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def child(args: argparse.Namespace) -> None:
    import torch

    from lora_real import timed_steps  # bench/, beside this
    torch.manual_seed(0)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    s = {**QWEN25_05B, "layers": args.layers}
    if args.variant == "peft":
        import peft  # noqa: F401  (imported before the baseline, as nanolm's modules are)
        import transformers  # noqa: F401
    else:
        import nanolm.model.transformer  # noqa: F401
    base_mib = current_rss_mib()
    if args.variant == "nanolm":
        from nanolm.config.model import ModelConfig
        from nanolm.model import lora
        from nanolm.model.transformer import Transformer
        model = Transformer(ModelConfig(vocab_size=s["vocab"], d_model=s["hidden"], n_layer=s["layers"],
                                        n_head=s["heads"], n_kv_head=s["kv_heads"], head_dim=s["head_dim"],
                                        n_hidden=s["ffn"], qkv_bias=True, tie_embeddings=True, norm_eps=1e-6,
                                        rope_theta=1e6, max_seq_len=args.seq_len))
        lora.apply_lora(model, args.rank, 2 * args.rank, 0.0, TARGETS)
        lora.mark_only_lora_as_trainable(model)
        if args.dtype == "bfloat16":  # lora.base_dtype auto under bf16 training: the frozen projections in bf16
            lora.cast_base(model, torch.bfloat16)

        def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return model(x, targets=y) / y.numel()  # the summed CE of the fused head, as a mean
    else:
        from peft import LoraConfig, get_peft_model
        from transformers import Qwen2Config, Qwen2ForCausalLM
        cfg = Qwen2Config(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                          num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
                          intermediate_size=s["ffn"], tie_word_embeddings=True, rms_norm_eps=1e-6,
                          rope_theta=1e6, max_position_embeddings=args.seq_len, use_cache=False)
        cfg._attn_implementation = "sdpa"
        base = Qwen2ForCausalLM(cfg)
        if args.dtype == "bfloat16":  # as a peft user loads it (torch_dtype=torch.bfloat16); adapters stay fp32
            base = base.to(torch.bfloat16)
        model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=2 * args.rank,
                                                                 lora_dropout=0.0, target_modules=list(TARGETS)))

        def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return model(input_ids=x, labels=x).loss  # transformers shifts the labels itself
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(0, s["vocab"], (args.batch, args.seq_len + 1), generator=gen)
    x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
    times, losses = timed_steps(loss_of, opt, x, y, autocast, args.warmup, args.steps)
    step_s = statistics.median(times)
    print(json.dumps({"variant": args.variant, "step_s": step_s, "tokens_per_s": args.batch * args.seq_len / step_s,
                      "peak_mib": peak_rss_mib(), "peak_over_imports_mib": peak_rss_mib() - base_mib,
                      "trainable": sum(p.numel() for p in trainable), "loss": losses[-1]}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=("nanolm", "peft"), help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=QWEN25_05B["layers"], help="fewer for a quick look")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.variant:
        child(args)
        return
    results: dict[str, list[dict]] = {"nanolm": [], "peft": []}
    for r in range(args.rounds):
        for variant in (("nanolm", "peft") if r % 2 == 0 else ("peft", "nanolm")):  # interleaved, alternating
            cmd = [sys.executable, __file__, "--variant", variant] + [
                f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("variant", "rounds")]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            res = json.loads(out)
            results[variant].append(res)
            print(f"round {r + 1} {variant:>6}: {res['tokens_per_s']:.1f} tokens/s ({res['step_s']:.2f} s/step), "
                  f"peak {res['peak_mib']:.0f} MiB ({res['peak_over_imports_mib']:.0f} over imports), loss "
                  f"{res['loss']:.3f}", flush=True)
    med = {v: {k: statistics.median(r[k] for r in rs) for k in ("tokens_per_s", "step_s", "peak_mib",
                                                                   "peak_over_imports_mib")}
           for v, rs in results.items()}
    summary = {"shape": {**QWEN25_05B, "layers": args.layers}, "seq_len": args.seq_len, "batch": args.batch,
               "rank": args.rank, "dtype": args.dtype, "rounds": args.rounds, "median": med,
               "speed_ratio": med["nanolm"]["tokens_per_s"] / med["peft"]["tokens_per_s"],
               "memory_ratio": med["nanolm"]["peak_mib"] / med["peft"]["peak_mib"],
               "memory_over_imports_ratio": med["nanolm"]["peak_over_imports_mib"] / med["peft"]["peak_over_imports_mib"]}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
