"""The on-disk layout (nanolm.checkpoint) and the atomic directory writer (nanolm.io): a config is checked
against the weights' header before anything is allocated, a model loads from its model config alone, and a
directory is written whole or not at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanolm import checkpoint as ckpt
from nanolm.cli import main
from nanolm.config import ModelConfig
from nanolm.errors import UserError
from nanolm.io import atomic_directory, check_new_directory, remove_directory, remove_leftovers
from nanolm.model.transformer import Transformer

CFG = dict(vocab_size=61, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=64)


def model_dir(tmp_path: Path, **over) -> Path:
    """A model directory as `nanolm lora merge` and `nanolm import hf` write it: weights and a model config."""
    torch.manual_seed(0)
    return ckpt.save_model(tmp_path / "model", Transformer(ModelConfig(**{**CFG, **over})), tokenizer_from=None)


def edit_config(d: Path, **model) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg["model"].update(model)
    (d / "config.json").write_text(json.dumps(cfg))


def test_a_model_loads_from_its_model_config_alone(tmp_path):
    d = model_dir(tmp_path)
    assert json.loads((d / "config.json").read_text()).keys() == {"model"}  # no invented training settings
    model, src = ckpt.load_model(d)
    assert src == d and model.config == ModelConfig(**CFG)
    torch.manual_seed(0)
    ref = Transformer(ModelConfig(**CFG))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
    assert ckpt.trained_seq_len(d) == 64  # no run config: the model's context


def test_a_config_claiming_millions_of_layers_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    d = model_dir(tmp_path)
    edit_config(d, n_layer=100_000_000)
    built = []
    monkeypatch.setattr(Transformer, "__init__", lambda self, cfg: built.append(cfg) or (_ for _ in ()).throw(
        AssertionError("a model was built")))
    with pytest.raises(UserError) as e:
        ckpt.load_model(d)
    assert str(e.value) == (f"{d / 'model.safetensors'}: checkpoint does not match the model config "
                            f"(model.n_layer is 100000000, the file holds 2 layers); use the {d / 'config.json'} "
                            f"the weights were saved with")
    assert built == []


def test_nanolm_generate_with_a_huge_layer_count_is_one_line(tmp_path, capsys):
    d = model_dir(tmp_path)
    edit_config(d, n_layer=100_000_000)
    assert main(["generate", str(d), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.n_layer is 100000000" in err


@pytest.mark.parametrize("over, field", [({"d_model": 64, "n_head": 8}, "model.d_model"),
                                         ({"n_kv_head": 4}, "model.n_kv_head x head_dim"),
                                         ({"n_hidden": 96}, "model.n_hidden"),
                                         ({"vocab_size": 62}, "model.vocab_size")])
def test_a_shape_mismatch_names_the_tensor_and_the_field(tmp_path, over, field):
    d = model_dir(tmp_path)
    edit_config(d, **over)
    with pytest.raises(UserError, match=r"checkpoint does not match the model config \(\d+ shape mismatch\(es\), "
                                        rf"first: .* vs model .*\({field}\)"):
        ckpt.load_model(d)


def test_experts_are_counted_from_the_header_too(tmp_path):
    d = model_dir(tmp_path, use_moe=True, n_experts=4, top_k=2, moe_n_hidden=16)
    edit_config(d, n_experts=1_000_000)
    with pytest.raises(UserError, match=r"model.n_experts is 1000000, the file holds 4 routed experts"):
        ckpt.load_model(d)
    edit_config(d, use_moe=False, n_experts=4)
    with pytest.raises(UserError, match=r"model.use_moe is false, the file holds 4 routed experts"):
        ckpt.load_model(d)


def test_a_truncated_header_is_a_one_line_error(tmp_path):
    d = model_dir(tmp_path)
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:20])
    with pytest.raises(UserError, match=r"model\.safetensors: corrupt or truncated weights"):
        ckpt.load_model(d)


def test_save_model_refuses_a_directory_with_files(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="already exists and is not an empty directory"):
        model_dir(tmp_path)
    assert (tmp_path / "model" / "notes.txt").read_text() == "mine"


# ----------------------------------------------------------------------------- the atomic directory writer

def dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def test_atomic_directory_appears_whole_and_replaces_the_old_one(tmp_path):
    final = tmp_path / "out"
    with atomic_directory(final) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".tmp-out-")
        (tmp / "a").write_text("1")
        assert not final.exists()  # nothing under the final name until the block ends
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (final / "a").read_text() == "1"
    with atomic_directory(final, replace=True) as tmp:
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in final.iterdir()) == ["b"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the old copy is gone


def test_a_failed_write_leaves_the_old_directory_as_it_was(tmp_path):
    final = tmp_path / "out"
    with atomic_directory(final) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(OSError):
        with atomic_directory(final, replace=True) as tmp:
            (tmp / "b").write_text("2")
            raise OSError(28, "No space left on device")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and sorted(p.name for p in final.iterdir()) == ["a"]


def test_without_replace_a_directory_with_files_is_refused_before_writing(tmp_path):
    final = tmp_path / "out"
    final.mkdir()
    (final / "keep").write_text("x")
    with pytest.raises(UserError, match=r"out: already exists and is not an empty directory"):
        with atomic_directory(final):
            raise AssertionError("the block must not run")
    check_new_directory(tmp_path / "new")  # absent: fine
    (tmp_path / "empty").mkdir()
    check_new_directory(tmp_path / "empty")


@pytest.mark.skipif(os.name != "posix", reason="tells dead writers by their pid (POSIX)")
def test_leftovers_of_killed_writers_are_cleared_or_put_back(tmp_path):
    dead, live = dead_pid(), os.getppid()
    (tmp_path / f".tmp-out-{dead}").mkdir()  # a write killed before its rename
    (tmp_path / f".old-data-{dead}").mkdir()  # killed between its two renames: data's new copy never arrived
    (tmp_path / f".old-data-{dead}" / "manifest.json").write_text("{}")
    (tmp_path / f".del-gone-{dead}").mkdir()  # killed mid-delete
    (tmp_path / f".best.json.{dead}.0badc0de.tmp").write_text("{")  # a torn write_bytes_atomic
    (tmp_path / f".tmp-out-{live}").mkdir()  # a live writer at work
    (tmp_path / ".tmp-notes").mkdir()  # not a name nanolm writes
    remove_leftovers(tmp_path, "out")
    assert (tmp_path / f".old-data-{dead}").exists()  # only "out"'s leftovers, when a name is given
    remove_leftovers(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f".tmp-out-{live}", ".tmp-notes", "data"])
    assert (tmp_path / "data" / "manifest.json").read_text() == "{}"


def test_remove_directory_renames_out_of_sight_first(tmp_path, monkeypatch):
    d = tmp_path / "step-00000001"
    d.mkdir()
    (d / "w").write_text("x")
    seen = []
    import shutil
    real = shutil.rmtree
    monkeypatch.setattr(shutil, "rmtree", lambda p, **k: seen.append(Path(p).name) or real(p, **k))
    remove_directory(d)
    assert not d.exists() and seen == [f".del-step-00000001-{os.getpid()}"] and list(tmp_path.iterdir()) == []
