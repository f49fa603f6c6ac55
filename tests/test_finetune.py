"""Fine-tuning stages through the one loop: LoRA adapters and full SFT from a pretrained checkpoint."""

from __future__ import annotations

import pytest
import torch

from nanolm.errors import UserError
from nanolm.train import checkpoint as ckpt
from nanolm.train.loop import train
from test_train import tiny_cfg


@pytest.fixture(scope="module")
def base_run(data_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("base") / "run"
    train(tiny_cfg(data_dir, run, **{"train.max_steps": 8, "model.dropout": 0.0}), quiet=True)
    return run


def lora_cfg(data_dir, out, base, **over):
    return tiny_cfg(data_dir, out, **{"train.stage": "lora", "train.init_from": str(base), "train.max_steps": 6,
                                      "train.save_interval": 3, "train.eval_interval": 3, "model.dropout": 0.0,
                                      "lora.rank": 4, "lora.alpha": 8, "lora.dropout": 0.0, "optim.lr": 1e-2,
                                      **over})


def test_lora_run_saves_only_the_adapter_and_leaves_the_base(data_dir, tmp_path, base_run):
    base_before = {k: v.clone() for k, v in ckpt.load_model(base_run, "last")[0].state_dict().items()}
    res = train(lora_cfg(data_dir, tmp_path / "lora", base_run), quiet=True)
    assert res.step == 6
    last = ckpt.resolve_checkpoint(tmp_path / "lora", "last")
    names = {p.name for p in last.iterdir()}
    assert {"adapter.safetensors", "adapter_config.json", "optimizer.pt"} <= names
    assert "model.safetensors" not in names
    from safetensors.torch import load_file
    adapter = load_file(str(last / "adapter.safetensors"))
    assert adapter and all(".lora_A" in k or ".lora_B" in k for k in adapter)
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if k.endswith("lora_B"))  # B moved off zero
    # the base checkpoint on disk is untouched
    base_after = ckpt.load_model(base_run, "last")[0].state_dict()
    assert all(torch.equal(base_before[k], base_after[k]) for k in base_before)


def test_lora_generation_unmerged_equals_merged(data_dir, tmp_path, base_run):
    train(lora_cfg(data_dir, tmp_path / "lora", base_run), quiet=True)
    unmerged, _, _ = ckpt.load_model(tmp_path / "lora", "last")
    merged_dir = ckpt.merge_adapter_checkpoint(tmp_path / "lora", tmp_path / "merged")
    merged, _, _ = ckpt.load_model(merged_dir)
    assert not any("lora" in k for k in merged.state_dict())
    x = torch.randint(0, 400, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(unmerged(x), merged(x), atol=1e-5, rtol=1e-5)
        base = ckpt.load_model(base_run, "last")[0]
        assert not torch.allclose(base(x), merged(x), atol=1e-4)  # the adapter did change the model
    # --adapter: a base plus a LoRA run, unmerged, gives the same model
    again, _, _ = ckpt.load_model(base_run, "last", adapter=tmp_path / "lora")
    with torch.no_grad():
        torch.testing.assert_close(again(x), merged(x), atol=1e-5, rtol=1e-5)


def test_lora_resume_is_exact(data_dir, tmp_path, base_run):
    full = train(lora_cfg(data_dir, tmp_path / "full", base_run), quiet=True)
    train(lora_cfg(data_dir, tmp_path / "part", base_run, **{"train.max_tokens": 3 * 4 * 32}), quiet=True)
    resumed = train(lora_cfg(data_dir, tmp_path / "part", base_run), resume=True, quiet=True)
    assert resumed.train_losses == {s: full.train_losses[s] for s in range(4, 7)}


def test_adapter_refuses_another_base(data_dir, tmp_path, base_run):
    train(lora_cfg(data_dir, tmp_path / "lora", base_run), quiet=True)
    other = tmp_path / "other"
    train(tiny_cfg(data_dir, other, **{"train.max_steps": 2, "train.seed": 5, "model.dropout": 0.0}), quiet=True)
    with pytest.raises(UserError, match="this adapter was trained on base .* but the model is"):
        ckpt.load_model(other, "last", adapter=tmp_path / "lora")


def test_fine_tuning_stages_need_a_base(data_dir, tmp_path):
    for stage in ("sft", "lora"):
        with pytest.raises(UserError, match=f"train.stage={stage} fine-tunes a trained model; pass --init-from"):
            train(tiny_cfg(data_dir, tmp_path / stage, **{"train.stage": stage}), quiet=True)
