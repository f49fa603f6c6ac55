"""Validation, a component of the training loop (nanolm/train/trainer.py): what a run measures on held-out
data at each `train.eval_interval`, and which checkpoint is the best.

- `Validation` scores each data set's validation split with the stage's objective (loss and bits per byte,
  DPO's reward accuracy, GRPO's held-out reward, ...; with several sets, each set's value as `name/<set>` and
  their mean), the benchmarks of `train.eval_tasks` (`task/<name>/<metric>`) and the degeneration samples
  (`degen/...`), and formats the line the loop prints.
- `Best` keeps the metric that picks the best checkpoint (`train.best_metric`: the stage's own validation
  metric, val_loss or GRPO's val_reward, or a task's score), whether higher is better, and its best value;
  state.json and best.json record both by name.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Callable

import torch

from nanolm.config import Config, SamplingParams
from nanolm.data.loader import iter_eval_batches
from nanolm.data.stream import DataStream
from nanolm.errors import UserError
from nanolm.train.objectives import Objective


class Best:
    """The metric that picks the best checkpoint and its best value so far (None: not evaluated yet)."""

    def __init__(self, metric: str, higher_better: bool) -> None:
        self.metric, self.higher_better = metric, higher_better
        self.value: float | None = None

    @classmethod
    def of(cls, cfg: Config, objective: Objective) -> "Best":
        """train.best_metric: val_loss means the stage's own validation metric (objective.best); a task's score
        is better higher."""
        metric = cfg.train.best_metric
        return cls(metric, True) if metric != "val_loss" else cls(*objective.best)

    def improves(self, val: dict[str, float]) -> bool:
        """Whether this evaluation's value beats the best so far (it is kept if so)."""
        value = val.get(self.metric)
        if value is None or not math.isfinite(value) or (self.value is not None and
                                                          (value <= self.value if self.higher_better
                                                           else value >= self.value)):
            return False
        self.value = value
        return True

    def state(self) -> dict[str, Any]:
        return {"best_metric": self.metric, "best_value": self.value}

    def restore(self, state: dict[str, Any]) -> None:
        if "best_value" in state:
            best = state["best_value"]
        else:  # a checkpoint written before best_metric/best_value: the best as minimised (a score negated)
            best = state.get("best_val_loss")
            best = None if best is None else float(best) * (-1 if self.higher_better else 1)
        self.value = None if best is None else float(best)

    def shown(self) -> str:
        return f"{self.metric.replace('_', ' ')} {self.value:.4f}" if self.value is not None else "none"


class Validation:
    """The held-out measurements of a run (see the module doc), read and checked when the run starts, so a bad
    task file stops it before any step."""

    def __init__(self, cfg: Config, data: DataStream, val_seq_len: int, tok_dir: Path | None,
                 device: torch.device, fsdp: bool) -> None:
        self.cfg, self.data, self.device = cfg, data, device
        # [(set name, val split)] of the sets that have one
        self.val_sets = data.val_sets(val_seq_len)
        self.token_bytes = _token_bytes(tok_dir, cfg.model.vocab_size) if self.val_sets else None
        self.tasks, self.task_tok = self._tasks(tok_dir, fsdp)

    @property
    def active(self) -> bool:
        return bool(self.val_sets or self.tasks)

    def _tasks(self, tok_dir: Path | None, fsdp: bool) -> tuple[list, Any]:
        """The benchmarks of train.eval_tasks (each its first eval_task_items items unless its spec says n) and
        the tokenizer they are scored with; ([], None) when there are none."""
        tc = self.cfg.train
        if not tc.eval_tasks and not tc.degeneration_samples:
            return [], None
        if tok_dir is None:
            raise UserError("train.eval_tasks / train.degeneration_samples need the data's tokenizer, which its "
                            "manifest does not point to; prepare the data with `nanolm prepare --tokenizer DIR` and "
                            "keep that directory")
        from nanolm.eval.runner import load_task, parse_task_spec
        from nanolm.tokenizer import Tokenizer
        tasks = []
        for spec in tc.eval_tasks:
            parsed = parse_task_spec(spec)
            parsed.n = parsed.n or tc.eval_task_items
            tasks.append(load_task(parsed))
        names = [t.task.name for t in tasks]
        if tc.best_metric != "val_loss" and tc.best_metric.split("/")[1] not in names:
            raise UserError(f"train.best_metric={tc.best_metric}: no task of that name in train.eval_tasks (names: "
                            f"{', '.join(names)}); name it as the table does, or add name=... to its spec")
        needs_engine = tc.degeneration_samples or any(t.task.kind == "gen" for t in tasks)
        if needs_engine and fsdp:
            raise UserError("generative eval_tasks and train.degeneration_samples decode with the engine, which needs "
                            "whole weights; under train.parallel=fsdp use multiple-choice tasks only")
        return tasks, Tokenizer.load(tok_dir)

    def scores(self, model: torch.nn.Module, objective: Objective,
               compute: Callable[[], AbstractContextManager]) -> dict[str, float]:
        """Every measurement with the current weights (on every rank: under FSDP the forward is collective;
        each rank gets the same numbers); the model is left in training mode."""
        tc = self.cfg.train
        model.eval()
        per_set = {}
        for name, val_data in self.val_sets:
            batches = (b.to(self.device) for b in iter_eval_batches(val_data, tc.batch_size, tc.seq_len,
                                                                    tc.eval_batches))
            per_set[name] = objective.evaluate(model, batches, compute, self.token_bytes)
        res = self.data.combine_eval(per_set) if per_set else {}
        if self.tasks or tc.degeneration_samples:  # benchmarks: task/<name>/acc, ... and degen/...
            res.update(self._task_scores(model, compute))
        model.train()
        return res

    def _task_scores(self, model: torch.nn.Module, compute: Callable[[], AbstractContextManager]
                     ) -> dict[str, float]:
        """train.eval_tasks and the degeneration samples."""
        from nanolm.eval.runner import evaluate_tasks, task_metrics
        tc = self.cfg.train
        engine = None
        if tc.degeneration_samples or any(t.task.kind == "gen" for t in self.tasks):
            from nanolm.infer.engine import Engine
            engine = Engine(model, self.device)  # a copy of this step's weights, for decoding
        with compute():
            results = evaluate_tasks(model, self.task_tok, self.tasks, chat_default=self.data.segments,
                                     batch_size=tc.batch_size, device=self.device, engine=engine)
        out = task_metrics(results)
        if tc.degeneration_samples and self.val_sets:
            from nanolm.eval.degeneration import degeneration_scores, sample_completions
            val = self.val_sets[0][1]
            prompts = []
            for b in iter_eval_batches(val, tc.batch_size, min(32, tc.seq_len), None):
                prompts += [row.tolist() for row in b.x]
                if len(prompts) >= tc.degeneration_samples:
                    break
            params = SamplingParams(max_new_tokens=64, seed=tc.seed)
            scores = degeneration_scores(sample_completions(engine, prompts[:tc.degeneration_samples], params,
                                                            (self.task_tok.eot_id, self.task_tok.im_end_id)))
            out.update({f"degen/{k}": scores[k] for k in ("distinct_1", "distinct_2", "loop_fraction")})
        return out

    def line(self, res: dict[str, float]) -> str:
        """The printed line: each metric (with several sets, the mean, then each set's value), then the tasks."""
        def shown(k: str) -> str:
            per = ", ".join(f"{name} {res[f'{k}/{name}']:.4f}" for name, _ in self.val_sets if f"{k}/{name}" in res)
            return f"{k.replace('_', ' ')} {res[k]:.4f}" + (f" ({per})" if per else "")
        return " | ".join([shown(k) for k in res if k != "eval_s" and "/" not in k]
                          + [f"{k.removeprefix('task/').removeprefix('degen/').replace('/', ' ')} {v:.4f}"
                             for k, v in res.items() if k.startswith(("task/", "degen/"))])


def _token_bytes(tok_dir: Path | None, vocab_size: int) -> torch.Tensor | None:
    """UTF-8 bytes per token id, for bits-per-byte; None when the tokenizer is not at hand."""
    if tok_dir is None:
        return None
    from nanolm.tokenizer import Tokenizer
    lengths = torch.zeros(vocab_size, dtype=torch.float64)
    tb = torch.tensor(Tokenizer.load(tok_dir).token_byte_lengths(), dtype=torch.float64)
    lengths[: len(tb)] = tb[:vocab_size]
    return lengths
