"""The settings of the training methods beside the loop: LoRA adapters, DPO, distillation, GRPO, PPO."""

from __future__ import annotations

from dataclasses import dataclass

from nanolm.config.fields import check as _check


@dataclass
class LoRAConfig:
    """Low-rank adapters for `train.stage = "lora"`: W x + (alpha / rank) * B A x on the target projections."""

    enabled: bool = False  # train adapters in any fine-tuning stage (dpo, distill); stage "lora" implies it
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    # The dtype the frozen base's matrices (projections, embedding, head) are kept in: auto = bfloat16 when training
    # computes in bf16 (autocast casts every weight to it anyway: the same products, half the memory), else float32.
    base_dtype: str = "auto"

    def __post_init__(self) -> None:
        _check(self.base_dtype in ("auto", "float32", "bfloat16"),
               f"lora.base_dtype must be auto, float32 or bfloat16, got {self.base_dtype!r}")
        _check(self.rank > 0, f"lora.rank must be a positive integer, got {self.rank}")
        _check(self.alpha > 0, f"lora.alpha must be > 0, got {self.alpha}")
        _check(0.0 <= self.dropout < 1.0, f"lora.dropout must be in [0, 1), got {self.dropout}")
        self.targets = tuple(self.targets)
        _check(len(self.targets) > 0, "lora.targets must name at least one module (e.g. q_proj,v_proj)")


@dataclass
class DPOConfig:
    """Direct preference optimisation (`train.stage = "dpo"`)."""

    beta: float = 0.1  # how far the policy may move from the reference
    ref_from: str = ""  # the frozen reference checkpoint; "" = the initial weights (train.init_from)

    def __post_init__(self) -> None:
        _check(self.beta > 0, f"dpo.beta must be > 0, got {self.beta}")


@dataclass
class DistillConfig:
    """Knowledge distillation (`train.stage = "distill"`): loss = alpha * T^2 * KL(teacher_T || student_T)
    + (1 - alpha) * cross-entropy."""

    teacher: str = ""  # the teacher's run or checkpoint (same tokenizer as the data)
    temperature: float = 2.0
    alpha: float = 0.5

    def __post_init__(self) -> None:
        _check(self.temperature > 0, f"distill.temperature must be > 0, got {self.temperature}")
        _check(0.0 <= self.alpha <= 1.0, f"distill.alpha must be in [0, 1], got {self.alpha}")


@dataclass
class GRPOConfig:
    """RL from rewards (`train.stage = "grpo"`): group_size sampled completions per prompt, group-relative
    advantages, a clipped (or CISPO) policy loss and a k3 KL penalty to the frozen initial model."""

    group_size: int = 8  # completions sampled per prompt (a group; its rewards are compared with each other)
    temperature: float = 1.0  # sampling of the completions
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 256  # completion budget; a completion cut here counts in the `truncated` metric
    thinking: bool = False  # open a <think> block in the generation prompt (the chat template's thinking switch)
    scale_rewards: bool = True  # divide by the group's std (off: Dr. GRPO)
    loss: str = "grpo"  # grpo (PPO's clipped ratio) or cispo (clipped importance weight, stop-gradient)
    epsilon: float = 0.2  # clip ratios below 1 - epsilon
    epsilon_high: float = 0.2  # clip ratios above 1 + epsilon_high (DAPO's clip-higher: > epsilon)
    cispo_clip: float = 5.0  # cispo: the importance weight is clipped at this
    average: str = "token"  # token: every completion token of the step weighs alike (DAPO); sequence: each one
    beta: float = 0.04  # weight of the k3 KL to the reference; 0 drops the reference (no copy is kept)
    inner_epochs: int = 1  # optimizer updates per rollout batch (the behaviour log-probs are kept)
    rewards: str = "answer:1.0"  # weighted rewards by name (nanolm/train/rl/rewards.py), e.g. answer:1,format:0.2
    reward_model: str = ""  # a transformers sequence-classification directory, for the `model` reward
    length_min: int = 1  # the `length` reward's window, in characters of the reply
    length_max: int = 512
    tools: str = ""  # RL over tool calls: "" none, builtin, tools.json, file.py:function (comma-separated)
    max_rounds: int = 3  # with tools: the most replies of a trajectory (each but the last may call tools)
    compile_rollouts: bool = False  # torch.compile the rollouts' decode step at the first step (30-90 s on a CPU)

    def __post_init__(self) -> None:
        _check(self.max_rounds >= 1, f"grpo.max_rounds must be >= 1, got {self.max_rounds}")
        _check(self.group_size >= 2, f"grpo.group_size must be >= 2 (a group compares completions), got "
                                     f"{self.group_size}")
        _check(self.temperature > 0, f"grpo.temperature must be > 0 (the completions of a group must differ), "
                                     f"got {self.temperature}")
        _check(0 < self.top_p <= 1, f"grpo.top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"grpo.top_k must be >= 0 (0 = off), got {self.top_k}")
        _check(self.max_new_tokens > 0, f"grpo.max_new_tokens must be > 0, got {self.max_new_tokens}")
        _check(self.loss in ("grpo", "cispo"), f"grpo.loss must be grpo or cispo, got {self.loss!r}")
        _check(0 < self.epsilon < 1, f"grpo.epsilon must be in (0, 1), got {self.epsilon}")
        _check(self.epsilon_high > 0, f"grpo.epsilon_high must be > 0, got {self.epsilon_high}")
        _check(self.cispo_clip > 0, f"grpo.cispo_clip must be > 0, got {self.cispo_clip}")
        _check(self.average in ("token", "sequence"), f"grpo.average must be token or sequence, got "
                                                      f"{self.average!r}")
        _check(self.beta >= 0, f"grpo.beta must be >= 0 (0 disables the KL penalty), got {self.beta}")
        _check(self.inner_epochs >= 1, f"grpo.inner_epochs must be >= 1, got {self.inner_epochs}")
        _check(self.length_min >= 0, f"grpo.length_min must be >= 0, got {self.length_min}")
        _check(self.length_max > 0 and self.length_max >= self.length_min,
               f"grpo.length_max must be > 0 and >= grpo.length_min ({self.length_min}), got {self.length_max}")


KL_ESTIMATORS = ("k1", "k3")


@dataclass
class PPOConfig:
    """RL from rewards with a learned critic (`train.stage = "ppo"`): sampled completions, a per-token KL
    penalty to the frozen initial model in the reward, GAE advantages from a value model, the clipped policy
    and value losses over inner_epochs updates per rollout."""

    samples_per_prompt: int = 1  # completions sampled per prompt
    temperature: float = 1.0  # sampling of the completions
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 256  # completion budget; a completion cut here counts in the `truncated` metric
    thinking: bool = False  # open a <think> block in the generation prompt (the chat template's thinking switch)
    epsilon: float = 0.2  # the policy ratio is clipped to [1 - epsilon, 1 + epsilon]
    kl_coef: float = 0.05  # each token's reward is -kl_coef x its KL to the reference; 0 drops the reference
    kl_estimator: str = "k1"  # k1: logp - ref_logp (TRL's default); k3: exp(q) - q - 1, q = ref_logp - logp
    gamma: float = 1.0  # discount of GAE
    lam: float = 0.95  # GAE's lambda: 1 = Monte Carlo returns, 0 = one-step TD
    whiten_advantages: bool = True  # advantages to mean 0, variance 1 over the step's completion tokens
    vf_coef: float = 0.1  # weight of the value loss beside the policy loss
    value_clip: float = 0.2  # a value may move this far from the rollout's before its loss stops pulling
    value_lr_scale: float = 1.0  # the critic's learning rate, times the policy's (optim.lr and its schedule)
    inner_epochs: int = 4  # optimizer updates per rollout (the behaviour log-probs and values are kept)
    target_kl: float = 0.0  # stop a step's updates once the approximate KL to the behaviour policy passes this
    critic_from: str = ""  # the checkpoint the critic starts from; "" = the initial weights (train.init_from)
    rewards: str = "answer:1.0"  # weighted rewards by name (nanolm/train/rl/rewards.py), e.g. answer:1,format:0.2
    reward_model: str = ""  # a transformers sequence-classification directory, for the `model` reward
    length_min: int = 1  # the `length` reward's window, in characters of the reply
    length_max: int = 512
    tools: str = ""  # RL over tool calls, as grpo.tools: "" none, builtin, tools.json, file.py:function
    max_rounds: int = 3  # with tools: the most replies of a trajectory (each but the last may call tools)
    compile_rollouts: bool = False  # as grpo.compile_rollouts

    def __post_init__(self) -> None:
        _check(self.max_rounds >= 1, f"ppo.max_rounds must be >= 1, got {self.max_rounds}")
        _check(self.samples_per_prompt >= 1, f"ppo.samples_per_prompt must be >= 1, got {self.samples_per_prompt}")
        _check(self.temperature > 0, f"ppo.temperature must be > 0 (PPO learns from sampled completions), got "
                                     f"{self.temperature}")
        _check(0 < self.top_p <= 1, f"ppo.top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"ppo.top_k must be >= 0 (0 = off), got {self.top_k}")
        _check(self.max_new_tokens > 0, f"ppo.max_new_tokens must be > 0, got {self.max_new_tokens}")
        _check(0 < self.epsilon < 1, f"ppo.epsilon must be in (0, 1), got {self.epsilon}")
        _check(self.kl_coef >= 0, f"ppo.kl_coef must be >= 0 (0 disables the KL penalty), got {self.kl_coef}")
        _check(self.kl_estimator in KL_ESTIMATORS,
               f"ppo.kl_estimator must be one of {', '.join(KL_ESTIMATORS)}, got {self.kl_estimator!r}")
        _check(0 < self.gamma <= 1, f"ppo.gamma must be in (0, 1], got {self.gamma}")
        _check(0 <= self.lam <= 1, f"ppo.lam must be in [0, 1], got {self.lam}")
        _check(self.vf_coef > 0, f"ppo.vf_coef must be > 0 (the critic learns from the value loss), got "
                                 f"{self.vf_coef}")
        _check(self.value_clip > 0, f"ppo.value_clip must be > 0, got {self.value_clip}")
        _check(self.value_lr_scale > 0, f"ppo.value_lr_scale must be > 0, got {self.value_lr_scale}")
        _check(self.inner_epochs >= 1, f"ppo.inner_epochs must be >= 1, got {self.inner_epochs}")
        _check(self.target_kl >= 0, f"ppo.target_kl must be >= 0 (0 = no early stop), got {self.target_kl}")
        _check(self.length_min >= 0, f"ppo.length_min must be >= 0, got {self.length_min}")
        _check(self.length_max > 0 and self.length_max >= self.length_min,
               f"ppo.length_max must be > 0 and >= ppo.length_min ({self.length_min}), got {self.length_max}")
