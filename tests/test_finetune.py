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


CONVS = [
    [{"role": "user", "content": "「一帆风顺」是什么意思？"}, {"role": "assistant", "content": "比喻非常顺利，没有任何阻碍。"}],
    [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "What is AI?"},
     {"role": "assistant", "content": "Artificial intelligence."}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there!"},
     {"role": "user", "content": "How are you?"}, {"role": "assistant", "content": "I am fine, thank you."}],
]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, tokenizer_dir):
    import json
    from nanolm.data.prepare import prepare
    d = tmp_path_factory.mktemp("chat")
    src = d / "sft.jsonl"
    with open(src, "w", encoding="utf-8") as f:
        for i in range(60):
            f.write(json.dumps({"conversations": CONVS[i % 3]}, ensure_ascii=False) + "\n")
    out = d / "data"
    prepare([src], tokenizer_dir, out, format="chat", val_fraction=0.1, workers=0, quiet=True)
    return out


def test_packed_block_loss_equals_per_conversation_loss(chat_dir, tokenizer_dir):
    """The loss of a packed chat batch equals the same conversations' losses computed one by one."""
    from nanolm.config import ModelConfig
    from nanolm.data.loader import Loader, PackedData
    from nanolm.model.transformer import Transformer
    from nanolm.tokenizer import Tokenizer
    from nanolm.train.objectives import lm_loss
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=400, d_model=32, n_layer=2, n_head=4, n_kv_head=2,
                                    max_seq_len=128)).eval()
    batch = Loader(PackedData(chat_dir, "train"), 2, 127, seed=0).next_batch()
    assert batch.seg is not None and int(batch.seg.max()) >= 1  # several conversations per row
    with torch.no_grad():
        packed = lm_loss(model(batch.x, pos=batch.pos, seg=batch.seg), batch.y, reduction="sum")
        one_by_one, n_targets = torch.zeros(()), 0
        for row in range(batch.x.shape[0]):
            for s in batch.seg[row].unique():
                idx = (batch.seg[row] == s).nonzero().squeeze(1)
                x, y = batch.x[row, idx][None], batch.y[row, idx][None]
                assert torch.equal(batch.pos[row, idx], torch.arange(len(idx)))  # positions restart
                one_by_one += lm_loss(model(x), y, reduction="sum")
                n_targets += int((y != -1).sum())
    torch.testing.assert_close(packed, one_by_one, rtol=1e-5, atol=1e-4)
    # the targets are exactly the assistant replies and their <|im_end|>
    tok = Tokenizer.load(tokenizer_dir)
    text = tok.decode(batch.y[0][batch.y[0] != -1].tolist())
    assert "<|im_end|>" in text and "user" not in text and "Hello" not in text and "What is AI?" not in text


def test_sft_stage_trains_on_chat_data(chat_dir, tmp_path, base_run):
    cfg = tiny_cfg(chat_dir, tmp_path / "sft", **{"train.stage": "sft", "train.init_from": str(base_run),
                                                  "train.max_steps": 150, "optim.lr": 1e-2, "model.dropout": 0.0,
                                                  "model.max_seq_len": 128, "train.seq_len": 128, "train.batch_size": 2,
                                                  "train.eval_interval": 10})
    assert cfg.optim.warmup_steps == 3  # the override wins over the stage default
    res = train(cfg, quiet=True)
    losses = [res.train_losses[s] for s in sorted(res.train_losses)]
    assert losses[-1] < 0.5 < 5 < losses[0]  # three repeated conversations are learnt by heart
    # greedy chat with the fine-tuned model gives the trained reply, and stops at <|im_end|>
    from nanolm.infer.chat import ChatSession
    from nanolm.infer.engine import Engine, SamplingParams
    from nanolm.tokenizer import Tokenizer
    model, _, src = ckpt.load_model(tmp_path / "sft", "last")
    session = ChatSession(Engine(model), Tokenizer.load(src), SamplingParams(max_new_tokens=20, temperature=0))
    session.set_system("You are brief.")
    assert "".join(session.reply("What is AI?")) == "Artificial intelligence."
