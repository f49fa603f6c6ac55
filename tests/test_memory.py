"""Will a run fit: the memory estimate's exact parts, its activation floor against what autograd really saves,
and the refusal at start-up."""

from __future__ import annotations

import pytest
import torch

from nanolm.errors import UserError
from nanolm.model import lora
from nanolm.model.transformer import Transformer
from nanolm.train import memory
from nanolm.train.trainer import train
from test_train import tiny_cfg

CPU = torch.device("cpu")


def n_params(model: torch.nn.Module, trained_only: bool = False) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()
               if p.requires_grad or not trained_only)


def test_the_exact_parts_of_a_full_and_a_lora_run(data_dir, tmp_path):
    cfg = tiny_cfg(data_dir, tmp_path / "run")
    P = n_params(Transformer(cfg.model))
    est = memory.estimate(cfg, CPU, torch.float32)
    assert (est.loaded, est.kept, est.states, est.copies) == (4 * P, 4 * P, 4 * 3 * P, 0)  # AdamW: grad + 2 moments

    lcfg = tiny_cfg(data_dir, tmp_path / "lora", **{"train.stage": "lora", "train.init_from": str(tmp_path),
                                                     "lora.rank": 4})
    model = Transformer(lcfg.model)
    lora.apply_lora(model, 4, lcfg.lora.alpha, 0.0, lcfg.lora.targets)
    lora.mark_only_lora_as_trainable(model)
    total, trained = n_params(model), n_params(model, trained_only=True)
    est = memory.estimate(lcfg, CPU, torch.float32)
    assert (est.loaded, est.kept, est.states) == (4 * total, 4 * total, 12 * trained)
    bf16 = memory.estimate(lcfg, CPU, torch.bfloat16)  # lora.base_dtype auto: the frozen matrices in bf16
    frozen = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()
                 if p.dim() == 2 and not p.requires_grad)
    assert bf16.kept == 4 * total - 2 * frozen and bf16.activations == est.activations // 2


def test_distillation_counts_its_teacher_at_the_teachers_own_size(data_dir, tmp_path):
    """The frozen teacher Distill.objective loads, of any size (its own model config), in float32."""
    from nanolm.checkpoint import save_checkpoint
    from nanolm.train.configure import load_config
    tcfg = load_config("tiny", overrides={"model.vocab_size": 96, "model.d_model": 48, "model.n_layer": 1,
                                          "model.n_head": 2, "model.n_kv_head": 1, "model.max_seq_len": 16,
                                          "train.seq_len": 16})
    teacher = Transformer(tcfg.model)
    # embedding 96x48 (tied head), q and o 48x48, k and v 24x48, the MLP 3 x 128x48, three norms of 48
    assert n_params(teacher) == 4608 + 2 * 2304 + 2 * 1152 + 3 * 6144 + 3 * 48 == 30096
    src = save_checkpoint(tmp_path / "teacher", 1, teacher, None, tcfg, {})
    plain = memory.estimate(tiny_cfg(data_dir, tmp_path / "run"), CPU, torch.float32)
    cfg = tiny_cfg(data_dir, tmp_path / "run", **{"train.stage": "distill", "distill.teacher": str(src)})
    est = memory.estimate(cfg, CPU, torch.float32)
    assert est.copies == 4 * 30096 == 120384
    assert est.per_process - plain.per_process == 120384  # the teacher is all it adds
    assert "reference/teacher/rollout copies 0.00" in est.describe()


def test_the_activation_floor_is_below_what_autograd_saves(data_dir, tmp_path):
    """The estimate is a lower bound: the tensors a forward really saves for backward weigh more."""
    for over in ({}, {"model.n_kv_head": 1, "train.batch_size": 3}, {"train.activation_checkpointing": "true"}):
        cfg = tiny_cfg(data_dir, tmp_path / "run", **over)
        model = Transformer(cfg.model).train()
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x, targets=x)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        really = sum(n for ptr, n in saved.items() if ptr not in params)
        floor = memory.estimate(cfg, CPU, torch.float32).activations
        assert 0 < floor <= really, over


def test_a_run_that_cannot_fit_stops_at_start_up_with_the_fix(data_dir, tmp_path, monkeypatch):
    cfg = tiny_cfg(data_dir, tmp_path / "run")
    need = memory.estimate(cfg, CPU, torch.float32).total
    assert memory.check_fit(cfg, CPU, torch.float32, free=need).startswith("memory: needs at least")
    with pytest.raises(UserError, match=r"this run will not fit in memory: it needs at least .* GiB \(weights .*"
                                        r"activations >= .*\), and .* GiB is free on cpu; try .*a smaller model"):
        memory.check_fit(cfg, CPU, torch.float32, free=need - 1)
    # two torchrun ranks on one CPU share its memory
    assert memory.estimate(cfg, CPU, torch.float32, world_size=2).total == 2 * need

    monkeypatch.setattr(memory, "available", lambda device: 1 << 16)
    with pytest.raises(UserError, match="this run will not fit in memory"):
        train(cfg, quiet=True)
    assert not (tmp_path / "run").exists()  # nothing written


def test_the_fixes_offered_follow_the_run(data_dir, tmp_path):
    big_batch = tiny_cfg(data_dir, tmp_path / "a", **{"train.batch_size": 64, "train.stage": "sft",
                                                      "train.init_from": str(tmp_path)})
    with pytest.raises(UserError) as e:
        memory.check_fit(big_batch, CPU, torch.float32, free=1)
    msg = str(e.value)
    assert "--train.batch_size 32 --train.grad_accum 2" in msg and "--train.activation_checkpointing true" in msg
    assert "--stage lora" in msg and "\n" not in msg
    lcfg = tiny_cfg(data_dir, tmp_path / "b", **{"train.stage": "lora", "train.init_from": str(tmp_path)})
    with pytest.raises(UserError, match=r"--lora.base_dtype bfloat16"):
        memory.check_fit(lcfg, CPU, torch.float32, free=1)


def test_free_memory_is_read_on_this_machine():
    free = memory.available(CPU)
    assert free is None or free > 0
