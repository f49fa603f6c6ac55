"""The options every command that loads a model to decode with shares (generate, chat, serve): the checkpoint
and how it is loaded (adapter, newest or best, device, dtype, YaRN), the sampling defaults (generated from
`SamplingParams`) and --compile; and the model or engine built from the parsed options."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

from nanolm.config.options import add_fields, from_fields


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model to load, for generate, chat and serve."""
    p.add_argument("checkpoint", help="a run directory or a checkpoint directory")
    p.add_argument("--adapter", default=None, help="a LoRA run or checkpoint to apply to the model, unmerged")
    p.add_argument("--last", action="store_true", help="use the newest checkpoint instead of the best one")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the weights' dtype while decoding (auto: bfloat16 on a GPU with it, or on a CPU, for a model "
                        "at least 256 wide, where one row through its weights times faster in bf16; else float32)")
    p.add_argument("--yarn", type=float, default=None, metavar="FACTOR",
                   help="stretch the context of a model trained without YaRN FACTOR times with YaRN RoPE scaling "
                        "(from the window it was trained on, e.g. 4: 512 -> 2048 tokens)")


def inference_parser(sub: argparse._SubParsersAction, name: str, func: Callable[[argparse.Namespace], None],
                     **kw: Any) -> argparse.ArgumentParser:
    """The parser of a command that loads a model and samples from it: generate, chat, serve."""
    from nanolm.config import SamplingParams
    p = sub.add_parser(name, **kw)
    add_model_args(p)
    add_fields(p, SamplingParams, "sampling")
    p.set_defaults(func=func)
    return p


def add_compile_arg(p: argparse.ArgumentParser) -> None:
    """--compile for generate and chat (serve's is a ServeConfig field)."""
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the one-row decode step before the first token, kept only where it times "
                        "faster (tens of seconds of compile for a faster token: for a long chat)")


def model_from_args(args: argparse.Namespace) -> tuple[Any, Any, Any, Path]:
    """(model, sampling params, device, checkpoint dir) from the shared inference arguments."""
    from nanolm.config import SamplingParams
    from nanolm.runtime import resolve_device
    from nanolm.checkpoint import load_model

    params = from_fields(args, SamplingParams)  # checked before the model loads
    device = resolve_device(args.device)
    model, src = load_model(args.checkpoint, "last" if args.last else "best", device, adapter=args.adapter,
                            yarn=args.yarn)
    return model, params, device, src


def engine_from_args(args: argparse.Namespace, loaded: tuple | None = None) -> tuple[Any, Any, Any, Path]:
    """(engine, tokenizer, sampling params, checkpoint dir) from the shared inference arguments (or the model
    `model_from_args` loaded)."""
    from nanolm.infer.engine import Engine
    from nanolm.runtime import decode_dtype
    from nanolm.tokenizer import Tokenizer

    model, params, device, src = loaded or model_from_args(args)
    dtype, why = decode_dtype(args.dtype, device, model.config)
    engine = Engine(model, device, dtype)
    if args.compile:
        why += f"; {engine.compile_decode(rows=1)}"
    print(f"[{src}{' + adapter ' + str(args.adapter) if args.adapter else ''}; decoding in "
          f"{str(dtype).removeprefix('torch.')}: {why}]", file=sys.stderr)
    return engine, Tokenizer.load(src), params, src
