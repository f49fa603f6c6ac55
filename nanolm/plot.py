"""Plots of training runs from their metrics.jsonl (`nanolm plot`).

One figure of four panels: loss (training as a line, validation as dashed
markers), learning rate, throughput (tokens/s) and gradient norm, against
optimizer steps or training tokens; runs that scored benchmarks during
training (train.eval_tasks, train.degeneration_samples) get two more: their
task scores and their degeneration metrics. Several runs are overlaid, one colour per
run, named by their directory. Drawn with matplotlib (the `track` extra)
through its object API with the Agg renderer, so it needs no display and
leaves the caller's pyplot backend alone.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Sequence

from nanolm.errors import UserError
from nanolm.io import write_bytes_atomic
from nanolm.metrics_log import read_metrics

X_AXES = ("step", "tokens")
FORMATS = ("png", "svg", "pdf")
# From this many training points on, the loss line is drawn faint with a moving average over it,
# over about 1/SMOOTH_FROM of the points.
SMOOTH_FROM = 50


def metrics_file(run: str | Path) -> Path:
    """<run>/metrics.jsonl, or the .jsonl file itself; UserError when it is not there."""
    path = Path(run)
    file = path if path.suffix == ".jsonl" else path / "metrics.jsonl"
    if not file.is_file():
        raise UserError(f"{file}: not found; pass a run directory written by `nanolm train` "
                        "(it holds metrics.jsonl once the first step is logged)")
    return file


def run_labels(runs: Sequence[str | Path]) -> list[str]:
    """Legend names: each run's directory name, with as many parent directories as tell equal names apart."""
    parts = [Path(r).resolve().parent.parts if Path(r).suffix == ".jsonl" else Path(r).resolve().parts
             for r in runs]
    depth = 1
    while True:
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels) or depth >= max(len(p) for p in parts):
            return labels
        depth += 1


def smooth(values: list[float], window: int) -> list[float]:
    """Centred moving average over `window` points (odd), ignoring non-finite values; no lag, unlike an EMA."""
    import numpy as np

    v = np.asarray(values, dtype=np.float64)
    ok = np.isfinite(v)
    kernel = np.ones(window)
    sums = np.convolve(np.where(ok, v, 0.0), kernel, mode="same")
    counts = np.convolve(ok.astype(np.float64), kernel, mode="same")
    with np.errstate(invalid="ignore", divide="ignore"):
        return (sums / counts).tolist()


def metric_series(records: list[dict[str, Any]], key: str, x: str) -> tuple[list[float], list[float]]:
    """(xs, ys) of the records holding `key`, sorted by x; a null (non-finite when logged) becomes NaN."""
    points = sorted((float(r[x]), float("nan") if r[key] is None else float(r[key]))
                    for r in records if key in r and x in r and not isinstance(r[key], (list, dict, str)))
    return [p[0] for p in points], [p[1] for p in points]


def plot_runs(runs: Sequence[str | Path], out: str | Path, *, x: str = "step") -> Path:
    """Draw the runs' training curves into `out` (.png, .svg or .pdf, written atomically). Returns `out`."""
    if x not in X_AXES:
        raise UserError(f"x={x!r}: plot against one of {', '.join(X_AXES)}")
    if not runs:
        raise UserError("no runs given; pass one or more run directories written by `nanolm train`")
    out = Path(out)
    fmt = out.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise UserError(f"{out}: unknown image type {out.suffix or '(no suffix)'!r}; end the name in "
                        f"{', '.join('.' + f for f in FORMATS)}")
    data = _read_runs(runs)
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError("nanolm plot needs matplotlib, which is not installed; pip install 'nanolm[track]'") from None

    # Benchmark scores of train.eval_tasks (task/<name>/<metric>) and degeneration (degen/...): a third row.
    bench = sorted({k for _, recs in data for r in recs for k in r if k.startswith(("task/", "degen/"))})
    fig = Figure(figsize=(12, 12 if bench else 8), layout="constrained")
    axes = fig.subplots(3 if bench else 2, 2, sharex=True)
    _draw_training(axes, data, x)
    if bench:
        _draw_benchmarks(axes[2], data, bench, x)
    _label(axes, data, x)

    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=110)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(out, buf.getvalue())
    return out


def _read_runs(runs: Sequence[str | Path]) -> list[tuple[str, list[dict[str, Any]]]]:
    """(legend label, metrics records) of each run; UserError for a run without a metrics.jsonl or a logged step."""
    files = [metrics_file(r) for r in runs]
    data = []
    for file, label in zip(files, run_labels(runs)):
        records = read_metrics(file)
        if not any("loss" in r or "val_loss" in r for r in records):
            raise UserError(f"{file}: no training records yet; plot it once the run has logged a step")
        data.append((label, records))
    return data


def _draw_training(axes: Any, data: list[tuple[str, list[dict[str, Any]]]], x: str) -> None:
    """The first two rows: loss (training, smoothed when long, and validation), learning rate, throughput and
    gradient norm, one colour per run."""
    ax_loss, ax_lr, ax_tps, ax_grad = axes[0, 0], axes[0, 1], axes[1, 0], axes[1, 1]
    for i, (label, records) in enumerate(data):
        color = f"C{i % 10}"
        xs, ys = metric_series(records, "loss", x)
        if xs:
            if len(xs) >= SMOOTH_FROM:
                ax_loss.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
                ys = smooth(ys, 2 * (len(ys) // SMOOTH_FROM) + 1)
            ax_loss.plot(xs, ys, color=color, linewidth=1.5)
        xs, ys = metric_series(records, "val_loss", x)
        if xs:
            ax_loss.plot(xs, ys, color=color, linestyle="--", marker="o", markersize=4, linewidth=1.2)
        for ax, key in ((ax_lr, "lr"), (ax_tps, "tokens_per_s"), (ax_grad, "grad_norm")):
            xs, ys = metric_series(records, key, x)
            if xs:
                ax.plot(xs, ys, color=color, linewidth=1.2)


def _draw_benchmarks(row: Any, data: list[tuple[str, list[dict[str, Any]]]], bench: list[str], x: str) -> None:
    """The third row: benchmark scores and degeneration metrics, a line style per metric, a colour per run."""
    from matplotlib.lines import Line2D

    styles = ("-", "--", ":", "-.")
    for ax, prefix, title in ((row[0], "task/", "benchmark scores (train.eval_tasks)"),
                              (row[1], "degen/", "degeneration of sampled text")):
        keys = [k for k in bench if k.startswith(prefix)]
        for i, (label, records) in enumerate(data):
            for j, key in enumerate(keys):
                xs, ys = metric_series(records, key, x)
                if xs:
                    ax.plot(xs, ys, color=f"C{i % 10}", linestyle=styles[j % len(styles)], marker="o",
                            markersize=3, linewidth=1.2)
        ax.set_title(title)
        if keys:
            ax.legend(handles=[Line2D([], [], color="gray", linestyle=styles[j % len(styles)],
                                      label=k.removeprefix(prefix)) for j, k in enumerate(keys)],
                      fontsize="small")


def _label(axes: Any, data: list[tuple[str, list[dict[str, Any]]]], x: str) -> None:
    """Titles, scales, axis formats, grids and the legend of runs and line styles."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter

    ax_loss, ax_lr, ax_tps, ax_grad = axes[0, 0], axes[0, 1], axes[1, 0], axes[1, 1]
    ax_loss.set_title("loss (nats/token)")
    ax_lr.set_title("learning rate")
    ax_tps.set_title("throughput (tokens/s)")
    ax_grad.set_title("gradient norm (before clipping)")
    ax_tps.set_ylim(bottom=0)
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    ax_tps.yaxis.set_major_formatter(EngFormatter())
    norms = [y for _, recs in data for y in metric_series(recs, "grad_norm", x)[1] if y > 0]
    if norms and max(norms) > 20 * min(norms):
        ax_grad.set_yscale("log")  # early spikes would flatten the rest on a linear scale
    for ax in axes[-1]:
        ax.set_xlabel("optimizer step" if x == "step" else "training tokens")
    if x == "tokens":
        for ax in axes.flat:
            ax.xaxis.set_major_formatter(EngFormatter())
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
    # One legend entry per run (its colour), and one per line style (train / validation).
    handles = [Line2D([], [], color=f"C{i % 10}", linewidth=2, label=label) for i, (label, _) in enumerate(data)]
    handles += [Line2D([], [], color="gray", linewidth=1.5, label="train"),
                Line2D([], [], color="gray", linestyle="--", marker="o", markersize=4, label="validation")]
    ax_loss.legend(handles=handles, fontsize="small")
