"""The training loop end to end on a tiny model: learning, exact resume, checkpoints, budgets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from nanolm.train.configure import load_config
from nanolm.errors import UserError
from nanolm import checkpoint as ckpt
from nanolm.train.trainer import train
from nanolm.train.metrics import measured_matmul_flops


def tiny_cfg(data_dir: Path, out: Path, **over):
    base = {"data.path": str(data_dir), "train.out_dir": str(out), "model.vocab_size": 400,
            "model.d_model": 32, "model.n_layer": 2, "model.n_head": 4, "model.n_kv_head": 2,
            # the MLP width the tests' margins and file sizes were measured with (tiny's 384; d_model 32 alone
            # would give 128 now that the width follows d_model)
            "model.n_hidden": 384,
            "model.max_seq_len": 32, "train.seq_len": 32, "train.batch_size": 4, "train.max_steps": 20,
            "train.log_interval": 1, "train.eval_interval": 5, "train.eval_batches": 2,
            "train.save_interval": 5, "optim.warmup_steps": 3, "optim.lr": 3e-3, "optim.min_lr": 3e-4,
            "model.dropout": 0.1}  # dropout makes the RNG state part of what a resume must restore
    base.update(over)
    return load_config("tiny", overrides=base)


def same_weights(run_a: Path, run_b: Path) -> bool:
    """Whether the last checkpoints of two runs hold bit-identical weights."""
    a = ckpt.load_model(run_a, "last")[0].state_dict()
    b = ckpt.load_model(run_b, "last")[0].state_dict()
    return all(torch.equal(a[k], b[k]) for k in a)


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
    assert same_weights(tmp_path / "full", tmp_path / "part")
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
    model, _ = ckpt.load_model(tmp_path / "ac", "last")
    assert "layers.0.self_attn.q_proj.weight" in model.state_dict()
    assert recomputed.best_metric == plain.best_metric == "val_loss"
    assert recomputed.best_value == pytest.approx(plain.best_value, rel=1e-5)


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
    # The compiler's fallback (run uncompiled where it cannot compile) was scoped to the steps: training leaves
    # no process-wide setting behind.
    import torch._dynamo
    assert torch._dynamo.config.suppress_errors is False


# ----------------------------------------------------------------------------- a step is the gradient of its batch

class StepGradients:
    """Records what each optimizer step applies: the weights and the gradients at the moment of the update, in
    the optimizer's parameter order (nanolm.train.optim.param_groups), through torch's global step hook."""

    def __enter__(self) -> "StepGradients":
        self.steps: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        self._handle = register_optimizer_step_pre_hook(self._hook)
        return self

    def _hook(self, optimizer, args, kwargs) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.steps.append(([p.detach().clone() for p in params], [p.grad.detach().clone() for p in params]))

    def __exit__(self, *exc) -> None:
        self._handle.remove()


def masked_lm_data(root: Path, targets=(1, 9), seq_len: int = 16) -> Path:
    """Chat-format data (a loss mask) of conversations that each fill one block of seq_len + 1 tokens, the i-th
    with targets[i] target tokens (its last ones), so a micro-batch of batch size 1 holds exactly that many."""
    import numpy as np

    from chat_helpers import write_masked_data
    rng = np.random.default_rng(0)
    convs = []
    for n in targets:
        mask = np.zeros(seq_len + 1, dtype=np.uint8)
        mask[seq_len + 1 - n:] = 1
        convs.append((rng.integers(3, 400, seq_len + 1), mask))
    return write_masked_data(root, {"train": convs}, "chat", vocab_size=400)


# One optimizer step of two micro-batches of one block each, without clipping (the gradient is compared).
ONE_STEP = {"train.seq_len": 16, "train.batch_size": 1, "train.grad_accum": 2, "train.max_steps": 1,
            "train.eval_interval": 0, "train.save_interval": 0, "optim.grad_clip": 0.0, "model.dropout": 0.0}


def micro_batch_gradients(cfg, weights: list[torch.Tensor], n_batches: int, aux: bool = False):
    """For the first n_batches micro-batches of cfg's data stream, taken at `weights` (in param_groups order):
    (target tokens, gradient of the summed cross-entropy, its value, gradient of the MoE balance loss or None)."""
    from nanolm.data.loader import Loader
    from nanolm.data.shards import PackedData
    from nanolm.model.moe import collect_aux_loss
    from nanolm.model.transformer import Transformer
    from nanolm.train.losses import lm_loss
    from nanolm.train.optim import param_groups
    model = Transformer(cfg.model)
    params = [p for group in param_groups(model, cfg.optim.weight_decay) for p in group["params"]]
    with torch.no_grad():
        for p, w in zip(params, weights, strict=True):
            p.copy_(w)
    loader = Loader(PackedData(Path(cfg.data.path)), cfg.train.batch_size, cfg.train.seq_len, seed=cfg.train.seed)
    out = []
    for _ in range(n_batches):
        b = loader.next_batch()
        ce = lm_loss(model(b.x, pos=b.pos, seg=b.seg), b.y, reduction="sum")
        balance = collect_aux_loss(model) if aux else None
        g_ce = torch.autograd.grad(ce, params, retain_graph=aux)
        g_aux = torch.autograd.grad(balance, params, allow_unused=True) if aux else None
        if g_aux is not None:
            g_aux = [torch.zeros_like(p) if g is None else g for p, g in zip(params, g_aux)]
        out.append((int((b.y != -1).sum()), g_ce, ce.item(), g_aux))
    return out


def assert_close_all(got, want, rtol: float = 1e-5) -> None:
    """Each tensor equal to its reference to float tolerance: within rtol of the reference's largest entry (a
    sum taken in another order differs in its last bits, which is large relative to an entry near 0)."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        scale = w.abs().max().item()
        assert (g - w).abs().max().item() <= rtol * scale, (i, (g - w).abs().max().item(), scale)


def test_every_target_token_weighs_the_same_in_a_step(tmp_path):
    """Two micro-batches with 1 and 9 target tokens give the gradient of one batch holding both: the summed
    per-token losses over the 10 targets, divided by 10, not the mean of the two micro-batches' means."""
    data = masked_lm_data(tmp_path / "data")
    cfg = tiny_cfg(data, tmp_path / "accum", **ONE_STEP)
    with StepGradients() as accum:
        res = train(cfg, quiet=True)
    with StepGradients() as whole:
        train(tiny_cfg(data, tmp_path / "whole", **{**ONE_STEP, "train.batch_size": 2, "train.grad_accum": 1}),
              quiet=True)
    weights, got = accum.steps[0]
    (n1, g1, ce1, _), (n2, g2, ce2, _) = micro_batch_gradients(cfg, weights, 2)
    assert sorted((n1, n2)) == [1, 9]
    want = [(a + b) / 10 for a, b in zip(g1, g2)]
    assert_close_all(got, want)
    # The same weights and gradient when both blocks are one micro-batch.
    assert all(torch.equal(a, b) for a, b in zip(whole.steps[0][0], weights))
    assert_close_all(whole.steps[0][1], want)
    # What a mean per micro-batch would have applied is far from it: the test can tell them apart.
    mean_of_means = [(a / n1 + b / n2) / 2 for a, b in zip(g1, g2)]
    assert max((w - m).abs().max().item() for w, m in zip(want, mean_of_means)) > 100 * 1e-5 * max(
        w.abs().max().item() for w in want)
    # The logged loss is the same token-weighted mean.
    assert res.train_losses[1] == pytest.approx((ce1 + ce2) / 10, rel=1e-6)


def test_moe_balance_loss_stays_a_mean_per_micro_batch(tmp_path):
    data = masked_lm_data(tmp_path / "data")
    cfg = tiny_cfg(data, tmp_path / "moe", **{**ONE_STEP, **MOE})
    with StepGradients() as rec:
        res = train(cfg, quiet=True)
    weights, got = rec.steps[0]
    (n1, g1, ce1, a1), (n2, g2, ce2, a2) = micro_batch_gradients(cfg, weights, 2, aux=True)
    coef = cfg.model.aux_loss_coef
    want = [(c1 + c2) / (n1 + n2) + coef * (x1 + x2) / 2 for c1, c2, x1, x2 in zip(g1, g2, a1, a2)]
    assert_close_all(got, want)
    assert res.train_losses[1] == pytest.approx((ce1 + ce2) / (n1 + n2), rel=1e-6)


def test_pretraining_steps_are_unchanged_bit_for_bit(data_dir, tmp_path):
    """Without a mask every micro-batch holds batch_size x seq_len targets, and the step is exactly what the mean
    of each micro-batch (the model's summed loss over its targets) divided by the micro-batches per step gives:
    the same bits."""
    from nanolm.data.loader import Loader
    from nanolm.data.shards import PackedData
    from nanolm.model.transformer import Transformer
    from nanolm.train.optim import param_groups
    cfg = tiny_cfg(data_dir, tmp_path / "run", **{**ONE_STEP, "train.seq_len": 32, "train.batch_size": 2})
    with StepGradients() as rec:
        train(cfg, quiet=True)
    weights, got = rec.steps[0]
    model = Transformer(cfg.model)
    params = [p for group in param_groups(model, cfg.optim.weight_decay) for p in group["params"]]
    with torch.no_grad():
        for p, w in zip(params, weights, strict=True):
            p.copy_(w)
    loader = Loader(PackedData(data_dir), 2, 32, seed=cfg.train.seed)
    for _ in range(2):
        b = loader.next_batch()
        (model(b.x, targets=b.y) / b.y.numel() / 2).backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(params, got, strict=True))


def test_dpo_pairs_weigh_the_same_in_a_step(tmp_path):
    """Two micro-batches of one pair each give the step of one micro-batch holding both pairs."""
    import numpy as np

    from chat_helpers import write_masked_data
    rng = np.random.default_rng(1)
    convs = []
    for length in (9, 12, 10, 14):  # two pairs: (chosen, rejected) of different lengths, a 3-token final reply
        mask = np.zeros(length, dtype=np.uint8)
        mask[-3:] = 1
        convs.append((rng.integers(3, 400, length), mask))
    data = write_masked_data(tmp_path / "pairs", {"train": convs}, "dpo", {"train": {"n_pairs": 2}},
                             vocab_size=400)
    base = tmp_path / "base"
    train(tiny_cfg(masked_lm_data(tmp_path / "chat"), base, **ONE_STEP), quiet=True)
    dpo = {**ONE_STEP, "train.stage": "dpo", "train.init_from": str(base)}
    with StepGradients() as accum:
        train(tiny_cfg(data, tmp_path / "accum", **dpo), quiet=True)
    with StepGradients() as whole:
        train(tiny_cfg(data, tmp_path / "whole", **{**dpo, "train.batch_size": 2, "train.grad_accum": 1}), quiet=True)
    assert all(torch.equal(a, b) for a, b in zip(accum.steps[0][0], whole.steps[0][0]))
    assert max(g.abs().max().item() for g in accum.steps[0][1]) > 0
    assert_close_all(accum.steps[0][1], whole.steps[0][1])


def test_a_step_called_alone_applies_the_exact_update(data_dir, tmp_path):
    """Trainer.train_step on micro-batches it is given: exactly the AdamW update, at the schedule's first
    learning rate, of the gradient of the batch they make (unmasked text: the mean per micro-batch over the
    micro-batches), nothing else; the step and token counts move on by one step."""
    from nanolm.data.loader import Loader
    from nanolm.data.shards import PackedData
    from nanolm.model.transformer import Transformer
    from nanolm.train.losses import lm_loss
    from nanolm.train.optim import build_optimizer
    from nanolm.train.schedule import lr_at
    from nanolm.train.trainer import Trainer
    cfg = tiny_cfg(data_dir, tmp_path / "run", **{**ONE_STEP, "train.seq_len": 32, "train.batch_size": 2})
    trainer = Trainer(cfg, quiet=True)
    loader = Loader(PackedData(data_dir), 2, 32, seed=5)
    batches = [loader.next_batch() for _ in range(2)]
    ref = Transformer(cfg.model)
    ref.load_state_dict(trainer.model.state_dict())
    for b in batches:
        (ref(b.x, targets=b.y) / b.y.numel() / 2).backward()
    optimizer = build_optimizer(ref, cfg.optim, torch.device("cpu"))
    for group in optimizer.param_groups:
        group["lr"] = lr_at(0, cfg.optim, cfg.train.max_steps)
    optimizer.step()
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    res = trainer.train_step(batches)
    after = trainer.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in ref.state_dict().items())
    assert not torch.equal(after["layers.0.mlp.up_proj.weight"], before["layers.0.mlp.up_proj.weight"])
    assert (trainer.step, trainer.tokens, res.units, res.tokens, res.finite) == (1, 128, 128, 128, True)
    assert res.lr == lr_at(0, cfg.optim, cfg.train.max_steps)
    start = Transformer(cfg.model)
    start.load_state_dict(before)
    with torch.no_grad():
        want = sum(lm_loss(start(b.x), b.y, reduction="sum").item() for b in batches) / 128
    assert res.logged(trainer.info)["loss"] == pytest.approx(want, rel=1e-6)
