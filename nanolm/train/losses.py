"""Pure loss functions over logits and targets, and how a micro-batch's loss is weighed into its step.

Each training stage's objective (nanolm.train.objectives) is built from these:
masked next-token cross-entropy, the DPO loss and distillation (the log-probabilities DPO and RL
take of a model's targets are objectives.token_logps); `step_share` turns a loss summed over a micro-batch's units into
its share of the optimizer step, so every unit of a step weighs the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanolm.data.shards import IGNORE_INDEX


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy. logits (B, T, V) any dtype, targets (B, T) int64.

    Computed in float32 whatever the autocast dtype, since a bf16 log-softmax
    over thousands of classes loses visible precision.
    """
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                           ignore_index=IGNORE_INDEX, reduction=reduction)


def split_pairs(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) of per-row values of a preference batch, whose rows 2i, 2i + 1 are pair i's."""
    return values[0::2], values[1::2]


def _reduction(name: str):
    """torch.mean or torch.sum, by name: how a loss over several items is reduced."""
    if name not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {name!r}")
    return torch.mean if name == "mean" else torch.sum


def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor,
             beta: float, reduction: str = "mean") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The sigmoid DPO loss (Rafailov et al. 2023) over pairs; each argument (P,) sequence log-probs.

    loss = -log sigmoid(beta * ((pc - rc) - (pr - rr))): pc, pr the policy's
    log-probabilities of the chosen and rejected replies, rc, rr the frozen
    reference model's. The implicit rewards are beta * (policy - reference).
    Metrics, detached, reduced over the pairs as the loss is (reduction "mean"
    or "sum"): chosen_rewards, rejected_rewards, reward_margin (chosen minus
    rejected) and reward_accuracy (the fraction, or with "sum" the number, of
    pairs whose chosen reward is the higher).
    """
    reduce = _reduction(reduction)
    chosen_rewards = beta * (policy_chosen_logps.float() - ref_chosen_logps.float())  # (P,)
    rejected_rewards = beta * (policy_rejected_logps.float() - ref_rejected_logps.float())
    margin = chosen_rewards - rejected_rewards
    loss = reduce(-F.logsigmoid(margin))  # logsigmoid: no overflow for large margins of either sign
    margin = margin.detach()
    metrics = {"chosen_rewards": reduce(chosen_rewards.detach()), "rejected_rewards": reduce(rejected_rewards.detach()),
               "reward_margin": reduce(margin), "reward_accuracy": reduce((margin > 0).float())}
    return loss, metrics


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
                 temperature: float, alpha: float,
                 reduction: str = "mean") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Knowledge distillation (Hinton et al. 2015): logits (B, T, V) of both models, targets (B, T).

    loss = alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * CE(student, targets),
    both averaged (reduction "mean") or summed ("sum") over the positions whose
    target is not IGNORE_INDEX; p_T = softmax(logits / T). The T^2 keeps the
    soft term's gradient scale independent of T. The teacher gets no gradient;
    both must share one vocabulary (the same V). A batch without targets gives a
    loss of 0. Metrics (detached, reduced alike): kl (at temperature T, before
    the T^2) and ce.
    """
    _reduction(reduction)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ; distillation needs one tokenizer and vocabulary")
    keep = targets != IGNORE_INDEX  # (B, T)
    n = keep.sum().clamp(min=1) if reduction == "mean" else 1
    student = student_logits[keep].float()  # (N, V): only the positions that carry a loss
    teacher = teacher_logits[keep].detach().float()
    log_s = F.log_softmax(student / temperature, dim=-1)
    log_t = F.log_softmax(teacher / temperature, dim=-1)
    p_t = log_t.exp()
    # A teacher probability of 0 adds 0 (the limit of p log p), not 0 * -inf.
    kl = torch.where(p_t > 0, p_t * (log_t - log_s), 0.0).sum() / n
    ce = F.cross_entropy(student, targets[keep], reduction="sum") / n
    loss = alpha * temperature ** 2 * kl + (1 - alpha) * ce
    return loss, {"kl": kl.detach(), "ce": ce.detach()}


def step_share(total: torch.Tensor, units: int, step_units: int, world_size: int) -> torch.Tensor:
    """A micro-batch's share of its optimizer step's loss.

    total: the micro-batch's loss summed over its `units` (target tokens, or
    preference pairs); step_units: the units of every micro-batch of the step
    on every rank. Each unit weighs 1 / step_units, whatever the micro-batch it
    falls in, so the step's gradient is that of one batch holding all of them.
    The factor world_size undoes DDP's and FSDP's averaging over the ranks.

    Written as (total / units) / (step_units / (units * world_size)): where all
    micro-batches hold the same number of units (pretraining windows, DPO pairs)
    that is each micro-batch's mean divided by its rank's micro-batches per step,
    bit for bit. A micro-batch without units adds nothing (its total is 0).
    """
    if units == 0:
        return total
    return total / units / (step_units / (units * world_size))
