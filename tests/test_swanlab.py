"""`train.track swanlab`: a real SwanLab run in local mode, its files under <run>/swanlog, nothing uploaded."""

from __future__ import annotations

import sys

import pytest

from nanolm.errors import UserError
from nanolm.train.trainer import train
from test_train import tiny_cfg


def test_swanlab_local_run_writes_its_files(data_dir, tmp_path, monkeypatch):
    pytest.importorskip("swanlab", reason="swanlab is not installed (pip install 'nanolm[swanlab]')")
    monkeypatch.setenv("SWANLAB_SAVE_DIR", str(tmp_path / "swanlab-home"))  # no login state of the user's touched
    run = tmp_path / "run"
    cfg = tiny_cfg(data_dir, run, **{"train.track": "swanlab", "train.max_steps": 4, "train.eval_interval": 2,
                                     "train.swanlab_project": "nanolm-test"})
    assert cfg.train.swanlab_mode == "local"
    train(cfg, quiet=True)
    files = [p for p in (run / "swanlog").rglob("*") if p.is_file()]
    assert files, "no SwanLab run files"
    written = b"".join(p.read_bytes() for p in files)
    for key in (b"loss", b"val_loss", b"grad_norm"):
        assert key in written


def test_swanlab_modes_and_missing_package(data_dir, tmp_path, monkeypatch):
    with pytest.raises(UserError, match=r"train\.swanlab_mode must be one of local, offline, online, got 'cloud'"):
        tiny_cfg(data_dir, tmp_path / "r", **{"train.swanlab_mode": "cloud"})
    monkeypatch.setitem(sys.modules, "swanlab", None)  # import swanlab -> ImportError
    with pytest.raises(UserError, match=r"swanlab, which is not installed; pip install 'nanolm\[swanlab\]'"):
        train(tiny_cfg(data_dir, tmp_path / "run", **{"train.track": "swanlab"}), quiet=True)
