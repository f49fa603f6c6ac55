"""The MoE layer: dense equivalence, routing weights, the balance loss by hand, dispatch vs a per-token loop."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanolm.config import ModelConfig
from nanolm.model.lora import apply_lora
from nanolm.model.moe import (MoE, collect_aux_loss, collect_expert_load, load_balancing_loss, moe_param_counts,
                              route)
from nanolm.model.transformer import MLP


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.silu(x @ gate.T) * (x @ up.T) @ down.T


def naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer written one token at a time, shared experts as n_shared separate SwiGLUs of width n_hidden."""
    B, T, C = x.shape
    h = moe.n_hidden
    ys = []
    for t in x.reshape(B * T, C):
        probs = (moe.gate.weight @ t).softmax(-1)
        chosen = sorted(range(moe.n_experts), key=lambda e: -probs[e].item())[:moe.top_k]
        w = probs[chosen]
        if moe.norm_topk:
            w = w / w.sum()
        y = torch.zeros(C)
        for wi, e in zip(w, chosen):
            ex = moe.experts[e]
            y = y + wi * swiglu(t, ex.gate_proj.weight, ex.up_proj.weight, ex.down_proj.weight)
        if moe.shared_expert is not None:
            sh = moe.shared_expert
            shared = sum(swiglu(t, sh.gate_proj.weight[j * h:(j + 1) * h], sh.up_proj.weight[j * h:(j + 1) * h],
                                sh.down_proj.weight[:, j * h:(j + 1) * h]) for j in range(moe.n_shared_experts))
            if moe.shared_expert_gate is not None:
                shared = torch.sigmoid(moe.shared_expert_gate.weight @ t) * shared
            y = y + shared
        ys.append(y)
    return torch.stack(ys).view(B, T, C)


@pytest.mark.parametrize("norm_topk", [True, False])
def test_one_expert_top1_equals_dense_mlp(norm_topk):
    torch.manual_seed(0)
    dense = MLP(ModelConfig(vocab_size=16, d_model=16, n_head=2, n_kv_head=2, n_hidden=48))
    moe = MoE(16, 48, n_experts=1, top_k=1, norm_topk=norm_topk)
    moe.experts[0].load_state_dict(dense.state_dict())
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(moe(x), dense(x), rtol=0, atol=0)


def test_balance_loss_on_hand_computed_routing():
    # Four tokens x = e_t and router weight W[e, t] = log p[t, e], so token t's router probabilities are p[t].
    p = torch.tensor([[0.50, 0.30, 0.10, 0.10],   # top-2: experts 0, 1
                      [0.60, 0.20, 0.10, 0.10],   # 0, 1
                      [0.10, 0.20, 0.30, 0.40],   # 3, 2
                      [0.40, 0.35, 0.15, 0.10]])  # 0, 1
    moe = MoE(4, 8, n_experts=4, top_k=2)
    with torch.no_grad():
        moe.gate.weight.copy_(p.log().T)
    moe(torch.eye(4).unsqueeze(0))
    # f = [3, 3, 1, 1] / 8 assignments; P = column means = [0.4, 0.2625, 0.1625, 0.175].
    torch.testing.assert_close(moe.expert_load, torch.tensor([0.375, 0.375, 0.125, 0.125]))
    want = 4 * (0.375 * 0.4 + 0.375 * 0.2625 + 0.125 * 0.1625 + 0.125 * 0.175)
    assert want == pytest.approx(1.1625)
    torch.testing.assert_close(moe.aux_loss, torch.tensor(want))
    assert moe.aux_loss.requires_grad

    weights, experts, _ = route(p.log(), top_k=2, norm_topk=True)
    assert experts.tolist() == [[0, 1], [0, 1], [3, 2], [0, 1]]
    torch.testing.assert_close(weights[0], torch.tensor([0.625, 0.375]))


def test_balance_loss_is_one_when_routing_is_uniform():
    probs = torch.full((8, 4), 0.25)
    experts = torch.tensor([[0, 1], [2, 3]] * 4)
    aux, load = load_balancing_loss(probs, experts)
    assert aux.item() == pytest.approx(1.0)
    assert load.tolist() == [0.25] * 4


def test_routing_weights_are_normalised_top_k_probabilities():
    torch.manual_seed(0)
    logits = torch.randn(64, 8)
    weights, experts, probs = route(logits, top_k=3, norm_topk=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(64))
    raw, _, _ = route(logits, top_k=3, norm_topk=False)
    torch.testing.assert_close(raw, probs.gather(-1, experts))
    assert (raw.sum(-1) < 1).all()
    # The chosen experts are the k most probable ones.
    third_largest = probs.sort(-1).values[:, -3]
    assert (probs.gather(-1, experts).min(-1).values >= third_largest).all()


@pytest.mark.parametrize("n_shared,shared_gate,norm_topk", [(0, False, True), (2, False, True), (2, True, False)])
def test_vectorised_dispatch_equals_per_token_loop(n_shared, shared_gate, norm_topk):
    torch.manual_seed(0)
    moe = MoE(16, 24, n_experts=4, top_k=2, n_shared_experts=n_shared, norm_topk=norm_topk, shared_gate=shared_gate)
    x = torch.randn(3, 7, 16)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), naive_moe(moe, x), rtol=1e-5, atol=1e-5)


def test_token_output_does_not_depend_on_the_rest_of_the_batch():
    torch.manual_seed(0)
    moe = MoE(16, 24, n_experts=4, top_k=2, n_shared_experts=1)
    x = torch.randn(4, 9, 16)
    with torch.no_grad():
        full = moe(x)
        torch.testing.assert_close(moe(x[1:2, 3:5]), full[1:2, 3:5], rtol=1e-5, atol=1e-6)


def test_gradients_reach_router_and_experts_and_idle_experts_get_zero_grads():
    torch.manual_seed(0)
    moe = MoE(8, 16, n_experts=4, top_k=2, n_shared_experts=1)
    with torch.no_grad():
        # Positive inputs; expert e < 3 scores x[e] >= 0, expert 3 scores -sum(x) < 0, so it is never in the top 2.
        moe.gate.weight.copy_(torch.cat([torch.eye(3, 8), -torch.ones(1, 8)]))
    x = torch.rand(2, 6, 8)
    y = moe(x)
    assert (moe.expert_load[:3] > 0).all() and moe.expert_load[3].item() == 0
    (y.square().sum() + collect_aux_loss(moe)).backward()
    assert (moe.gate.weight.grad.abs().sum(-1) > 0).all()  # row 3 through the balance loss
    for e in range(3):
        assert all(p.grad.abs().sum() > 0 for p in moe.experts[e].parameters())
    assert all(p.grad is not None and torch.equal(p.grad, torch.zeros_like(p)) for p in moe.experts[3].parameters())
    assert all(p.grad.abs().sum() > 0 for p in moe.shared_expert.parameters())


def test_collectors_walk_every_moe_layer():
    torch.manual_seed(0)
    model = nn.Sequential(MoE(8, 16, 4, 2), nn.Linear(8, 8), MoE(8, 16, 6, 1, n_shared_experts=1))
    with pytest.raises(RuntimeError, match="run the model's forward"):
        collect_aux_loss(model)
    model(torch.randn(2, 5, 8))
    loads = collect_expert_load(model)
    assert [tuple(l.shape) for l in loads] == [(4,), (6,)]
    for load in loads:
        assert not load.requires_grad
        assert load.sum().item() == pytest.approx(1.0)
    torch.testing.assert_close(collect_aux_loss(model), model[0].aux_loss + model[2].aux_loss)
    assert collect_aux_loss(nn.Linear(2, 2)).item() == 0.0


def test_param_counts_total_and_active():
    # expert = 3*8*16 = 384; router 8*4 = 32; one shared expert 384; shared gate 8.
    assert moe_param_counts(8, 16, 4, 2, 1) == {"total": 4 * 384 + 32 + 384, "active": 2 * 384 + 32 + 384}
    assert moe_param_counts(8, 16, 4, 2, 1, shared_gate=True)["active"] == 2 * 384 + 32 + 384 + 8
    for kw in (dict(n_shared_experts=0), dict(n_shared_experts=2, shared_gate=True)):
        moe = MoE(8, 16, 4, 2, **kw)
        assert moe.param_counts()["total"] == sum(p.numel() for p in moe.parameters())


def test_lora_targets_experts_by_name_but_not_the_router():
    moe = MoE(8, 16, 2, 1, n_shared_experts=1)
    wrapped = apply_lora(moe, rank=2, alpha=4.0, dropout=0.0, targets=("gate_proj", "up_proj", "down_proj"))
    assert sorted(wrapped) == sorted(f"{m}.{p}" for m in ("experts.0", "experts.1", "shared_expert")
                                     for p in ("gate_proj", "up_proj", "down_proj"))
    assert isinstance(moe.gate, nn.Linear)


def test_invalid_settings_are_refused():
    with pytest.raises(ValueError, match="top_k"):
        MoE(8, 16, n_experts=2, top_k=3)
    with pytest.raises(ValueError, match="shared_gate"):
        MoE(8, 16, n_experts=2, top_k=1, shared_gate=True)
    assert math.isclose(moe_param_counts(8, 16, 1, 1)["total"], 3 * 8 * 16 + 8)
