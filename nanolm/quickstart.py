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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from nanolm.train.configure import load_config
from nanolm.train.stages import GRPO, SFT, Pretrain
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
# The real model's quickstart (--model, nanolm/quickstart_model.py): a model of 135 M parameters fine-tuned on a
# CPU needs more minutes, and scores fewer items (each calc item is prefilled twice).
MODEL_MINUTES = 15.0
MODEL_RL_MINUTES = 25.0  # with rl: the same fine-tuning, then GRPO
MODEL_BENCH_ITEMS = 50  # items of calc on the card and of everyday (its 48 prompts)


def truncated_copies(files: Sequence[Path], dest: Path, max_chars: int) -> list[Path]:
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


def train_within(cfg_overrides: dict, preset_name: str | None, seconds: float, *, quiet: bool = False,
                  config_file: Path | None = None):
    """Train for `seconds`: the trainer fits max_steps to the time budget (train.max_steps 0) from the step rate
    of its first steps, so the schedule's warmup and decay end with the budget. config_file: a config read
    between the preset and the overrides (an imported model's own)."""
    from nanolm.train.trainer import train
    cfg = load_config(preset_name, config_file, overrides={**cfg_overrides, "train.max_minutes": seconds / 60})
    return train(cfg, quiet=quiet)


@dataclass
class QuickstartConfig:
    """What `nanolm quickstart` runs (its command-line options are generated from these fields): the toy's every
    stage on the built-in corpora, or, with `model`, a real model's fine-tuning (nanolm/quickstart_model.py, which
    reads out, model, minutes, rl and bench_items). None means the flavour's own default, as each help says."""

    out: Path | None = field(default=None, metadata={
        "help": "where every artefact goes (default runs/quickstart, with --model runs/quickstart-MODEL)"})
    model: str | None = field(default=None, metadata={
        "help": "start from a real model instead: a built-in one (`nanolm models list`, e.g. smollm2-135m-instruct) "
                "or an imported checkpoint; LoRA on tool use, its card, its GGUF"})
    minutes: float | None = field(default=None, metadata={
        "help": f"total time budget (default {MINUTES:g}; {RL_MINUTES:g} with --rl, so that the stages before RL "
                f"train as long; with --model {MODEL_MINUTES:g}, or {MODEL_RL_MINUTES:g} with --rl)"})
    corpora: tuple[str, ...] = field(default=TEXT_CORPORA, metadata={
        "nargs": "+", "help": "pretraining text: built-in corpora or your own files/directories"})
    chat_corpora: tuple[str, ...] = field(default=CHAT_CORPORA, metadata={
        "nargs": "*", "help": "conversations for the fine-tuning stage (none = stop after pretraining)"})
    chat_max_chars: int = field(default=500_000, metadata={"help": "the same cap for the chat corpora (0 = all)"})
    vocab_size: int = field(default=6400, metadata={"help": "the tokenizer's vocabulary"})
    preset: str = field(default="cpu-small", metadata={"help": "the model and training preset"})
    max_chars: int = field(default=2_000_000, metadata={
        "help": "use at most this many characters of each corpus, so the small Chinese novel is not drowned by "
                "the English corpora (0 = all)"})
    rl: bool = field(default=False, metadata={
        "help": "add a GRPO stage (answer reward) on the arithmetic task after fine-tuning, with its row on the "
                "report card"})
    bench_items: int | None = field(default=None, metadata={
        "help": f"items of each benchmark on the report card (default {BENCH_ITEMS}, cloze: all of its items; with "
                f"--model {MODEL_BENCH_ITEMS})"})

    def __post_init__(self) -> None:
        self.corpora, self.chat_corpora = tuple(self.corpora), tuple(self.chat_corpora)
        if self.out is not None:
            self.out = Path(self.out)
        if self.minutes is not None and not self.minutes > 0:
            raise UserError(f"--minutes must be > 0, got {self.minutes}")
        if self.rl and not self.chat_corpora and self.model is None:
            raise UserError("--rl starts from the fine-tuned model; give --chat-corpora too")


def quickstart(out: Path, **settings: Any) -> dict[str, Path]:
    """Run every stage into `out`; returns the artefact paths: `run(QuickstartConfig(out, **settings))`, settings
    being QuickstartConfig's other fields (rl: add a GRPO stage on the arithmetic task; minutes: the whole budget)."""
    return run(QuickstartConfig(out=Path(out), **settings))


def run(cfg: QuickstartConfig) -> dict[str, Path]:
    """The toy quickstart (module doc) as `cfg` says; returns the artefact paths. `cfg.model` is
    nanolm.quickstart_model's."""
    return _Toy(cfg).run()


class _Toy:
    """One toy quickstart: its settings, its clock, and what each step writes for the next to read; each step is
    a method, in the order `run` calls them."""

    def __init__(self, cfg: QuickstartConfig) -> None:
        if cfg.model is not None:
            raise UserError("--model is the real model's quickstart: nanolm.quickstart_model.run")
        self.cfg, self.out = cfg, Path(cfg.out or "runs/quickstart")
        self.minutes = cfg.minutes if cfg.minutes is not None else RL_MINUTES if cfg.rl else MINUTES
        self.bench_items = BENCH_ITEMS if cfg.bench_items is None else cfg.bench_items
        self.t0 = time.perf_counter()
        self.n = 8 + bool(cfg.rl) if cfg.chat_corpora else 6
        self.step = itertools.count(1)
        out = self.out
        self.tok_dir, self.data_dir, self.drill_dir = out / "tokenizer", out / "data", out / "drill-data"
        self.sft_dir, self.rl_dir = out / "sft-data", out / "rl-data"
        self.run_dir, self.sft_run, self.rl_run = out / "run", out / SFT.name, out / "rl"
        self.runs, self.final = [self.run_dir], self.run_dir
        self.artefacts: dict[str, Path] = {}

    def remaining(self) -> float:
        return self.minutes * 60 - (time.perf_counter() - self.t0)

    def banner(self, title: str) -> None:
        print(f"\n== [{next(self.step)}/{self.n}] {title}", flush=True)

    def run(self) -> dict[str, Path]:
        self.out.mkdir(parents=True, exist_ok=True)
        self.corpora()
        self.tokenizer()
        self.prepare()
        self.pretrain()
        self.samples()
        if self.chat_files:
            self.fine_tune()
            self.scripted_chat()
        if self.cfg.rl:
            self.reinforce()
        return self.report()

    def corpora(self) -> None:
        """The built-in corpora (each cut to its first max_chars), the built-in tool-use set, the arithmetic task's
        worked answers and the tool drill."""
        from nanolm.data.builtin.arith import write_arith
        from nanolm.data.builtin.tooluse import build_calculator_conversations, build_tool_drill
        from nanolm.infer.tools import BUILTIN_TOOLS, calculator
        cfg, out = self.cfg, self.out
        self.banner("corpora")
        text_files = resolve_sources(list(cfg.corpora))
        chat_files = resolve_sources(list(cfg.chat_corpora)) if cfg.chat_corpora else []
        if cfg.max_chars:
            text_files = truncated_copies(text_files, out / "corpora" / "text", cfg.max_chars)
        if cfg.chat_max_chars:
            # 30,895 idioms would drown chatterbot's 2,492 conversations; a smaller share keeps both in view.
            chat_files = truncated_copies(chat_files, out / "corpora" / "chat", cfg.chat_max_chars)
        self.arith, self.drill = {}, None
        if chat_files:
            # the built-in tool-use set (arithmetic answered through the calculator, results computed) and the
            # arithmetic task's worked answers; neither holds a problem of the calc or arith benchmarks
            chat_files.append(build_calculator_conversations(out / "corpora" / "tools.jsonl", TOOL_CONVERSATIONS,
                                                             calculator=calculator, tools=BUILTIN_TOOLS))
            self.arith = write_arith(out / "corpora" / "arith", ARITH_SFT, ARITH_PROMPTS if cfg.rl else 0, 0)
            chat_files.append(self.arith["sft"])
            # the same kind of conversation, without tool lists, as pretraining text: where the model learns to
            # copy numbers from its context, which a few fine-tuning minutes do not teach (data/builtin/tooluse.py)
            self.drill = build_tool_drill(out / "corpora" / "drill.jsonl", DRILL_CONVERSATIONS, seed=1,
                                          calculator=calculator, tools=BUILTIN_TOOLS)
        for f in [*text_files, *chat_files, *([self.drill] if self.drill else [])]:
            print(f"  {f} ({f.stat().st_size / 2**20:.1f} MiB)")
        self.text_files, self.chat_files = text_files, chat_files

    def tokenizer(self) -> None:
        from nanolm.data.kinds import ChatKind, TextKind
        from nanolm.tokenizer import compression_report, split_by_script, train_tokenizer
        self.banner(f"tokenizer (byte-level BPE, {self.cfg.vocab_size} tokens, one per digit)")
        texts = lambda: itertools.chain(TextKind.texts(self.text_files),  # noqa: E731
                                        ChatKind.texts(self.chat_files))
        self.tok = train_tokenizer(texts(), self.tok_dir, self.cfg.vocab_size)
        zh, en = split_by_script(texts())
        print(f"  {compression_report(self.tok, zh, en)}")

    def prepare(self) -> None:
        """Token shards, then the training time: what is left but the reserve for the samples, chats and card."""
        from nanolm.data.kinds import ChatKind, PromptsKind
        from nanolm.data.prepare import prepare
        self.banner("prepare token shards (pretraining text, then chat with loss masks)")
        # Chat blocks twice the pretraining window, so a conversation offering tools fits whole with its tool list.
        self.sft_len = 2 * load_config(self.cfg.preset).train.seq_len
        prepare(self.text_files, self.tok_dir, self.data_dir, val_fraction=0.02, workers=2)
        if self.drill:
            prepare([self.drill], self.tok_dir, self.drill_dir, val_fraction=0.02, workers=2)
        if self.chat_files:
            prepare(self.chat_files, self.tok_dir, self.sft_dir, format=ChatKind.name, max_tokens=self.sft_len + 1,
                    val_fraction=0.02, workers=2)
        if self.cfg.rl:
            prepare([self.arith["prompts"]], self.tok_dir, self.rl_dir, format=PromptsKind.name, val_fraction=0.05,
                    workers=0)
        # seconds kept for the samples, the chats and the report card (measured on a 2-core CPU: 42-48 s for the
        # report card of the two models, 3 x 200 items, cloze's 282 and the xz baseline, and about 10 s for the
        # samples and chats; at 80 s kept for the card, default runs ended at 5:15-5:18, at 60 s at 5:28-5:38)
        self.reserve = (15.0 + (60.0 if self.chat_files else 15.0) * self.bench_items / BENCH_ITEMS
                        + EVERYDAY_RESERVE)
        self.train_time = max(30.0, self.remaining() - self.reserve)
        self.rl_time = self.train_time * RL_SHARE if self.cfg.rl else 0.0

    def pretrain(self) -> None:
        self.banner(Pretrain.name)
        for d in (self.run_dir, self.sft_run, self.rl_run):
            if (d / "config.json").is_file():
                shutil.rmtree(d)  # a previous quickstart's run: start afresh so the logs tell one story
        self.base = {"data.path": str(self.data_dir), "train.out_dir": str(self.run_dir),
                     "model.vocab_size": self.tok.vocab_size, "model.max_seq_len": self.sft_len}
        pre = {**self.base, "optim.muon_lr": MUON_LR}
        if self.drill:  # text and drill as a mixture; the report card measures the text (the first set) on its own
            pre.pop("data.path")
            pre.update({"train.eval_interval": 100, "data.mode": "mixture",
                        "data.sets": [{"path": str(self.data_dir), "name": "text"},
                                      {"path": str(self.drill_dir), "name": "drill", "weight": DRILL_WEIGHT}]})
        seconds = (self.train_time - self.rl_time) * (PRETRAIN_SHARE if self.chat_files else 1.0)
        self.result = train_within(pre, self.cfg.preset, max(10.0, seconds))

    def samples(self) -> None:
        from nanolm.checkpoint import load_model
        from nanolm.config import SamplingParams
        from nanolm.infer.engine import Engine
        from nanolm.infer.generate import complete
        from nanolm.tokenizer import Tokenizer
        self.banner("samples from the pretrained model")
        model, ckpt_dir = load_model(self.run_dir, "best")
        engine = Engine(model)
        self.tok = Tokenizer.load(ckpt_dir)
        self.params = SamplingParams(max_new_tokens=60, seed=0)  # the one set of defaults, short and reproducible
        for prompt in SAMPLE_PROMPTS:
            print(f"\n> {prompt}", end="", flush=True)
            complete(engine, self.tok, prompt, self.params)
            print()
        self.artefacts = {"corpora": self.text_files[0].parent if self.cfg.max_chars
                          else self.text_files[0].parent.parent, "tokenizer": self.tok_dir, "data": self.data_dir,
                          "run": self.run_dir, "checkpoint": ckpt_dir, "metrics": self.run_dir / "metrics.jsonl"}
        self.ckpt_dir = ckpt_dir

    def fine_tune(self) -> None:
        self.banner("supervised fine-tuning on the chat corpora, the tool-use set and worked arithmetic")
        # A few minutes from a barely-trained tiny model: larger steps than the SFT default (a tenth of the
        # pretraining lr), which suits long fine-tuning runs of well-trained models.
        pre_lr = load_config(self.cfg.preset).optim.lr  # SFT halves both learning rates of pretraining
        sft = {**self.base, "data.path": str(self.sft_dir), "train.out_dir": str(self.sft_run),
               "train.stage": SFT.name, "train.seq_len": self.sft_len, "train.init_from": str(self.ckpt_dir),
               "optim.lr": pre_lr / 2, "optim.min_lr": pre_lr / 20, "optim.muon_lr": MUON_LR / 2}
        train_within(sft, self.cfg.preset, max(10.0, self.remaining() - self.reserve - self.rl_time))

    def scripted_chat(self) -> None:
        from nanolm.checkpoint import load_model
        from nanolm.config import SamplingParams
        from nanolm.infer.engine import Engine
        from nanolm.infer.session import ChatSession, run_chat
        from nanolm.infer.tools import Toolbox
        from nanolm.tokenizer import Tokenizer
        self.banner("a scripted chat")
        model, sft_ckpt = load_model(self.sft_run, "best")
        engine, sft_tok = Engine(model), Tokenizer.load(sft_ckpt)
        run_chat(ChatSession(engine, sft_tok, self.params), stdin=io.StringIO("\n".join(CHAT_SCRIPT) + "\n"),
                 interactive=False)
        print("\n  with the built-in tools (nanolm chat --tools builtin): the model's calculator calls are run")
        greedy = SamplingParams(max_new_tokens=60, temperature=0.0)
        run_chat(ChatSession(engine, sft_tok, greedy, tools=Toolbox.from_specs(["builtin"]), max_tool_rounds=1),
                 stdin=io.StringIO("\n".join(TOOL_SCRIPT) + "\n"), interactive=False)
        self.artefacts.update({"sft data": self.sft_dir, "sft run": self.sft_run, "sft ckpt": sft_ckpt})
        self.runs.append(self.sft_run)
        self.final = self.sft_run

    def reinforce(self) -> None:
        self.banner("reinforcement learning (GRPO, answer reward) on the arithmetic task's prompts")
        grpo = {**self.base, "data.path": str(self.rl_dir), "train.out_dir": str(self.rl_run),
                "train.stage": GRPO.name, "train.init_from": str(self.sft_run), "train.batch_size": 8,
                "train.eval_batches": 8, "grpo.group_size": 8, "grpo.max_new_tokens": 24, "grpo.rewards": "answer"}
        train_within(grpo, self.cfg.preset, max(10.0, self.remaining() - self.reserve))
        self.artefacts["rl run"] = self.rl_run
        self.runs.append(self.rl_run)
        self.final = self.rl_run

    def report(self) -> dict[str, Path]:
        from nanolm.corpora import REGISTRY
        from nanolm.eval.everyday import DEFAULT_ITEMS as EVERYDAY_ITEMS
        from nanolm.eval.card import format_report, write_report
        from nanolm.eval.report import DEFAULT_TASKS, build_report, with_items
        self.banner("report card: each stage's effect on held-out data, against a baseline")
        items = self.bench_items
        # built-in chat data leaves the idioms and everyday benchmarks' conversations out; a user's own may not
        own_chat = all(c in REGISTRY for c in self.cfg.chat_corpora)
        tasks = [t if t in WHOLE_TASKS else with_items(t, min(items, EVERYDAY_ITEMS) if t in OWN_ITEMS else items)
                 for t in DEFAULT_TASKS if t not in CARD_SKIPS and (t not in ("idioms", "everyday") or own_chat)]
        # the SFT row's held-out replies by source: what the tool-use set and the worked arithmetic cost the replies
        made = {"tools.jsonl": "tool use", **({self.arith["sft"].name: "arithmetic"} if self.arith else {})}
        groups: dict[str, list[str]] = {}
        for f in self.chat_files:
            groups.setdefault(made.get(f.name, "chat corpora"), []).append(f.name)
        card = build_report(self.runs, tasks=tasks, source_groups=groups or None)
        print(format_report(card))
        self.artefacts["report"] = write_report(card, self.out / "report")
        result = self.result
        print(f"== done in {fmt_duration(time.perf_counter() - self.t0)} (pretraining: {result.step} steps"
              + (f", best {result.best_metric.replace('_', ' ')} {result.best_value:.3f})"
                 if result.best_value is not None else ")"))
        for name, path in self.artefacts.items():
            print(f"  {name:<11}{path.resolve()}")
        print(f"\nnext: nanolm chat {self.final}   |   nanolm report {' '.join(str(r) for r in self.runs)}   |   "
              f"nanolm train --preset minimind-26m --data {self.data_dir} --model.vocab_size {self.tok.vocab_size}")
        return self.artefacts
