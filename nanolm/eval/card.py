"""The report card rendered (nanolm/eval/report.py measures it): `format_report` as markdown for the terminal,
each stage's row with its held-out measure, cost and baseline, then the benchmarks (better higher or lower,
chance, standard error) and the stage-by-stage gains and costs; `write_report` writes report.md, report.json and
curves.png (validation bits per byte and training loss against tokens, every run; skipped with a line in
report.md where matplotlib, the `track` extra, is missing) into a directory."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from nanolm.config import registry
from nanolm.errors import UserError

REPORT_MD, REPORT_JSON, CURVES_PNG = "report.md", "report.json", "curves.png"


def _wall(seconds: float | None) -> str:
    from nanolm.progress import fmt_duration
    if seconds is None:
        return "?"
    return f"{seconds:.1f}s" if seconds < 60 else fmt_duration(seconds)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _validation_row(entry: dict[str, Any]) -> tuple[str, str, str, str] | None:
    v = entry["validation"]
    if v is None:
        return None
    first, best, last = v["first"], v["best"], v["last"]
    if v["metric"] == "val_bpb":
        stage = registry.find(entry["stage"])  # None: a stage not registered in this process
        what = stage.card_measures if stage is not None else "text"
        if entry.get("data_set"):
            what += f", set {entry['data_set']}"
        measure = f"held-out bits per byte ({what}), first → last validation"
    elif v["metric"] == "val_reward":
        measure = "held-out reward, first → last validation"
    else:
        measure = "held-out pairs ranked right (chosen over rejected), first → last validation"
    value = f"{first['value']:.4f} (step {first['step']}) → {last['value']:.4f} (step {last['step']})"
    if best["step"] != last["step"]:
        value += f"; best {best['value']:.4f} (step {best['step']})"
    b = entry["baseline"] or {}
    if "init_bpb" in b:
        baseline = f"initial model {b['init_bpb']:.4f}"
    elif "xz_bpb" in b and "model_bpb" not in b:
        baseline = f"unigram {b['unigram_bpb']:.4f} · xz -9e {b['xz_bpb']:.4f} · uniform {b['uniform_bpb']:.4f}"
    else:
        baseline = "—"
    return entry["label"], measure, value, baseline


def _rows(report: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rows = []
    for e in report["runs"]:
        row = _validation_row(e)
        if row:
            rows.append(row)
        b = e["baseline"] or {}
        if "model_bpb" in b:
            rows.append((e["label"], f"held-out bits per byte on {b['heldout']['source']}, best checkpoint",
                         f"{b['model_bpb']:.4f}",
                         f"unigram {b['unigram_bpb']:.4f} · xz -9e {b['xz_bpb']:.4f} · "
                         f"uniform {b['uniform_bpb']:.4f}"))
        if e.get("by_source"):
            groups = e["by_source"].items()
            rows.append((e["label"], "held-out bits per byte of replies by source, best checkpoint (lower is better)",
                         " · ".join(f"{g} {v['bpb']:.4f}" for g, v in groups),
                         "initial model " + " · ".join(f"{g} {v['init_bpb']:.4f}" for g, v in groups)))
        if e["stage"] == "base":
            continue  # not trained here
        tokens = "?" if e["tokens"] is None else f"{e['tokens']:,}"
        rows.append((e["label"], "training: steps · tokens · wall time",
                     f"{e['steps']} · {tokens} · {_wall(e['wall_s'])}", "—"))
    for t in report["tasks"]:
        for r in t["results"]:
            how = "chat template" if r["chat"] else "plain text"
            rows.append((r["label"], f"{t['task']} {r.get('metric', 'acc')} ({how}, {r['n']} items; {_better(r)} is "
                                     "better)", _score(r), f"chance {_pct(r['chance'])}"))
            if "reply_bpb" in r:  # everyday: the corpus's own replies under the model
                rows.append((r["label"], f"{t['task']} bits per byte of the held-out replies ({r['n']} "
                                         "conversations; lower is better)", f"{r['reply_bpb']:.4f}", "—"))
    return rows


def _better(r: dict[str, Any]) -> str:
    from nanolm.eval.runner import higher_is_better
    return "higher" if higher_is_better(r) else "lower"


def _score(r: dict[str, Any]) -> str:
    """A task result's score (the accuracy its task names) ± its standard error."""
    from nanolm.eval.runner import score_of
    acc, _, stderr = score_of(r)
    return f"{_pct(acc)} ± {_pct(stderr)}"


def _table(rows: list[tuple[str, ...]]) -> str:
    return _grid([("stage", "measure", "value", "baseline"), *rows])


def _stage_rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per model: each benchmark's score with its change from the model before (a gain or a cost, as
    the task says which way is better), and the stage's training time. Empty with fewer than two models."""
    from nanolm.eval.runner import higher_is_better, score_of
    labels = [e["label"] for e in report["runs"]]
    if len(labels) < 2 or not report["tasks"]:
        return []
    # (heading, the task, result -> (value, higher is better, whether a share))
    columns: list[tuple[str, dict[str, Any], Any]] = []
    for t in report["tasks"]:
        first = t["results"][0]
        columns.append((f"{t['task']} {first.get('metric', 'acc')} ({_better(first)} better)", t,
                        lambda r: (score_of(r)[0], higher_is_better(r), True)))
        if "reply_bpb" in first:
            columns.append((f"{t['task']} reply bits per byte (lower better)", t,
                            lambda r: (r["reply_bpb"], False, False)))
    walls = {e["label"]: e["wall_s"] for e in report["runs"]}
    rows: list[tuple[str, ...]] = [("stage", *(c[0] for c in columns), "training time")]
    before: list[Any] | None = None
    for label in labels:
        now = [next((get(r) for r in t["results"] if r["label"] == label), None) for _, t, get in columns]
        cells = [label]
        for i, v in enumerate(now):
            if v is None:
                cells.append("—")
                continue
            value, higher, share = v
            text = _pct(value) if share else f"{value:.4f}"
            if before is not None and before[i] is not None and value != before[i][0]:
                d = value - before[i][0]
                size = f"{100 * abs(d):.1f} pts" if share else f"{100 * abs(d) / before[i][0]:.1f}%"
                text += f" ({'+' if d > 0 else '−'}{size}, {'gain' if (d > 0) == higher else 'cost'})"
            cells.append(text)
        cells.append("—" if walls.get(label) is None else _wall(walls[label]))
        rows.append(tuple(cells))
        before = now
    return rows


def _grid(rows: list[tuple[str, ...]]) -> str:
    """A markdown table of any width, its first row the heading."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(rows[0]), line(["-" * w for w in widths]), *(line(r) for r in rows[1:])])


def format_report(report: dict[str, Any]) -> str:
    """The card as markdown (readable as it is in a terminal): the table, a line per benchmark, what the
    baselines are, and notes."""
    out = ["# nanolm report card", "", _table(_rows(report))]
    stages = _stage_rows(report)
    if stages:
        out += ["", "Each stage against the model before it (a gain or a cost, by which way each measure is "
                "better):", "", _grid(stages)]
    if report["tasks"]:
        out += ["", "Benchmarks (best checkpoint of each run, scored as `nanolm eval --task` does):", ""]
        for t in report["tasks"]:
            chance = {_pct(r["chance"]) for r in t["results"]}
            scores = ", ".join(f"{r['label']} {_score(r)}" for r in t["results"])
            metric = t["results"][0].get("metric", "acc")
            out.append(f"- {t['task']} ({t['kind']}, {t['results'][0]['n']} items, {metric}, "
                       f"{_better(t['results'][0])} is better): {scores}; chance {' / '.join(sorted(chance))}")
            for r in t["results"]:
                if r.get("misses"):  # calc: what went wrong with the items each model missed
                    from nanolm.eval.calc import format_misses
                    out.append(f"  - {r['label']} missed: {format_misses(r['misses'])}")
                if "reply_bpb" in r:  # everyday: the two shares apart, and the replies' bits per byte
                    out.append(f"  - {r['label']}: arithmetic {_pct(r['arithmetic'])}, tool calls {_pct(r['calls'])}; "
                               f"held-out replies {r['reply_bpb']:.4f} bits per byte")
    pre = [e for e in report["runs"] if e["baseline"] and "xz_bpb" in e["baseline"]]
    if pre:
        out += ["", "Baselines, on the same held-out tokens as the model's bits per byte:", ""]
        for e in pre:
            b = e["baseline"]
            h, tr = b["heldout"], b["train"]
            out.append(f"- {e['label']}: held out: {h['source']}, {h['tokens']:,} tokens, {h['bytes']:,} bytes; "
                       f"training text: {tr['source']}, {tr['tokens']:,} tokens, {tr['bytes']:,} bytes "
                       f"(xz given its last {tr['xz_bytes']:,})")
        out.append(f"- unigram: add-one smoothed token frequencies of the training tokens over the tokenizer's "
                   f"{pre[0]['baseline']['vocab_size']} ids, bits summed over the held-out tokens / held-out bytes; "
                   "xz -9e: (xz(train + held out) - xz(train)) x 8 / held-out bytes; uniform: log2(vocab size) "
                   "bits per token, an untrained model")
    if any(e["baseline"] and "init_bpb" in e["baseline"] for e in report["runs"]):
        out.append("- initial model: the run's train.init_from (best checkpoint) on the validation blocks the "
                   "run's own validation scored")
    if any(e.get("by_source") for e in report["runs"]):
        out.append("- by source: the conversations of the fine-tuning data's val split, grouped by the file each "
                   "came from, their replies teacher-forced (one conversation per row), best checkpoint and initial "
                   "model")
    if report["notes"]:
        out += ["", *(f"Note: {n}" for n in report["notes"])]
    return "\n".join(out) + "\n"


def plot_curves(report: dict[str, Any], out: Path) -> Path:
    """curves.png: validation bits per byte and training loss against training tokens, one colour per run, the
    pretraining baselines as dotted lines. ImportError when matplotlib is missing."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter

    from nanolm.io import write_bytes_atomic
    from nanolm.plot import SMOOTH_FROM, metric_series, smooth
    from nanolm.metrics_log import read_metrics

    fig = Figure(figsize=(12, 5), layout="constrained")
    ax_val, ax_loss = fig.subplots(1, 2)
    for i, e in enumerate(report["runs"]):
        color = f"C{i % 10}"
        if e["stage"] == "base":
            continue  # an imported model: no curves of ours
        records = read_metrics(Path(e["path"]) / "metrics.jsonl")
        xs, ys = metric_series(records, "val_bpb", "tokens")
        if xs:
            ax_val.plot(xs, ys, color=color, linestyle="--", marker="o", markersize=4, label=e["label"])
        xs, ys = metric_series(records, "loss", "tokens")
        if xs:
            if len(xs) >= SMOOTH_FROM:
                ax_loss.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
                ys = smooth(ys, 2 * (len(ys) // SMOOTH_FROM) + 1)
            ax_loss.plot(xs, ys, color=color, linewidth=1.5, label=e["label"])
        b = e["baseline"] or {}
        if "xz_bpb" in b and "model_bpb" not in b:
            for key, style, name in (("unigram_bpb", ":", "unigram"), ("xz_bpb", "-.", "xz -9e")):
                ax_val.axhline(b[key], color=color, linestyle=style, linewidth=1, label=f"{e['label']}: {name}")
    ax_val.set_title("held-out bits per byte (validation)")
    ax_loss.set_title("training loss (nats/token)")
    for ax in (ax_val, ax_loss):
        ax.set_xlabel("training tokens")
        ax.xaxis.set_major_formatter(EngFormatter())
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    write_bytes_atomic(out, buf.getvalue())
    return out


def write_report(report: dict[str, Any], out_dir: str | Path) -> Path:
    """Write report.md, report.json and curves.png into `out_dir` (made if missing), each atomically; returns
    the path of report.md. Without matplotlib, report.md says in one line that the curves were not drawn."""
    from nanolm.io import write_json_atomic, write_text_atomic

    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir}: exists and is not a directory; choose another output directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        plot_curves(report, out_dir / CURVES_PNG)
        curves = f"![validation bits per byte and training loss against tokens]({CURVES_PNG})"
    except ImportError:
        curves = "Curves: not drawn, matplotlib is not installed (pip install 'nanolm[track]')."
    md = out_dir / REPORT_MD
    write_text_atomic(md, format_report(report) + "\n" + curves + "\n")
    write_json_atomic(out_dir / REPORT_JSON, report)
    return md
