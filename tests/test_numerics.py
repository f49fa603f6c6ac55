"""Non-finite losses and gradients: skipped and counted, a stop after too many in a row with the layer named,
and never a checkpoint with NaN weights."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from nanolm.errors import UserError
from nanolm.io import crc32_of
from nanolm import checkpoint as ckpt
from nanolm.train import trainer
from nanolm.train.trainer import train
from nanolm.train.numerics import locate_nonfinite, weights_are_finite
from nanolm.train.objectives import LMObjective, Loss
from test_train import read_metrics, tiny_cfg

OVER = {"train.max_steps": 8, "train.save_interval": 2, "train.keep_last": 10, "train.eval_interval": 0}


def weights(run, step):
    return load_file(str(run / "checkpoints" / f"step-{step:08d}" / "model.safetensors"))


def test_nonfinite_steps_are_skipped_counted_and_the_run_goes_on(data_dir, tmp_path, monkeypatch):
    accum = 2
    poisoned = {3, 4}  # optimizer steps whose loss turns NaN
    calls = {"n": 0, "replaying": False}  # training micro-batches so far; whether a bad step is being replayed
    original, original_replay = LMObjective.__call__, trainer.Trainer._replay

    def replay(self, *args):
        calls["replaying"] = True
        try:
            return original_replay(self, *args)
        finally:
            calls["replaying"] = False

    def nan_on_some_steps(self, model, batch):
        loss = original(self, model, batch)
        if not calls["replaying"]:
            calls["n"] += 1
        if model.training and (calls["n"] - 1) // accum + 1 in poisoned:
            loss = Loss(loss.total * float("nan"), {**loss.sums, "loss": loss.sums["loss"] * float("nan")})
        return loss

    monkeypatch.setattr(LMObjective, "__call__", nan_on_some_steps)
    monkeypatch.setattr(trainer.Trainer, "_replay", replay)
    run = tmp_path / "run"
    res = train(tiny_cfg(data_dir, run, **OVER, **{"train.grad_accum": accum}), quiet=True)
    assert res.step == 8 and res.stop_reason == "max_steps"
    events = [r for r in read_metrics(run) if r.get("event") == "nonfinite"]
    assert [(e["step"], e["in_a_row"], e["total"]) for e in events] == [(3, 1, 1), (4, 2, 2)]
    assert events[0]["loss"] == "nan" and "where" in events[0]
    # The skipped steps left the weights as they were after step 2; training went on after them.
    before, after = weights(run, 2), weights(run, 4)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not all(torch.equal(after[k], weights(run, 6)[k]) for k in after)
    assert all(torch.isfinite(t).all() for t in weights(run, 8).values())
    assert all(v == v for s, v in res.train_losses.items() if s not in poisoned)  # finite elsewhere


def test_a_layer_that_overflows_stops_the_run_and_is_named(data_dir, tmp_path):
    base = train(tiny_cfg(data_dir, tmp_path / "base", **{**OVER, "train.max_steps": 2}), quiet=True)
    bad = ckpt.resolve_checkpoint(tmp_path / "base")
    tensors = load_file(str(bad / "model.safetensors"))
    # Finite weights whose products overflow: inf first appears in the output of layers.1.mlp.down_proj.
    tensors["layers.1.mlp.up_proj.weight"].fill_(1e30)
    tensors["layers.1.mlp.down_proj.weight"].fill_(3e38)
    save_file(tensors, str(bad / "model.safetensors"))
    state = json.loads((bad / "state.json").read_text())  # the checkpoint holds these weights: its checksum too
    state["checksums"]["model.safetensors"] = crc32_of(bad / "model.safetensors")
    (bad / "state.json").write_text(json.dumps(state))
    assert base.step == 2
    run = tmp_path / "run"
    with pytest.raises(UserError) as e:
        train(tiny_cfg(data_dir, run, **OVER, **{"train.init_from": str(bad), "model.dropout": 0.0}), quiet=True)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("stopped: 3 steps in a row had a NaN/inf loss or gradient (first at step 1, forward: "
                          "first non-finite output in layers.1.mlp.down_proj)")
    assert "lower optim.lr" in msg and "--resume" in msg
    # The checkpoint it left holds the weights it started from: the updates were skipped.
    saved = weights(run, 3)
    assert all(torch.equal(saved[k], tensors[k]) for k in saved)
    stop = [r for r in read_metrics(run) if r.get("event") == "stop"]
    assert stop[-1]["reason"] == "nonfinite"


def test_nan_weights_are_never_saved(data_dir, tmp_path, monkeypatch):
    real = trainer.build_optimizer

    def poisoning_optimizer(model, cfg, device):
        opt = real(model, cfg, device)
        step = opt.step

        def poisoned_step(*a, **kw):
            out = step(*a, **kw)
            if opt.state[next(iter(opt.state))]["step"] >= 3:
                with torch.no_grad():
                    next(model.parameters()).view(-1)[0] = float("nan")
            return out
        opt.step = poisoned_step
        return opt

    monkeypatch.setattr(trainer, "build_optimizer", poisoning_optimizer)
    run = tmp_path / "run"
    with pytest.raises(UserError, match=r"^step 4: the weights hold NaN or inf values, so no checkpoint was "
                                        r"written; the previous checkpoints are untouched"):
        train(tiny_cfg(data_dir, run, **OVER), quiet=True)
    assert [p.name for p in ckpt.step_dirs(run)] == ["step-00000002"]
    assert all(torch.isfinite(t).all() for t in weights(run, 2).values())


class _Sqrt(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(min=0).sqrt()  # finite at 0, but its gradient there is inf


def test_locate_names_the_forward_or_backward_culprit():
    model = nn.Sequential(nn.Linear(4, 4), _Sqrt(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()  # the first layer outputs 0: sqrt'(0) = inf in backward
    x = torch.ones(2, 4)

    def replay():
        loss = model(x).sum()
        loss.backward()
        return [loss.detach()]

    assert locate_nonfinite(model, replay) == "backward: first non-finite gradient from 1"
    model.zero_grad()
    with torch.no_grad():
        model[2].weight.fill_(float("inf"))
    assert locate_nonfinite(model, replay) == "forward: first non-finite output in 2"
    assert not weights_are_finite(model)
    with torch.no_grad():
        model[2].weight.fill_(1.0)
    assert weights_are_finite(model)
