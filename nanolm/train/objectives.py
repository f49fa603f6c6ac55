"""Training stages as objectives: batch -> loss summed over its units, plus how each evaluates.

The loop is the same for every stage; what differs is here. Pretraining, SFT
and LoRA minimise next-token cross-entropy on the batch's targets (SFT data
masks all but the assistant replies), plus the MoE load-balancing loss when
the model has experts. DPO compares the policy's and a frozen reference's
log-probabilities of chosen and rejected replies. Distillation matches a
frozen teacher's token distributions, mixed with cross-entropy. Blocks
(--stage blocks) take the cross-entropy of an output block, read by a causal
model after its input block or by a non-causal model from the input alone.

Each objective counts its units in a batch (`units`: target tokens, or for DPO
preference pairs) and returns its loss summed over them (`Loss.total`), so
that the loop can weigh every unit of an optimizer step alike, however the
step's batch is cut into micro-batches and ranks (`losses.step_share`).
The MoE balance loss is the exception: a mean of its own per micro-batch.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanolm.data.kinds.blocks import block_views
from nanolm.data.shards import IGNORE_INDEX, Batch
from nanolm.eval.loss import lm_scores
from nanolm.model.moe import collect_aux_loss, moe_layers
from nanolm.train.losses import distill_loss, dpo_loss, step_share

Metrics = dict[str, torch.Tensor]


@dataclass
class Loss:
    """One micro-batch's loss, as the loop weighs it into its step.

    total: the objective summed over the batch's units (differentiable).
    sums: detached metrics summed over the same units ("loss" is total's value).
    per_batch: a term that is a mean of its own per micro-batch (the MoE balance loss times its
    coefficient), or None. means: detached metrics of that kind ("aux_loss").
    """

    total: torch.Tensor
    sums: Metrics
    per_batch: torch.Tensor | None = None
    means: Metrics = field(default_factory=dict)

    def weighted(self, units: int, step_units: int, world_size: int, micro_batches: int) -> torch.Tensor:
        """What this micro-batch adds to its step's loss: its share of the step's units (`step_share`), plus
        its per-batch term over the rank's micro-batches per step (DDP averages that over the ranks)."""
        loss = step_share(self.total, units, step_units, world_size)
        return loss if self.per_batch is None else loss + self.per_batch / micro_batches


def target_tokens(batch: Batch) -> int:
    """The batch's targets (positions whose target is not IGNORE_INDEX)."""
    return int((batch.y != IGNORE_INDEX).sum())


def _forward(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(batch.x, pos=batch.pos, seg=batch.seg)


def _summed_ce(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The batch's next-token cross-entropy summed over its targets, float32, through the model's fused output
    projection and loss (the same value as losses.lm_loss of its logits, reduction "sum", without writing the logits)."""
    return model(batch.x, pos=batch.pos, seg=batch.seg, targets=batch.y)


def token_logps(model: nn.Module, x: torch.Tensor, y: torch.Tensor, pos: torch.Tensor | None = None,
                seg: torch.Tensor | None = None) -> torch.Tensor:
    """The model's log p(y) per position (R, T) of inputs x (R, T) (pos, seg: packed rows' positions and
    segments), in float32, 0 where y is IGNORE_INDEX. Only the positions with a target are projected to the
    vocabulary (`Transformer.forward`'s `at`): a row's prompt, most of an agentic trajectory's tokens, costs no
    output projection and no softmax. DPO sums it over each row; RL weighs it token by token."""
    targets = y.flatten()
    at = (targets != IGNORE_INDEX).nonzero().squeeze(-1)
    # The model runs even where no position has a target, so that the loss stays a function of every parameter
    # (what DDP's reduction expects of each rank's backward).
    nll = F.cross_entropy(model(x, pos=pos, seg=seg, at=at).float(), targets.index_select(0, at), reduction="none")
    logp = torch.zeros(targets.shape, dtype=torch.float32, device=y.device).index_put((at,), -nll)
    return logp.view(y.shape)


@dataclass
class Companion:
    """A module an objective trains beside the policy (PPO's critic). The loop gives it an optimizer of its own
    (optim.* as the policy's, its learning rate lr_scale x the schedule's), reduces its gradients over the ranks,
    clips them together with the policy's, steps it (or skips the step) with the policy's, and saves its weights
    and optimizer state in every checkpoint (`<name>.safetensors`, `<name>.optimizer.pt`), restored on --resume."""

    module: nn.Module
    lr_scale: float = 1.0


class Objective:
    """What a stage trains (nanolm/train/stages.py builds it): `__call__(model, batch)` is a micro-batch's `Loss`
    summed over its `units`, `evaluate` scores a validation split. The hooks have defaults that fit every stage
    but RL: `before_step` turns the step's batches into what the loss reads (GRPO: prompts into scored
    rollouts, with the rollout's metrics), `updates` optimizer updates run over them, `stop_updates` may end
    those early, `after_step` adds to the step's logged metrics once its updates are timed, `warning` is said
    with a logged step; `companions` are the modules it trains beside the policy (PPO: its critic)."""

    updates = 1  # optimizer updates per step over the same batches
    best = ("val_loss", False)  # the validation metric that picks the best checkpoint, and whether higher is better
    units = staticmethod(target_tokens)  # what every micro-batch and rank of a step weighs alike

    def __call__(self, model: nn.Module, batch: Batch) -> Loss:
        raise NotImplementedError

    def evaluate(self, model: nn.Module, batches: Iterable[Batch], autocast: Callable[[], AbstractContextManager],
                 token_bytes: torch.Tensor | None) -> dict[str, float]:
        raise NotImplementedError

    def positions(self, batch: Batch) -> int:
        """The input positions the model reads of the batch (the tokens a step counts)."""
        return batch.x.numel()

    def projected(self, batch: Batch) -> int:
        """The positions whose output projection the loss computes (uncompiled; a compiled model projects every
        position): MFU counts the projection's FLOPs at these alone. All the positions the model reads, unless
        the objective's loss reads fewer."""
        return self.positions(batch)

    def before_step(self, model: nn.Module, batches: list, info: Any) -> tuple[list, dict[str, float]]:
        return batches, {}

    def stop_updates(self, sums: Metrics, step_units: int, info: Any) -> bool:
        """After one of the step's `updates`, with this rank's metric sums of it: whether to skip the rest. Every
        rank must answer alike (reduce over `info`'s ranks before deciding)."""
        return False

    def after_step(self, extra: dict[str, float], update_s: float) -> dict[str, float]:
        return extra

    def warning(self, logged: dict[str, float]) -> str | None:
        return None

    def companions(self) -> dict[str, Companion]:
        """The modules trained beside the policy, by name (a file-name stem of the checkpoint's)."""
        return {}


class LMObjective(Objective):
    """Next-token cross-entropy summed over the targets (+ aux_loss_coef x the MoE balance loss, per micro-batch).
    The logged `loss` is the cross-entropy."""

    def __init__(self, model: nn.Module, aux_loss_coef: float) -> None:
        self.moe = bool(moe_layers(model))
        self.aux_loss_coef = aux_loss_coef

    def balance(self, model: nn.Module, loss: Loss) -> Loss:
        """`loss` with the MoE balance loss of the forward just run, if the model has experts."""
        if self.moe:
            aux = collect_aux_loss(model)
            loss.per_batch, loss.means["aux_loss"] = self.aux_loss_coef * aux, aux.detach()
        return loss

    def __call__(self, model: nn.Module, batch: Batch) -> Loss:
        ce = _summed_ce(model, batch)
        return self.balance(model, Loss(ce, {"loss": ce.detach()}))

    def projected(self, batch: Batch) -> int:
        """The targets alone (Transformer.forward projects only the positions with one)."""
        return target_tokens(batch)

    def evaluate(self, model: nn.Module, batches: Iterable[Batch], autocast: Callable[[], AbstractContextManager],
                 token_bytes: torch.Tensor | None) -> dict[str, float]:
        """Validation loss per target token, and bits per byte of the target text."""
        loss_sum, n_tokens, n_bytes = lm_scores(model, batches, autocast, token_bytes)
        if n_tokens == 0:
            return {}
        out = {"val_loss": loss_sum / n_tokens}
        if n_bytes > 0:
            out["val_bpb"] = loss_sum / (math.log(2) * n_bytes)
        return out


class BlocksObjective(LMObjective):
    """Input and output blocks (nanolm/data/kinds/blocks.py): the output block's cross-entropy summed over its targets
    (+ the MoE balance loss), for a causal model (the output token by token after the input) or a non-causal one
    (every output position from the whole input block at once)."""

    def __init__(self, model: nn.Module, aux_loss_coef: float, causal: bool) -> None:
        super().__init__(model, aux_loss_coef)
        self.causal = causal

    def __call__(self, model: nn.Module, batch: Batch) -> Loss:
        return super().__call__(model, block_views(batch, self.causal))

    def positions(self, batch: Batch) -> int:
        """The input positions the model reads of the batch: both blocks but the last token (causal), or the
        input block alone."""
        return block_views(batch, self.causal).x.numel()

    def projected(self, batch: Batch) -> int:
        return target_tokens(block_views(batch, self.causal))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[Batch], autocast: Callable[[], AbstractContextManager],
                 token_bytes: torch.Tensor | None) -> dict[str, float]:
        """Validation loss per target token, bits per byte, and the share of output tokens (val_token_acc) and of
        whole output blocks (val_exact) whose every token is the model's most likely one. For a causal model that
        is teacher-forced, and equals greedy decoding's exact match: greedy decoding writes the right block
        exactly when the most likely token is right at every position given the right ones before it."""
        loss_sum, n_tokens, n_bytes, right, exact, rows = 0.0, 0, 0.0, 0, 0, 0
        for batch in batches:
            view = block_views(batch, self.causal)
            with autocast():
                logits = model(view.x)
            targets = view.y != IGNORE_INDEX
            loss_sum += F.cross_entropy(logits.float().flatten(0, 1), view.y.flatten(), ignore_index=IGNORE_INDEX,
                                        reduction="sum").item()
            ok = (logits.argmax(-1) == view.y) | ~targets
            right += int((ok & targets).sum())
            exact += int(ok.all(dim=1).sum())
            rows += len(view.y)
            n_tokens += int(targets.sum())
            if token_bytes is not None:
                n_bytes += token_bytes[view.y[targets].cpu()].sum().item()
        if n_tokens == 0:
            return {}
        out = {"val_loss": loss_sum / n_tokens, "val_token_acc": right / n_tokens, "val_exact": exact / rows}
        if n_bytes > 0:
            out["val_bpb"] = loss_sum / (math.log(2) * n_bytes)
        return out


class DPOObjective(Objective):
    """Direct preference optimisation on batches of (chosen, rejected) row pairs.

    The reference is either a frozen model (the initial weights) or, for a
    LoRA policy, the same model with its adapters disabled: no second copy.
    """

    def __init__(self, beta: float, reference: nn.Module | None,
                 disable_adapters: Callable[[nn.Module], AbstractContextManager] | None = None) -> None:
        """Units are pairs: each weighs the same in a step, whatever micro-batch or rank it falls in."""
        if (reference is None) == (disable_adapters is None):
            raise ValueError("DPO needs exactly one of a reference model or an adapter switch")
        self.beta = beta
        self.reference = reference
        self.disable_adapters = disable_adapters

    def _logps(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        logps = token_logps(model, batch.x, batch.y, batch.pos, batch.seg).sum(dim=1)  # (2P,): chosen, rejected, ...
        return logps[0::2], logps[1::2]

    def _ref_logps(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            if self.reference is not None:
                return self._logps(self.reference, batch)
            with self.disable_adapters(model):
                return self._logps(model, batch)

    @staticmethod
    def units(batch: Batch) -> int:
        return batch.x.shape[0] // 2  # rows 2i, 2i + 1 are pair i

    def projected(self, batch: Batch) -> int:
        """The replies' tokens (token_logps), the policy's: the reference's forward is not training work."""
        return target_tokens(batch)

    def __call__(self, model: nn.Module, batch: Batch) -> Loss:
        rc, rr = self._ref_logps(model, batch)
        pc, pr = self._logps(model, batch)
        loss, m = dpo_loss(pc, pr, rc, rr, self.beta, reduction="sum")
        return Loss(loss, {"loss": loss.detach(), **m})

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[Batch], autocast: Callable[[], AbstractContextManager],
                 token_bytes: torch.Tensor | None) -> dict[str, float]:
        """Mean DPO loss, reward margin and accuracy over the validation pairs."""
        sums: dict[str, float] = {}
        n = 0
        for batch in batches:
            with autocast():
                loss = self(model, batch)
            for k, v in loss.sums.items():
                sums[k] = sums.get(k, 0.0) + v.item()
            n += self.units(batch)
        return {f"val_{k}": v / n for k, v in sums.items()} if n else {}


class DistillObjective(Objective):
    """KL to a frozen teacher's temperature-softened distributions, mixed with cross-entropy by alpha."""

    def __init__(self, teacher: nn.Module, temperature: float, alpha: float, vocab_size: int,
                 lm: LMObjective) -> None:
        self.teacher = teacher
        self.temperature = temperature
        self.alpha = alpha
        self.vocab_size = vocab_size  # the tokenizer's; models may pad their vocabularies differently
        self.lm = lm

    def __call__(self, model: nn.Module, batch: Batch) -> Loss:
        with torch.no_grad():
            teacher_logits = _forward(self.teacher, batch)[..., : self.vocab_size]
        student_logits = _forward(model, batch)[..., : self.vocab_size]
        loss, m = distill_loss(student_logits, teacher_logits, batch.y, self.temperature, self.alpha, reduction="sum")
        return self.lm.balance(model, Loss(loss, {"loss": loss.detach(), **m}))

    def evaluate(self, model: nn.Module, batches: Iterable[Batch], autocast: Callable[[], AbstractContextManager],
                 token_bytes: torch.Tensor | None) -> dict[str, float]:
        # The student's own cross-entropy: comparable with any other run on the same data.
        return self.lm.evaluate(model, batches, autocast, token_bytes)
