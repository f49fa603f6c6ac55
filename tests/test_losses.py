"""Loss functions with exact values: the log-probabilities of a model's targets, the DPO loss and its rewards, distillation."""

from __future__ import annotations

import math

import pytest
import torch

from nanolm.train.losses import distill_loss, dpo_loss, lm_loss, split_pairs
from nanolm.train.objectives import token_logps

# Rows of probabilities over a vocabulary of 4; their logs are logits whose log-softmax is the log itself.
PROBS = [[[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]],
         [[0.5, 0.5, 0.0, 0.0], [0.05, 0.05, 0.45, 0.45], [0.4, 0.3, 0.2, 0.1]]]


class FixedLogits(torch.nn.Module):
    """A "model" whose logits are given: forward(x, pos, seg, at) returns the listed positions' rows."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits
        self.asked: list[list[int]] = []

    def forward(self, x, pos=None, seg=None, at=None):
        self.asked.append(at.tolist())
        return self.logits.flatten(0, 1).index_select(0, at)


def test_token_logps_are_the_targets_log_probabilities_and_sum_per_row():
    # A zero probability becomes a very negative logit; it is never a target here.
    model = FixedLogits(torch.tensor(PROBS).clamp(min=1e-30).log())  # (2, 3, 4)
    targets = torch.tensor([[3, -1, 0], [1, 2, -1]])
    got = token_logps(model, torch.zeros(2, 3, dtype=torch.long), targets)
    assert got.dtype == torch.float32 and got.shape == (2, 3)
    assert model.asked == [[0, 2, 3, 4]]  # only the positions with a target are asked for
    assert got[0, 1].item() == got[1, 2].item() == 0.0
    assert got.sum(dim=1).tolist() == pytest.approx([math.log(0.4) + math.log(0.7), math.log(0.5) + math.log(0.45)],
                                                    rel=1e-6)
    # The same as gathering the log-softmax by hand, for any logits; bf16 logits are summed in float32.
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(1))
    targets[0, :2] = targets[2] = -1
    logp = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    want = (logp * (targets != -1)).sum(1)
    x = torch.zeros(3, 5, dtype=torch.long)
    torch.testing.assert_close(token_logps(FixedLogits(logits), x, targets).sum(dim=1), want)
    assert token_logps(FixedLogits(logits), x, targets)[2].abs().sum().item() == 0.0  # no targets: nothing
    assert token_logps(FixedLogits(logits.bfloat16()), x, targets).dtype == torch.float32


def test_split_pairs_takes_even_rows_as_chosen():
    chosen, rejected = split_pairs(torch.tensor([10.0, 11.0, 20.0, 21.0]))
    assert chosen.tolist() == [10.0, 20.0] and rejected.tolist() == [11.0, 21.0]


def test_dpo_loss_is_the_formula_for_two_pairs():
    beta = 0.1
    policy_chosen = torch.tensor([-10.0, -20.0])
    policy_rejected = torch.tensor([-12.0, -18.0])
    ref_chosen = torch.tensor([-11.0, -19.5])
    ref_rejected = torch.tensor([-11.0, -19.0])
    loss, m = dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta)
    # Pair 0: chosen reward 0.1 * (-10 + 11) = 0.1, rejected 0.1 * (-12 + 11) = -0.1, margin 0.2.
    # Pair 1: chosen reward 0.1 * (-20 + 19.5) = -0.05, rejected 0.1 * (-18 + 19) = 0.1, margin -0.15.
    want = (math.log(1 + math.exp(-0.2)) + math.log(1 + math.exp(0.15))) / 2  # -log sigmoid(z) = log(1 + e^-z)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert m["chosen_rewards"].item() == pytest.approx((0.1 - 0.05) / 2, abs=1e-7)
    assert m["rejected_rewards"].item() == pytest.approx((-0.1 + 0.1) / 2, abs=1e-7)
    assert m["reward_margin"].item() == pytest.approx((0.2 - 0.15) / 2, abs=1e-7)
    assert m["reward_accuracy"].item() == 0.5
    assert not any(v.requires_grad for v in m.values())


def test_dpo_loss_starts_at_log2_and_its_gradient_favours_the_chosen_reply():
    logps = torch.tensor([-5.0, -7.0, -3.0], requires_grad=True)
    rejected = torch.tensor([-6.0, -6.0, -9.0], requires_grad=True)
    loss, m = dpo_loss(logps, rejected, logps.detach(), rejected.detach(), beta=0.5)  # policy = reference
    assert loss.item() == pytest.approx(math.log(2), rel=1e-7)
    assert m["reward_margin"].item() == 0.0 and m["reward_accuracy"].item() == 0.0  # a tie is not a win
    loss.backward()
    # d/dpc of -log sigmoid(beta * (pc - pr)) at 0: -beta * sigmoid(0) / n_pairs.
    assert logps.grad.tolist() == pytest.approx([-0.5 * 0.5 / 3] * 3)
    assert rejected.grad.tolist() == pytest.approx([0.5 * 0.5 / 3] * 3)
    # Huge margins either way stay finite: ~0 when the policy is right, ~|margin| when it is wrong.
    big = torch.tensor([1000.0])
    zero = torch.zeros(1)
    assert dpo_loss(big, zero, zero, zero, 1.0)[0].item() == 0.0
    assert dpo_loss(zero, big, zero, zero, 1.0)[0].item() == pytest.approx(1000.0)


def softmax(row: list[float], t: float) -> list[float]:
    e = [math.exp(v / t) for v in row]
    return [v / sum(e) for v in e]


def kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q))


def test_distill_loss_matches_a_manual_kl_and_ce():
    student = torch.tensor([[[1.0, 2.0, 0.5], [0.0, -1.0, 3.0], [2.0, 2.0, 2.0]]])  # (1, 3, 3)
    teacher = torch.tensor([[[2.0, 0.0, 1.0], [1.0, 1.0, 1.0], [-5.0, 9.0, 0.0]]])
    targets = torch.tensor([[1, -1, 0]])  # position 1 carries no loss
    for t in (1.0, 2.0):
        kls = [kl(softmax(teacher[0, i].tolist(), t), softmax(student[0, i].tolist(), t)) for i in (0, 2)]
        ces = [-math.log(softmax(student[0, 0].tolist(), 1)[1]), -math.log(softmax(student[0, 2].tolist(), 1)[0])]
        want_kl, want_ce = sum(kls) / 2, sum(ces) / 2
        for alpha in (1.0, 0.3, 0.0):
            loss, m = distill_loss(student, teacher, targets, temperature=t, alpha=alpha)
            assert m["kl"].item() == pytest.approx(want_kl, rel=1e-5)
            assert m["ce"].item() == pytest.approx(want_ce, rel=1e-5)
            assert loss.item() == pytest.approx(alpha * t * t * want_kl + (1 - alpha) * want_ce, rel=1e-5)
    # The temperature softens both distributions: a different KL at T=2 than at T=1.
    kl1 = distill_loss(student, teacher, targets, 1.0, 1.0)[1]["kl"].item()
    kl2 = distill_loss(student, teacher, targets, 2.0, 1.0)[1]["kl"].item()
    assert kl2 < kl1
    # Positions without a target do not count, whatever their logits.
    other = student.clone()
    other[0, 1] = torch.tensor([50.0, -50.0, 0.0])
    assert distill_loss(other, teacher, targets, 2.0, 0.5)[0].item() == distill_loss(student, teacher, targets,
                                                                                     2.0, 0.5)[0].item()


def test_distill_loss_is_zero_for_the_teacher_itself_and_ce_at_alpha_zero():
    g = torch.Generator().manual_seed(0)
    student = torch.randn(2, 6, 17, generator=g, requires_grad=True)
    targets = torch.randint(0, 17, (2, 6), generator=g)
    targets[1, 3:] = -1
    loss, m = distill_loss(student, student.detach().clone(), targets, temperature=2.0, alpha=1.0)
    assert loss.item() == 0.0 and m["kl"].item() == 0.0
    loss, _ = distill_loss(student, torch.randn(2, 6, 17, generator=g), targets, temperature=3.0, alpha=0.0)
    torch.testing.assert_close(loss, lm_loss(student, targets))
    # Only the student gets a gradient.
    teacher = torch.randn(2, 6, 17, generator=g, requires_grad=True)
    distill_loss(student, teacher, targets, 2.0, 0.5)[0].backward()
    assert teacher.grad is None and student.grad is not None and student.grad.abs().sum() > 0
    # No targets at all: nothing to learn, a loss of 0 rather than 0/0.
    loss, m = distill_loss(student, teacher, torch.full((2, 6), -1), 2.0, 0.5)
    assert loss.item() == 0.0 and m["ce"].item() == 0.0
    with pytest.raises(ValueError, match=r"student logits \(2, 6, 17\) and teacher logits \(2, 6, 16\) differ"):
        distill_loss(student, teacher[..., :16], targets, 2.0, 0.5)
