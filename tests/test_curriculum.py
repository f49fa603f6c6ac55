"""Curricula and mixtures of prepared data sets (nanolm/data/stream.py): where each batch comes from, on one
rank and on two, exact resume, the end of a curriculum, refusals, and what the training log shows."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest
import torch

from conftest import EN, ZH
from nanolm.config import DataConfig, DataSetConfig
from nanolm.data.loader import Loader
from nanolm.data.prepare import prepare
from nanolm.data.shards import PackedData
from nanolm.data.stream import DataStream
from nanolm.errors import UserError
from nanolm.train.trainer import train

from chat_helpers import a, u, write_jsonl
from test_train import read_metrics, tiny_cfg

SEQ, B = 32, 4


def word_corpus(path: Path, pool: list[str], n_docs: int, seed: int) -> Path:
    """Documents of words drawn at random from the pool's sentences: no two windows of the data alike."""
    rng = random.Random(seed)
    words = " ".join(pool).split()
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(10, 30))) for _ in range(n_docs)]
    return write_jsonl(path, [{"text": d} for d in docs])


@pytest.fixture(scope="module")
def sets(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    """Two text sets (English 'wiki', Chinese 'novel'), a chat set and a preference set, one tokenizer; and a
    copy of wiki that claims another tokenizer."""
    root = tmp_path_factory.mktemp("sets")
    out = {}
    for name, pool, n in (("wiki", EN, 20), ("novel", ZH, 6)):
        src = word_corpus(root / f"{name}.jsonl", pool, n, seed=len(name))
        out[name] = root / name
        prepare([src], tokenizer_dir, out[name], val_fraction=0.2, workers=0, quiet=True)
    chats = [{"messages": [u(f"{ZH[i % 5]} {i}"), a(EN[i % 5])]} for i in range(24)]
    out["chat"] = root / "chat"
    prepare([write_jsonl(root / "chat.jsonl", chats)], tokenizer_dir, out["chat"], format="chat", val_fraction=0,
            workers=0, quiet=True)
    pairs = [{"chosen": [u(f"q{i}"), a("To be.")], "rejected": [u(f"q{i}"), a("no")]} for i in range(8)]
    out["prefs"] = root / "prefs"
    prepare([write_jsonl(root / "prefs.jsonl", pairs)], tokenizer_dir, out["prefs"], format="pairs", val_fraction=0,
            workers=0, quiet=True)
    out["other"] = root / "other"
    shutil.copytree(out["wiki"], out["other"])
    manifest = json.loads((out["other"] / "manifest.json").read_text())
    manifest["tokenizer"]["fingerprint"] = "f" * 64
    (out["other"] / "manifest.json").write_text(json.dumps(manifest))
    return out


def stream(specs: list[dict], mode: str = "curriculum", batch_size: int = B, rank: int = 0, world_size: int = 1,
           grad_accum: int = 1, seed: int = 0) -> DataStream:
    cfg = DataConfig(sets=tuple(DataSetConfig(**{k: str(v) if k == "path" else v for k, v in s.items()})
                                for s in specs), mode=mode)
    return DataStream(cfg, batch_size, SEQ, grad_accum=grad_accum, seed=seed, rank=rank, world_size=world_size,
                      pin_memory=False)


def plain(path: Path, seed: int) -> Loader:
    return Loader(PackedData(path), B, SEQ, seed=seed, pin_memory=False)


def units(path: Path) -> int:
    return plain(path, 0).epoch_windows


def same(b1, b2) -> bool:
    return torch.equal(b1.x, b2.x) and torch.equal(b1.y, b2.y)


def test_one_data_set_is_the_plain_loader(sets):
    s = DataStream(DataConfig(path=str(sets["wiki"])), B, SEQ, seed=3, pin_memory=False)
    ref = plain(sets["wiki"], 3)
    assert s.describe() == [ref.describe()] and s.epoch_windows == ref.epoch_windows and s.kind == "text"
    for _ in range(3 * ref.epoch_windows // B):  # three epochs
        start = {"epoch": ref.epoch, "cursor": ref.cursor}  # where the batch starts in the stream
        assert same(s.next_batch(), ref.next_batch())
        assert s.position() == {"set": "wiki", "set_index": 0, **start}
    assert s.state_dict() == ref.state_dict()  # the checkpoint format of a single data set is unchanged
    assert not s.exhausted and s.pop_events() == []
    assert [name for name, _ in s.val_sets()] == ["wiki"]


def test_curriculum_moves_on_exactly_at_the_budget(sets):
    ew = units(sets["wiki"])
    s = stream([{"path": sets["wiki"], "epochs": 1.5}, {"path": sets["novel"], "tokens": 40 * SEQ + 1}])
    budget_w = math.ceil(1.5 * ew)
    calls_w, calls_n = math.ceil(budget_w / B), math.ceil(41 / B)  # 41 windows hold the 1281 tokens
    ref_w, ref_n = plain(sets["wiki"], 0), plain(sets["novel"], 1)  # set i is seeded with seed + i
    for k in range(calls_w):
        assert s.current.name == "wiki" and same(s.next_batch(), ref_w.next_batch())
        assert s.position()["set"] == "wiki" and s.position()["units"] == (k + 1) * B
    [event] = s.pop_events()
    assert event["done"] == "wiki" and event["next"] == "novel" and event["units"] == calls_w * B
    assert event["message"].startswith(f"curriculum: 'wiki' done ({calls_w * B / ew:.2f} epochs, {calls_w * B} "
                                       f"windows, {calls_w * B * SEQ:,} tokens; budget 1.5 epochs); next 'novel'")
    for k in range(calls_n):
        assert not s.exhausted
        assert same(s.next_batch(), ref_n.next_batch())
        assert s.position() == {"set": "novel", "set_index": 1, "epoch": 0, "cursor": k * B, "units": (k + 1) * B}
    assert s.exhausted and s.pop_events()[0]["next"] is None
    lines = s.describe()
    assert lines[0].startswith(f"1/2 'wiki' (text, {sets['wiki']}): 1.5 epochs = {calls_w * B} windows = {calls_w} "
                               "steps, then 'novel' | ")
    assert lines[0].endswith(f" | one epoch = {ew / B:.1f} steps")
    assert f"1,281 tokens = 44 windows ({44 / units(sets['novel']):.2f} epochs) = 11 steps, then stop |" in lines[1]


def test_a_curriculum_switches_between_steps_whatever_the_number_of_processes(sets):
    """With grad_accum 2: 1 process takes 2 micro-batches of 4 windows a step, 2 processes 1 each of 4 + 4.
    The budgets are rounded up to whole steps, so both switch at the same window and read the same stream."""
    spec = [{"path": sets["wiki"], "tokens": 9 * SEQ}, {"path": sets["novel"], "epochs": 0.1}]
    one = stream(spec, grad_accum=2)
    ranks = [stream(spec, grad_accum=2, rank=r, world_size=2) for r in range(2)]
    assert [s.budget for s in one.sets] == [16, 8 * math.ceil(0.1 * units(sets["novel"]) / 8)]
    steps = 0
    while not one.exhausted:
        a1, first = one.next_batch(), one.position()["set"]
        a2 = one.next_batch()
        assert one.position()["set"] == first == ranks[0].current.name  # a step never mixes two sets
        r0, r1 = ranks[0].next_batch(), ranks[1].next_batch()
        assert torch.equal(torch.cat([a1.x, a2.x]), torch.cat([r0.x, r1.x]))
        assert ranks[0].exhausted == ranks[1].exhausted == one.exhausted
        steps += 1
    assert steps == sum(s.budget for s in one.sets) // 8
    assert [s.budget for s in ranks[0].sets] == [s.budget for s in one.sets]


@pytest.mark.parametrize("mode", ["curriculum", "mixture"])
def test_two_ranks_split_each_set_and_switch_together(sets, mode):
    ew = units(sets["wiki"])
    spec = ([{"path": sets["wiki"], "tokens": (ew // B) * B * SEQ}, {"path": sets["novel"]}] if mode == "curriculum"
            else [{"path": sets["wiki"], "weight": 2}, {"path": sets["novel"]}])
    ranks = [stream(spec, mode, batch_size=2, rank=r, world_size=2) for r in range(2)]
    seen: dict[str, list] = {"wiki": [], "novel": []}
    # One process: for a curriculum, 4 units a call, as the two ranks' 2 together; a mixture is made of slots
    # of batch_size units, which one process with batch 2 takes in two calls: the same slots, in order.
    one = stream(spec, mode) if mode == "curriculum" else stream(spec, mode, batch_size=2)

    def calls() -> list[tuple[torch.Tensor, str]]:
        out = []
        for _ in range(1 if mode == "curriculum" else 2):
            x = one.next_batch().x
            out.append((x, one.position()["set"]))
        return out

    for _ in range(2 * (ew // B)):
        b0, b1 = ranks[0].next_batch(), ranks[1].next_batch()
        ref = calls()
        assert torch.equal(torch.cat([b0.x, b1.x]), torch.cat([x for x, _ in ref]))  # rank r: the r-th part
        if mode == "curriculum":
            assert ranks[0].position() == one.position()  # the same set at the same call
        assert ranks[0].position() == ranks[1].position()  # the same position logged on every rank
        for x, name in ref:
            seen[name] += [tuple(row.tolist()) for row in x]
    assert ranks[0].state_dict() == ranks[1].state_dict()
    # The same streams and counts as one process (`last`, the logged position, is slot 0 of the last call).
    drop = lambda st: {k: v for k, v in st.items() if k != "last"}  # noqa: E731
    assert drop(ranks[0].state_dict()) == drop(one.state_dict())
    if mode == "curriculum":
        assert len(seen["wiki"]) == (ew // B) * B  # its budget, to the window
    assert len(seen["wiki"]) >= ew and len(set(seen["wiki"][:ew])) == ew  # within an epoch, no window twice
    assert len(set(seen["novel"])) == len(seen["novel"])


def test_mixture_is_exact_deterministic_and_resumes(sets):
    spec = [{"path": sets["wiki"], "weight": 3}, {"path": sets["novel"], "weight": 1},
            {"path": sets["wiki"], "weight": 2, "name": "wiki_again"}]
    s, twin = stream(spec, "mixture"), stream(spec, "mixture")
    refs = [plain(sets["wiki"], 0), plain(sets["novel"], 1), plain(sets["wiki"], 2)]
    shares = [3 / 6, 1 / 6, 2 / 6]
    counts, order = [0, 0, 0], []
    for n in range(1, 61):
        i = s.current.name
        batch = s.next_batch()
        k = s.position()["set_index"]
        assert s.sets[k].name == i and same(batch, refs[k].next_batch())  # each set continues its own stream
        assert same(twin.next_batch(), batch)
        counts[k] += 1
        order.append(k)
        assert all(abs(c - w * n) < 1 for c, w in zip(counts, shares))  # never a micro-batch off its share
        if n == 25:
            state = json.loads(json.dumps(s.state_dict()))
    assert counts == [30, 10, 20] and order[:6] == [0, 2, 0, 1, 2, 0]
    resumed = stream(spec, "mixture")
    resumed.load_state_dict(state)
    replay = stream(spec, "mixture")
    for _ in range(25):
        replay.next_batch()
    for _ in range(35):
        assert same(resumed.next_batch(), replay.next_batch()) and resumed.position() == replay.position()
    assert resumed.state_dict() == s.state_dict()


def test_curriculum_resumes_where_it_was_and_refuses_other_sets(sets):
    spec = [{"path": sets["wiki"], "tokens": 10 * SEQ}, {"path": sets["novel"]}]
    s = stream(spec)
    for _ in range(4):  # the switch is after the third call
        s.next_batch()
    state = json.loads(json.dumps(s.state_dict()))
    assert state["active"] == 1 and [e["units"] for e in state["sets"]] == [12, 4]
    assert state["sets"][0]["loader"] == plain(sets["wiki"], 0).state_dict() | {"cursor": 12}
    resumed = stream(spec, world_size=2, batch_size=2)  # another number of processes: the same global stream
    other = stream(spec, world_size=2, batch_size=2, rank=1)
    resumed.load_state_dict(state)
    other.load_state_dict(state)
    assert resumed.position() == s.position() and resumed.pop_events() == []
    for _ in range(5):
        ref = s.next_batch()
        assert torch.equal(torch.cat([resumed.next_batch().x, other.next_batch().x]), ref.x)
    with pytest.raises(UserError, match=r"the saved data position is for the curriculum \['wiki', 'novel'\], but "
                                        r"this run has the curriculum \['novel', 'wiki'\]; resume with the same"):
        stream([{"path": sets["novel"], "epochs": 1}, {"path": sets["wiki"]}]).load_state_dict(state)
    with pytest.raises(UserError, match="but this run reads one data set \\(data.path\\)"):
        DataStream(DataConfig(path=str(sets["wiki"])), B, SEQ).load_state_dict(state)
    with pytest.raises(UserError, match="is for one data set \\(data.path\\), but this run reads data.sets"):
        s.load_state_dict(plain(sets["wiki"], 0).state_dict())


def test_sets_must_share_a_tokenizer_and_preferences_stay_alone(sets):
    with pytest.raises(UserError) as e:
        stream([{"path": sets["wiki"], "epochs": 1}, {"path": sets["other"]}])
    assert f"data.sets: {sets['wiki']} and {sets['other']} were prepared with different tokenizers" in str(e.value)
    assert "prepare every set with the same tokenizer" in str(e.value)
    with pytest.raises(UserError, match=r"holds text data and .*prefs pairs data; preference pairs cannot be "
                                        r"combined with text or chat data"):
        stream([{"path": sets["wiki"]}, {"path": sets["prefs"]}], "mixture")
    with pytest.raises(UserError, match="data.path is empty; pass --data"):
        DataStream(DataConfig(), B, SEQ)
    # Preference sets make a curriculum of their own; a token there is one with a target, padding not counted.
    prefs = plain(sets["prefs"], 0)
    s = stream([{"path": sets["prefs"], "tokens": prefs.tokens_per_epoch}, {"path": sets["prefs"]}])
    assert s.kind == "pairs" and s.sets[0].budget == prefs.epoch_windows == 8  # one epoch's tokens: one epoch
    assert s.next_batch().pairs and s.sets[0].unit_name == "pairs"


def test_text_and_chat_mix_and_validation_means(sets):
    s = stream([{"path": sets["wiki"], "weight": 3}, {"path": sets["chat"]}], "mixture")
    assert s.kind == "chat" and s.segments  # the loop picks attention that handles segments
    for _ in range(8):
        batch = s.next_batch()
        assert (batch.seg is not None) == (s.position()["set"] == "chat")
    assert [name for name, _ in s.val_sets()] == ["wiki"]  # the chat set was prepared without a val split
    res = s.combine_eval({"wiki": {"val_loss": 2.0, "val_bpb": 1.0}, "chat": {"val_loss": 4.0}})
    assert res == {"val_loss": 2.5, "val_loss/wiki": 2.0, "val_bpb/wiki": 1.0, "val_loss/chat": 4.0}
    curriculum = stream([{"path": sets["wiki"], "epochs": 1}, {"path": sets["chat"]}])
    assert curriculum.combine_eval({"wiki": {"val_loss": 2.0}, "chat": {"val_loss": 4.0}})["val_loss"] == 3.0


def curriculum_cfg(sets, out: Path, **over):
    return tiny_cfg("", out, **{"data.path": "", "data.sets": [{"path": str(sets["wiki"]), "epochs": 1},
                                                                {"path": str(sets["novel"])}],
                                "train.max_steps": 14, "train.eval_interval": 4, "train.save_interval": 0, **over})


def test_training_resumes_mid_curriculum_exactly_and_logs_the_set(sets, tmp_path, capsys):
    switch = math.ceil(units(sets["wiki"]) / B)  # steps on wiki (one micro-batch a step)
    assert 5 < switch < 11
    full = train(curriculum_cfg(sets, tmp_path / "full"))
    out = capsys.readouterr().out
    assert "data: 2 sets as a curriculum," in out and "data stream: 1/2 'wiki' (text, " in out
    assert f"step {switch:>6}/14 [wiki epoch 0] | loss" in out and f"step {switch + 1:>6}/14 [novel epoch 0]" in out
    assert f"step {switch:>6} | curriculum: 'wiki' done (" in out
    assert "val loss/wiki" not in out and "| val loss " in out and " (wiki " in out and ", novel " in out
    # Stopped before the switch, resumed to a stop after it, then to the end: the losses of one run.
    run = tmp_path / "part"
    train(curriculum_cfg(sets, run, **{"train.max_tokens": 5 * B * SEQ}), quiet=True)
    mid = train(curriculum_cfg(sets, run, **{"train.max_tokens": 11 * B * SEQ}), resume=True, quiet=True)
    end = train(curriculum_cfg(sets, run), resume=True, quiet=True)
    assert (mid.step, end.step, end.stop_reason) == (11, 14, "max_steps")
    assert {**mid.train_losses, **end.train_losses} == {s: full.train_losses[s] for s in range(6, 15)}
    recs = read_metrics(run)
    logged = {r["step"]: r["data"]["set"] for r in recs if "loss" in r}
    assert logged == {s: "wiki" if s <= switch else "novel" for s in range(1, 15)}
    events = [r for r in recs if r.get("event") == "data_set"]
    assert [(r["step"], r["done"], r["next"]) for r in events] == [(switch, "wiki", "novel")]  # once, resumes or not
    val = [r for r in recs if "val_loss" in r][-1]
    assert val["val_loss"] == pytest.approx((val["val_loss/wiki"] + val["val_loss/novel"]) / 2)
    state = json.loads((run / "checkpoints" / "step-00000014" / "state.json").read_text())["loader"]
    assert state["active"] == 1 and state["sets"][1]["units"] == (14 - switch) * B


def test_a_curriculum_whose_last_set_has_a_budget_stops_the_run(sets, tmp_path):
    ew_n = units(sets["novel"])
    cfg = curriculum_cfg(sets, tmp_path / "run", **{
        "data.sets": [{"path": str(sets["wiki"]), "tokens": 3 * B * SEQ}, {"path": str(sets["novel"]), "epochs": 0.25}],
        "train.grad_accum": 2, "train.max_steps": 100, "model.dropout": 0.0})
    res = train(cfg, quiet=True)
    steps = 2 + math.ceil(0.25 * ew_n / (2 * B))  # 12 windows of wiki take 2 steps of 8, then a quarter of novel
    assert res.stop_reason == "data_done" and res.step == steps
    recs = read_metrics(tmp_path / "run")
    assert [(r["done"], r["next"]) for r in recs if r.get("event") == "data_set"] == [("wiki", "novel"),
                                                                                        ("novel", None)]
    assert recs[-1] == {"step": res.step, "tokens": res.tokens, "event": "stop", "reason": "data_done"}
    assert {r["data"]["set"] for r in recs if "loss" in r} == {"wiki", "novel"}


def test_command_line_data_sets(sets):
    from nanolm.cli import _config_from_args, build_parser
    args = build_parser().parse_args(["train", "--preset", "tiny", "--data", f"{sets['wiki']}:epochs=2,name=w",
                                      str(sets["novel"]), "--data.mode", "curriculum"])
    cfg = _config_from_args(args)
    assert cfg.data.path == "" and [(s.name, s.epochs) for s in cfg.data.sets] == [("w", 2.0), ("novel", 0.0)]
    cfg = _config_from_args(build_parser().parse_args(["train", "--data", str(sets["wiki"])]))
    assert cfg.data.path == str(sets["wiki"]) and cfg.data.sets == ()
    with pytest.raises(UserError, match=r"data.sets\[0\] \(wiki\): weight 3 applies only to a mixture"):
        _config_from_args(build_parser().parse_args(["train", "--data", f"{sets['wiki']}:weight=3", "b"]))
    text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert "--data DIR [DIR ...]" in text and "--data.mode" in text and "--data.sets" not in text
