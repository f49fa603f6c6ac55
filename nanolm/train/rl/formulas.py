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

PPO with a learned critic (`--stage ppo`, nanolm/train/rl/ppo.py) adds per-token
advantages and a value loss:

- `token_rewards`: each completion token's reward, -kl_coef x its KL to the
  reference, plus the completion's reward at its last token (TRL's PPO);
- `gae` (Schulman et al. 2016): generalised advantage estimation over each
  row's completion tokens, delta_t = r_t + gamma V_{t+1} - V_t (V = 0 after a
  completion's last token), A_t = delta_t + gamma lam A_{t+1}; returns
  A_t + V_t are the critic's targets;
- `clipped_value_loss` (as PPO2 and TRL clip the value function): 0.5 x the
  larger of (V - R)^2 and (clip(V, V_old - c, V_old + c) - R)^2;
- `masked_moments`, `whiten`, `explained_variance`: advantages whitened over
  the completion tokens of a whole step (the moments summed over micro-batches
  and ranks, so the step's advantages do not depend on how it is cut), and how
  much of the returns' variance the critic's values explain.
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


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """Each completion token's reward (R, T), as TRL's PPO gives it: -kl_coef x its KL to the reference (kl
    (R, T)), plus its completion's score (scores (R,)) at the completion's last token; 0 outside mask (R, T)."""
    last = mask & (mask.cumsum(dim=1) == mask.sum(dim=1, keepdim=True))  # (R, T): a row's last completion token
    return (-kl_coef * kl.float() + scores.float()[:, None] * last) * mask


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over rows of tokens.

    rewards, values (R, T): each token's reward and the critic's value of the state it was written in;
    mask (R, T) bool: the tokens the policy wrote (prompt, padding and, in a multi-turn trajectory, the tool
    turns between its replies False). The steps are the masked tokens alone, in order: a position outside the
    mask is no step, so the credit of a later reply reaches an earlier one across the tool turn between them
    (the result is that of the row with those positions removed).
    Returns (advantages, returns) (R, T) float32, 0 outside the mask; returns = advantages + values.
    """
    m = mask.bool()
    r, v = rewards.float(), values.float()
    adv = torch.zeros_like(v)
    carried = torch.zeros_like(v[:, 0])  # (R,) the advantage of the row's next step, 0 past its last one
    next_value = torch.zeros_like(v[:, 0])  # (R,) the value of the row's next step's state
    for t in reversed(range(v.shape[1])):
        step = m[:, t]
        a = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * carried
        carried = torch.where(step, a, carried)
        next_value = torch.where(step, v[:, t], next_value)
        adv[:, t] = torch.where(step, a, torch.zeros_like(a))
    return adv, torch.where(m, adv + v, torch.zeros_like(adv))


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss per token and where the clip sets it.

    values (R, T) the critic's values now; old_values (R, T) its values when the rollout was made; returns
    (R, T) the targets. Returns (0.5 max((V - R)^2, (clip(V, V_old - clip, V_old + clip) - R)^2) (R, T),
    clipped (R, T) bool: the clipped term is the larger, so the token's value has no gradient).
    """
    clipped_v = old_values + torch.clamp(values - old_values, -clip, clip)
    plain, held = (values - returns) ** 2, (clipped_v - returns) ** 2
    return 0.5 * torch.maximum(plain, held), (held > plain).detach()


def masked_moments(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(3,) float64: the count, sum and sum of squares of `values` (R, T) over `mask` (R, T); moments of
    several batches (micro-batches, ranks) add up."""
    v = values.double()[mask]
    return torch.stack([torch.tensor(float(v.numel()), dtype=torch.float64, device=v.device), v.sum(),
                        (v * v).sum()])


def _mean_var(moments: torch.Tensor) -> tuple[float, float]:
    """The mean and unbiased variance of `masked_moments` (variance 0 below two values)."""
    n, total, sq = (float(x) for x in moments)
    if n < 1:
        return 0.0, 0.0
    mean = total / n
    return mean, max(sq - n * mean * mean, 0.0) / (n - 1) if n > 1 else 0.0


def whiten(values: torch.Tensor, mask: torch.Tensor, moments: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / sqrt(var + eps) on the mask, 0 off it; mean and unbiased variance from `moments`
    (`masked_moments` of all the values whitened together, as TRL's masked_whiten)."""
    mean, var = _mean_var(moments)
    return (values - mean) * (1.0 / (var + eps) ** 0.5) * mask.to(values.dtype)


def explained_variance(returns: torch.Tensor, residuals: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns), from the `masked_moments` of the returns and of the residuals
    returns - values: 1 for a perfect critic, 0 for one that predicts the mean, negative for a worse one (nan
    when the returns do not vary)."""
    var = _mean_var(returns)[1]
    return 1.0 - _mean_var(residuals)[1] / var if var > 0 else float("nan")
