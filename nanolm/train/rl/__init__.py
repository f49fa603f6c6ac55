"""Reinforcement learning from rewards: the GRPO and PPO stages, their rollouts, rewards and tool-using agents.

`formulas` holds the math as pure functions (advantages, surrogate losses, KL,
GAE); `rollout` samples and scores completions with the generation engine;
`agent` runs multi-turn trajectories with tools; `rewards` scores a completion;
`grpo` and `ppo` are the stages' objectives.
"""
