"""optim.name = "muon": which parameters Muon trains, the exact update of a step, grad accumulation, exact resume."""

from __future__ import annotations

import pytest
import torch

from nanolm import checkpoint as ckpt
from nanolm.config import ModelConfig, OptimConfig
from nanolm.errors import UserError
from nanolm.model.transformer import Transformer
from nanolm.train.optim import MuonAdamW, build_optimizer, is_hidden_matrix
from nanolm.train.schedule import lr_at
from nanolm.train.trainer import Trainer, train
from test_train import ONE_STEP, StepGradients, assert_close_all, same_weights, tiny_cfg

MUON = {"optim.name": "muon", "optim.muon_lr": 0.02}


def test_muon_trains_the_hidden_matrices_and_adamw_the_rest():
    model = Transformer(ModelConfig(vocab_size=64, d_model=32, n_layer=1, n_head=4, n_kv_head=2, use_moe=True,
                                    n_experts=2, top_k=1, tie_embeddings=False))
    muon = sorted(n for n, p in model.named_parameters() if is_hidden_matrix(n, p))
    assert muon == sorted(f"layers.0.{m}.weight" for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        *(f"mlp.{e}.{w}" for e in ("experts.0", "experts.1", "shared_expert")
          for w in ("gate_proj", "up_proj", "down_proj"))))
    opt = build_optimizer(model, OptimConfig(name="muon", lr=1e-3, muon_lr=0.02, weight_decay=0.1),
                          torch.device("cpu"))
    assert isinstance(opt, MuonAdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [(sorted(names[id(p)] for p in g["params"]), g["lr_scale"], g["weight_decay"]) for g in opt.param_groups]
    assert groups[0] == (muon, 20.0, pytest.approx(0.1 / 20))
    assert groups[1] == (sorted(["embed_tokens.weight", "lm_head.weight", "layers.0.mlp.gate.weight"]), 1.0, 0.1)
    assert groups[2] == (sorted(["layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight",
                                 "norm.weight"]), 1.0, 0.0)


def test_a_muon_step_is_torch_muon_on_the_matrices_and_adamw_on_the_rest(data_dir, tmp_path):
    """Trainer.train_step with optim.name muon over two micro-batches: exactly torch.optim.Muon (at muon_lr times the
    schedule's factor) on the blocks' matrices and AdamW on the rest, of the mean gradient of the two."""
    from nanolm.data.loader import Loader
    from nanolm.data.shards import PackedData
    cfg = tiny_cfg(data_dir, tmp_path / "run", **{**ONE_STEP, **MUON, "train.seq_len": 32, "train.batch_size": 2})
    trainer = Trainer(cfg, quiet=True)
    loader = Loader(PackedData(data_dir), 2, 32, seed=5)
    batches = [loader.next_batch() for _ in range(2)]
    ref = Transformer(cfg.model)
    ref.load_state_dict(trainer.model.state_dict())
    for b in batches:
        (ref(b.x, targets=b.y) / b.y.numel() / 2).backward()
    factor = lr_at(0, cfg.optim, cfg.train.max_steps) / cfg.optim.lr
    hidden = [p for n, p in ref.named_parameters() if is_hidden_matrix(n, p)]
    rest = [p for n, p in ref.named_parameters() if not is_hidden_matrix(n, p)]
    wd = cfg.optim.weight_decay
    torch.optim.Muon(hidden, lr=0.02 * factor, weight_decay=wd * cfg.optim.lr / 0.02, momentum=0.95,
                     nesterov=True).step()
    torch.optim.AdamW([{"params": [p for p in rest if p.dim() == 2], "weight_decay": wd},
                       {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                      lr=cfg.optim.lr * factor, betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps,
                      fused=True).step()
    before = trainer.model.state_dict()["layers.0.mlp.up_proj.weight"].clone()
    trainer.train_step(batches)
    after = trainer.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in ref.state_dict().items())
    assert not torch.equal(after["layers.0.mlp.up_proj.weight"], before)


def test_muon_under_grad_accumulation_takes_the_whole_batch_step(data_dir, tmp_path):
    """A step over 2 micro-batches of 2 hands the optimizer the gradient of one batch of 4 (to float rounding of
    the sum), at the same weights; the update of a given gradient is exact (the test above). The updated weights
    agree only to about 1% of the step: torch's Muon orthogonalises in bfloat16, which rounds the last bits of
    the two gradients apart."""
    one = {**ONE_STEP, **MUON, "train.seq_len": 32}
    with StepGradients() as whole:
        train(tiny_cfg(data_dir, tmp_path / "whole", **{**one, "train.batch_size": 4, "train.grad_accum": 1}),
              quiet=True)
    with StepGradients() as accum:
        train(tiny_cfg(data_dir, tmp_path / "accum", **{**one, "train.batch_size": 2, "train.grad_accum": 2}),
              quiet=True)
    # The hook sees MuonAdamW's step (every parameter), then the Muon and AdamW steps it makes.
    assert len(whole.steps) == len(accum.steps) == 3
    assert all(torch.equal(a, b) for a, b in zip(accum.steps[0][0], whole.steps[0][0]))
    assert max(g.abs().max().item() for g in accum.steps[0][1]) > 0
    assert_close_all(accum.steps[0][1], whole.steps[0][1])


def test_muon_resumes_exactly(data_dir, tmp_path):
    """20 steps equal 10, a resume from the checkpoint, and 10 more: the Muon momentum and AdamW moments are saved."""
    full = train(tiny_cfg(data_dir, tmp_path / "full", **MUON), quiet=True)
    part = train(tiny_cfg(data_dir, tmp_path / "part", **{**MUON, "train.max_tokens": 10 * 4 * 32}), quiet=True)
    assert part.step == 10
    resumed = train(tiny_cfg(data_dir, tmp_path / "part", **MUON), resume=True, quiet=True)
    assert resumed.step == 20
    assert resumed.train_losses == {s: full.train_losses[s] for s in range(11, 21)}
    assert same_weights(tmp_path / "full", tmp_path / "part")
    # The saved optimizer state holds Muon's momentum buffers and AdamW's moments, by parameter name.
    state = ckpt.read_optimizer(ckpt.resolve_checkpoint(tmp_path / "part", "last"))["state"]
    assert set(state["layers.0.self_attn.q_proj.weight"]) == {"momentum_buffer"}
    assert {"exp_avg", "exp_avg_sq"} <= set(state["embed_tokens.weight"])


def test_muon_refuses_fsdp_and_bad_settings(data_dir, tmp_path, monkeypatch):
    from nanolm.train import distributed
    # As rank 0 of two under torchrun: refused before any process group work (the check precedes the wrap).
    monkeypatch.setattr(distributed, "setup", lambda device: distributed.DistInfo(0, 0, 2, torch.device("cpu")))
    with pytest.raises(UserError, match="optim.name=muon orthogonalises each whole weight matrix, which "
                                        "train.parallel=fsdp shards"):
        Trainer(tiny_cfg(data_dir, tmp_path / "run", **{**MUON, "train.parallel": "fsdp", "train.grad_accum": 2}),
                quiet=True)
    with pytest.raises(UserError, match="optim.name must be one of adamw, muon"):
        OptimConfig(name="sgd")
    with pytest.raises(UserError, match="optim.muon_lr must be > 0"):
        OptimConfig(name="muon", muon_lr=0)


def test_fine_tuning_stages_divide_the_muon_rate_as_they_divide_lr():
    """A stage's smaller steps reach the Muon matrices too: at cpu-small's 0.02 the quickstart's GRPO had wrecked
    its model. The matrices' group gets muon_lr at the schedule's peak, and a rate given by the user wins."""
    from nanolm.train.configure import load_config
    base = load_config("cpu-small")
    assert base.optim.name == "muon"
    for stage in ("sft", "lora", "dpo", "grpo", "ppo"):
        cfg = load_config("cpu-small", overrides={"train.stage": stage})
        div = base.optim.lr / cfg.optim.lr
        assert div in (2, 10, 50)
        assert cfg.optim.muon_lr == pytest.approx(base.optim.muon_lr / div), stage
        opt = build_optimizer(Transformer(cfg.model), cfg.optim, torch.device("cpu"))
        assert opt.param_groups[0]["lr_scale"] * cfg.optim.lr == pytest.approx(base.optim.muon_lr / div)
    distill = load_config("cpu-small", overrides={"train.stage": "distill", "distill.teacher": "runs/t"})
    assert distill.optim.muon_lr == base.optim.muon_lr  # distillation trains like pretraining
    given = load_config("cpu-small", overrides={"train.stage": "grpo", "optim.muon_lr": 0.01})
    assert given.optim.muon_lr == 0.01
