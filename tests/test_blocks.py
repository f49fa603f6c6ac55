"""Nano's non-causal mode: input and output blocks (`prepare --format blocks`, `--stage blocks`), a model that
attends to the whole input block (`model.causal false`), and the paths that refuse it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nanolm import checkpoint as ckpt
from nanolm.cli import main
from nanolm.config import ModelConfig
from nanolm.train.configure import load_config
from nanolm.data.kinds.blocks import block_views
from nanolm.data.loader import iter_eval_batches
from nanolm.data.prepare import prepare
from nanolm.data.shards import IGNORE_INDEX, Batch, PackedData
from nanolm.errors import UserError
from nanolm.model.transformer import Transformer
from nanolm.train.objectives import BlocksObjective
from nanolm.train.trainer import Trainer, train
from test_train import StepGradients, assert_close_all, read_metrics, same_weights

VOCAB = 320


@pytest.fixture(scope="module")
def sort_data(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(records file, tokenizer dir, prepared dir) of 600 sort records of 2 to 6 digits, a 10% held-out split."""
    from nanolm.data.kinds import iter_texts
    from nanolm.tokenizer import train_tokenizer
    root = tmp_path_factory.mktemp("sort")
    assert main(["data", "blocks", "--out", str(root / "sort.jsonl"), "--n", "600", "--min-len", "2", "--max-len",
                 "6", "--seed", "1"]) in (0, None)
    train_tokenizer(iter_texts([root / "sort.jsonl"], format="blocks"), root / "tok", vocab_size=VOCAB, quiet=True)
    prepare([root / "sort.jsonl"], root / "tok", root / "data", format="blocks", val_fraction=0.1, quiet=True)
    return root / "sort.jsonl", root / "tok", root / "data"


def blocks_cfg(data: Path, out: Path, **over):
    base = {"data.path": str(data), "train.out_dir": str(out), "train.stage": "blocks", "model.causal": False,
            "model.vocab_size": VOCAB, "model.d_model": 32, "model.n_layer": 2, "model.n_head": 4,
            "model.n_kv_head": 2, "model.max_seq_len": 16, "train.seq_len": 8, "train.batch_size": 8,
            "train.max_steps": 12, "train.log_interval": 1, "train.eval_interval": 4, "train.eval_batches": 2,
            "train.save_interval": 4, "optim.warmup_steps": 2, "optim.lr": 3e-3, "optim.min_lr": 3e-4,
            "model.dropout": 0.1}  # dropout makes the RNG state part of what a resume must restore
    base.update(over)
    return load_config("tiny", overrides=base)


def _mixing_off(model: Transformer) -> Transformer:
    """The model with every attention and MLP output zeroed: each position's logits then depend on its own token
    alone, E @ rmsnorm(E[token]) (tied embeddings, unit norm weights), which a test computes by hand."""
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


def _hand_ce(E: torch.Tensor, token: int, target: int, eps: float) -> float:
    h = E[token] / torch.sqrt(E[token].pow(2).mean() + eps)
    logits = E @ h
    return float(torch.logsumexp(logits, 0) - logits[target])


@pytest.mark.parametrize("causal", [False, True])
def test_a_two_position_block_loss_equals_the_hand_computed_one(causal):
    """Input "a" and output "b" in blocks of 2: the input block is [a, eot], the targets [b, eot]. Non-causal:
    position 0 (a) predicts b, position 1 (eot) predicts eot. Causal: the sequence [a, eot, b] predicts b after
    eot and eot after b."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=16, d_model=8, n_layer=1, n_head=2, n_kv_head=1, max_seq_len=4, causal=causal)
    model = _mixing_off(Transformer(cfg))
    a, b, eot = 5, 7, 0
    batch = Batch(torch.tensor([[a, eot, b, eot]]), torch.tensor([[IGNORE_INDEX, b, eot, IGNORE_INDEX]]))
    objective = BlocksObjective(model, 0.0, causal)
    loss = objective(model, batch)
    E = model.embed_tokens.weight.detach()
    pairs = [(eot, b), (b, eot)] if causal else [(a, b), (eot, eot)]
    want = sum(_hand_ce(E, t, y, cfg.norm_eps) for t, y in pairs)
    assert objective.units(batch) == 2
    assert loss.total.item() == pytest.approx(want, rel=1e-5)


def test_a_non_causal_position_sees_later_input_tokens_and_a_causal_one_does_not():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=32, d_model=16, n_layer=1, n_head=2, n_kv_head=1, max_seq_len=8, causal=False)
    bidirectional = Transformer(cfg).eval()
    causal = Transformer(ModelConfig(**{**cfg.__dict__, "causal": True})).eval()
    causal.load_state_dict(bidirectional.state_dict())
    x = torch.tensor([[3, 9, 4, 11, 2, 6]])
    y = x.clone()
    y[0, 5] = 20  # the last input token changes
    with torch.no_grad():
        nc = (bidirectional(x), bidirectional(y))
        c = (causal(x), causal(y))
    assert (nc[0][0, 0] - nc[1][0, 0]).abs().max() > 1e-4  # the first position reads the last token
    assert torch.equal(c[0][0, :5], c[1][0, :5])  # a causal position never does
    # with the same weights and no later change, the last position reads the same in both modes
    torch.testing.assert_close(nc[0][0, -1], c[0][0, -1], rtol=1e-5, atol=1e-6)


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def test_a_batch_lays_input_and_output_blocks_side_by_side_and_masks_the_padding(sort_data, tmp_path):
    _, tok_dir, _ = sort_data
    from nanolm.tokenizer import Tokenizer
    tok = Tokenizer.load(tok_dir)
    src = _write(tmp_path / "r.jsonl", [{"input": "12", "output": "345"}, {"input": "9", "output": "87654"},
                                        {"input": "123456", "output": "1"}])
    prepare([src], tok_dir, tmp_path / "d", format="blocks", val_fraction=0, quiet=True)
    data = PackedData(tmp_path / "d", "train")
    assert data.kind == "blocks"
    rows = next(iter_eval_batches(data, 3, 5))  # blocks of 5 tokens: the third record's input does not fit
    e, ids = tok.eot_id, lambda s: tok.encode(s)
    assert ids("12") == [ids("1")[0], ids("2")[0]]  # one token per digit
    assert rows.x.tolist() == [ids("12") + [e] * 3 + ids("345") + [e] * 2,
                               ids("9") + [e] * 4 + ids("87654")]
    I = IGNORE_INDEX
    assert rows.y.tolist() == [[I] * 4 + ids("345") + [e] + [I] * 2,
                               [I] * 4 + ids("87654") + [I]]  # a full output block has no end-of-text
    nc = block_views(rows, causal=False)
    assert nc.x.tolist() == [r[:5] for r in rows.x.tolist()]
    assert nc.y.tolist() == [ids("345") + [e, I], ids("87654")]
    from nanolm.data.loader import unit_kind
    assert "1 left out (an input or output longer than 5 tokens)" in unit_kind(data, 5).describe(None, 3)


def test_prepare_reads_both_layouts_and_names_the_line_of_a_bad_record(sort_data, tmp_path):
    _, tok_dir, _ = sort_data
    from nanolm.tokenizer import Tokenizer
    tok = Tokenizer.load(tok_dir)
    # Nano's layout: one sequence, cut at the block length into its input and output
    src = _write(tmp_path / "nano.jsonl", [{"text": "1234" + "567"}, {"input": "4", "output": "44"}])
    m = prepare([src], tok_dir, tmp_path / "n", format="blocks", block_len=4, val_fraction=0, quiet=True)
    assert m.kind == "blocks" and m.section == {"n_records": 2, "train": 2, "val": 0, "longest_input": 4,
                                                "longest_output": 3}
    rows = next(iter_eval_batches(PackedData(tmp_path / "n", "train"), 2, 4))
    assert rows.x[0].tolist() == tok.encode("1234") + tok.encode("567") + [tok.eot_id]
    cases = [({"input": "1"}, 'no "output" field'),
             ({"input": "1", "output": ""}, '"output" is empty'),
             ({"input": "123456", "output": "1"}, '"input" is 6 tokens, longer than --block-len 4'),
             ({"text": "12"}, '"text" is 2 tokens: a sequence cut at --block-len 4 needs more than 4'),
             (["1", "2"], "expected a JSON object")]
    for row, what in cases:
        bad = _write(tmp_path / "bad.jsonl", [{"input": "1", "output": "2"}, row])
        with pytest.raises(UserError, match=rf"bad\.jsonl:2: .*{what}"):
            prepare([bad], tok_dir, tmp_path / "b", format="blocks", block_len=4, val_fraction=0, quiet=True)
        assert not (tmp_path / "b").exists()  # nothing half-written
    with pytest.raises(UserError, match="pass --block-len N"):
        prepare([_write(tmp_path / "t.jsonl", [{"text": "12345"}])], tok_dir, tmp_path / "b", format="blocks",
                val_fraction=0, quiet=True)
    m = prepare([bad], tok_dir, tmp_path / "s", format="blocks", block_len=4, val_fraction=0, skip_bad=True,
                quiet=True)
    assert m.section["n_records"] == 1 and m.skipped["bad_lines"] == 1


def test_the_digit_task_holds_each_input_once_and_its_val_split_is_held_out(sort_data, tmp_path):
    records, _, data = sort_data
    rows = [json.loads(x) for x in records.read_text().splitlines()]
    assert len(rows) == 600 and len({r["input"] for r in rows}) == 600
    assert all(r["output"] == "".join(sorted(r["input"])) and 2 <= len(r["input"]) <= 6 for r in rows)
    main(["data", "blocks", "--task", "reverse", "--out", str(tmp_path / "rev.jsonl"), "--n", "50"])
    rev = [json.loads(x) for x in (tmp_path / "rev.jsonl").read_text().splitlines()]
    assert all(r["output"] == r["input"][::-1] for r in rev)
    seen = {}
    for split in ("train", "val"):
        d = PackedData(data, split)
        shard, start, length = d.documents()
        seen[split] = {tuple(d.shards[int(shard[i])][int(start[i]):int(start[i] + length[i])].tolist())
                       for i in range(0, len(length), 2)}  # the inputs
    assert len(seen["val"]) == 60 and not seen["val"] & seen["train"]


def test_interrupted_and_resumed_equals_uninterrupted(sort_data, tmp_path):
    _, _, data = sort_data
    full = train(blocks_cfg(data, tmp_path / "full"), quiet=True)
    part = train(blocks_cfg(data, tmp_path / "part", **{"train.max_steps": 12, "train.max_tokens": 6 * 8 * 8}),
                 quiet=True)
    assert part.step == 6
    resumed = train(blocks_cfg(data, tmp_path / "part"), resume=True, quiet=True)
    assert resumed.step == 12
    assert resumed.train_losses == {s: full.train_losses[s] for s in range(7, 13)}
    assert same_weights(tmp_path / "full", tmp_path / "part")
    vals = [r for r in read_metrics(tmp_path / "full") if "val_loss" in r]
    assert [r["step"] for r in vals] == [4, 8, 12]
    assert all(0 <= r["val_exact"] <= r["val_token_acc"] <= 1 for r in vals)


@pytest.mark.parametrize("causal", [False, True])
def test_a_step_is_the_same_however_its_records_are_cut_into_micro_batches(sort_data, tmp_path, causal):
    """Records of 2 to 6 digits have different numbers of targets: every target token weighs the same."""
    _, _, data = sort_data
    over = {"model.causal": causal, "train.max_steps": 1, "train.eval_interval": 0, "train.save_interval": 0,
            "optim.grad_clip": 0.0, "model.dropout": 0.0}
    with StepGradients() as whole:
        train(blocks_cfg(data, tmp_path / "whole", **{**over, "train.batch_size": 8}), quiet=True)
    with StepGradients() as accum:
        train(blocks_cfg(data, tmp_path / "accum", **{**over, "train.batch_size": 2, "train.grad_accum": 4}),
              quiet=True)
    assert all(torch.equal(a, b) for a, b in zip(whole.steps[0][0], accum.steps[0][0]))
    assert_close_all(accum.steps[0][1], whole.steps[0][1])


@pytest.mark.slow
def test_two_processes_train_blocks_as_one(sort_data, tmp_path):
    from test_distributed import torchrun_cmd
    _, _, data = sort_data
    over = {"train.max_steps": 4, "train.grad_accum": 2, "train.eval_interval": 0, "train.save_interval": 0,
            "model.dropout": 0.0}
    one = train(blocks_cfg(data, tmp_path / "one", **over), quiet=True)
    config = tmp_path / "two.json"
    config.write_text(json.dumps(blocks_cfg(data, tmp_path / "two", **over).to_dict()))
    r = torchrun_cmd("-m", "nanolm", "train", "--config", str(config))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    two = {x["step"]: x["loss"] for x in read_metrics(tmp_path / "two") if "loss" in x}
    assert sorted(two) == [1, 2, 3, 4]
    for s in two:
        assert two[s] == pytest.approx(one.train_losses[s], rel=1e-4, abs=1e-5)


def test_a_non_causal_model_learns_to_reverse_and_generate_prints_its_output_block(tmp_path, capsys):
    from nanolm.data.kinds import iter_texts
    from nanolm.tokenizer import train_tokenizer
    main(["data", "blocks", "--task", "reverse", "--out", str(tmp_path / "rev.jsonl"), "--n", "2000",
          "--min-len", "3", "--max-len", "5"])
    train_tokenizer(iter_texts([tmp_path / "rev.jsonl"], format="blocks"), tmp_path / "tok", VOCAB, quiet=True)
    prepare([tmp_path / "rev.jsonl"], tmp_path / "tok", tmp_path / "d", format="blocks", val_fraction=0.1,
            quiet=True)
    cfg = blocks_cfg(tmp_path / "d", tmp_path / "run", **{
        "model.d_model": 64, "train.seq_len": 6, "train.batch_size": 32, "train.max_steps": 600,
        "train.eval_interval": 600, "train.eval_batches": 8, "train.save_interval": 0, "model.dropout": 0.0,
        "optim.lr": 1e-2, "optim.min_lr": 1e-3, "optim.warmup_steps": 20})
    train(cfg, quiet=True)
    last = [r for r in read_metrics(tmp_path / "run") if "val_exact" in r][-1]
    assert last["val_exact"] > 0.5  # held-out inputs, never trained on: chance is about 1e-4
    capsys.readouterr()
    main(["generate", str(tmp_path / "run"), "--prompt", "4071"])
    out = capsys.readouterr()
    model, src = ckpt.load_model(tmp_path / "run")
    from nanolm.infer.generate import write_block
    from nanolm.tokenizer import Tokenizer
    want = write_block(model, Tokenizer.load(src), "4071", 6)
    assert out.out == want + "\n" and "non-causal model" in out.err
    x = torch.tensor([Tokenizer.load(src).encode("4071") + [0, 0]])
    with torch.no_grad():
        ids = model(x)[0].argmax(-1).tolist()
    assert want == Tokenizer.load(src).decode(ids[:ids.index(0)] if 0 in ids else ids)


def test_every_path_that_needs_a_causal_model_refuses_a_non_causal_one(sort_data, tmp_path, data_dir, capsys):
    _, _, data = sort_data
    train(blocks_cfg(data, tmp_path / "run", **{"train.max_steps": 1, "train.eval_interval": 0}), quiet=True)
    model, src = ckpt.load_model(tmp_path / "run")
    from nanolm.infer.engine import Engine
    with pytest.raises(UserError, match="model.causal is false"):
        Engine(model)
    from nanolm.export.hf import export_hf
    with pytest.raises(UserError, match=r"config\.json: model\.causal is false.*export to transformers"):
        export_hf(tmp_path / "run", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    for argv in (["chat", str(tmp_path / "run")], ["eval", str(tmp_path / "run"), "--task", "idioms:n=2"],
                 ["export", "gguf", str(tmp_path / "run"), str(tmp_path / "m.gguf")]):
        capsys.readouterr()
        assert main(argv) not in (0, None)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) >= 1 and "model.causal is false" in err[-1], argv
    with pytest.raises(UserError, match=r"model\.causal is false: a non-causal model trains only with --stage "
                                        r"blocks.*train\.stage=pretrain"):
        Trainer(blocks_cfg(data_dir, tmp_path / "pre", **{"train.stage": "pretrain", "model.vocab_size": 400}),
                quiet=True)
    with pytest.raises(UserError, match=r"train\.stage=blocks cannot train on text data; prepare input/output"):
        Trainer(blocks_cfg(data_dir, tmp_path / "txt", **{"model.vocab_size": 400}), quiet=True)
    with pytest.raises(UserError, match=r"model\.max_seq_len=8 is shorter than the 15 positions a causal model"):
        Trainer(blocks_cfg(data, tmp_path / "short", **{"model.causal": True, "model.max_seq_len": 8}), quiet=True)
