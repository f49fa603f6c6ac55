"""PPO: the pure math with exact values (GAE, the clipped value loss, the per-token rewards, whitening), the
stage in the one loop (its critic, checkpoints and resume, micro-batch invariance, the KL early stop, the
metrics), and end to end: SFT, then PPO raising the held-out reward, which it does not with the advantage's
sign flipped."""

from __future__ import annotations

import json
import math

import pytest
import torch

from nanolm.errors import UserError
from nanolm.train.rl.formulas import clipped_value_loss, explained_variance, gae, masked_moments, token_rewards, whiten


# ----------------------------------------------------------------------------- the math, exact values


def test_gae_on_a_hand_worked_row():
    # gamma 0.9, lam 0.8; V = 0 after the last token:
    # delta_2 = 1 - 0.4 = 0.6; delta_1 = 0.5 + 0.9 * 0.4 - 0.2 = 0.66; delta_0 = 0 + 0.9 * 0.2 - 0.5 = -0.32
    # A_2 = 0.6; A_1 = 0.66 + 0.72 * 0.6 = 1.092; A_0 = -0.32 + 0.72 * 1.092 = 0.46624; returns A + V
    rewards, values = torch.tensor([[0.0, 0.5, 1.0]]), torch.tensor([[0.5, 0.2, 0.4]])
    adv, ret = gae(rewards, values, torch.ones(1, 3, dtype=torch.bool), 0.9, 0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.46624, 1.092, 0.6]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(ret, torch.tensor([[0.96624, 1.292, 1.0]]), rtol=0, atol=1e-6)


def test_gae_of_a_masked_padded_row_ignores_the_prompt_and_the_padding():
    # row 0: a prompt position, the hand-worked completion, two of padding (whatever their rewards and values);
    # row 1: a one-token completion, then padding
    rewards = torch.tensor([[7.0, 0.0, 0.5, 1.0, 9.0, 9.0], [3.0, 2.0, 9.0, 9.0, 9.0, 9.0]])
    values = torch.tensor([[5.0, 0.5, 0.2, 0.4, 8.0, 8.0], [4.0, 0.5, 8.0, 8.0, 8.0, 8.0]])
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 1, 0, 0, 0, 0]], dtype=torch.bool)
    adv, ret = gae(rewards, values, mask, 0.9, 0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.46624, 1.092, 0.6, 0.0, 0.0],
                                                  [0.0, 1.5, 0.0, 0.0, 0.0, 0.0]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.96624, 1.292, 1.0, 0.0, 0.0],
                                                  [0.0, 2.0, 0.0, 0.0, 0.0, 0.0]]), rtol=0, atol=1e-6)
    # gamma = lam = 1: the advantage is the reward still to come minus the value (Monte Carlo)
    adv, ret = gae(rewards, values, mask, 1.0, 1.0)
    assert adv[0, 1:4].tolist() == pytest.approx([1.5 - 0.5, 1.5 - 0.2, 1.0 - 0.4])
    assert ret[0, 1:4].tolist() == pytest.approx([1.5, 1.5, 1.0])


def test_gae_of_a_trajectory_carries_credit_across_its_tool_turns():
    """A multi-turn trajectory: reply, tool turn (not the policy's tokens), reply. Its steps are the masked
    tokens alone: the advantages equal those of the row with the tool turn removed (the hand-worked row), so the
    final reward reaches the first reply."""
    rewards = torch.tensor([[7.0, 0.0, 9.0, 9.0, 0.5, 1.0, 9.0]])
    values = torch.tensor([[5.0, 0.5, 8.0, 8.0, 0.2, 0.4, 8.0]])
    mask = torch.tensor([[0, 1, 0, 0, 1, 1, 0]], dtype=torch.bool)
    adv, ret = gae(rewards, values, mask, 0.9, 0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.46624, 0.0, 0.0, 1.092, 0.6, 0.0]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.96624, 0.0, 0.0, 1.292, 1.0, 0.0]]), rtol=0, atol=1e-6)


def test_token_rewards_penalise_the_kl_and_score_the_last_token():
    kl = torch.tensor([[9.0, 0.1, -0.2, 0.4, 9.0], [9.0, 0.5, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 0, 0, 0]], dtype=torch.bool)
    r = token_rewards(torch.tensor([2.0, -1.0]), kl, mask, kl_coef=0.5)
    torch.testing.assert_close(r, torch.tensor([[0.0, -0.05, 0.1, -0.2 + 2.0, 0.0], [0.0, -0.25 - 1.0, 0, 0, 0]]))


def test_clipped_value_loss_inside_and_outside_the_clip():
    old = torch.full((1, 4), 1.0)
    returns = torch.full((1, 4), 2.0)
    # V = 1.1: inside the clip (1.1 within 1.0 +- 0.2): 0.5 (1.1 - 2)^2 = 0.405, gradient V - R = -0.9
    # V = 1.5: clipped to 1.2, whose error is larger: 0.5 (1.2 - 2)^2 = 0.32, no gradient
    # V = 0.5: clipped to 0.8, but the plain error is larger: 0.5 (0.5 - 2)^2 = 1.125, gradient -1.5
    # V = 2.5: overshoots the return; clipped to 1.2, larger: 0.32, no gradient
    v = torch.tensor([[1.1, 1.5, 0.5, 2.5]], requires_grad=True)
    loss, clipped = clipped_value_loss(v, old, returns, 0.2)
    torch.testing.assert_close(loss, torch.tensor([[0.405, 0.32, 1.125, 0.32]]))
    assert clipped.tolist() == [[False, True, False, True]]
    loss.sum().backward()
    torch.testing.assert_close(v.grad, torch.tensor([[-0.9, 0.0, -1.5, 0.0]]))


def test_whitening_and_explained_variance_from_moments_of_several_batches():
    a, b = torch.tensor([[1.0, 2.0, 9.0]]), torch.tensor([[3.0, 4.0]])
    ma, mb = torch.tensor([[True, True, False]]), torch.tensor([[True, True]])
    moments = masked_moments(a, ma) + masked_moments(b, mb)  # 1, 2, 3, 4: mean 2.5, unbiased var 5/3
    assert moments.tolist() == [4.0, 10.0, 30.0]
    s = math.sqrt(5 / 3 + 1e-8)
    torch.testing.assert_close(whiten(a, ma, moments), torch.tensor([[-1.5 / s, -0.5 / s, 0.0]]))
    torch.testing.assert_close(whiten(b, mb, moments), torch.tensor([[0.5 / s, 1.5 / s]]))
    returns = masked_moments(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.ones(1, 4, dtype=torch.bool))
    residual = masked_moments(torch.tensor([[0.5, -0.5, 0.5, -0.5]]), torch.ones(1, 4, dtype=torch.bool))
    # Var(returns) 5/3, Var(residual) 1/3: 1 - 0.2
    assert explained_variance(returns, residual) == pytest.approx(0.8)
    assert explained_variance(returns, returns) == pytest.approx(0.0)  # a critic that predicts 0
    assert math.isnan(explained_variance(masked_moments(torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool)),
                                         residual))


@pytest.mark.parametrize("field, value, message", [
    ("samples_per_prompt", 0, "ppo.samples_per_prompt must be >= 1, got 0"),
    ("gamma", 0.0, r"ppo.gamma must be in \(0, 1\], got 0.0"),
    ("lam", 1.5, r"ppo.lam must be in \[0, 1\], got 1.5"),
    ("kl_estimator", "k2", "ppo.kl_estimator must be one of k1, k3, got 'k2'"),
    ("vf_coef", 0.0, "ppo.vf_coef must be > 0"),
    ("value_clip", -1.0, "ppo.value_clip must be > 0, got -1.0"),
    ("value_lr_scale", 0.0, "ppo.value_lr_scale must be > 0, got 0.0"),
    ("inner_epochs", 0, "ppo.inner_epochs must be >= 1, got 0"),
    ("target_kl", -0.1, r"ppo.target_kl must be >= 0 \(0 = no early stop\), got -0.1"),
    ("epsilon", 1.0, r"ppo.epsilon must be in \(0, 1\), got 1.0"),
])
def test_ppo_settings_are_checked_with_one_line_naming_the_field(field, value, message):
    from nanolm.train.configure import load_config
    with pytest.raises(UserError, match=message) as e:
        load_config("tiny", overrides={f"ppo.{field}": value})
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- the stage in the loop

from nanolm import checkpoint as ckpt  # noqa: E402
from nanolm.train.trainer import Trainer, train  # noqa: E402
from test_train import read_metrics, same_weights, tiny_cfg  # noqa: E402


@pytest.fixture(scope="module")
def prompts_dir(tmp_path_factory, tokenizer_dir):
    from nanolm.data.builtin.arith import write_arith
    from nanolm.data.prepare import prepare
    files = write_arith(tmp_path_factory.mktemp("arith"), 50, 40, 10, seed=1, max_number=9)
    out = tmp_path_factory.mktemp("prompts") / "p"
    prepare([files["prompts"]], tokenizer_dir, out, format="prompts", val_fraction=0.25, quiet=True)
    return out


@pytest.fixture(scope="module")
def base_run(data_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("ppo-base") / "run"
    train(tiny_cfg(data_dir, run, **{"train.max_steps": 2, "model.dropout": 0.0, "model.max_seq_len": 128}),
          quiet=True)
    return run


def ppo_cfg(prompts_dir, out, base, **over):
    # The length and repetition rewards vary between a random model's completions.
    return tiny_cfg(prompts_dir, out, **{
        "train.stage": "ppo", "train.init_from": str(base), "model.max_seq_len": 128, "model.dropout": 0.0,
        "train.batch_size": 2, "train.max_steps": 4, "train.eval_interval": 2, "train.eval_batches": 1,
        "train.save_interval": 2, "optim.lr": 1e-2, "optim.min_lr": 1e-2, "optim.warmup_steps": 0,
        "ppo.samples_per_prompt": 2, "ppo.max_new_tokens": 6, "ppo.inner_epochs": 2,
        "ppo.rewards": "length:1.0,repetition:0.5", "ppo.length_min": 8, "ppo.length_max": 12, **over})


def test_the_stage_is_registered_with_its_defaults_and_data(prompts_dir, data_dir, base_run, tmp_path):
    from nanolm.train.configure import load_config
    from nanolm.train import stages
    stage = stages.get("ppo")
    assert stage.kinds == ("prompts",) and stage.fine_tunes
    base = load_config("tiny")
    cfg = load_config("tiny", overrides={"train.stage": "ppo"})
    assert (cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_steps) == (base.optim.lr / 50, base.optim.lr / 50, 0)
    assert any(line.startswith("ppo: samples_per_prompt=1 ") for line in cfg.summary())
    assert not any(line.startswith("ppo:") for line in base.summary())
    with pytest.raises(UserError, match="train.stage=ppo cannot train on text data; prepare RL prompts"):
        Trainer(ppo_cfg(data_dir, tmp_path / "a", base_run), quiet=True)
    with pytest.raises(UserError, match="train.stage=ppo fine-tunes a trained model; pass --init-from"):
        Trainer(ppo_cfg(prompts_dir, tmp_path / "b", ""), quiet=True)
    with pytest.raises(UserError, match="ppo.rewards: unknown reward 'lenght'"):
        Trainer(ppo_cfg(prompts_dir, tmp_path / "c", base_run, **{"ppo.rewards": "lenght"}), quiet=True)


def test_the_critic_is_the_policy_with_a_scalar_head_and_trains_beside_it(prompts_dir, base_run, tmp_path):
    t = Trainer(ppo_cfg(prompts_dir, tmp_path / "a", base_run), quiet=True)
    critic = t.objective.critic
    assert set(t.companions) == {"critic"} and t.companions["critic"].module is critic
    head = critic.lm_head
    assert head.weight.shape == (1, 32) and not head.weight.any() and not head.bias.any()
    policy = t.model.state_dict()
    body = {k: v for k, v in critic.state_dict().items() if not k.startswith("lm_head.")}
    assert body and all(torch.equal(v, policy[k]) for k, v in body.items())  # the initial weights
    assert all(p.data_ptr() not in {q.data_ptr() for q in t.model.parameters()} for p in critic.parameters())
    ref = t.objective.reference  # frozen initial weights for the KL penalty
    assert ref is not None and not any(p.requires_grad for p in ref.parameters())
    # the critic's own optimizer, over all its parameters
    opt = t.companion_optimizers["critic"]
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == sum(p.numel() for p in critic.parameters())
    t = Trainer(ppo_cfg(prompts_dir, tmp_path / "b", base_run, **{"ppo.kl_coef": 0.0, "ppo.value_lr_scale": 3.0}),
                quiet=True)
    assert t.objective.reference is None and t.objective.disable_adapters is None
    assert {g["lr_scale"] for g in t.companion_optimizers["critic"].param_groups} == {3.0}


def test_a_ppo_run_logs_what_tells_whether_rl_works_and_saves_its_critic(prompts_dir, base_run, tmp_path):
    res = train(ppo_cfg(prompts_dir, tmp_path / "run", base_run), quiet=True)
    assert res.step == 4 and res.best_metric == "val_reward"
    recs = read_metrics(tmp_path / "run")
    steps = [r for r in recs if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    keys = {"loss", "reward", "reward_std", "reward_length", "policy_loss", "value_loss", "approx_kl", "clipped",
            "value_clipped", "explained_variance", "kl", "non_score_reward", "value", "completion_len", "truncated",
            "updates", "generate_s", "update_s", "generate_share", "rollout_tok_s"}
    assert all(keys <= r.keys() for r in steps)
    assert "zero_var_groups" not in steps[0] and "kl_stop" not in steps[0]
    assert all(r["updates"] == 2 and 0 < r["completion_len"] <= 6 and r["value_loss"] > 0 for r in steps)
    assert steps[0]["kl"] == 0.0 and steps[0]["value"] == 0.0  # the policy is the reference; the head starts at 0
    assert steps[-1]["value"] != 0.0  # the critic learnt
    evals = [r for r in recs if "val_reward" in r]
    assert [r["step"] for r in evals] == [2, 4]
    last = ckpt.resolve_checkpoint(tmp_path / "run", "last")
    state = json.loads((last / "state.json").read_text())
    assert {"critic.safetensors", "critic.optimizer.pt", "model.safetensors"} <= set(state["checksums"])
    policy = ckpt.load_model(tmp_path / "run", "last")[0]  # the checkpoint is a model like any other
    base = ckpt.load_model(base_run, "last")[0].state_dict()
    assert any(not torch.equal(base[k], v) for k, v in policy.state_dict().items())


def test_resume_equals_the_uninterrupted_run_critic_included(prompts_dir, base_run, tmp_path):
    from safetensors.torch import load_file
    over = {"model.dropout": 0.1}  # the RNG state is part of what a resume restores
    full = train(ppo_cfg(prompts_dir, tmp_path / "full", base_run, **over), quiet=True)
    train(ppo_cfg(prompts_dir, tmp_path / "part", base_run, **{**over, "train.max_steps": 2}), quiet=True)
    resumed = train(ppo_cfg(prompts_dir, tmp_path / "part", base_run, **over), resume=True, quiet=True)
    assert full.step == resumed.step == 4
    assert same_weights(tmp_path / "full", tmp_path / "part")  # exact policy weights
    critics = [load_file(ckpt.resolve_checkpoint(tmp_path / run, "last") / "critic.safetensors")
               for run in ("full", "part")]
    assert all(torch.equal(critics[0][k], critics[1][k]) for k in critics[0])
    metrics = [{r["step"]: (r["reward"], r["value_loss"]) for r in read_metrics(tmp_path / run) if "reward" in r}
               for run in ("full", "part")]
    assert metrics[0] == metrics[1]


def test_lora_ppo_trains_adapters_and_a_full_critic_with_the_base_as_reference(prompts_dir, base_run, tmp_path):
    from nanolm.model import lora
    over = {"lora.enabled": True, "lora.rank": 2, "lora.dropout": 0.0, "train.max_steps": 2, "train.eval_interval": 0}
    t = Trainer(ppo_cfg(prompts_dir, tmp_path / "lora", base_run, **over), quiet=True)
    assert t.objective.reference is None and t.objective.disable_adapters is lora.disable_adapters
    assert all(p.requires_grad for p in t.objective.critic.parameters())  # the critic is not an adapter
    t.run()
    last = ckpt.resolve_checkpoint(tmp_path / "lora", "last")
    names = {p.name for p in last.iterdir()}
    assert {"adapter.safetensors", "critic.safetensors"} <= names and "model.safetensors" not in names
    steps = [r for r in read_metrics(tmp_path / "lora") if "reward" in r]
    assert steps[0]["kl"] == 0.0 and steps[1]["kl"] != 0.0  # B starts at 0: at step 1 the policy is its base


def test_a_resume_without_the_critic_is_refused(prompts_dir, base_run, tmp_path):
    train(ppo_cfg(prompts_dir, tmp_path / "run", base_run, **{"train.max_steps": 2}), quiet=True)
    last = ckpt.resolve_checkpoint(tmp_path / "run", "last")
    state = json.loads((last / "state.json").read_text())
    del state["checksums"]["critic.safetensors"]
    (last / "state.json").write_text(json.dumps(state))
    (last / "critic.safetensors").unlink()
    with pytest.raises(UserError, match=r"critic.safetensors: missing; this checkpoint holds no critic"):
        Trainer(ppo_cfg(prompts_dir, tmp_path / "run", base_run), resume=True, quiet=True)


def step_gradients(cfg) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The gradient of a PPO run's first step (rollout, then every micro-batch's backward) of the policy and the
    critic, and the rollout's metrics."""
    t = Trainer(cfg, quiet=True)
    batches, extra = t.objective.before_step(t.model, [t.data.next_batch() for _ in range(t.accum)], t.info)
    units = [t.objective.units(b) for b in batches]
    t._micro_batches(t.model, batches, units, sum(units), sync=False)
    grads = {n: p.grad.clone() for n, p in t.model.named_parameters()}
    grads.update({f"critic.{n}": p.grad.clone() for n, p in t.objective.critic.named_parameters()})
    return grads, extra


def test_a_step_is_the_same_however_its_prompts_are_cut_into_micro_batches(prompts_dir, base_run, tmp_path):
    one, ra = step_gradients(ppo_cfg(prompts_dir, tmp_path / "one", base_run, **{"train.batch_size": 4}))
    two, rb = step_gradients(ppo_cfg(prompts_dir, tmp_path / "two", base_run, **{"train.grad_accum": 2}))
    # the same prompts and samples (each row's seed is its place in the step), so the same rewards (summed in
    # another order)
    assert ra["completion_len"] == rb["completion_len"]
    assert (ra["reward"], ra["reward_std"]) == pytest.approx((rb["reward"], rb["reward_std"]), abs=1e-6)
    assert ra["reward_std"] > 0
    for k in one:  # every completion token weighs the same in both, advantages whitened over the step: one gradient
        torch.testing.assert_close(one[k], two[k], rtol=1e-5, atol=1e-7)
    assert any(g.abs().sum() > 0 for k, g in one.items() if not k.startswith("critic."))
    assert one["critic.lm_head.weight"].abs().sum() > 0


def test_target_kl_stops_the_inner_epochs_early(prompts_dir, base_run, tmp_path):
    over = {"ppo.inner_epochs": 4, "train.max_steps": 2, "train.eval_interval": 0}
    train(ppo_cfg(prompts_dir, tmp_path / "off", base_run, **over), quiet=True)
    train(ppo_cfg(prompts_dir, tmp_path / "on", base_run, **{**over, "ppo.target_kl": 1e-9}), quiet=True)
    off = [r for r in read_metrics(tmp_path / "off") if "reward" in r]
    on = [r for r in read_metrics(tmp_path / "on") if "reward" in r]
    assert [r["updates"] for r in off] == [4, 4] and "kl_stop" not in off[0]
    # the first update's policy is the behaviour policy (KL 0); once it has moved, the KL passes 1e-9 and stops
    assert all(r["updates"] < 4 and r["kl_stop"] == 1.0 for r in on)


@pytest.mark.slow
def test_two_processes_train_policy_and_critic_as_one(prompts_dir, base_run, tmp_path):
    from test_distributed import torchrun_cmd
    from safetensors.torch import load_file
    over = {"train.max_steps": 2, "train.eval_interval": 0, "train.save_interval": 0, "train.grad_accum": 2}
    train(ppo_cfg(prompts_dir, tmp_path / "one", base_run, **over), quiet=True)
    cfg = ppo_cfg(prompts_dir, tmp_path / "two", base_run, **over)
    config = tmp_path / "two.json"
    config.write_text(json.dumps(cfg.to_dict()))
    r = torchrun_cmd("-m", "nanolm", "train", "--config", str(config))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "data parallel: 2 processes (ddp) | 1 micro-batch(es) per rank per step" in r.stdout
    got = {x["step"]: x for x in read_metrics(tmp_path / "two") if "reward" in x}
    want = {x["step"]: x for x in read_metrics(tmp_path / "one") if "reward" in x}
    assert got[1]["completion_len"] == want[1]["completion_len"]
    # step 2's value loss reads the critic after step 1's update: its gradients were averaged over the ranks
    for step in (1, 2):
        for k in ("reward", "loss", "value_loss", "policy_loss"):
            assert got[step][k] == pytest.approx(want[step][k], rel=1e-4, abs=1e-6), (step, k)
    critics = [load_file(ckpt.resolve_checkpoint(tmp_path / run, "last") / "critic.safetensors")
               for run in ("one", "two")]
    for k in critics[0]:
        # Two Adam steps move these weights by up to ~2e-2; the ranks' all-reduce sums in another order than one
        # process's accumulation, which Adam's normalisation turns into up to ~2e-6 where a gradient is near 0
        # (measured on a Xeon with AMX: 1.8e-6 on one weight of 12,288)
        torch.testing.assert_close(critics[0][k], critics[1][k], rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- end to end


E2E_MARGIN = 0.5  # the held-out reward must rise by at least this much in E2E_STEPS steps
E2E_STEPS = 10


@pytest.fixture(scope="module")
def arith_sft(tmp_path_factory):
    """A short SFT on the arithmetic task's worked answers, and its prompts (the val split held out)."""
    from nanolm.train.configure import load_config
    from nanolm.data.builtin.arith import write_arith
    from nanolm.data.kinds import iter_texts
    from nanolm.data.prepare import prepare
    from nanolm.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("ppo-e2e")
    files = write_arith(root / "arith", 140, 90, 30, seed=0, max_number=9)
    train_tokenizer(iter_texts([files["sft"]], format="chat"), root / "tok", vocab_size=400, quiet=True)
    prepare([files["sft"]], root / "tok", root / "sft", format="chat", val_fraction=0, workers=0, quiet=True)
    prepare([files["prompts"], files["heldout"]], root / "tok", root / "prompts", format="prompts",
            val_fraction=0.25, quiet=True)
    train(load_config("tiny", overrides={**E2E_COMMON, "data.path": str(root / "sft"), "train.out_dir":
                                         str(root / "sftrun"), "train.max_steps": 100, "train.batch_size": 16,
                                         "optim.lr": 1e-2, "optim.min_lr": 1e-3, "optim.warmup_steps": 10}),
          quiet=True)
    return root


E2E_COMMON = {"model.vocab_size": 400, "model.d_model": 64, "model.n_layer": 2, "model.n_head": 4,
              "model.n_kv_head": 2, "model.max_seq_len": 96, "train.seq_len": 96, "model.dropout": 0.0,
              "train.eval_interval": 0, "train.save_interval": 0, "train.log_interval": 10}


def ppo_reward_change(root, out) -> tuple[float, float]:
    """The held-out prompts' greedy mean reward before and after PPO steps with the length reward."""
    from nanolm.train.configure import load_config
    cfg = load_config("tiny", overrides={
        **E2E_COMMON, "data.path": str(root / "prompts"), "train.out_dir": str(out), "train.stage": "ppo",
        "train.init_from": str(root / "sftrun"), "train.max_steps": E2E_STEPS, "train.batch_size": 16,
        "train.eval_batches": 2, "optim.lr": 3e-3, "optim.min_lr": 3e-3, "ppo.samples_per_prompt": 2,
        "ppo.max_new_tokens": 20, "ppo.rewards": "length", "ppo.length_min": 4, "ppo.length_max": 8})
    t = Trainer(cfg, quiet=True)
    before = t.evaluate()
    t.run()
    after = [r for r in read_metrics(out) if "val_reward" in r][-1]
    print(f"held-out reward: {before['val_reward']:.3f} -> {after['val_reward']:.3f}; completion length "
          f"{before['val_completion_len']:.2f} -> {after['val_completion_len']:.2f} tokens")
    return before["val_reward"], after["val_reward"]


@pytest.mark.slow
def test_sft_then_ppo_raises_the_held_out_reward(arith_sft, tmp_path):
    """SFT on the arithmetic task's worked answers, then PPO on its prompts with the built-in length reward
    (replies of 4 to 8 characters, falling to 0 at 16; SFT's worked answers are longer, reward 0) and the default
    KL penalty, inner epochs and critic: the held-out prompts' greedy mean reward rises by E2E_MARGIN in E2E_STEPS
    steps. Measured (2-core CPU): 0.229 -> 0.975, and 0.229 -> 0.000 with the advantage's sign flipped (the
    completions growing to the 20-token limit); with the wider SFT model of earlier (SwiGLU 384), train.seed 1,
    2, 3: 0.000 -> 0.900, 0.858, 1.000."""
    before, after = ppo_reward_change(arith_sft, tmp_path / "ppo")
    assert after >= before + E2E_MARGIN


@pytest.mark.slow
def test_with_the_advantage_sign_flipped_the_reward_does_not_rise(arith_sft, tmp_path, monkeypatch):
    """The same run with GAE's advantages negated (the critic's targets left as they are): the update then
    pushes away from what the reward favours, and the held-out reward does not rise by the margin, so the test
    above fails with the sign flipped."""
    from nanolm.train.rl import ppo
    real = ppo.gae

    def flipped(*args, **kwargs):
        adv, returns = real(*args, **kwargs)
        return -adv, returns
    monkeypatch.setattr(ppo, "gae", flipped)
    before, after = ppo_reward_change(arith_sft, tmp_path / "flipped")
    assert after < before + E2E_MARGIN


def test_ppo_with_tools_trains_on_trajectories_and_resumes(prompts_dir, base_run, tmp_path, monkeypatch):
    """ppo.tools: each completion is a trajectory (here every reply is forced to call the calculator, so each runs
    out of its 2 rounds: call, tool turn, call); the rewards see the calls, and a resumed run is the same."""
    from test_agent_rl import CALL, Forced

    from nanolm.tokenizer import Tokenizer
    from nanolm.train.rl.agent import AgentSampler
    tok = Tokenizer.load(ckpt.resolve_checkpoint(base_run, "last"))
    script = tok.encode(CALL) + [tok.im_end_id]
    monkeypatch.setattr(AgentSampler, "_guides", lambda self, objects: [Forced(script, 400) for _ in objects])
    over = {"ppo.tools": "builtin", "ppo.max_rounds": 2, "ppo.max_new_tokens": 256, "model.max_seq_len": 1024,
            "ppo.rewards": "tool_call:1.0,finished:0.5", "train.eval_interval": 0}
    full = train(ppo_cfg(prompts_dir, tmp_path / "full", base_run, **over), quiet=True)
    steps = [r for r in read_metrics(tmp_path / "full") if "reward" in r]
    assert full.step == 4 and len(steps) == 4
    # every trajectory called (tool_call 1) and ran out of rounds (finished 0); both replies are its tokens
    assert all(r["reward_tool_call"] == 1.0 and r["reward_finished"] == 0.0 for r in steps)
    assert all(r["truncated"] == 0.0 and r["completion_len"] >= 2 * (len(script) - 1) for r in steps)
    train(ppo_cfg(prompts_dir, tmp_path / "part", base_run, **{**over, "train.max_steps": 2}), quiet=True)
    train(ppo_cfg(prompts_dir, tmp_path / "part", base_run, **over), resume=True, quiet=True)
    assert same_weights(tmp_path / "full", tmp_path / "part")
