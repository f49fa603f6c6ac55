"""Silent corruption caught: a flipped byte anywhere in a token shard or a checkpoint's weights or optimizer
state is a one-line error naming the file on every path that reads it, and --resume falls back to the newest
checkpoint that verifies."""

from __future__ import annotations

import json
import random
import shutil
import zlib
from pathlib import Path

import pytest

from nanolm import checkpoint as ckpt
from nanolm.data import shards as shards_module
from nanolm.data.loader import iter_eval_batches
from nanolm.data.shards import PackedData
from nanolm.errors import UserError
from nanolm.io import crc32_of
from nanolm.train.trainer import train
from test_train import read_metrics, same_weights, tiny_cfg

SEEDS = range(12)  # random positions per file


def flip(path: Path, rng: random.Random) -> int:
    """XOR one byte at a random position of the file with a random non-zero value; returns the position."""
    data = bytearray(path.read_bytes())
    at = rng.randrange(len(data))
    data[at] ^= rng.randrange(1, 256)
    path.write_bytes(bytes(data))
    return at


def one_line(e: BaseException, *parts: str) -> None:
    msg = str(e)
    assert "\n" not in msg and all(p in msg for p in parts), msg


def test_crc32_of_a_file_is_zlibs_of_its_bytes(tmp_path):
    data = random.Random(0).randbytes(20_000_000)  # more than one read chunk
    (tmp_path / "f").write_bytes(data)
    assert crc32_of(tmp_path / "f") == f"{zlib.crc32(data):08x}"


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, tokenizer_dir) -> Path:
    from nanolm.data.prepare import prepare
    root = tmp_path_factory.mktemp("chat")
    convs = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}
             for i in range(30)]
    (root / "c.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs), encoding="utf-8")
    prepare([root / "c.jsonl"], tokenizer_dir, root / "data", format="chat", val_fraction=0.1, workers=0, quiet=True)
    return root / "data"


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_a_flipped_byte_anywhere_in_a_shard_is_caught_before_it_is_read(kind, data_dir, chat_dir, tmp_path):
    src = data_dir if kind == "text" else chat_dir
    files = [p.name for p in sorted(src.iterdir()) if p.suffix in (".bin", ".idx", ".mask")]
    assert {Path(f).suffix for f in files} == ({".bin", ".idx"} if kind == "text" else {".bin", ".idx", ".mask"})
    for seed in SEEDS:
        rng = random.Random(seed)
        d = tmp_path / f"d{seed}"
        shutil.copytree(src, d)
        name = rng.choice(files)
        flip(d / name, rng)
        split = name.split("-")[0]
        with pytest.raises(UserError) as e:
            next(iter_eval_batches(PackedData(d, split), 4, 16))
        one_line(e.value, str(d / name), "its checksum is", "run `nanolm prepare` again")


def test_each_shard_file_is_checked_once_per_process(data_dir, tmp_path, monkeypatch):
    d = tmp_path / "d"
    shutil.copytree(data_dir, d)
    calls = []
    real = shards_module.check_crc32
    monkeypatch.setattr(shards_module, "check_crc32", lambda path, *a: (calls.append(Path(path).name), real(path, *a)))
    for _ in range(3):
        PackedData(d, "train")
    assert sorted(calls) == ["train-00000.bin", "train-00000.idx"]
    # a file rewritten in place (another size or time) is checked again, and caught
    flip(d / "train-00000.bin", random.Random(0))
    with pytest.raises(UserError, match="train-00000.bin: its checksum is"):
        PackedData(d, "train")


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_dir) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "run"
    train(tiny_cfg(data_dir, out, **{"train.max_steps": 8, "train.eval_interval": 4, "train.save_interval": 4,
                                     "train.keep_last": 3}), quiet=True)
    return out


def test_a_checkpoint_records_the_crc32_of_its_weights_and_optimizer_state(run):
    last = ckpt.resolve_checkpoint(run, "last")
    sums = json.loads((last / "state.json").read_text())["checksums"]
    assert sums == {n: f"{zlib.crc32((last / n).read_bytes()):08x}" for n in ("model.safetensors", "optimizer.pt")}


def test_a_flipped_byte_in_a_checkpoint_is_caught_by_every_load(run, tmp_path):
    for seed in SEEDS:
        rng = random.Random(seed)
        d = tmp_path / f"c{seed}"
        shutil.copytree(ckpt.resolve_checkpoint(run, "last"), d)
        name = rng.choice(["model.safetensors", "optimizer.pt"])
        flip(d / name, rng)
        with pytest.raises(UserError) as e:
            ckpt.verify_checkpoint(d)
        one_line(e.value, str(d / name), "its checksum is", "falls back to the newest one that verifies")
        with pytest.raises(UserError) as e:  # the one reader of each file
            ckpt.load_model(d) if name == "model.safetensors" else ckpt.read_optimizer(d)
        one_line(e.value, str(d / name), "its checksum is")


def test_resume_passes_over_a_damaged_checkpoint_and_ends_as_the_uninterrupted_run(run, data_dir, tmp_path, capsys):
    over = {"train.max_steps": 8, "train.eval_interval": 4, "train.save_interval": 4, "train.keep_last": 3}
    part = tmp_path / "part"
    train(tiny_cfg(data_dir, part, **over), quiet=True)  # saves steps 4 and 8
    newest = ckpt.resolve_checkpoint(part, "last")
    assert newest.name == "step-00000008"
    flip(newest / "model.safetensors", random.Random(1))
    # resuming redoes steps 5..8 from step 4's checkpoint
    capsys.readouterr()
    resumed = train(tiny_cfg(data_dir, part, **over), resume=True, quiet=True)
    err = capsys.readouterr().err
    assert f"{newest / 'model.safetensors'}: its checksum is" in err
    assert "resuming from" in err and "step-00000004 instead, the newest checkpoint that verifies" in err
    assert resumed.step == 8
    assert same_weights(run, part)  # step 8 written again, whole
    assert [r["step"] for r in read_metrics(part) if "loss" in r] == list(range(1, 9))
    # with every checkpoint damaged there is nothing to fall back to
    for d in ckpt.step_dirs(part):
        flip(d / "optimizer.pt", random.Random(2))
    with pytest.raises(UserError, match="no earlier checkpoint of the run verifies either"):
        train(tiny_cfg(data_dir, part, **over), resume=True, quiet=True)
