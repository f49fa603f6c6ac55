"""Fine-tuning stages through the one loop: LoRA adapters and full SFT from a pretrained checkpoint."""

from __future__ import annotations

import pytest
import torch

from nanolm.errors import UserError
from nanolm import checkpoint as ckpt
from nanolm.train.trainer import Trainer, train
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
    unmerged, _ = ckpt.load_model(tmp_path / "lora", "last")
    merged_dir = ckpt.merge_adapter_checkpoint(tmp_path / "lora", tmp_path / "merged")
    merged, _ = ckpt.load_model(merged_dir)
    assert not any("lora" in k for k in merged.state_dict())
    x = torch.randint(0, 400, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(unmerged(x), merged(x), atol=1e-5, rtol=1e-5)
        base = ckpt.load_model(base_run, "last")[0]
        assert not torch.allclose(base(x), merged(x), atol=1e-4)  # the adapter did change the model
    # --adapter: a base plus a LoRA run, unmerged, gives the same model
    again, _ = ckpt.load_model(base_run, "last", adapter=tmp_path / "lora")
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
    from nanolm.data.loader import Loader
    from nanolm.data.shards import PackedData
    from nanolm.model.transformer import Transformer
    from nanolm.tokenizer import Tokenizer
    from nanolm.train.losses import lm_loss
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
    from nanolm.config import SamplingParams
    from nanolm.infer.session import ChatSession
    from nanolm.infer.engine import Engine
    from nanolm.tokenizer import Tokenizer
    model, src = ckpt.load_model(tmp_path / "sft", "last")
    session = ChatSession(Engine(model), Tokenizer.load(src), SamplingParams(max_new_tokens=20, temperature=0))
    session.set_system("You are brief.")
    assert "".join(session.reply("What is AI?")) == "Artificial intelligence."


@pytest.fixture(scope="module")
def dpo_dir(tmp_path_factory, tokenizer_dir):
    """Preference pairs: the right answer chosen, an evasive one rejected.

    (Rejecting another question's answer would push the same reply up in one pair and down in
    another, which a tiny model that barely reads the question cannot resolve in a few steps.)"""
    import json
    from nanolm.data.prepare import prepare
    d = tmp_path_factory.mktemp("dpo")
    qa = [("「一帆风顺」是什么意思？", "比喻非常顺利，没有任何阻碍。"), ("What is AI?", "Artificial intelligence."),
          ("How are you?", "I am fine, thank you."), ("滚滚长江东逝水的下一句是什么？", "浪花淘尽英雄。")]
    src = d / "prefs.jsonl"
    with open(src, "w", encoding="utf-8") as f:
        for i in range(40):
            q, a = qa[i % 4]
            wrong = ("我不知道。", "No idea.", "随便吧。", "Whatever.")[i % 4]
            user = {"role": "user", "content": q}
            f.write(json.dumps({"chosen": [user, {"role": "assistant", "content": a}],
                                "rejected": [user, {"role": "assistant", "content": wrong}]},
                               ensure_ascii=False) + "\n")
    out = d / "data"
    prepare([src], tokenizer_dir, out, format="pairs", val_fraction=0.1, workers=0, quiet=True)
    return out


def dpo_cfg(dpo_dir, out, base, **over):
    return tiny_cfg(dpo_dir, out, **{"train.stage": "dpo", "train.init_from": str(base), "train.max_steps": 12,
                                     "train.eval_interval": 6, "model.dropout": 0.0, "optim.lr": 3e-3,
                                     "optim.warmup_steps": 2, "model.max_seq_len": 64, "train.seq_len": 64,
                                     **over})


@pytest.mark.parametrize("use_lora", [False, True])
def test_dpo_raises_the_chosen_rejected_margin(dpo_dir, tmp_path, base_run, use_lora):
    import json
    over = {"lora.enabled": "true", "lora.rank": 4, "lora.dropout": 0.0, "optim.lr": 1e-2} if use_lora else {}
    res = train(dpo_cfg(dpo_dir, tmp_path / "dpo", base_run, **over), quiet=True)
    recs = [json.loads(line) for line in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "reward_margin" in r]
    assert abs(steps[0]["reward_margin"]) < 1e-4  # step 1: the policy still equals its reference
    assert steps[-1]["reward_margin"] > 0.2 and steps[-1]["reward_accuracy"] == 1.0
    assert res.train_losses[12] < res.train_losses[1] < 0.7  # log(2) = 0.693 at the start
    vals = [r for r in recs if "val_reward_accuracy" in r]
    assert vals and vals[-1]["val_reward_margin"] > 0
    names = {p.name for p in ckpt.resolve_checkpoint(tmp_path / "dpo", "last").iterdir()}
    assert ("adapter.safetensors" in names) == use_lora and ("model.safetensors" in names) != use_lora


def test_dpo_needs_preference_data(data_dir, dpo_dir, tmp_path, base_run):
    with pytest.raises(UserError, match="train.stage=dpo cannot train on text data; prepare preference pairs"):
        train(dpo_cfg(data_dir, tmp_path / "a", base_run), quiet=True)
    with pytest.raises(UserError, match="train.stage=sft cannot train on pairs data; preference data trains with "
                                        "--stage dpo"):
        train(dpo_cfg(dpo_dir, tmp_path / "b", base_run, **{"train.stage": "sft"}), quiet=True)


def test_distillation_into_a_smaller_student(data_dir, tmp_path, base_run):
    cfg = tiny_cfg(data_dir, tmp_path / "student", **{"train.stage": "distill", "distill.teacher": str(base_run),
                                                      "model.d_model": 16, "model.n_layer": 1, "model.dropout": 0.0,
                                                      "train.max_steps": 20, "distill.alpha": 0.7})
    res = train(cfg, quiet=True)
    assert res.train_losses[20] < res.train_losses[1]
    import json
    rec = [json.loads(line) for line in (tmp_path / "student" / "metrics.jsonl").read_text().splitlines()][0]
    assert {"kl", "ce"} <= rec.keys()


def test_distillation_loss_is_zero_when_the_student_is_the_teacher(data_dir, tmp_path, base_run):
    cfg = tiny_cfg(data_dir, tmp_path / "same", **{"train.stage": "distill", "distill.teacher": str(base_run),
                                                   "train.init_from": str(base_run), "distill.alpha": 1.0,
                                                   "model.dropout": 0.0, "train.max_steps": 1})
    res = train(cfg, quiet=True)
    assert res.train_losses[1] == pytest.approx(0.0, abs=1e-6)


def test_distillation_refuses_another_tokenizer(tmp_path, base_run, corpus):
    from nanolm.data.formats import iter_documents
    from nanolm.data.prepare import prepare
    from nanolm.tokenizer import train_tokenizer
    other_tok = tmp_path / "tok"
    train_tokenizer((t.upper() for t in iter_documents(corpus)), other_tok, vocab_size=400, quiet=True)
    other_data = tmp_path / "data"
    prepare([corpus], other_tok, other_data, val_fraction=0.1, workers=0, quiet=True)
    cfg = tiny_cfg(other_data, tmp_path / "s", **{"train.stage": "distill", "distill.teacher": str(base_run)})
    with pytest.raises(UserError, match="the teacher was trained with another tokenizer"):
        train(cfg, quiet=True)


def test_lora_base_kept_in_bf16_under_bf16_training(data_dir, tmp_path, base_run):
    """Under bf16 autocast the frozen base is kept in bf16 by default (its products cast to bf16 anyway): the
    losses stay within bf16 rounding of an fp32 base's, the adapters load onto the fp32 base, resume is exact."""
    bf16 = {"train.dtype": "bfloat16"}
    fp32_base = train(lora_cfg(data_dir, tmp_path / "fp32", base_run, **bf16, **{"lora.base_dtype": "float32"}),
                      quiet=True)
    trainer = Trainer(lora_cfg(data_dir, tmp_path / "probe", base_run, **bf16), quiet=True)
    dtypes = {n: p.dtype for n, p in trainer.model.named_parameters()}
    assert {d for n, d in dtypes.items() if ".base." in n or "embed_tokens" in n} == {torch.bfloat16}
    assert {d for n, d in dtypes.items() if "lora_" in n or "norm" in n} == {torch.float32}
    auto = train(lora_cfg(data_dir, tmp_path / "auto", base_run, **bf16), quiet=True)
    assert auto.train_losses != fp32_base.train_losses
    for s, loss in fp32_base.train_losses.items():
        assert auto.train_losses[s] == pytest.approx(loss, rel=1e-2)
    train(lora_cfg(data_dir, tmp_path / "part", base_run, **bf16, **{"train.max_tokens": 3 * 4 * 32}), quiet=True)
    resumed = train(lora_cfg(data_dir, tmp_path / "part", base_run, **bf16), resume=True, quiet=True)
    assert resumed.train_losses == {s: auto.train_losses[s] for s in range(4, 7)}
    merged, _ = ckpt.load_model(base_run, "last", adapter=tmp_path / "auto")  # the fp32 base's fingerprint
    assert {p.dtype for p in merged.parameters()} == {torch.float32}


def test_lora_base_in_bf16_under_float32_training(data_dir, tmp_path, base_run):
    """Asked for explicitly without autocast: the frozen products run in bf16 on a cast of the activations and
    return float32; the adapters still learn, and the losses stay within bf16 rounding of the fp32 base's."""
    fp32 = train(lora_cfg(data_dir, tmp_path / "fp32", base_run), quiet=True)
    bf16 = train(lora_cfg(data_dir, tmp_path / "bf16", base_run, **{"lora.base_dtype": "bfloat16"}), quiet=True)
    assert bf16.train_losses != fp32.train_losses
    for s, loss in fp32.train_losses.items():
        assert bf16.train_losses[s] == pytest.approx(loss, rel=2e-2)
    from safetensors.torch import load_file
    adapter = load_file(str(ckpt.resolve_checkpoint(tmp_path / "bf16", "last") / "adapter.safetensors"))
    assert all(v.dtype == torch.float32 for v in adapter.values())
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if k.endswith("lora_B"))  # B moved off zero
