"""`nanolm <command>`: one dispatcher that parses arguments and calls the library.

Every user-facing failure is a `UserError`: printed as one line, exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from nanolm.config.options import add_fields, from_fields
from nanolm.errors import UserError
from nanolm.infer.options import add_compile_arg, engine_from_args, inference_parser, model_from_args


def _cmd_data(args: argparse.Namespace) -> None:
    from nanolm import corpora
    if args.data_cmd == "list":
        print(corpora.describe())
    elif args.data_cmd == "preferences":
        from nanolm.corpora.holdout import training_view
        from nanolm.data.builtin.preferences import build_idiom_preferences
        # The training view: the idioms of the built-in benchmark stay out of the pairs.
        out = build_idiom_preferences(training_view("idioms", corpora.fetch("idioms")), Path(args.out), args.n,
                                      args.seed)
        print(f"{args.n} preference pairs from the idioms corpus -> {out}")
    elif args.data_cmd == "tools":
        from nanolm.data.builtin.tooluse import build_calculator_conversations, calculator_prompts, calculator_prompts2
        from nanolm.infer.tools import BUILTIN_TOOLS, calculator
        if args.prompts2:
            out = calculator_prompts2(Path(args.out), args.n, args.seed, calculator=calculator)
            print(f"{args.n} two-operation calculator prompts for --stage grpo with --grpo.tools builtin (phrasings "
                  f"of their own, numbers no calc or calc2 item uses) -> {out}")
        elif args.prompts:
            out = calculator_prompts(Path(args.out), args.n, args.seed, calculator=calculator)
            print(f"{args.n} calculator prompts for --stage grpo / ppo with --grpo.tools builtin (in phrasings the "
                  f"conversations never use; each answer the calculator's) -> {out}")
        else:
            out = build_calculator_conversations(Path(args.out), args.n, args.seed, calculator=calculator,
                                                 tools=BUILTIN_TOOLS)
            print(f"{args.n} tool-use conversations (the calculator's own results) -> {out}")
    elif args.data_cmd == "arith":
        from nanolm.data.builtin.arith import write_arith
        for name, path in write_arith(Path(args.out), args.n_sft, args.n_prompts, args.n_heldout, args.seed,
                                      max_number=args.max_number, level=args.level).items():
            print(f"{name}: {path}")
    elif args.data_cmd == "blocks":
        from nanolm.data.builtin.digit_tasks import write_digit_task
        out = write_digit_task(Path(args.out), args.task, args.n, args.min_len, args.max_len, args.seed)
        print(f"{args.n} {args.task} records (inputs of {args.min_len} to {args.max_len} digits, each once) -> {out}; "
              "the val split of `nanolm prepare --format blocks` is held out")
    else:
        for name in args.names:
            print(corpora.fetch(name))


def _cmd_tokenizer_train(args: argparse.Namespace) -> None:
    from nanolm.corpora import resolve_sources
    from nanolm.data.kinds import iter_texts
    from nanolm.tokenizer import compression_report, split_by_script, train_tokenizer

    files = resolve_sources(args.sources)
    texts = iter_texts(files, format=args.format, skip_bad=args.skip_bad)
    tok = train_tokenizer(texts, Path(args.out), args.vocab_size, split_digits=args.split_digits)
    zh, en = split_by_script(iter_texts(files, format=args.format, skip_bad=True))
    print(f"tokenizer: {tok.vocab_size} tokens -> {Path(args.out).resolve()}")
    print(compression_report(tok, zh, en))


def _cmd_prepare(args: argparse.Namespace) -> None:
    from nanolm.corpora import resolve_sources
    from nanolm.data.prepare import PrepareConfig, run

    args.sources = resolve_sources(args.sources)  # built-in corpus names become their files
    run(from_fields(args, PrepareConfig))


def _add_overrides(p: argparse.ArgumentParser) -> None:
    from nanolm.config.load import override_fields
    g = p.add_argument_group("config fields (override the preset and the config file)")
    for name, typ in override_fields().items():
        if name == "data.sets":  # given as --data DIR:key=value,... (see _config_from_args)
            continue
        kind = getattr(typ, "__name__", str(typ))
        if typ is bool:
            g.add_argument(f"--{name}", dest=name, nargs="?", const="true", default=argparse.SUPPRESS,
                           metavar="BOOL")
        else:
            g.add_argument(f"--{name}", dest=name, default=argparse.SUPPRESS, metavar=kind.upper())


# Common fields with a short spelling too.
_SHORTCUTS = {"out": "train.out_dir", "stage": "train.stage", "init_from": "train.init_from"}


def _config_from_args(args: argparse.Namespace):
    from nanolm.config import data_overrides
    from nanolm.config.load import override_fields
    from nanolm.train.configure import load_config
    overrides = {k: v for k, v in vars(args).items() if k in override_fields()}
    if getattr(args, "data", None) is not None:
        overrides.update(data_overrides(args.data))
    for short, full in _SHORTCUTS.items():
        value = getattr(args, short, None)
        if value is not None:
            overrides[full] = value
    return load_config(args.preset, args.config, overrides)


def _cmd_train(args: argparse.Namespace) -> None:
    from nanolm.train.trainer import train
    cfg = _config_from_args(args)
    train(cfg, resume=args.resume)


def _cmd_generate(args: argparse.Namespace) -> None:
    from nanolm.infer.generate import check_text, complete
    check_text(args.prompt, "--prompt")  # bytes that are not UTF-8 cannot be echoed, nor tokenized
    loaded = model_from_args(args)
    model, src = loaded[0], loaded[3]
    if not model.config.causal or _block_run(src):  # a block in, the output block out
        from nanolm.checkpoint import trained_seq_len
        from nanolm.infer.generate import write_block
        from nanolm.tokenizer import Tokenizer
        print(f"[{src}; {'non-causal' if not model.config.causal else 'causal'} model of input/output blocks: the "
              "output block, greedy]", file=sys.stderr)
        print(write_block(model, Tokenizer.load(src), args.prompt, trained_seq_len(src)))
        return
    engine, tok, params, _ = engine_from_args(args, loaded)
    sys.stdout.write(args.prompt)
    complete(engine, tok, args.prompt, params)
    sys.stdout.write("\n")


def _block_run(src: Path) -> bool:
    """Whether a checkpoint's run trained input/output blocks: its config.json's train.stage is a `block_model`
    stage (a model directory made by export or merge records no stage)."""
    from nanolm.checkpoint import CONFIG, read_json
    from nanolm.train import stages
    train = read_json(Path(src) / CONFIG, "config").get("train")
    name = train.get("stage") if isinstance(train, dict) else None
    return name in stages.names() and stages.get(name).block_model


def _cmd_chat(args: argparse.Namespace) -> None:
    from nanolm.infer.session import ChatSession, run_chat
    from nanolm.infer.tools import Toolbox
    if args.max_tool_rounds < 0:
        raise UserError(f"--max-tool-rounds {args.max_tool_rounds}: must be >= 0 (0: no continuation after tool "
                        "results)")
    tools = Toolbox.from_specs(args.tools)  # a bad tools.json fails before the model loads
    engine, tok, params, _ = engine_from_args(args)
    run_chat(ChatSession(engine, tok, params, system=args.system, tools=tools, thinking=args.think,
                         max_tool_rounds=args.max_tool_rounds, guide_calls=not args.free_calls))


def _cmd_lora_merge(args: argparse.Namespace) -> None:
    from nanolm.checkpoint import merge_adapter_checkpoint
    out = merge_adapter_checkpoint(args.adapter, Path(args.out), base=args.base)
    print(f"merged model written to {out}")


def _cmd_export(args: argparse.Namespace) -> None:
    which = "last" if args.last else "best"
    if args.format == "hf":
        from nanolm.export.hf import export_hf
        out = export_hf(args.checkpoint, Path(args.out), which=which, adapter=args.adapter, dtype=args.dtype)
    elif args.format == "gguf":
        from nanolm.export.gguf import export_gguf
        out = export_gguf(args.checkpoint, Path(args.out), which=which, adapter=args.adapter, outtype=args.outtype)
    elif args.format == "web":
        from nanolm.config import SamplingParams
        from nanolm.export.web import export_web, serve
        out = export_web(args.checkpoint, Path(args.out), which=which, adapter=args.adapter, outtype=args.outtype,
                         sampling=from_fields(args, SamplingParams), system=args.system or "")
        if args.serve:
            serve(out, port=args.port)
        else:
            print(f"exported to {out}; open it with `python -m http.server -d {out}` (http://localhost:8000/) "
                  "or put the folder on any static host")
        return
    else:
        from nanolm.config import SamplingParams
        from nanolm.export.ollama import MODELFILE, export_ollama
        out = export_ollama(args.checkpoint, Path(args.out), which=which, adapter=args.adapter,
                            outtype=args.outtype, sampling=from_fields(args, SamplingParams), system=args.system)
        print(f"exported to {out}; load it into ollama with `ollama create <name> -f {out / MODELFILE}`")
        return
    print(f"exported to {out}")


def _cmd_models(args: argparse.Namespace) -> None:
    from nanolm.corpora.models import describe_models, fetch_model
    from nanolm.export.gguf_import import builtin_checkpoint
    if args.models_cmd == "list":
        print(describe_models())
    else:
        for name in args.names:
            print(fetch_model(name) if args.file_only else builtin_checkpoint(name))


def _builtin_models(args: argparse.Namespace) -> None:
    """A built-in model's name (`nanolm models list`) given where a checkpoint directory goes, and no such path,
    becomes the checkpoint imported from its file (fetched and verified; imported once into the cache)."""
    for key in ("checkpoint", "init_from", "train.init_from", "base"):
        value = getattr(args, key, None)
        if isinstance(value, str) and "/" not in value and os.sep not in value and not Path(value).exists():
            from nanolm.corpora.models import MODELS
            if value in MODELS:
                from nanolm.export.gguf_import import builtin_checkpoint
                setattr(args, key, str(builtin_checkpoint(value)))


def _cmd_import(args: argparse.Namespace) -> None:
    if args.format == "gguf":
        from nanolm.export.gguf_import import import_gguf
        out = import_gguf(Path(args.file), Path(args.out))
    else:
        from nanolm.export.hf import import_hf
        out = import_hf(Path(args.hf_dir), Path(args.out))
    print(f"imported into {out}; continue with `nanolm train --config {out}/config.json --init-from {out} "
          f"--data <prepared dir> ...`")


def _cmd_serve(args: argparse.Namespace) -> None:
    from nanolm.config import SamplingParams, ServeConfig
    from nanolm.infer.server import serve
    args.api_key = args.api_key or os.environ.get("NANOLM_API_KEY") or None  # "" is no key, as unset
    serve(args.checkpoint, from_fields(args, ServeConfig), sampling=from_fields(args, SamplingParams),
          adapter=args.adapter, which="last" if args.last else "best", device=args.device, yarn=args.yarn,
          dtype=args.dtype)


def _cmd_plot(args: argparse.Namespace) -> None:
    from nanolm.plot import plot_runs
    print(f"plot written to {plot_runs(args.runs, Path(args.out), x=args.x)}")


def _cmd_eval(args: argparse.Namespace) -> None:
    from nanolm.eval.loss import evaluate, format_result
    if args.endpoint:  # a served model: tool-use tasks only, through its chat completions
        from nanolm.eval.runner import format_table, run_endpoint_eval
        if args.checkpoint or args.data or args.degeneration:
            raise UserError("nanolm eval --endpoint scores a served model: give --model NAME and --task "
                            "toolcall:FILE, without a checkpoint, --data or --degeneration")
        if not args.model or not args.task:
            raise UserError("nanolm eval --endpoint URL needs --model NAME (as the endpoint names it) and --task "
                            "toolcall:FILE")
        report = run_endpoint_eval(args.endpoint, args.model, args.task, max_new_tokens=args.max_new_tokens,
                                   api_key=args.api_key or os.environ.get("OPENAI_API_KEY"), out=args.out)
        print(format_table(report["tasks"]))
        print(f"results -> {report['path']}")
        return
    if not args.checkpoint:
        raise UserError("nanolm eval: give a run or checkpoint directory (or --endpoint URL --model NAME)")
    if not args.data and not args.task:
        raise UserError("nanolm eval: nothing to score; pass --data (loss, perplexity, bits per byte on text) "
                        "and/or --task (benchmarks: a built-in name such as idioms, or a task file)")
    which = "last" if args.last else "best"
    if args.data:  # with --degeneration, --data also gives its prompts
        result = evaluate(args.checkpoint, args.data, which=which, batch_size=args.batch_size, seq_len=args.seq_len,
                          max_tokens=args.max_tokens, device=args.device, adapter=args.adapter)
        print(format_result(result))
    if args.task or args.degeneration:
        from nanolm.eval.runner import format_degeneration, format_table, run_eval
        report = run_eval(args.checkpoint, args.task, which=which, batch_size=args.batch_size, device=args.device,
                          adapter=args.adapter, chat={"auto": None, "on": True, "off": False}[args.chat],
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                          degeneration=args.degeneration, data=args.data, out=args.out)
        if report["tasks"]:
            print(format_table(report["tasks"]))
        for r in report["tasks"]:
            if r.get("kind") == "calc":
                from nanolm.eval.calc import format_calc
                print(format_calc(r))
        if "degeneration" in report:
            print(format_degeneration(report["degeneration"]))
        print(f"results -> {report['path']}")


def _cmd_report(args: argparse.Namespace) -> None:
    from nanolm.eval.card import format_report, write_report
    from nanolm.eval.report import DEFAULT_TASKS, build_report
    card = build_report(args.runs, tasks=args.task or DEFAULT_TASKS, n=args.n, text_train=args.text_train,
                        text_heldout=args.text_heldout, device=args.device, batch_size=args.batch_size)
    print(format_report(card))
    print(f"report -> {write_report(card, Path(args.out) if args.out else Path(args.runs[0]) / 'report')}")


def _cmd_quickstart(args: argparse.Namespace) -> None:
    from nanolm.quickstart import QuickstartConfig, run
    cfg = from_fields(args, QuickstartConfig)
    if cfg.model is not None:
        from nanolm.quickstart_model import run as run_model
        run_model(cfg)
    else:
        run(cfg)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nanolm", description="Train a small language model yourself, "
                                "from raw text to chat.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_commands in (_add_quickstart, _add_builtin_commands, _add_training_commands, _add_chat_commands,
                         _add_conversion_commands, _add_serve_and_eval_commands):
        add_commands(sub)
    return p


# The _add_*_commands below each add their commands to `sub`, in the order `nanolm --help` lists them.


def _add_quickstart(sub: argparse._SubParsersAction) -> None:
    from nanolm.quickstart import QuickstartConfig
    q = sub.add_parser("quickstart", help="every stage at tiny scale on the built-in corpora, in minutes")
    add_fields(q, QuickstartConfig, "what to run")
    q.set_defaults(func=_cmd_quickstart)


def _add_builtin_commands(sub: argparse._SubParsersAction) -> None:
    """data, models: the built-in corpora, data sets and real models."""
    d = sub.add_parser("data", help="built-in corpora: list, fetch")
    dsub = d.add_subparsers(dest="data_cmd", required=True, metavar="ACTION")
    dsub.add_parser("list", help="show the registry of built-in corpora")
    f = dsub.add_parser("fetch", help="download and verify built-in corpora into the cache")
    f.add_argument("names", nargs="+")
    pf = dsub.add_parser("preferences", help="a DPO set from the idioms corpus: the real answer chosen, "
                                             "another idiom's real answer rejected")
    pf.add_argument("--out", required=True, help="the JSONL file to write")
    pf.add_argument("--n", type=int, default=2000, help="number of pairs")
    pf.add_argument("--seed", type=int, default=0)
    tl = dsub.add_parser("tools", help="a tool-use SFT set: arithmetic questions answered through the built-in "
                                       "calculator, its result fed back and quoted")
    tl.add_argument("--out", required=True, help="the JSONL file to write")
    tl.add_argument("--n", type=int, default=2000, help="number of conversations (or prompts)")
    tl.add_argument("--prompts", action="store_true",
                    help="write RL prompts instead ({\"prompt\", \"answer\"} records for `nanolm prepare --format "
                         "prompts`), in phrasings of their own")
    tl.add_argument("--prompts2", action="store_true",
                    help="RL prompts that need two operations (where the held-out calc2 benchmark scores)")
    tl.add_argument("--seed", type=int, default=0)
    ar = dsub.add_parser("arith", help="arithmetic word problems with computed answers (English and Chinese): an SFT "
                                       "set with worked answers, and RL prompts (train and held out) for --stage grpo")
    ar.add_argument("--out", required=True, help="directory for sft.jsonl, prompts.jsonl and heldout.jsonl")
    ar.add_argument("--n-sft", type=int, default=2000, help="worked SFT conversations")
    ar.add_argument("--n-prompts", type=int, default=1000, help="RL prompts to train on")
    ar.add_argument("--n-heldout", type=int, default=200, help="held-out RL prompts (no problem shared)")
    ar.add_argument("--seed", type=int, default=0)
    ar.add_argument("--level", choices=["standard", "easy"], default="standard",
                    help="standard: +, -, x of numbers up to 20 and two-step problems; easy: one sum or difference "
                         "of single digits (a small model learns part of it in minutes)")
    ar.add_argument("--max-number", type=int, default=None, help="largest number drawn (default 20, easy: 9)")
    bl = dsub.add_parser("blocks", help="digit strings sorted or reversed, as input/output records for a "
                                        "non-causal model (--stage blocks); the val split is held out")
    bl.add_argument("--out", required=True, help="the JSONL file to write")
    bl.add_argument("--task", choices=["sort", "reverse"], default="sort")
    bl.add_argument("--n", type=int, default=20000, help="records (every input distinct)")
    bl.add_argument("--min-len", type=int, default=4, help="fewest digits of an input")
    bl.add_argument("--max-len", type=int, default=12, help="most digits of an input")
    bl.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=_cmd_data)

    mo = sub.add_parser("models", help="built-in real models (a name works wherever a checkpoint directory does)")
    mosub = mo.add_subparsers(dest="models_cmd", required=True, metavar="ACTION")
    mosub.add_parser("list", help="show the registry of built-in models, their licences and what is cached")
    mf = mosub.add_parser("fetch", help="download and verify built-in models and import them into the cache")
    mf.add_argument("names", nargs="+")
    mf.add_argument("--file-only", action="store_true", help="only the model file (GGUF), not imported")
    mo.set_defaults(func=_cmd_models)


def _add_training_commands(sub: argparse._SubParsersAction) -> None:
    """tokenizer, prepare, train."""
    from nanolm.config import PRESETS
    from nanolm.data import kinds
    from nanolm.data.prepare import PrepareConfig
    t = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer")
    tsub = t.add_subparsers(dest="tok_cmd", required=True, metavar="ACTION")
    tt = tsub.add_parser("train", help="train on built-in corpora and/or .txt/.jsonl files or directories")
    tt.add_argument("sources", nargs="+")
    tt.add_argument("--out", required=True, help="directory for tokenizer.json + tokenizer_config.json")
    tt.add_argument("--vocab-size", type=int, default=6400)
    tt.add_argument("--format", choices=kinds.choices(), default=kinds.TextKind.name,
                    help="the kind of data the files hold (as `nanolm prepare --format`), and what the tokenizer "
                         "trains on: " + kinds.texts_help())
    tt.add_argument("--split-digits", action=argparse.BooleanOptionalAction, default=True,
                    help="one token per digit, as Qwen2/3 (default); --no-split-digits: GPT-2's split, as tokenizers "
                         "trained before")
    tt.add_argument("--skip-bad", action="store_true", help="skip malformed JSONL lines instead of stopping")
    tt.set_defaults(func=_cmd_tokenizer_train)

    pr = sub.add_parser("prepare", help="tokenize text into memory-mapped training shards")
    add_fields(pr, PrepareConfig, "what to prepare, from what")
    pr.set_defaults(func=_cmd_prepare)

    tr = sub.add_parser("train", help="train a model (one loop for every stage)",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    tr.add_argument("--preset", default=None, help=", ".join(PRESETS))
    tr.add_argument("--config", default=None, help="a TOML or JSON file with model/data/optim/train sections")
    tr.add_argument("--data", nargs="+", default=None, metavar="DIR",
                    help="prepared data: one directory (data.path), or data sets (data.sets), each DIR or "
                         "DIR:key=value,... with keys epochs, tokens, weight, name; used in turn, each but the last "
                         "for its budget (a curriculum: wiki:epochs=2 sft, or wiki:tokens=5M sft), or with "
                         "--data.mode mixture sampled by weight (wiki:weight=3 sft)")
    tr.add_argument("--out", default=None, help="run directory (train.out_dir)")
    tr.add_argument("--stage", default=None, help="train.stage")
    tr.add_argument("--init-from", dest="init_from", default=None, help="start from this checkpoint's weights")
    tr.add_argument("--resume", action="store_true", help="continue the newest checkpoint in the run directory")
    _add_overrides(tr)
    tr.set_defaults(func=_cmd_train)


def _add_chat_commands(sub: argparse._SubParsersAction) -> None:
    """generate, chat."""
    from nanolm.infer.tools import MAX_TOOL_ROUNDS
    g = inference_parser(sub, "generate", _cmd_generate, help="continue a prompt with a trained model, streaming")
    g.add_argument("--prompt", default="", help="text to continue")
    add_compile_arg(g)

    c = inference_parser(sub, "chat", _cmd_chat,
                          help="multi-turn chat in the terminal (or scripted: one user turn per stdin line)")
    add_compile_arg(c)
    c.add_argument("--system", default="", help="system prompt")
    c.add_argument("--tools", action="append", default=[], metavar="builtin|FILE",
                   help="offer the model tools: `builtin` (calculator, current_time, which the chat runs) or a "
                        "tools.json (a JSON array of OpenAI tool objects, whose results you type in); repeatable")
    c.add_argument("--think", action="store_true",
                   help="let the model reason in a <think> block before it answers (shown apart)")
    c.add_argument("--max-tool-rounds", type=int, default=MAX_TOOL_ROUNDS, metavar="N",
                   help="the most times the model continues after tool results in one turn (default %(default)s)")
    c.add_argument("--free-calls", action="store_true",
                   help="read the model's tool calls as it writes them; by default, once it opens a call, what it "
                        "writes is held to the offered tools' schemas")


def _add_conversion_commands(sub: argparse._SubParsersAction) -> None:
    """lora merge, export, import: a checkpoint written in another form, or another form read in."""
    from nanolm.config import SamplingParams
    from nanolm.export.gguf_import import ARCHITECTURES as GGUF_ARCHITECTURES
    from nanolm.export.hf import FAMILIES
    from nanolm.export.ollama import DEFAULT_OUTTYPE
    lo = sub.add_parser("lora", help="LoRA adapters: merge into a full model")
    losub = lo.add_subparsers(dest="lora_cmd", required=True, metavar="ACTION")
    lm = losub.add_parser("merge", help="write base + adapter as one full checkpoint")
    lm.add_argument("adapter", help="a LoRA run or checkpoint directory")
    lm.add_argument("--out", required=True, help="directory for the merged checkpoint")
    lm.add_argument("--base", default=None, help="the base checkpoint (default: the one the adapter was trained from)")
    lo.set_defaults(func=_cmd_lora_merge)

    ex = sub.add_parser("export", help="write a checkpoint in another format: hf (transformers), gguf (llama.cpp), "
                                       "ollama or web (a page that runs it in the browser)")
    exsub = ex.add_subparsers(dest="format", required=True, metavar="FORMAT")
    for fmt, help_text, out_help in (("hf", "a transformers directory (Llama, Qwen2 with q/k/v biases, Qwen3 with "
                                            "QK-norm; MoE: Qwen2-MoE, Qwen3-MoE with QK-norm)",
                                      "output directory"),
                                     ("gguf", "a GGUF file for llama.cpp / ollama", "output .gguf file"),
                                     ("ollama", "a directory of model.gguf and a Modelfile for `ollama create`",
                                      "output directory"),
                                     ("web", "a static folder whose page chats with the model in the browser "
                                             "(llama.cpp's WebAssembly build)", "output directory")):
        e = exsub.add_parser(fmt, help=help_text)
        e.add_argument("checkpoint", help="a run or checkpoint directory")
        e.add_argument("out", help=out_help)
        e.add_argument("--adapter", default=None, help="a LoRA run to merge in first")
        e.add_argument("--last", action="store_true", help="the newest checkpoint instead of the best one")
        if fmt == "hf":
            e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
        else:  # checked by the exporter, whose one-line error names the types and where K-quants come from
            e.add_argument("--outtype", default="f16" if fmt == "gguf" else DEFAULT_OUTTYPE,
                           help="f32, f16, q8_0 or q4_0 (default: %(default)s)")
        if fmt == "ollama":
            e.add_argument("--system", default=None, help="a system prompt for the Modelfile (default: none)")
            add_fields(e, SamplingParams, "sampling (the Modelfile's PARAMETERs)")
        if fmt == "web":
            e.add_argument("--system", default=None, help="the page's default system prompt (default: none)")
            e.add_argument("--serve", action="store_true", help="then serve the folder on localhost (Ctrl-C stops)")
            e.add_argument("--port", type=int, default=8000, help="the port --serve listens on (default 8000)")
            add_fields(e, SamplingParams, "sampling (the page's default settings)")
    ex.set_defaults(func=_cmd_export)

    im_help = (f"bring a transformers checkpoint ({', '.join(FAMILIES.values())}) or a GGUF file of a dense model "
               f"({', '.join(FAMILIES[a] for a in GGUF_ARCHITECTURES)}) into nanolm")
    im = sub.add_parser("import", help=im_help, description=im_help[0].upper() + im_help[1:] + ".")
    imsub = im.add_subparsers(dest="format", required=True, metavar="FORMAT")
    ih = imsub.add_parser("hf", help=f"a local transformers directory (config.json + safetensors; model_type "
                                     f"{', '.join(FAMILIES)})")
    ih.add_argument("hf_dir")
    ih.add_argument("out", help="the nanolm checkpoint directory to write")
    ig = imsub.add_parser("gguf", help="a GGUF model file (llama.cpp's converter or `nanolm export gguf`; any tensor "
                                       "type the gguf package dequantizes; needs the gguf and hf extras)")
    ig.add_argument("file")
    ig.add_argument("out", help="the nanolm checkpoint directory to write")
    im.set_defaults(func=_cmd_import)


def _add_serve_and_eval_commands(sub: argparse._SubParsersAction) -> None:
    """serve, plot, eval, report."""
    from nanolm.config import ServeConfig
    sv = inference_parser(sub, "serve", _cmd_serve, help="an OpenAI-compatible HTTP API (needs the serve extra)",
                           description="Serve a checkpoint over an OpenAI-compatible HTTP API. The sampling options "
                                       "are the defaults for the fields a request leaves out; a completion without "
                                       "max_tokens gets 16 tokens, as OpenAI's does.")
    add_fields(sv, ServeConfig, "server")

    pl = sub.add_parser("plot", help="loss, lr, tokens/s and grad-norm of one or more runs, as a PNG")
    pl.add_argument("runs", nargs="+", help="run directories (each with a metrics.jsonl)")
    pl.add_argument("--out", default="plot.png")
    pl.add_argument("--x", choices=["step", "tokens"], default="step")
    pl.set_defaults(func=_cmd_plot)

    ev = sub.add_parser("eval", help="loss, perplexity and bits-per-byte of a checkpoint on any text; benchmark "
                                     "tasks (multiple choice, generative) and degeneration of sampled text")
    ev.add_argument("checkpoint", nargs="?", default=None,
                    help="a run or checkpoint directory (none with --endpoint)")
    ev.add_argument("--endpoint", default=None, metavar="URL",
                    help="score a served model instead: an OpenAI-compatible API's base URL "
                         "(http://127.0.0.1:8000/v1 for nanolm serve, http://localhost:11434/v1 for ollama); "
                         "tool-use tasks (toolcall:FILE) only")
    ev.add_argument("--model", default=None, help="with --endpoint: the model's name at the endpoint")
    ev.add_argument("--api-key", default=None, help="with --endpoint: its key (default $OPENAI_API_KEY)")
    ev.add_argument("--data", nargs="+", default=None,
                    help="built-in corpora, .txt/.jsonl files or directories, or a prepared data directory")
    ev.add_argument("--task", action="append", default=[], metavar="TASK[:key=value,...]",
                    help="a benchmark: a built-in one (idioms, cloze, calc, calc2, everyday, arith), toolcall:FILE (tool use), or a task file (C-Eval/CMMLU/MMLU .csv; ARC, OpenBookQA, "
                         "PIQA, HellaSwag, SIQA, GSM8K or nanolm .jsonl); options n=, shots=, dev=, chat=, "
                         "style=cloze|letters, name=; repeatable")
    ev.add_argument("--chat", choices=["auto", "on", "off"], default="auto",
                    help="score tasks through the chat template (auto: for sft/lora/dpo/grpo/ppo runs)")
    ev.add_argument("--max-new-tokens", type=int, default=256, help="generative tasks and --degeneration")
    ev.add_argument("--temperature", type=float, default=0.0, help="generative tasks: 0 = greedy")
    ev.add_argument("--seed", type=int, default=0, help="generative tasks at temperature > 0, and --degeneration")
    ev.add_argument("--degeneration", type=int, default=0, metavar="N",
                    help="sample N continuations (of --data documents' first 32 tokens, else of the built-in "
                         "benchmark's held-out questions) and report distinct-1/2 and the loop fraction")
    ev.add_argument("--out", default=None, help="the results JSON (default <run>/eval/<checkpoint>.json)")
    ev.add_argument("--batch-size", type=int, default=8, help="rows per forward pass")
    ev.add_argument("--seq-len", type=int, default=None, help="default: the model's training seq_len")
    ev.add_argument("--max-tokens", type=int, default=None, help="score at most this many tokens")
    ev.add_argument("--adapter", default=None, help="a LoRA run to apply, unmerged")
    ev.add_argument("--last", action="store_true", help="the newest checkpoint instead of the best one")
    ev.add_argument("--device", default="auto")
    ev.set_defaults(func=_cmd_eval)

    rp = sub.add_parser("report", help="the report card of runs: each stage's effect on held-out data against a "
                                       "baseline (bits per byte against unigram and xz -9e; benchmarks against "
                                       "chance), wall time and tokens; report.md, report.json and curves.png")
    rp.add_argument("runs", nargs="+", help="run directories, e.g. a pretraining run and the SFT run made from it")
    rp.add_argument("--out", default=None, help="directory for the report (default <first run>/report)")
    rp.add_argument("--task", action="append", default=[], metavar="TASK[:key=value,...]",
                    help="benchmarks to score each run on, as nanolm eval --task (default: the built-in idioms, "
                         "cloze, calc and arith); repeatable")
    rp.add_argument("--n", type=int, default=None, help="items per benchmark (default: each task's own)")
    rp.add_argument("--text-train", nargs="+", default=None,
                    help="text files standing for the training text of the baselines (default: the run's shards)")
    rp.add_argument("--text-heldout", nargs="+", default=None,
                    help="held-out text files to score and compare (default: the run's validation blocks)")
    rp.add_argument("--batch-size", type=int, default=8, help="rows per forward pass")
    rp.add_argument("--device", default="auto")
    rp.set_defaults(func=_cmd_report)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _builtin_models(args)
        args.func(args)
        code = 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        code = 130
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "LOCAL_RANK" in os.environ:
        # A torchrun worker whose work is done: everything is written and the process group destroyed.
        # Leave without C++ static destructors, where a thread of the distributed runtime is sometimes
        # destroyed unjoined and aborts a finished run ("terminate called without an active exception",
        # no Python frame; seen in ~1 of 40 gloo runs here), which torchrun reports as a failure.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
