"""Mixture-of-experts feed-forward layer: routed + shared SwiGLU experts, load-balancing loss.

`MoE` replaces a block's dense SwiGLU `mlp`. Each token's hidden state goes to
a linear router (`gate`), a softmax over the experts picks its `top_k`
routed experts, their outputs are summed weighted by the (optionally
renormalised) router probabilities, and the shared expert, which every token
uses, is added. Routing is dropless: there is no capacity factor, every token
is processed by all of its k experts, so a token's output never depends on
the other tokens in the batch (generation with a KV cache gives the same
result as a full forward).

Dispatch is vectorised: the (token, slot) assignments are sorted by expert,
the tokens gathered once, each expert runs once on its contiguous chunk (the
only Python loop is over experts), and the weighted outputs are scatter-added
back with `index_add`. Every expert runs even on zero tokens, so every expert
parameter gets a (zero) gradient and DDP never sees an unused parameter. The
per-expert counts are read on the host (`tolist`), one device sync per layer.

Module layout (names as in HuggingFace):

    gate                      nn.Linear(d_model, n_experts, bias=False)   the router
    experts.{i}.gate_proj     SwiGLU of width n_hidden, same names as the dense MLP
    experts.{i}.up_proj
    experts.{i}.down_proj
    shared_expert.{gate,up,down}_proj   one SwiGLU of width n_shared_experts * n_hidden
    shared_expert_gate        nn.Linear(d_model, 1, bias=False), only with shared_gate=True

The n_shared_experts shared experts are one MLP of their summed width:
sum_j down_j(silu(gate_j x) * up_j x) is exactly a SwiGLU whose gate/up rows
and down columns are the experts' concatenated, so one wide MLP computes the
same function with one matmul instead of n_shared (DeepSeek-V2/V3 store them
the same way, as `shared_experts`).

HuggingFace export targets (nanolm attention is Llama attention: no q/k/v
bias, rotate-half RoPE, and QK-norm only with model.qk_norm):
- Qwen2-MoE (`Qwen2MoeForCausalLM`), any setting: `mlp.gate`, `mlp.experts.{i}.*`,
  `mlp.shared_expert.*` map by name; config num_experts, num_experts_per_tok=top_k,
  moe_intermediate_size=n_hidden, shared_expert_intermediate_size=n_shared_experts*n_hidden,
  norm_topk_prob=norm_topk, decoder_sparse_step=1, qkv_bias=False (older transformers
  without qkv_bias: export zero q/k/v biases). Qwen2-MoE always multiplies the shared
  expert by sigmoid(shared_expert_gate(x)); with shared_gate=False export that gate's
  weight as zeros (sigmoid(0) = 0.5 exactly) and the shared down_proj weight times 2,
  which is exact in floating point (scaling by powers of two). With n_shared_experts=0,
  export a shared expert of width 1 with a zero down_proj.
- Mixtral (`MixtralForCausalLM`), when n_shared_experts=0 and norm_topk=True: softmax
  over the top-k logits equals renormalised top-k softmax probabilities; keys become
  `block_sparse_moe.gate`, `block_sparse_moe.experts.{i}.w1` (gate_proj), `w3` (up_proj),
  `w2` (down_proj).
- Qwen3-MoE (`Qwen3MoeForCausalLM`), for models with QK-norm and n_shared_experts=0:
  Qwen2-MoE's routing and expert names without the shared expert, and Qwen3's QK-norm
  attention (nanolm/export/hf.py).
Recent transformers versions fuse expert weights into 3-D tensors in memory but
still read and write per-expert keys in checkpoints.

Load-balancing loss (Switch Transformer / DeepSeek-V2 expert-level balance):
aux = n_experts * sum_i f_i * P_i, with f_i the fraction of the N*k (token, slot)
assignments routed to expert i and P_i the mean router probability of expert i
over the N tokens of the batch; it is 1 when routing is uniform and grows as it
concentrates. f is not differentiable; the gradient reaches the router through P.
HuggingFace's `load_balancing_loss_func` (Mixtral, Qwen-MoE) sums f over the k
slots instead of averaging, so its value is top_k times this one. The layer stores
the unscaled loss as `self.aux_loss` after every forward (also in eval mode, where
it is cheap and carries no graph under no_grad); the training loop multiplies the
sum over layers (`collect_aux_loss`) by its coefficient. Because the value is a
module attribute, it must be collected after each micro-batch's forward, before
the next forward overwrites it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): one expert, with the dense MLP's module names."""

    def __init__(self, d_model: int, n_hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, n_hidden, bias=False)
        self.up_proj = nn.Linear(d_model, n_hidden, bias=False)
        self.down_proj = nn.Linear(n_hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def route(logits: torch.Tensor, top_k: int, norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits (N, E) -> (weights (N, k), experts (N, k), probs (N, E)), all but experts in float32.

    probs is the softmax over all experts; weights are the top-k probabilities,
    divided by their sum when norm_topk so that each token's weights sum to 1.
    """
    probs = logits.float().softmax(dim=-1)  # float32 even under bf16 autocast, as HF's MoE routers do
    weights, experts = probs.topk(top_k, dim=-1)  # (N, k), largest first
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts, probs


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux, load): aux = E * sum_i f_i * P_i; load = f, the fraction of assignments per expert.

    probs: (N, E) router probabilities; experts: (N, k) chosen expert ids.
    """
    n_experts = probs.shape[-1]
    counts = torch.bincount(experts.reshape(-1), minlength=n_experts)  # (E,)
    load = counts.float() / experts.numel()  # f_i, sums to 1
    importance = probs.float().mean(dim=0)  # P_i, sums to 1
    return n_experts * (load * importance).sum(), load


class MoE(nn.Module):
    """Routed top-k SwiGLU experts plus optional shared expert; a drop-in for the dense MLP.

    x (B, T, C) -> y (B, T, C). After each forward, `aux_loss` holds the
    unscaled load-balancing loss (a scalar on the graph) and `expert_load` the
    detached fraction of assignments per expert (E,), for metrics.
    """

    def __init__(self, d_model: int, n_hidden: int, n_experts: int, top_k: int, n_shared_experts: int = 0,
                 norm_topk: bool = True, shared_gate: bool = False) -> None:
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={n_experts}], got {top_k}")
        if n_shared_experts < 0:
            raise ValueError(f"n_shared_experts must be >= 0, got {n_shared_experts}")
        if shared_gate and n_shared_experts == 0:
            raise ValueError("shared_gate needs n_shared_experts > 0")
        self.d_model, self.n_hidden = d_model, n_hidden
        self.n_experts, self.top_k, self.n_shared_experts = n_experts, top_k, n_shared_experts
        self.norm_topk = norm_topk
        self.gate = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(d_model, n_hidden) for _ in range(n_experts))
        self.shared_expert = SwiGLU(d_model, n_shared_experts * n_hidden) if n_shared_experts else None
        self.shared_expert_gate = nn.Linear(d_model, 1, bias=False) if shared_gate else None
        self.aux_loss: torch.Tensor | None = None
        self.expert_load: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        flat = x.reshape(B * T, C)  # (N, C)
        weights, experts, probs = route(self.gate(flat), self.top_k, self.norm_topk)  # (N, k), (N, k), (N, E)
        self.aux_loss, load = load_balancing_loss(probs, experts)
        self.expert_load = load.detach()

        # Sort the N*k assignments by expert so each expert's tokens are one contiguous chunk.
        order = experts.reshape(-1).argsort(stable=True)  # (N*k,)
        token = order // self.top_k  # (N*k,) the token of each sorted assignment
        counts = torch.bincount(experts.reshape(-1), minlength=self.n_experts).tolist()
        chunks = flat[token].split(counts)  # E tensors of (count_e, C)
        out = torch.cat([expert(chunk) for expert, chunk in zip(self.experts, chunks)])  # (N*k, C)
        out = out * weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        y = out.new_zeros(B * T, C).index_add(0, token, out)  # (N, C): adds each token's k outputs

        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            y = y + shared
        return y.view(B, T, C)

    def param_counts(self) -> dict[str, int]:
        """Total parameters of the layer and those used per token (see moe_param_counts)."""
        return moe_param_counts(self.d_model, self.n_hidden, self.n_experts, self.top_k, self.n_shared_experts,
                                self.shared_expert_gate is not None)


def moe_param_counts(d_model: int, n_hidden: int, n_experts: int, top_k: int, n_shared_experts: int = 0,
                     shared_gate: bool = False) -> dict[str, int]:
    """{"total", "active"} parameters of one MoE layer; active = those a token's forward multiplies by.

    A token uses the router, its top_k routed experts and the shared expert, so
    its forward matmul FLOPs are 2 * active (the top-k, softmax and scatter are
    not counted, as elementwise work is not elsewhere).
    """
    expert = 3 * d_model * n_hidden
    always = d_model * n_experts + n_shared_experts * expert + (d_model if shared_gate else 0)
    return {"total": n_experts * expert + always, "active": top_k * expert + always}


def moe_layers(model: nn.Module) -> list[MoE]:
    """The model's MoE layers, in module order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def collect_aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of the unscaled load-balancing losses of the model's MoE layers from the last forward.

    Summed over layers as in Switch/DeepSeek, so the loop's coefficient applies per layer.
    A model without MoE layers gives a zero scalar on its parameters' device.
    """
    layers = moe_layers(model)
    if not layers:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        return torch.zeros((), device=device)
    if any(m.aux_loss is None for m in layers):
        raise RuntimeError("collect_aux_loss: run the model's forward before collecting its MoE aux loss")
    return torch.stack([m.aux_loss for m in layers]).sum()


def collect_expert_load(model: nn.Module) -> list[torch.Tensor]:
    """Per MoE layer, the detached fraction of (token, slot) assignments per expert (E,) from the last forward."""
    layers = moe_layers(model)
    if any(m.expert_load is None for m in layers):
        raise RuntimeError("collect_expert_load: run the model's forward before collecting its MoE expert load")
    return [m.expert_load for m in layers]
