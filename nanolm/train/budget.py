"""The schedule's length, a component of the training loop (nanolm/train/trainer.py): `train.max_steps`, or,
with `train.max_steps = 0`, the steps fitted to the budget. A token budget fixes them at the start; a time
budget after the first `schedule.probe_steps` steps (all inside the warmup, whose learning rates do not depend
on it) from their measured rate, and once more a quarter into that plan from the rate of the whole loop since
(evaluations included, and robust to a busy moment in the probe). state.json records the decision
(`budget_fit`), so a resumed run keeps it."""

from __future__ import annotations

from typing import Any, Callable

from nanolm.config import Config
from nanolm.train.schedule import steps_for_time, steps_for_tokens


class Budget:
    """max_steps (None until a time budget's fit is made) and how a fitted one was chosen."""

    def __init__(self, cfg: Config, tokens_per_step: int, accum: int, evaluates: bool,
                 say: Callable[[str], None], on_fit: Callable[[], None]) -> None:
        self.cfg, self.tokens_per_step, self.accum, self.evaluates = cfg, tokens_per_step, accum, evaluates
        self.say, self.on_fit = say, on_fit  # on_fit: after an announced fit (the trainer's repeat warning)
        tc = cfg.train
        self.max_steps: int | None = tc.max_steps or None
        self.fit: dict[str, Any] | None = None  # how a fitted max_steps was chosen (state.json)
        if self.max_steps is None and tc.max_tokens and not tc.max_minutes:
            self.set(steps_for_tokens(tc.max_tokens, tokens_per_step), {"rule": "max_tokens"}, 0, announce=False)

    def set(self, max_steps: int, how: dict[str, Any], step: int, announce: bool = True) -> None:
        """Fix the schedule's max_steps for a budget, and say so (else the start-of-run report does)."""
        tc = self.cfg.train
        if tc.max_tokens:  # a token budget caps a time budget's steps too
            max_steps = min(max_steps, steps_for_tokens(tc.max_tokens, self.tokens_per_step))
        self.max_steps = max(max_steps, step + 1)
        self.fit = {"max_steps": self.max_steps, "at_step": step, **how}
        if announce:
            self.say(f"schedule: {self.text()}")
            self.on_fit()

    def text(self) -> str:
        how, optim = self.fit or {}, self.cfg.optim
        rate = (f" at {how['step_s']:.3f}s/step over steps {how['timed_steps']}" if "step_s" in how else "")
        assert self.max_steps is not None
        return (f"max_steps {self.max_steps} fitted to {how.get('rule')}{rate}: warmup {optim.warmup_steps}, "
                f"then {optim.schedule} to step {self.max_steps}"
                + (" (note: no more steps than the warmup)" if self.max_steps <= optim.warmup_steps else ""))

    def describe(self, probe: int) -> str:
        """The schedule's length, for the start-of-run report."""
        if self.cfg.train.max_steps:
            return f"max_steps {self.max_steps}"
        if self.fit:
            return self.text()
        return f"max_steps fitted to the time budget at the step rate of the first {probe} steps"

    def _eval_fraction(self) -> float:
        # A validation pass is a forward (about a third of a training step's work) of eval_batches micro-batches.
        return self.cfg.train.eval_batches / (3 * self.accum) if self.evaluates else 0.0

    def fit_time(self, step_times: list[float], step: int, elapsed: float) -> None:
        """Fix max_steps for max_minutes from the timed steps (the first one, with its one-time costs, left out
        when there are others)."""
        tc = self.cfg.train
        timed = step_times[1:] or step_times
        step_s = sorted(timed)[len(timed) // 2]
        fitted = steps_for_time(tc.max_minutes * 60, elapsed, step, step_s,
                                eval_interval=tc.eval_interval if self.evaluates else 0,
                                eval_step_fraction=self._eval_fraction())
        refit_at = step + max(1, (max(fitted, step + 1) - step) // 4)
        self.set(fitted, {"rule": "max_minutes", "step_s": round(step_s, 6),
                          "timed_steps": f"{step - len(timed) + 1}-{step}", "refit_at": refit_at,
                          "elapsed_s": round(elapsed, 6)}, step)

    def refit_due(self, step: int) -> bool:
        return bool(self.fit) and step == self.fit.get("refit_at")

    def refit_time(self, step: int, elapsed: float) -> None:
        """A quarter into the first fit's plan, fit max_steps again from the rate since that fit (all the loop's
        costs included: evaluations, saves, a machine that got busier or quieter), once; recorded as the first."""
        fit = self.fit
        assert fit is not None
        rate = (elapsed - fit["elapsed_s"]) / max(1, step - fit["at_step"])
        fitted = steps_for_time(self.cfg.train.max_minutes * 60, elapsed, step, rate,
                                eval_step_fraction=self._eval_fraction())
        first = fit["max_steps"]
        self.set(fitted, {"rule": "max_minutes", "step_s": round(rate, 6),
                          "timed_steps": f"{fit['at_step'] + 1}-{step}", "first_fit": first}, step, announce=False)
        self.say(f"schedule: refit after step {step}: {self.text()} (was {first})")

    def state(self) -> dict[str, Any]:
        return {"budget_fit": self.fit} if self.fit else {}

    def restore(self, state: dict[str, Any]) -> None:
        if self.cfg.train.max_steps == 0 and state.get("budget_fit"):  # the fitted schedule, as decided
            self.max_steps, self.fit = int(state["budget_fit"]["max_steps"]), dict(state["budget_fit"])
