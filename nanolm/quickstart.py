"""`nanolm quickstart`: every stage at tiny scale, on a CPU, in a few minutes, ending with a report card.

fetch the built-in corpora -> train a tokenizer -> prepare shards -> pretrain
a tiny model within the time budget -> print a Chinese and an English
continuation -> fine-tune it on the built-in chat corpora, the built-in
tool-use set (arithmetic through the calculator) and the arithmetic task's
worked answers -> hold a short scripted conversation, then one with the
built-in tools, where the model's calculator call is run and its result fed
back -> (with `rl`) GRPO on the arithmetic task's prompts with the answer
reward -> the report card (`nanolm.eval.report`): pretraining's held-out bits
per byte against a unigram model and xz -9e, every built-in held-out benchmark
(idioms, cloze, calc, arith, everyday) for each model against chance, each stage's time
and tokens; printed, and written as report.md, report.json and curves.png.
It is also the shortest complete example of the library's API: each step is
one call.
"""

from __future__ import annotations

import io
import itertools
import shutil
import time
from pathlib import Path
from typing import Sequence

from nanolm.config.load import load_config
from nanolm.corpora import TEXT_CORPORA, resolve_sources
from nanolm.errors import UserError
from nanolm.progress import fmt_duration

CHAT_CORPORA = ("idioms", "chatterbot")
SAMPLE_PROMPTS = ("话说天下大势，", "To be, or not to be,", "My fellow citizens,")
CHAT_SCRIPT = ("「一帆风顺」是什么意思？", "What is AI?")
TOOL_SCRIPT = ("What is 37 times 24?", "48 加 76 等于多少？")
TOOL_CONVERSATIONS = 1500  # the built-in tool-use set's share of the fine-tuning data
DRILL_CONVERSATIONS = 24000  # tool-use conversations as pretraining text (about 2 M tokens, fewer than a pass)
DRILL_WEIGHT = 2.0  # the drill's micro-batches per text micro-batch in pretraining (a mixture)
ARITH_SFT = 1500  # worked arithmetic answers in the fine-tuning data (and RL prompts, with rl)
ARITH_PROMPTS = 1000
BENCH_ITEMS = 200  # items of each built-in held-out benchmark on the report card, but those below
# Scored on all their items: cloze's 282 (its standard error at 200 would hide what a few CPU-minutes teach), in
# about 10 s a model.
WHOLE_TASKS = ("cloze",)
# Scored on at most their own default items: everyday's 48 prompts, short replies decoded in batched rows.
OWN_ITEMS = ("everyday",)
# Left off the toy's card: calc2's two rounds of calls over 200 items would take training time from a model that
# answers few of calc's one-operation questions.
CARD_SKIPS = ("calc2",)
# Seconds kept for everyday (two models' 48 short replies and their replies' bits per byte) and the SFT row's
# held-out replies by source (estimated, not yet measured on the 2-core machine).
EVERYDAY_RESERVE = 10.0
PRETRAIN_SHARE = 0.8  # of the training time left after RL's (SFT gets the rest)
RL_SHARE = 0.25  # of the training time, with rl
MINUTES = 6.0  # the default budget, from the first stage to the report card
# With rl, the default budget grows by the RL stage's share, so the stages before it train as long as without
# it: taken out of 6 minutes, RL left pretraining 833 steps and the fine-tuned model 5% of held-out calc.
RL_MINUTES = 7.5
# The Muon matrices' peak learning rate in pretraining (half the preset's 0.02). Measured at equal budgets (800
# steps of the quickstart's text + drill mixture, cpu-small, 2-core CPU): the question's digits copied into the
# call (teacher-forced, held-out calc items) 32% at 0.02 and 75% at 0.01, the reply copying the tool's result
# 54% and 97%, and the text's held-out bits per byte 2.692 and 2.663. Halving AdamW's lr as well copies a little
# better (81%) but costs the text (2.727 bits per byte).
MUON_LR = 0.01


def _banner(i: int, n: int, title: str) -> None:
    print(f"\n== [{i}/{n}] {title}", flush=True)


def _truncated_copies(files: Sequence[Path], dest: Path, max_chars: int) -> list[Path]:
    """Copies of JSONL sources holding their first records up to about `max_chars` characters each.

    Built-in corpora are JSONL (text or chat records), so whole records are copied as they are.
    """
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for f in files:
        target = dest / f.name
        n = 0
        with open(f, encoding="utf-8") as r, open(target, "w", encoding="utf-8") as w:
            for line in r:
                if n >= max_chars:
                    break
                w.write(line)
                n += len(line)
        out.append(target)
    return out


def _train_within(cfg_overrides: dict, preset_name: str | None, seconds: float, *, quiet: bool = False,
                  config_file: Path | None = None):
    """Train for `seconds`: the trainer fits max_steps to the time budget (train.max_steps 0) from the step rate
    of its first steps, so the schedule's warmup and decay end with the budget. config_file: a config read
    between the preset and the overrides (an imported model's own)."""
    from nanolm.train.trainer import train
    cfg = load_config(preset_name, config_file, overrides={**cfg_overrides, "train.max_minutes": seconds / 60})
    return train(cfg, quiet=quiet)


def quickstart(out: Path, *, minutes: float | None = None, corpora: Sequence[str] = TEXT_CORPORA,
               chat_corpora: Sequence[str] = CHAT_CORPORA, vocab_size: int = 6400, preset_name: str = "cpu-small",
               max_chars: int = 2_000_000, chat_max_chars: int = 500_000, rl: bool = False,
               bench_items: int = BENCH_ITEMS) -> dict[str, Path]:
    """Run every stage into `out`; returns the artefact paths. rl: add a GRPO stage on the arithmetic task.
    minutes: the whole budget (None: MINUTES, or RL_MINUTES with rl)."""
    from nanolm.config import SamplingParams
    from nanolm.data.builtin.arith import write_arith
    from nanolm.data.formats import iter_texts
    from nanolm.data.prepare import prepare
    from nanolm.data.builtin.tooluse import build_calculator_conversations, build_tool_drill
    from nanolm.corpora import REGISTRY
    from nanolm.eval.everyday import DEFAULT_ITEMS as EVERYDAY_ITEMS
    from nanolm.eval.report import DEFAULT_TASKS, build_report, format_report, with_items, write_report
    from nanolm.infer.session import ChatSession, run_chat
    from nanolm.infer.tools import BUILTIN_TOOLS, Toolbox, calculator
    from nanolm.infer.engine import Engine
    from nanolm.infer.generate import complete
    from nanolm.tokenizer import Tokenizer, compression_report, split_by_script, train_tokenizer
    from nanolm.checkpoint import load_model

    if minutes is None:
        minutes = RL_MINUTES if rl else MINUTES
    if minutes <= 0:
        raise UserError(f"--minutes must be > 0, got {minutes}")
    if rl and not chat_corpora:
        raise UserError("--rl starts from the fine-tuned model; give --chat-corpora too")
    t0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    n = 8 + bool(rl) if chat_corpora else 6
    step = itertools.count(1)
    remaining = lambda: minutes * 60 - (time.perf_counter() - t0)  # noqa: E731

    _banner(next(step), n, "corpora")
    text_files = resolve_sources(list(corpora))
    chat_files = resolve_sources(list(chat_corpora)) if chat_corpora else []
    if max_chars:
        text_files = _truncated_copies(text_files, out / "corpora" / "text", max_chars)
    if chat_max_chars:
        # 30,895 idioms would drown chatterbot's 2,492 conversations; a smaller share keeps both in view.
        chat_files = _truncated_copies(chat_files, out / "corpora" / "chat", chat_max_chars)
    arith, drill = {}, None
    if chat_files:
        # the built-in tool-use set (arithmetic answered through the calculator, results computed) and the
        # arithmetic task's worked answers; neither holds a problem of the calc or arith benchmarks
        chat_files.append(build_calculator_conversations(out / "corpora" / "tools.jsonl", TOOL_CONVERSATIONS,
                                                         calculator=calculator, tools=BUILTIN_TOOLS))
        arith = write_arith(out / "corpora" / "arith", ARITH_SFT, ARITH_PROMPTS if rl else 0, 0)
        chat_files.append(arith["sft"])
        # the same kind of conversation, without tool lists, as pretraining text: where the model learns to copy
        # numbers from its context, which a few fine-tuning minutes do not teach (nanolm.data.builtin.tooluse)
        drill = build_tool_drill(out / "corpora" / "drill.jsonl", DRILL_CONVERSATIONS, seed=1,
                                 calculator=calculator, tools=BUILTIN_TOOLS)
    for f in [*text_files, *chat_files, *([drill] if drill else [])]:
        print(f"  {f} ({f.stat().st_size / 2**20:.1f} MiB)")

    _banner(next(step), n, f"tokenizer (byte-level BPE, {vocab_size} tokens, one per digit)")
    tok_dir = out / "tokenizer"
    texts = itertools.chain(iter_texts(text_files), iter_texts(chat_files, format="chat"))
    tok = train_tokenizer(texts, tok_dir, vocab_size)
    zh, en = split_by_script(itertools.chain(iter_texts(text_files), iter_texts(chat_files, format="chat")))
    print(f"  {compression_report(tok, zh, en)}")

    _banner(next(step), n, "prepare token shards (pretraining text, then chat with loss masks)")
    data_dir, drill_dir, sft_dir, rl_dir = out / "data", out / "drill-data", out / "sft-data", out / "rl-data"
    # Chat blocks twice the pretraining window, so a conversation offering tools fits whole with its tool list.
    sft_len = 2 * load_config(preset_name).train.seq_len
    prepare(text_files, tok_dir, data_dir, val_fraction=0.02, workers=2)
    if drill:
        prepare([drill], tok_dir, drill_dir, val_fraction=0.02, workers=2)
    if chat_files:
        prepare(chat_files, tok_dir, sft_dir, format="chat", max_tokens=sft_len + 1,
                val_fraction=0.02, workers=2)
    if rl:
        prepare([arith["prompts"]], tok_dir, rl_dir, format="prompts", val_fraction=0.05, workers=0)

    # seconds kept for the samples, the chats and the report card (measured on a 2-core CPU: 42-48 s for the report
    # card of the two models, 3 x 200 items, cloze's 282 and the xz baseline, and about 10 s for the samples and
    # chats; at 80 s kept for the card, default runs ended at 5:15-5:18, at 60 s at 5:28-5:38)
    reserve = 15.0 + (60.0 if chat_files else 15.0) * bench_items / BENCH_ITEMS + EVERYDAY_RESERVE
    train_time = max(30.0, remaining() - reserve)
    rl_time = train_time * RL_SHARE if rl else 0.0
    _banner(next(step), n, "pretrain")
    run_dir, sft_run, rl_run = out / "run", out / "sft", out / "rl"
    for d in (run_dir, sft_run, rl_run):
        if (d / "config.json").is_file():
            shutil.rmtree(d)  # a previous quickstart's run: start afresh so the logs tell one story
    base = {"data.path": str(data_dir), "train.out_dir": str(run_dir), "model.vocab_size": tok.vocab_size,
            "model.max_seq_len": sft_len}
    pre = {**base, "optim.muon_lr": MUON_LR}
    if drill:  # text and drill as a mixture; the report card measures the text (the first set) on its own
        pre.pop("data.path")
        pre.update({"train.eval_interval": 100, "data.mode": "mixture", "data.sets": [{"path": str(data_dir), "name": "text"},
                                                           {"path": str(drill_dir), "name": "drill",
                                                            "weight": DRILL_WEIGHT}]})
    result = _train_within(pre, preset_name, max(10.0, (train_time - rl_time) * (PRETRAIN_SHARE if chat_files else 1.0)))

    _banner(next(step), n, "samples from the pretrained model")
    model, ckpt_dir = load_model(run_dir, "best")
    engine = Engine(model)
    tok = Tokenizer.load(ckpt_dir)
    params = SamplingParams(max_new_tokens=60, seed=0)  # the one set of sampling defaults, short and reproducible
    for prompt in SAMPLE_PROMPTS:
        print(f"\n> {prompt}", end="", flush=True)
        complete(engine, tok, prompt, params)
        print()

    artefacts = {"corpora": text_files[0].parent if max_chars else text_files[0].parent.parent,
                 "tokenizer": tok_dir, "data": data_dir, "run": run_dir, "checkpoint": ckpt_dir,
                 "metrics": run_dir / "metrics.jsonl"}
    runs, final = [run_dir], run_dir
    if chat_files:
        _banner(next(step), n, "supervised fine-tuning on the chat corpora, the tool-use set and worked arithmetic")
        # A few minutes from a barely-trained tiny model: larger steps than the SFT default (a tenth of the
        # pretraining lr), which suits long fine-tuning runs of well-trained models.
        pre_lr = load_config(preset_name).optim.lr  # SFT halves both learning rates of pretraining
        sft = {**base, "data.path": str(sft_dir), "train.out_dir": str(sft_run), "train.stage": "sft",
               "train.seq_len": sft_len,
               "train.init_from": str(ckpt_dir), "optim.lr": pre_lr / 2, "optim.min_lr": pre_lr / 20,
               "optim.muon_lr": MUON_LR / 2}
        _train_within(sft, preset_name, max(10.0, remaining() - reserve - rl_time))

        _banner(next(step), n, "a scripted chat")
        model, sft_ckpt = load_model(sft_run, "best")
        engine, sft_tok = Engine(model), Tokenizer.load(sft_ckpt)
        run_chat(ChatSession(engine, sft_tok, params), stdin=io.StringIO("\n".join(CHAT_SCRIPT) + "\n"),
                 interactive=False)
        print("\n  with the built-in tools (nanolm chat --tools builtin): the model's calculator calls are run")
        greedy = SamplingParams(max_new_tokens=60, temperature=0.0)
        run_chat(ChatSession(engine, sft_tok, greedy, tools=Toolbox.from_specs(["builtin"]), max_tool_rounds=1),
                 stdin=io.StringIO("\n".join(TOOL_SCRIPT) + "\n"), interactive=False)
        artefacts.update({"sft data": sft_dir, "sft run": sft_run, "sft ckpt": sft_ckpt})
        runs.append(sft_run)
        final = sft_run

    if rl:
        _banner(next(step), n, "reinforcement learning (GRPO, answer reward) on the arithmetic task's prompts")
        grpo = {**base, "data.path": str(rl_dir), "train.out_dir": str(rl_run), "train.stage": "grpo",
                "train.init_from": str(sft_run), "train.batch_size": 8, "train.eval_batches": 8,
                "grpo.group_size": 8, "grpo.max_new_tokens": 24, "grpo.rewards": "answer"}
        _train_within(grpo, preset_name, max(10.0, remaining() - reserve))
        artefacts["rl run"] = rl_run
        runs.append(rl_run)
        final = rl_run

    _banner(next(step), n, "report card: each stage's effect on held-out data, against a baseline")
    # built-in chat data leaves the idioms and everyday benchmarks' conversations out; a user's own chat data may not
    tasks = [t if t in WHOLE_TASKS else with_items(t, min(bench_items, EVERYDAY_ITEMS) if t in OWN_ITEMS
                                                   else bench_items) for t in DEFAULT_TASKS
             if t not in CARD_SKIPS and (t not in ("idioms", "everyday") or all(c in REGISTRY for c in chat_corpora))]
    # the SFT row's held-out replies by source: what the tool-use set and the worked arithmetic cost the chat replies
    made = {"tools.jsonl": "tool use", **({arith["sft"].name: "arithmetic"} if arith else {})}
    groups: dict[str, list[str]] = {}
    for f in chat_files:
        groups.setdefault(made.get(f.name, "chat corpora"), []).append(f.name)
    card = build_report(runs, tasks=tasks, source_groups=groups or None)
    print(format_report(card))
    artefacts["report"] = write_report(card, out / "report")
    print(f"== done in {fmt_duration(time.perf_counter() - t0)} "
          f"(pretraining: {result.step} steps"
          + (f", best {result.best_metric.replace('_', ' ')} {result.best_value:.3f})" if result.best_value is not None
             else ")"))
    for name, path in artefacts.items():
        print(f"  {name:<11}{path.resolve()}")
    print(f"\nnext: nanolm chat {final}   |   nanolm report {' '.join(str(r) for r in runs)}   |   "
          f"nanolm train --preset minimind-26m --data {data_dir} --model.vocab_size {tok.vocab_size}")
    return artefacts
