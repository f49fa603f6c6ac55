"""`nanolm eval RUN --task ...`: tasks named on the command line, scored, summarised and saved.

A task spec is a built-in task name (`idioms`) or a task file (see
`tasks.py`; the built-in names are `idioms`, `cloze`, `calc`, `calc2`, `arith`
and `everyday`, see `builtin.py`; `toolcall:FILE`, tool use scored on calls and answers, see
`toolcall.py`), optionally followed by `:key=value,...` options:

- `n=N`: score the first N items only;
- `shots=K`: K solved examples before each question, the first K items of
  the dev split (`dev=FILE`, else found beside the file: C-Eval's
  `<subject>_dev.csv` beside `<subject>_val.csv`, CMMLU's `dev/<subject>.csv`
  beside `test/<subject>.csv`, `<name>_dev.*` / `dev.*` beside others);
- `chat=true|false`: through the tokenizer's chat template or as plain text
  (default: chat for a run of a fine-tuning stage, trained on data in the chat layout);
- `style=cloze|letters`: multiple choice scored by each choice's text after
  the question (cloze, the default: informative for small models), or with
  the choices listed under the question and their letters scored (letters:
  how lm-eval's ceval-valid / cmmlu and MiniMind score C-Eval);
- `name=NAME`: the name in the table (default: the file's stem).

`evaluate_tasks` scores loaded tasks with a model in memory (the trainer's
eval_tasks call it); `run_eval` loads a checkpoint, scores, prints the
summary table (task, n, accuracy, chance-centred, stderr) and writes the
results as JSON beside the run (`<run>/eval/<checkpoint>.json`).
`run_endpoint_eval` scores `toolcall` tasks through any OpenAI-compatible
endpoint instead of a checkpoint (`nanolm eval --endpoint URL --model NAME`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from nanolm.errors import UserError
from nanolm.eval.builtin import BUILTIN_TASKS, builtin_task
from nanolm.eval.tasks import Task, as_letters, read_task_file
from nanolm.eval.toolcall import MAX_NEW_TOKENS, PREFIX, LocalBackend, read_toolcall_file, score_toolcall

_OPTIONS = re.compile(r"^[a-z_]+=[^,]*(,[a-z_]+=[^,]*)*$")
_KEYS = ("n", "shots", "dev", "chat", "style", "name")


@dataclass
class TaskSpec:
    source: str
    n: int | None = None
    shots: int = 0
    dev: str | None = None
    chat: bool | None = None
    style: str = "cloze"
    name: str | None = None


def parse_task_spec(spec: str) -> TaskSpec:
    """`TASK` or `TASK:key=value,...` (keys n, shots, dev, chat, style, name)."""
    source, sep, options = spec.rpartition(":")
    if not sep or not _OPTIONS.match(options):
        return TaskSpec(spec)
    out = TaskSpec(source)
    for item in options.split(","):
        key, value = item.split("=", 1)
        where = f"--task {spec}: {key}"
        if key not in _KEYS:
            raise UserError(f"--task {spec}: unknown option {key!r}; use {', '.join(_KEYS)}")
        if key in ("n", "shots"):
            if not value.isdigit() or (key == "n" and int(value) < 1):
                raise UserError(f"{where} must be a {'positive' if key == 'n' else 'non-negative'} integer, "
                                f"got {value!r}")
            setattr(out, key, int(value))
        elif key == "chat":
            if value not in ("true", "false"):
                raise UserError(f"{where} must be true or false, got {value!r}")
            out.chat = value == "true"
        elif key == "style":
            if value not in ("cloze", "letters"):
                raise UserError(f"{where} must be cloze or letters, got {value!r}")
            out.style = value
        else:
            setattr(out, key, value)
    return out


def find_dev(path: Path) -> Path | None:
    """The dev split published beside a task file, when there is one."""
    stem, suffix = path.stem, path.suffix
    candidates = []
    for split in ("_val", "_test", "-val", "-test"):
        if stem.endswith(split):
            candidates.append(path.with_name(stem[: -len(split)] + split[0] + "dev" + suffix))
    if path.parent.name in ("test", "val", "validation"):
        candidates.append(path.parent.parent / "dev" / path.name)
    candidates += [path.with_name(f"dev{suffix}"), path.with_name(f"{stem}_dev{suffix}")]
    return next((c for c in candidates if c.is_file() and c != path), None)


@dataclass
class LoadedTask:
    task: Task
    shots: list
    chat: bool | None


def load_task(spec: str | TaskSpec) -> LoadedTask:
    """The task a spec names, its shots drawn from its dev split."""
    s = parse_task_spec(spec) if isinstance(spec, str) else spec
    if s.source.startswith(PREFIX):  # tool use: a file of items with tools, expected calls and answers
        path = s.source[len(PREFIX):]
        task = Task(s.name or f"toolcall:{Path(path).stem}", "toolcall", read_toolcall_file(path), path, "toolcall")
        task.items = task.items[: s.n] if s.n else task.items
        if s.shots or s.style != "cloze":
            raise UserError(f"--task {s.source}: tool-use items take no shots= or style=")
        return LoadedTask(task, [], True)
    if s.source in BUILTIN_TASKS and not Path(s.source).exists():
        task = builtin_task(s.source, s.n)
        if s.shots:
            raise UserError(f"--task {s.source}: the built-in task has no dev split; score it 0-shot")
    else:
        task = read_task_file(s.source)
        task.items = task.items[: s.n] if s.n else task.items
    shots: list = []
    if s.shots:
        dev = Path(s.dev) if s.dev else find_dev(Path(s.source))
        if dev is None:
            raise UserError(f"--task {s.source}: shots={s.shots} needs a dev split; pass dev=FILE (C-Eval: "
                            f"<subject>_dev.csv, CMMLU: dev/<subject>.csv)")
        dev_task = read_task_file(dev)
        if dev_task.kind != task.kind:
            raise UserError(f"{dev}: a {dev_task.kind} task, but {s.source} is {task.kind}; use its own dev split")
        if len(dev_task.items) < s.shots:
            raise UserError(f"{dev}: holds {len(dev_task.items)} items, fewer than shots={s.shots}")
        shots = dev_task.items[: s.shots]
    if s.style == "letters":
        if task.kind != "mc":
            raise UserError(f"--task {s.source}: style=letters is for multiple-choice tasks; this one is generative")
        task.items, shots = [as_letters(i) for i in task.items], [as_letters(i) for i in shots]
    if s.name:
        task.name = s.name
    return LoadedTask(task, shots, s.chat)


def evaluate_tasks(model: torch.nn.Module, tok: Any, tasks: Sequence[LoadedTask], *, chat_default: bool = False,
                   batch_size: int = 16, device: torch.device | str | None = None, engine: Any = None,
                   sampling: Any = None, rows: int = 16) -> list[dict[str, Any]]:
    """Score each task with `model` (generative tasks with `engine`, an Engine of the same weights, made when
    not given). Returns one result per task: {"task", "kind", "n", "shots", "chat", "acc", ...}."""
    from nanolm.config.sampling import SamplingParams
    from nanolm.eval.scoring import score_gen, score_mc

    results = []
    was_training = model.training
    model.eval()
    try:
        for lt in tasks:
            chat = chat_default if lt.chat is None else lt.chat
            if lt.task.kind == "mc":
                res = score_mc(model, tok, lt.task.items, shots=lt.shots, chat=chat, batch_size=batch_size,
                               device=device)
            else:
                if engine is None:
                    from nanolm.infer.engine import Engine
                    engine = Engine(model, next(model.parameters()).device)
                if lt.task.kind in ("calc", "calc2"):  # always through the chat template, with the built-in tools
                    from nanolm.eval.calc import ROUNDS, score_calc
                    res = score_calc(engine, tok, lt.task.items, rows=rows, rounds=ROUNDS[lt.task.kind])
                    chat = True
                elif lt.task.kind == "everyday":  # through the chat template, no tools offered
                    from nanolm.eval.everyday import score_everyday
                    res, chat = score_everyday(engine, tok, lt.task.items, model=model, rows=rows,
                                               batch_size=batch_size), True
                elif lt.task.kind == "toolcall":  # through the chat template with each item's tools
                    max_new = sampling.max_new_tokens if sampling is not None else MAX_NEW_TOKENS
                    res, chat = score_toolcall(LocalBackend(engine, tok, rows=rows, max_new_tokens=max_new),
                                               lt.task.items), True
                else:
                    params = sampling or SamplingParams(max_new_tokens=256, temperature=0.0)
                    res = score_gen(engine, tok, lt.task.items, params, shots=lt.shots, chat=chat, rows=rows)
            results.append({"task": lt.task.name, "path": lt.task.path, "layout": lt.task.layout,
                            "metric": lt.task.metric, "shots": len(lt.shots), "chat": chat, **res})
    finally:
        model.train(was_training)
    return results


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """The summary: task, n, accuracy (multiple choice: summed, length-normalised and by mutual information),
    chance-centred and stderr of the accuracy, and which accuracy is the task's score (nanolm/eval/tasks.py)."""
    rows = [("task", "n", "shots", "acc", "acc_norm", "acc_mutual_info", "chance", "centred", "stderr", "score")]
    for r in results:
        rows.append((r["task"] + (" (chat)" if r["chat"] else ""), str(r["n"]), str(r["shots"]),
                     *(f"{r[k]:.4f}" if k in r else "-" for k in ("acc", "acc_norm", "acc_mutual_info")),
                     f"{r['chance']:.4f}", f"{score_of(r)[1]:+.4f}", f"{score_of(r)[2]:.4f}",
                     r.get("metric", "acc")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in rows)


def score_of(r: dict[str, Any]) -> tuple[float, float, float]:
    """A task result's score, the accuracy its task names (acc, acc_norm or acc_mutual_info) or another share
    (everyday's arith_or_call, better lower): (score, score less chance (chance-centred for an accuracy),
    standard error)."""
    metric = r.get("metric", "acc")
    if not metric.startswith("acc"):
        return r[metric], r[metric] - r["chance"], r[f"{metric}_stderr"]
    key = metric.removeprefix("acc")
    return r["acc" + key], r["centred" + key], r["stderr" + key]


def higher_is_better(r: dict[str, Any]) -> bool:
    """Whether a task result's score is better higher (every accuracy; not everyday's share)."""
    return r.get("higher_is_better", True)


def run_dir_of(ckpt_dir: Path) -> Path:
    """The run a checkpoint belongs to (<run>/checkpoints/step-N -> <run>), else the checkpoint directory."""
    return ckpt_dir.parent.parent if ckpt_dir.parent.name == "checkpoints" else ckpt_dir


def is_finetuned(ckpt_dir: Path) -> bool:
    """Whether the checkpoint's run is of a fine-tuning stage (the stage registry's `fine_tunes`,
    nanolm/config/registry.py), whose data is chat, pairs or RL prompts in the chat layout."""
    from nanolm.checkpoint import read_run_config
    from nanolm.config import registry
    try:
        return registry.get(read_run_config(ckpt_dir).train.stage).fine_tunes
    except (UserError, OSError, ValueError, KeyError, TypeError):
        return False


def degeneration_prompts(tok: Any, sources: Sequence[str] | None, n: int, prompt_tokens: int = 32,
                         chat: bool = False) -> list[list[int]]:
    """n prompts: the first prompt_tokens tokens of the first n documents of `sources`, or, without sources,
    the built-in benchmark's held-out questions (never trained on), through the chat template when `chat`."""
    if sources:
        from nanolm.corpora import resolve_sources
        from nanolm.data.formats import iter_documents
        prompts = []
        for file in resolve_sources(sources):
            for doc in iter_documents(file):
                ids = tok.encode(doc)[:prompt_tokens]
                if ids:
                    prompts.append(ids)
                if len(prompts) == n:
                    return prompts
        return prompts
    from nanolm.eval.scoring import chat_prompt
    task = builtin_task("idioms", n)
    return [tok.encode(chat_prompt(tok, [], it.question) if chat else it.prompt) for it in task.items]


def run_eval(checkpoint: str | Path, specs: Sequence[str], *, which: str = "best", batch_size: int = 16,
             device: str = "auto", adapter: str | Path | None = None, chat: bool | None = None,
             max_new_tokens: int = 256, temperature: float = 0.0, seed: int = 0, degeneration: int = 0,
             data: Sequence[str] | None = None, out: str | Path | None = None) -> dict[str, Any]:
    """Score a checkpoint on tasks (and, with `degeneration` > 0, the degeneration of that many sampled
    continuations); prints nothing, writes the JSON (to `out`, default <run>/eval/<checkpoint>.json) and
    returns {"checkpoint", "tasks": [...], "degeneration": {...}, "path"}."""
    from nanolm.checkpoint import load_model, require_causal
    from nanolm.config.sampling import SamplingParams
    from nanolm.infer.engine import Engine
    from nanolm.infer.generate import check_vocab
    from nanolm.io import write_json_atomic
    from nanolm.model.lora import merge_lora
    from nanolm.runtime import autocast, resolve_device, resolve_dtype
    from nanolm.tokenizer import Tokenizer

    if which not in ("best", "last"):
        raise UserError(f"which={which!r}: use 'best' or 'last'")
    if batch_size < 1:
        raise UserError(f"--batch-size {batch_size}: must be a positive integer")
    loaded = [load_task(s) for s in specs]  # a bad task file fails before the model loads
    dev = resolve_device(device)
    model, ckpt_dir = load_model(checkpoint, which, dev, adapter=adapter)
    merge_lora(model)  # a LoRA run scores as its merged model, the one it exports as: W + BA once, not per token
    require_causal(model.config, "a benchmark (choices scored, replies decoded token by token)", ckpt_dir)
    if not (ckpt_dir / "tokenizer.json").is_file():
        raise UserError(f"{ckpt_dir}: holds no tokenizer.json, so the tasks cannot be tokenized; use a checkpoint "
                        "written by nanolm train")
    tok = Tokenizer.load(ckpt_dir)
    check_vocab(tok, model.config.vocab_size)
    chat_default = is_finetuned(ckpt_dir) if chat is None else chat
    engine = None
    if any(lt.task.kind != "mc" for lt in loaded) or degeneration:
        engine = Engine(model, dev)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    with autocast(dev, resolve_dtype("auto", dev)):  # bf16 on a GPU that has it, as nanolm eval --data
        results = evaluate_tasks(model, tok, loaded, chat_default=chat_default, batch_size=batch_size, device=dev,
                                 engine=engine, sampling=params)
    report: dict[str, Any] = {"checkpoint": str(ckpt_dir), "tasks": results}
    if degeneration:
        from nanolm.eval.degeneration import degeneration_scores, sample_completions
        prompts = degeneration_prompts(tok, data, degeneration, chat=chat_default)
        sample = SamplingParams(max_new_tokens=max_new_tokens, seed=seed)  # the sampling defaults, seeded
        report["degeneration"] = {**degeneration_scores(sample_completions(engine, prompts, sample,
                                                                           (tok.eot_id, tok.im_end_id))),
                                  "max_new_tokens": max_new_tokens, "source": ", ".join(data) if data else
                                  "idioms (held-out questions)"}
    path = Path(out) if out else run_dir_of(ckpt_dir) / "eval" / f"{ckpt_dir.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, report)
    report["path"] = str(path)
    return report


def run_endpoint_eval(url: str, model: str, specs: Sequence[str], *, api_key: str | None = None,
                      max_new_tokens: int = MAX_NEW_TOKENS, out: str | Path | None = None) -> dict[str, Any]:
    """Score `toolcall:FILE` tasks through an OpenAI-compatible endpoint (`model` as it names the model); writes
    the JSON (to `out`, default eval/<model>.json) and returns {"endpoint", "model", "tasks": [...], "path"}."""
    from nanolm.eval.toolcall import EndpointBackend
    from nanolm.io import write_json_atomic
    loaded = [load_task(s) for s in specs]
    other = [lt.task.name for lt in loaded if lt.task.kind != "toolcall"]
    if other:
        raise UserError(f"--endpoint scores tool-use tasks (--task toolcall:FILE) only, not {', '.join(other)}; "
                        "score those on a checkpoint")
    backend = EndpointBackend(url, model, api_key=api_key, max_new_tokens=max_new_tokens)
    results = [{"task": lt.task.name, "path": lt.task.path, "layout": lt.task.layout, "shots": 0, "chat": True,
                **score_toolcall(backend, lt.task.items)} for lt in loaded]
    report: dict[str, Any] = {"endpoint": url, "model": model, "tasks": results}
    safe = re.sub(r"[^\w.-]+", "_", model) or "endpoint"
    path = Path(out) if out else Path("eval") / f"{safe}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, report)
    report["path"] = str(path)
    return report


def format_degeneration(d: dict[str, Any]) -> str:
    return (f"degeneration ({d['n']} sampled continuations of {d['source']}, up to {d['max_new_tokens']} tokens): "
            f"distinct-1 {d['distinct_1']:.4f} | distinct-2 {d['distinct_2']:.4f} | loop fraction "
            f"{d['loop_fraction']:.4f} | mean length {d['mean_tokens']:.1f} tokens")


def task_metrics(results: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Results as flat metrics for metrics.jsonl and the trackers: task/<name>/acc (and acc_norm,
    acc_mutual_info, centred; everyday's arith_or_call and reply_bpb)."""
    out: dict[str, float] = {}
    for r in results:
        for key in ("acc", "acc_norm", "acc_mutual_info", "centred", "arith_or_call", "reply_bpb"):
            if key in r and math.isfinite(r[key]):
                out[f"task/{r['task']}/{key}"] = r[key]
    return out
