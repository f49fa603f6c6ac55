"""The training loop end to end on a tiny model: learning, exact resume, checkpoints, budgets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nanolm.config import load_config
from nanolm.errors import UserError
from nanolm.train import checkpoint as ckpt
from nanolm.train.loop import train
from nanolm.train.metrics import measured_matmul_flops


def tiny_cfg(data_dir: Path, out: Path, **over):
    base = {"data.path": str(data_dir), "train.out_dir": str(out), "model.vocab_size": 400,
            "model.d_model": 32, "model.n_layer": 2, "model.n_head": 4, "model.n_kv_head": 2,
            "model.max_seq_len": 32, "train.seq_len": 32, "train.batch_size": 4, "train.max_steps": 20,
            "train.log_interval": 1, "train.eval_interval": 5, "train.eval_batches": 2,
            "train.save_interval": 5, "optim.warmup_steps": 3, "optim.lr": 3e-3, "optim.min_lr": 3e-4,
            "model.dropout": 0.1}  # dropout makes the RNG state part of what a resume must restore
    base.update(over)
    return load_config("tiny", overrides=base)


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_loss_falls_and_artefacts_are_written(data_dir, tmp_path):
    res = train(tiny_cfg(data_dir, tmp_path / "run", **{"train.max_steps": 40, "model.dropout": 0.0}), quiet=True)
    assert res.step == 40 and res.stop_reason == "max_steps"
    losses = [res.train_losses[s] for s in sorted(res.train_losses)]
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0  # tiny model on repetitive text learns fast
    run = tmp_path / "run"
    assert json.loads((run / "config.json").read_text())["model"]["d_model"] == 32
    recs = read_metrics(run)
    train_recs = [r for r in recs if "loss" in r]
    assert [r["step"] for r in train_recs] == list(range(1, 41))
    assert all({"lr", "grad_norm", "tokens_per_s", "mfu"} <= r.keys() for r in train_recs)
    vals = [r for r in recs if "val_loss" in r]
    assert vals and all(r["val_bpb"] > 0 for r in vals)
    last = ckpt.resolve_checkpoint(run, "last")
    assert last.name == "step-00000040"
    assert {p.name for p in last.iterdir()} >= {"model.safetensors", "config.json", "state.json", "optimizer.pt",
                                                "tokenizer.json", "tokenizer_config.json"}
    # keep_last=2 plus the best one
    assert len(ckpt.step_dirs(run)) <= 3


def test_interrupted_and_resumed_equals_uninterrupted(data_dir, tmp_path):
    full = train(tiny_cfg(data_dir, tmp_path / "full"), quiet=True)
    # Same config, but a token budget stops it after 10 of the 20 steps (the schedule still spans 20).
    part = train(tiny_cfg(data_dir, tmp_path / "part", **{"train.max_tokens": 10 * 4 * 32}), quiet=True)
    assert part.step == 10 and part.stop_reason == "max_tokens"
    measured_matmul_flops.cache_clear()  # as in a new process, where the MFU peak is measured again
    resumed = train(tiny_cfg(data_dir, tmp_path / "part"), resume=True, quiet=True)
    assert resumed.step == 20
    assert resumed.train_losses == {s: full.train_losses[s] for s in range(11, 21)}
    a = ckpt.load_model(tmp_path / "full", "last")[0].state_dict()
    b = ckpt.load_model(tmp_path / "part", "last")[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # metrics.jsonl of the resumed run reads as one run: each step once
    steps = [r["step"] for r in read_metrics(tmp_path / "part") if "loss" in r]
    assert steps == list(range(1, 21))
    # and each evaluation once: the stop right after step 10's evaluation does not evaluate again
    assert [r["step"] for r in read_metrics(tmp_path / "part") if "val_loss" in r] == [5, 10, 15, 20]


def test_resume_from_an_older_checkpoint_after_a_crash(data_dir, tmp_path):
    """A crash after step 10's save loses steps 11..; resuming redoes them identically."""
    full = train(tiny_cfg(data_dir, tmp_path / "full"), quiet=True)
    run = tmp_path / "run"
    train(tiny_cfg(data_dir, run, **{"train.max_tokens": 13 * 4 * 32, "train.keep_last": 5}), quiet=True)
    # simulate a crash at step 13: only checkpoints up to step 10 exist, and a half-written temp dir
    for d in ckpt.step_dirs(run):
        if d.name > "step-00000010":
            import shutil
            shutil.rmtree(d)
    (run / "checkpoints" / ".tmp-step-00000015-999").mkdir()
    res = train(tiny_cfg(data_dir, run), resume=True, quiet=True)
    assert res.train_losses == {s: full.train_losses[s] for s in range(11, 21)}


def test_corrupt_checkpoint_gives_a_clear_error(data_dir, tmp_path):
    run = tmp_path / "run"
    train(tiny_cfg(data_dir, run, **{"train.max_steps": 5}), quiet=True)
    last = ckpt.resolve_checkpoint(run, "last")
    weights = last / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(UserError, match=r"model\.safetensors: corrupt or truncated weights"):
        ckpt.load_model(run, "last")


def test_mismatched_checkpoint_gives_a_clear_error(data_dir, tmp_path):
    run = tmp_path / "run"
    train(tiny_cfg(data_dir, run, **{"train.max_steps": 5}), quiet=True)
    from nanolm.model.transformer import Transformer
    other = Transformer(tiny_cfg(data_dir, run, **{"model.d_model": 64}).model)
    with pytest.raises(UserError) as e:
        ckpt.load_weights(other, ckpt.resolve_checkpoint(run))
    msg = str(e.value)
    assert "checkpoint does not match the model config" in msg and "shape mismatch" in msg
    assert "embed_tokens.weight (400, 32) vs model (400, 64)" in msg
    # resuming with another model config is refused before anything is overwritten
    with pytest.raises(UserError, match="the checkpoint's model config differs"):
        train(tiny_cfg(data_dir, run, **{"model.n_layer": 3}), resume=True, quiet=True)


def test_init_from_and_missing_inputs(data_dir, tmp_path):
    src = tmp_path / "src"
    train(tiny_cfg(data_dir, src, **{"train.max_steps": 5}), quiet=True)
    cfg = tiny_cfg(data_dir, tmp_path / "dst", **{"train.init_from": str(src), "train.max_steps": 1,
                                                    "optim.lr": 1e-9, "optim.min_lr": 0.0})
    train(cfg, quiet=True)
    a = ckpt.load_model(src, "last")[0].state_dict()
    b = ckpt.load_model(tmp_path / "dst", "last")[0].state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    with pytest.raises(UserError, match="nothing to resume"):
        train(tiny_cfg(data_dir, tmp_path / "empty"), resume=True, quiet=True)
    with pytest.raises(UserError, match="model.vocab_size is 100; set --model.vocab_size 400"):
        train(tiny_cfg(data_dir, tmp_path / "v", **{"model.vocab_size": 100}), quiet=True)


def test_failed_save_keeps_previous_checkpoint(data_dir, tmp_path, monkeypatch):
    run = tmp_path / "run"
    train(tiny_cfg(data_dir, run, **{"train.max_steps": 5}), quiet=True)
    before = ckpt.resolve_checkpoint(run, "last")
    good = (before / "model.safetensors").read_bytes()

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ckpt, "save_file", full_disk)
    with pytest.raises(UserError, match=r"could not write checkpoint \(model\.safetensors: No space left on device\); "
                                        r"about [\d.]+ MiB needed, [\d.]+ MiB free on that disk"):
        train(tiny_cfg(data_dir, run, **{"train.max_steps": 10}), resume=True, quiet=True)
    assert ckpt.resolve_checkpoint(run, "last") == before
    assert (before / "model.safetensors").read_bytes() == good
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp")]


MOE = {"model.use_moe": "true", "model.n_experts": 4, "model.top_k": 2, "model.n_shared_experts": 1,
       "model.moe_n_hidden": 32, "model.dropout": 0.0}


def test_moe_model_trains_and_logs_aux_loss_and_expert_load(data_dir, tmp_path):
    res = train(tiny_cfg(data_dir, tmp_path / "moe", **MOE, **{"train.max_steps": 40}), quiet=True)
    losses = [res.train_losses[s] for s in sorted(res.train_losses)]
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    recs = [r for r in read_metrics(tmp_path / "moe") if "loss" in r]
    assert all(0.9 < r["aux_loss"] < 4 for r in recs)  # about 1 when balanced, n_experts when collapsed
    loads = recs[-1]["expert_load"]
    assert len(loads) == 2 and all(len(layer) == 4 and abs(sum(layer) - 1) < 1e-5 for layer in loads)


def test_moe_resume_is_exact(data_dir, tmp_path):
    full = train(tiny_cfg(data_dir, tmp_path / "full", **MOE), quiet=True)
    train(tiny_cfg(data_dir, tmp_path / "part", **MOE, **{"train.max_tokens": 10 * 4 * 32}), quiet=True)
    resumed = train(tiny_cfg(data_dir, tmp_path / "part", **MOE), resume=True, quiet=True)
    assert resumed.train_losses == {s: full.train_losses[s] for s in range(11, 21)}


def test_moe_parameter_report(tmp_path):
    from nanolm.config import preset
    from nanolm.model.transformer import Transformer, count_params, flops_per_token
    dense, moe = preset("minimind-26m").model, preset("minimind-26m-moe").model
    p = count_params(Transformer(moe))
    assert p["active"] == count_params(Transformer(dense))["total"] + 8 * 8 * 512  # + the routers
    assert p["total"] > 3 * p["active"]
    assert flops_per_token(moe, 512) - flops_per_token(dense, 512) == 6 * 8 * 8 * 512  # router matmuls only


def test_activation_checkpointing_and_attention_kernel_leave_the_losses_unchanged(data_dir, tmp_path):
    over = {"train.max_steps": 6, "train.eval_interval": 3}
    plain = train(tiny_cfg(data_dir, tmp_path / "plain", **over), quiet=True)
    # Recomputing each block in backward (dropout included: its RNG state is replayed) gives the same steps.
    recomputed = train(tiny_cfg(data_dir, tmp_path / "ac", **over, **{"train.activation_checkpointing": True}),
                       quiet=True)
    math_kernel = train(tiny_cfg(data_dir, tmp_path / "math", **over, **{"train.sdpa_backend": "math"}), quiet=True)
    for s in plain.train_losses:
        assert recomputed.train_losses[s] == pytest.approx(plain.train_losses[s], rel=1e-5)
        assert math_kernel.train_losses[s] == pytest.approx(plain.train_losses[s], rel=1e-4)
    # The checkpoint keeps the model's own names: it loads into a plain model.
    model, _, _ = ckpt.load_model(tmp_path / "ac", "last")
    assert "layers.0.self_attn.q_proj.weight" in model.state_dict()
    assert recomputed.best_val_loss == pytest.approx(plain.best_val_loss, rel=1e-5)


def test_an_attention_kernel_the_device_lacks_stops_at_start(data_dir, tmp_path):
    with pytest.raises(UserError, match=r"train.sdpa_backend=efficient: PyTorch has no efficient attention kernel "
                                        r"for cpu in float32; use --train.sdpa_backend auto"):
        train(tiny_cfg(data_dir, tmp_path / "run", **{"train.sdpa_backend": "efficient"}), quiet=True)
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.slow
def test_compiled_training_takes_the_steps_of_eager_training(data_dir, tmp_path):
    over = {"train.max_steps": 4, "model.dropout": 0.0, "train.eval_interval": 0}
    eager = train(tiny_cfg(data_dir, tmp_path / "eager", **over), quiet=True)
    compiled = train(tiny_cfg(data_dir, tmp_path / "compiled", **over, **{"train.compile": True}), quiet=True)
    for s in eager.train_losses:
        assert compiled.train_losses[s] == pytest.approx(eager.train_losses[s], rel=1e-5)
