"""The math of reinforcement learning from rewards (GRPO and its variants), as small pure functions.

Group-relative advantages (DeepSeekMath's GRPO, Shao et al. 2024): each
prompt's `G` completions form a group, and a completion's advantage is its
reward minus the group's mean, divided by the group's standard deviation
(the unbiased one, as TRL computes it, plus `STD_EPS`) unless `scale` is off
(Dr. GRPO, Liu et al. 2025, who found the division biases the update towards
groups of nearly equal rewards). A group whose rewards are all equal has
advantage 0 for every member: it teaches nothing.

Per-token policy losses, with ratio r = exp(logp - old_logp) (old: the
behaviour policy that sampled the completion):

- `clipped_surrogate` (PPO's, as GRPO uses it): -min(r A, clip(r, 1 - eps,
  1 + eps_high) A); eps_high > eps is DAPO's asymmetric "clip-higher";
- `cispo` (MiniMax-M1, 2025): -sg(min(r, clip)) A logp: the importance weight
  is clipped and carries no gradient, so every token keeps a gradient (none is
  dropped by the clip, as PPO's clip drops them).

`k3_kl` is Schulman's k3 estimator of KL(policy || reference) per token:
exp(q) - q - 1 with q = ref_logp - logp; non-negative, unbiased, and 0 where
the two agree. `token_sums` reduces per-token values of a batch to what the
loop's token-sum normalisation needs: summed over tokens (DAPO's token
average over the step) or each sequence's mean, summed over sequences (the
original GRPO's per-sequence average).
"""

from __future__ import annotations

import torch

STD_EPS = 1e-4  # added to a group's std before dividing (TRL's value): a tiny std does not blow up


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True) -> torch.Tensor:
    """Advantages of rewards (N * G,), groups of `group_size` consecutive completions -> (N * G,) float32."""
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not make groups of {group_size} (group_size >= 2)")
    r = rewards.float().view(-1, group_size)  # (N, G)
    centred = r - r.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (r.std(dim=1, keepdim=True) + STD_EPS)
    # An all-equal group is exactly 0 (the mean of equal floats may differ from them in the last bit).
    equal = (r == r[:, :1]).all(dim=1, keepdim=True)
    return torch.where(equal, torch.zeros_like(centred), centred).flatten()


def zero_variance_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N,) bool: the groups whose rewards are all equal."""
    r = rewards.view(-1, group_size)
    return (r == r[:, :1]).all(dim=1)


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, epsilon: float,
                      epsilon_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped policy loss per token and where the clip is active.

    logp, old_logp (R, T) log-probabilities of the sampled tokens; advantages (R,) or (R, T).
    Returns (loss (R, T), clipped (R, T) bool: the clip sets the objective there, so the token has no
    gradient).
    """
    adv = advantages if advantages.dim() == logp.dim() else advantages.unsqueeze(-1)
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped_obj = torch.clamp(ratio, 1.0 - epsilon, 1.0 + epsilon_high) * adv
    loss = -torch.minimum(unclipped, clipped_obj)
    clipped = ((ratio < 1.0 - epsilon) & (adv < 0)) | ((ratio > 1.0 + epsilon_high) & (adv > 0))
    return loss, clipped.detach()


def cispo(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
          clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO's policy loss per token: -sg(min(r, clip)) A logp, and where the weight was clipped (r > clip).

    Shapes as `clipped_surrogate`. Its gradient is -min(r, clip) A d(logp): REINFORCE weighted by the
    clipped importance ratio.
    """
    adv = advantages if advantages.dim() == logp.dim() else advantages.unsqueeze(-1)
    ratio = torch.exp(logp - old_logp).detach()
    weight = torch.clamp(ratio, max=clip)
    return -weight * adv * logp, (ratio > clip)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """KL(policy || reference) per token, k3 estimator: exp(q) - q - 1, q = ref_logp - logp."""
    q = ref_logp - logp
    return torch.exp(q) - q - 1.0


def token_sums(values: torch.Tensor, mask: torch.Tensor, average: str) -> torch.Tensor:
    """Per-token values (R, T) over the completion tokens mask (R, T) -> one sum the loop normalises.

    average "token": the sum over every completion token (the step's units are its tokens);
    "sequence": each row's mean over its tokens, summed over rows (the units are its sequences);
    a row without tokens adds 0.
    """
    m = mask.to(values.dtype)
    per_row = (values * m).sum(dim=-1)  # (R,)
    if average == "token":
        return per_row.sum()
    if average == "sequence":
        return (per_row / m.sum(dim=-1).clamp(min=1)).sum()
    raise ValueError(f"average must be 'token' or 'sequence', got {average!r}")
