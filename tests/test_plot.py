"""`nanolm plot`: PNGs from the metrics.jsonl of real (tiny) runs."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import pytest

from nanolm.errors import UserError
from nanolm.plot import plot_runs, run_labels, smooth
from nanolm.train.trainer import train
from test_train import tiny_cfg

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir) -> list[Path]:
    root = tmp_path_factory.mktemp("runs")
    out = []
    for name, lr in (("lr-3e-3", "3e-3"), ("lr-1e-3", "1e-3")):
        train(tiny_cfg(data_dir, root / name, **{"train.max_steps": 8, "train.eval_interval": 4,
                                                 "optim.lr": lr, "optim.min_lr": "1e-4"}), quiet=True)
        out.append(root / name)
    return out


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_one_run(runs, tmp_path):
    out = plot_runs([runs[0]], tmp_path / "sub" / "plot.png")
    assert out == tmp_path / "sub" / "plot.png"
    data = out.read_bytes()
    assert png_size(data) == (1320, 880)  # 12 x 8 inches at 110 dpi
    assert len(data) > 30_000  # four panels of curves, not a blank canvas
    assert [p.name for p in out.parent.iterdir()] == ["plot.png"]  # no temp file left behind


def test_plot_two_runs_against_tokens(runs, tmp_path):
    one = plot_runs([runs[0]], tmp_path / "one.png", x="tokens").read_bytes()
    two = plot_runs(runs, tmp_path / "two.png", x="tokens").read_bytes()
    assert png_size(two) == (1320, 880)
    assert two != one
    assert plot_runs(runs, tmp_path / "two.svg").read_bytes().lstrip().startswith(b"<?xml")


def test_plot_errors(runs, tmp_path):
    with pytest.raises(UserError, match=r"nope/metrics\.jsonl: not found; pass a run directory written by"):
        plot_runs([runs[0], tmp_path / "nope"], tmp_path / "p.png")
    with pytest.raises(UserError, match=r"x='time': plot against one of step, tokens"):
        plot_runs(runs, tmp_path / "p.png", x="time")
    with pytest.raises(UserError, match=r"p\.jpg: unknown image type '\.jpg'; end the name in \.png, \.svg, \.pdf"):
        plot_runs(runs, tmp_path / "p.jpg")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text('{"step": 0, "tokens": 0, "event": "stop"}\n')
    with pytest.raises(UserError, match=r"empty/metrics\.jsonl: no training records yet"):
        plot_runs([tmp_path / "empty"], tmp_path / "p.png")
    assert not (tmp_path / "p.png").exists()


def test_legend_names_tell_runs_apart(tmp_path):
    assert run_labels([tmp_path / "a" / "run", tmp_path / "b" / "run"]) == ["a/run", "b/run"]
    assert run_labels([tmp_path / "x" / "r1", tmp_path / "x" / "r2"]) == ["r1", "r2"]
    assert run_labels([tmp_path / "x" / "r1" / "metrics.jsonl"]) == ["r1"]


def test_smooth_is_a_centred_mean_that_skips_gaps():
    got = smooth([1.0, 2.0, 3.0, float("nan"), 5.0], 3)
    assert got == [1.5, 2.0, 2.5, 4.0, 5.0]
    assert all(math.isnan(v) for v in smooth([float("nan")] * 3, 3))
