"""The report card (`nanolm report RUN...`): each stage's measured effect beside a baseline, in one table.

For every run given (labelled by its train.stage: the pretrained base, SFT,
RL, ...):

- held-out quality: the validation metric the trainer logged in
  metrics.jsonl (`val_bpb`, bits per byte of the val split; `val_reward` for
  grpo, `val_reward_accuracy` for dpo), at the first validation, the last
  and the best. The trainer first validates after train.eval_interval
  steps, not at step 0, so "first" is an early model, not an untrained one;
  the uniform baseline below stands for that.
- its cost: wall time, the last `elapsed_s` of the run's training records
  (seconds of the training loop, resumed runs included; setup and the final
  evaluation and save not included), and tokens, the last `tokens` logged
  (input positions of the training steps; for chat data the padded blocks).
- benchmark tasks: each task spec (a built-in name, `nanolm.eval.builtin`,
  or a task file) scored on the run's best checkpoint by
  `nanolm.eval.runner.run_eval` with its defaults (base models on plain
  text, fine-tuned ones through the chat template), so the card's numbers are
  those of `nanolm eval RUN --task SPEC`: accuracy, its standard error and
  chance.

Baselines of a pretraining run (train.stage pretrain, one data set of text),
computed on exactly the held-out tokens its `val_bpb` scored: the targets of
the first train.eval_batches batches of the val split, as the loader's
`iter_eval_batches` gives them (or, with `text_heldout`, the targets of
those files tokenized as `nanolm eval --data FILES` reads them, and then the
model's bits per byte is that of `nanolm eval` on them, best checkpoint).
"Text" means the bytes the tokens stand for in the run's own tokenizer
(`Tokenizer.token_bytes`; special tokens such as `<|endoftext|>` stand for
no bytes), which is exactly the byte count val_bpb divides by; the training
text is the run's train split decoded so (or `text_train`'s files).

- uniform: every held-out token costs log2(vocab size) bits; about what an
  untrained model scores.
- unigram: each held-out token costs -log2 p(token), p = (count in the
  training tokens + 1) / (training tokens + vocab size) (add-one, Laplace,
  smoothing over the tokenizer's vocabulary); bits summed over the held-out
  tokens, end-of-text tokens included as the model predicts them, over the
  held-out bytes.
- xz -9e: `lzma` (xz format, preset 9 | PRESET_EXTREME) given the training
  text: (compressed size of training + held-out text - compressed size of
  the training text) x 8 / held-out bytes. Of the training text only its last
  XZ_TRAIN_BYTES (64 MiB, the dictionary of preset 9: xz finds no match
  further back) are used.

A fine-tuning run trained on chat data (sft, lora) gets its initial model
(train.init_from, best checkpoint) scored by `nanolm.eval.loss.evaluate` on
the same validation blocks its val_bpb covered (the assistant replies) as
its baseline, and its held-out replies' bits per byte split by source
(`by_source`): the conversations of its data's val split, read again from
the source files its manifest lists by the split rule `nanolm prepare`
applied, grouped by file (or as `source_groups` names them: the quickstart's
chat corpora, tool use and arithmetic), each group scored with the run's best
checkpoint and its initial model (`nanolm.eval.loss.reply_bits`), so a
mixture that buys one source with another shows it.

Every benchmark row says whether its score is better higher (accuracies) or
lower (`everyday`'s share of replies that compute or call unasked, and its
replies' bits per byte, a row of their own).

`build_report` measures and returns the card as a dict (JSON-serialisable);
nanolm/eval/card.py renders it (`format_report`, `write_report`).
"""

from __future__ import annotations

import lzma
import math
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from nanolm.config import registry
from nanolm.errors import UserError
from nanolm.eval.builtin import BUILTIN_TASKS

DEFAULT_TASKS: tuple[str, ...] = BUILTIN_TASKS
XZ_PRESET = 9 | lzma.PRESET_EXTREME  # xz -9e
XZ_TRAIN_BYTES = 64 << 20  # the dictionary size of preset 9: xz reaches no further back
REPORT_VERSION = 1
# Validation metrics, in the order looked for, and whether higher is better.
VALIDATION_METRICS = {"val_bpb": False, "val_reward": True, "val_reward_accuracy": True}
_DECODE_CHUNK = 1 << 20  # training tokens decoded to bytes at a time, from the end, for xz
_TEXT_FIX = "pass the training and held-out text as files instead (text_train, text_heldout)"

Source = Path | str | Sequence[Path | str] | None


# ------------------------------------------------------------------------------------------ the baselines

def xz_bits_per_byte(train: bytes, heldout: bytes) -> float:
    """Bits per held-out byte that xz -9e spends on `heldout` after `train`:
    (len(xz(train + heldout)) - len(xz(train))) * 8 / len(heldout)."""
    if not heldout:
        raise ValueError("xz_bits_per_byte needs at least one held-out byte")

    def size(data: bytes) -> int:
        return len(lzma.compress(data, format=lzma.FORMAT_XZ, preset=XZ_PRESET))

    with ThreadPoolExecutor(max_workers=2) as pool:  # lzma releases the GIL: the two run side by side
        both, alone = pool.map(size, (train + heldout, train))
    return (both - alone) * 8 / len(heldout)


def unigram_counts(train_ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """int64 [vocab_size]: how often each id occurs in `train_ids`."""
    ids = np.asarray(train_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"training ids outside the vocabulary [0, {vocab_size})")
    return np.bincount(ids, minlength=vocab_size)


def unigram_bits_from_counts(counts: np.ndarray, heldout_ids: np.ndarray) -> float:
    """Summed bits of `heldout_ids` under the add-one smoothed unigram model of `counts` (one per vocab id)."""
    counts = np.asarray(counts, dtype=np.float64)
    ids = np.asarray(heldout_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= len(counts)):
        raise ValueError(f"held-out ids outside the vocabulary [0, {len(counts)})")
    bits = np.log2(counts.sum() + len(counts)) - np.log2(counts + 1)  # -log2 p per id, (V,)
    return float(bits[ids].sum())


def unigram_bits_per_byte(train_ids: np.ndarray, heldout_ids: np.ndarray, vocab_size: int,
                          heldout_bytes: int) -> float:
    """Bits per held-out byte of the unigram model of `train_ids` with add-one smoothing over the vocabulary:
    sum over held-out tokens t of -log2((count(t) + 1) / (len(train_ids) + vocab_size)), over heldout_bytes."""
    if heldout_bytes <= 0:
        raise ValueError("unigram_bits_per_byte needs heldout_bytes > 0")
    return unigram_bits_from_counts(unigram_counts(train_ids, vocab_size), heldout_ids) / heldout_bytes


def uniform_bits_per_byte(n_tokens: int, vocab_size: int, heldout_bytes: int) -> float:
    """Bits per byte of n_tokens tokens each drawn uniformly from the vocabulary: an untrained model's score."""
    return n_tokens * math.log2(vocab_size) / heldout_bytes


# ------------------------------------------------------------------------------------------ reading runs

def check_run(path: str | Path) -> Path:
    """`path` as a run directory (config.json, metrics.jsonl, checkpoints/step-*); a one-line UserError else."""
    from nanolm.checkpoint import step_dirs
    from nanolm.eval.runner import run_dir_of

    p = Path(path)
    fix = "pass run directories written by `nanolm train`"
    if is_plain_checkpoint(p):
        return p
    if not p.is_dir():
        raise UserError(f"{p}: no such run directory; {fix}")
    if run_dir_of(p) != p and (run_dir_of(p) / "metrics.jsonl").is_file():
        raise UserError(f"{p}: a checkpoint, not a run; pass its run directory {run_dir_of(p)}")
    missing = [name for name in ("config.json", "metrics.jsonl") if not (p / name).is_file()]
    if not step_dirs(p):
        missing.append("checkpoints/step-*")
    if missing:
        raise UserError(f"{p}: not a training run (it holds no {', '.join(missing)}); {fix}")
    return p


def is_plain_checkpoint(path: Path) -> bool:
    """Whether `path` is a checkpoint no training run wrote (an imported model: `nanolm import`, a built-in
    model): config.json and model.safetensors, no metrics.jsonl. The card gives it benchmark rows only."""
    return (path / "model.safetensors").is_file() and (path / "config.json").is_file() \
        and not (path / "metrics.jsonl").is_file() and not (path.parent.parent / "metrics.jsonl").is_file()


def _point(record: dict[str, Any], key: str) -> dict[str, Any]:
    return {"step": record.get("step"), "tokens": record.get("tokens"), "value": record[key]}


def stage_summary(run: Path, data_set: str | None = None) -> dict[str, Any]:
    """What a run's metrics.jsonl says: steps, tokens, wall time, and its validation metric's first, best and
    last values ({"step", "tokens", "value"} each). data_set: read that data set's own validation metric
    (`val_bpb/NAME`, which a run on several sets logs beside their weighted mean)."""
    from nanolm.metrics_log import read_metrics

    records = read_metrics(run / "metrics.jsonl")
    with_tokens = [r for r in records if isinstance(r.get("tokens"), int)]
    elapsed = [r["elapsed_s"] for r in records if isinstance(r.get("elapsed_s"), (int, float))]
    out: dict[str, Any] = {"steps": with_tokens[-1].get("step") if with_tokens else None,
                           "tokens": with_tokens[-1]["tokens"] if with_tokens else None,
                           "wall_s": elapsed[-1] if elapsed else None, "validation": None}
    for metric, higher in VALIDATION_METRICS.items():
        key = f"{metric}/{data_set}" if data_set else metric
        vals = [r for r in records if isinstance(r.get(key), (int, float))]
        if vals:
            best = (max if higher else min)(vals, key=lambda r: r[key])
            out["validation"] = {"metric": metric, "key": key, "higher_is_better": higher, "first": _point(vals[0], key),
                                 "best": _point(best, key), "last": _point(vals[-1], key)}
            break
    return out


def _as_list(source: Source) -> list[str]:
    if source is None:
        return []
    if isinstance(source, (str, Path)):
        return [str(source)]
    return [str(s) for s in source]


def _byte_table(tok: Any) -> list[bytes]:
    """The bytes each id stands for, b"" for special tokens: what bits per byte counts (token_byte_lengths)."""
    lengths = tok.token_byte_lengths()
    return [b if lengths[i] else b"" for i, b in enumerate(tok.token_bytes())]


def text_of(ids: np.ndarray, table: Sequence[bytes]) -> bytes:
    """The bytes token ids stand for (`_byte_table`), joined."""
    return b"".join(map(table.__getitem__, np.asarray(ids, dtype=np.int64).tolist()))


def _file_stream(files: list[str], tok: Any) -> np.ndarray:
    """The token stream `nanolm eval --data FILES` scores: each document followed by EOT."""
    from nanolm.corpora import resolve_sources
    from nanolm.eval.loss import tokenize_files
    return tokenize_files(resolve_sources(files), tok)


def text_set(cfg: Any) -> str | None:
    """The name of the data set whose held-out text a pretraining run on several sets is measured on: the first
    (the text corpus, beside which a mixture such as the quickstart's adds drills); None with one data set."""
    return cfg.data.sets[0].name if cfg.data.sets else None


def _one_data_dir(cfg: Any) -> Path:
    """The run's prepared data directory (with several sets, the first: `text_set`); UserError when it is gone."""
    if not (cfg.data.sets or cfg.data.path):
        raise UserError(f"the run names no data directory; {_TEXT_FIX}")
    path = Path(cfg.data.sets[0].path if cfg.data.sets else cfg.data.path)
    if not path.is_dir():
        raise UserError(f"{path}: the run's data directory is not there; {_TEXT_FIX}")
    return path


def _train_side(cfg: Any, tok: Any, table: Sequence[bytes], text_train: list[str],
                xz_train_bytes: int) -> tuple[np.ndarray, bytes, dict[str, Any]]:
    """(unigram counts, the training text for xz (its last xz_train_bytes), what it was)."""
    if text_train:
        ids = _file_stream(text_train, tok)
        text = text_of(ids, table)
        return (unigram_counts(ids, tok.vocab_size), text[-xz_train_bytes:],
                {"source": ", ".join(text_train), "tokens": int(len(ids)), "bytes": len(text)})
    from nanolm.data.shards import PackedData
    data_dir = _one_data_dir(cfg)
    data = PackedData(data_dir, "train", tokenizer_fingerprint=tok.fingerprint)
    counts = np.zeros(tok.vocab_size, dtype=np.int64)
    lengths = tok.token_byte_lengths().astype(np.int64)
    n_bytes = 0
    for i, shard in enumerate(data.shards):
        for start in range(0, len(shard), _DECODE_CHUNK):
            ids = data.check_ids(np.asarray(shard[start:start + _DECODE_CHUNK], dtype=np.int64), i)
            counts += np.bincount(ids, minlength=tok.vocab_size)[: tok.vocab_size]
            n_bytes += int(lengths[ids].sum())
    pieces, have = [], 0  # the text's end, decoded backwards a chunk at a time
    for i in reversed(range(len(data.shards))):
        shard = data.shards[i]
        for stop in range(len(shard), 0, -_DECODE_CHUNK):
            pieces.append(text_of(np.asarray(shard[max(0, stop - _DECODE_CHUNK):stop]), table))
            have += len(pieces[-1])
            if have >= xz_train_bytes:
                break
        if have >= xz_train_bytes:
            break
    text = b"".join(reversed(pieces))[-xz_train_bytes:]
    return counts, text, {"source": f"{data_dir} (train split)", "tokens": int(data.n_tokens), "bytes": n_bytes}


def _heldout_side(run: Path, cfg: Any, tok: Any, text_heldout: list[str],
                  device: str) -> tuple[np.ndarray, str, dict[str, Any]]:
    """(the held-out target ids, what they are, with files the model's bits per byte on them else {})."""
    if text_heldout:
        from nanolm.eval.loss import evaluate
        ids = _file_stream(text_heldout, tok)[1:]  # every token but the first is a target
        model = evaluate(run, text_heldout, which="best", device=device, quiet=True)
        return (ids, ", ".join(text_heldout) + " (as nanolm eval --data reads them)",
                {"model_bpb": model["bpb"], "model_checkpoint": model["checkpoint"]})
    from nanolm.data.kinds import TextKind
    from nanolm.data.loader import iter_eval_batches
    from nanolm.data.shards import PackedData
    data_dir = _one_data_dir(cfg)
    val = PackedData(data_dir, "val", tokenizer_fingerprint=tok.fingerprint)
    if val.kind != TextKind.name:
        raise UserError(f"{data_dir}: {val.kind} data, and the baselines are computed on text; {_TEXT_FIX}")
    tc = cfg.train
    # The batches the trainer's validation scores (Trainer.evaluate), so the ids are val_bpb's targets.
    ids = np.concatenate([b.y.reshape(-1).numpy() for b in iter_eval_batches(val, tc.batch_size, tc.seq_len,
                                                                             tc.eval_batches)])
    return ids, (f"{data_dir} (val split: the {tc.eval_batches} batches of {tc.batch_size} x {tc.seq_len} tokens "
                 f"each validation scored)"), {}


def pretrain_baselines(run: Path, cfg: Any, tok: Any, *, text_train: list[str], text_heldout: list[str],
                       xz_train_bytes: int = XZ_TRAIN_BYTES, device: str = "auto") -> dict[str, Any]:
    """The uniform, unigram and xz baselines of a pretraining run on its held-out tokens (see the module doc)."""
    table = _byte_table(tok)
    ids, source, model = _heldout_side(run, cfg, tok, text_heldout, device)
    heldout = text_of(ids, table)
    if not heldout:
        raise UserError(f"{source}: no held-out text to compare on; {_TEXT_FIX}")
    counts, train_text, train = _train_side(cfg, tok, table, text_train, xz_train_bytes)
    return {**model, "heldout": {"source": source, "tokens": int(len(ids)), "bytes": len(heldout)},
            "train": {**train, "xz_bytes": len(train_text)},
            "vocab_size": tok.vocab_size,
            "uniform_bpb": uniform_bits_per_byte(len(ids), tok.vocab_size, len(heldout)),
            "unigram_bpb": unigram_bits_from_counts(counts, ids) / len(heldout),
            "xz_bpb": xz_bits_per_byte(train_text, heldout)}


def init_baseline(cfg: Any, device: str = "auto") -> dict[str, Any]:
    """A chat fine-tuning run's initial model (train.init_from, best checkpoint) scored on the validation blocks
    the run's val_bpb covered."""
    from nanolm.eval.loss import evaluate
    data_dir = _one_data_dir(cfg)
    tc = cfg.train
    r = evaluate(tc.init_from, [data_dir], which="best", batch_size=tc.batch_size, seq_len=tc.seq_len,
                 max_tokens=tc.eval_batches * tc.batch_size * tc.seq_len, device=device, quiet=True)
    return {"init_bpb": r["bpb"], "checkpoint": r["checkpoint"], "source": r["data"], "tokens": r["tokens"]}


def val_by_source(data_dir: Path, tok: Any) -> dict[str, list]:
    """{source file name: its conversations in the val split} of a chat data directory: the manifest's sources
    read again in order (each checked against its sha256), record i of them all in the val split when
    i % k == 1, k from the val_fraction it was prepared with (`nanolm.data.provenance.val_every`)."""
    from nanolm.data.formats import iter_chat_records
    from nanolm.data.kinds import ChatKind
    from nanolm.data.provenance import sha256_of, val_every
    from nanolm.data.shards import MANIFEST, Manifest
    m = Manifest.read(data_dir)
    opts = m.options
    if m.kind != ChatKind.name or opts.get("system_ratio") or opts.get("empty_think_ratio"):
        raise UserError(f"{data_dir / MANIFEST}: not chat data prepared without augmentations, so its held-out "
                        "replies cannot be read again by source")
    k = val_every(opts.get("val_fraction", 0))
    if not k:
        raise UserError(f"{data_dir / MANIFEST}: the data has no val split (val_fraction 0)")
    out: dict[str, list] = {}
    i = 0
    for source in m.sources:
        path = Path(source["path"])
        if not path.is_file() or sha256_of(path) != source.get("sha256"):
            raise UserError(f"{path}: gone or changed since {data_dir} was prepared from it, so its held-out "
                            "replies are not known; keep the sources as prepared")
        convs = out.setdefault(path.name, [])
        for conv, _ in iter_chat_records(path, skip_bad=opts.get("skip_bad", False), fmt=tok.chat_format):
            if i % k == 1:
                convs.append(conv)
            i += 1
    return out


def _sources(cfg: Any) -> int:
    """How many source files a run's (one) data directory was prepared from."""
    from nanolm.data.shards import Manifest
    return len(Manifest.read(_one_data_dir(cfg)).sources)


def by_source(run: Path, cfg: Any, groups: dict[str, Sequence[str]] | None = None,
              device: str = "auto") -> dict[str, dict[str, Any]]:
    """A chat fine-tuning run's held-out reply bits per byte by source (`val_by_source`), with its best
    checkpoint and its initial model: {group: {"files", "conversations", "tokens", "bytes", "bpb", "init_bpb"}}.
    groups: {group name: source file names}; a file no group names is a group of its own (its stem)."""
    from nanolm.checkpoint import load_model
    from nanolm.eval.loss import reply_bits
    from nanolm.runtime import autocast, resolve_device, resolve_dtype
    from nanolm.tokenizer import Tokenizer

    dev = resolve_device(device)
    model, ckpt = load_model(run, "best", dev)
    tok = Tokenizer.load(ckpt)
    per_file = val_by_source(_one_data_dir(cfg), tok)
    named = {f: g for g, files in (groups or {}).items() for f in files}
    grouped: dict[str, list[str]] = {}
    for f in per_file:
        grouped.setdefault(named.get(f, Path(f).stem), []).append(f)
    init, _ = load_model(cfg.train.init_from, "best", dev)
    out = {}
    with autocast(dev, resolve_dtype("auto", dev)):
        for group, files in grouped.items():
            convs = [c for f in files for c in per_file[f]]
            if not convs:
                continue
            mine, theirs = (reply_bits(m.eval(), tok, convs, batch_size=cfg.train.batch_size) for m in (model, init))
            out[group] = {"files": files, "conversations": len(convs), "tokens": mine["tokens"],
                          "bytes": mine["bytes"], "bpb": mine["bpb"], "init_bpb": theirs["bpb"]}
    return out


def with_items(spec: str, n: int | None) -> str:
    """A task spec scoring its first n items, unless it names its own n."""
    from nanolm.eval.runner import parse_task_spec
    if n is None:
        return spec
    parsed = parse_task_spec(spec)
    if parsed.n is not None:
        return spec
    return f"{spec}{',' if parsed.source != spec else ':'}n={n}"


def _labels(runs: list[Path], stages: list[str]) -> list[str]:
    """Each run's stage, with its directory where two runs share a stage."""
    from nanolm.plot import run_labels
    names = run_labels(runs)
    return [s if stages.count(s) == 1 else f"{s} ({name})" for s, name in zip(stages, names)]


def build_report(runs: Sequence[str | Path], *, tasks: Sequence[str] = DEFAULT_TASKS, n: int | None = None,
                 text_train: Source = None, text_heldout: Source = None, device: str = "auto",
                 batch_size: int = 8, xz_train_bytes: int = XZ_TRAIN_BYTES,
                 source_groups: dict[str, Sequence[str]] | None = None,
                 scored: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Measure the report card of `runs` (run directories; see the module doc). tasks: task specs as
    `nanolm eval --task` takes them; n: score each task's first n items (a spec's own n= wins); text_train,
    text_heldout: files (or built-in corpus names) for the pretraining baselines instead of the run's shards;
    batch_size: rows per forward pass of the benchmarks (`nanolm eval`'s default); source_groups: how a chat
    fine-tuning run's held-out replies are grouped by source file (`by_source`); scored: `run_eval` results of
    the same task specs already measured, by the run's path as given (not scored again). A checkpoint that no
    run wrote (an imported model) is a "base" row with benchmarks only. Returns a JSON-serialisable
    dict: {"version", "runs": [...], "tasks": [...], "notes": [...], "settings": {...}}."""
    from nanolm.checkpoint import read_run_config, resolve_checkpoint
    from nanolm.eval.runner import run_eval
    from nanolm.tokenizer import Tokenizer

    if not runs:
        raise UserError("no runs given; pass one or more run directories written by `nanolm train`")
    dirs = [check_run(r) for r in runs]
    specs = [with_items(s, n) for s in tasks]
    train_files, heldout_files = _as_list(text_train), _as_list(text_heldout)
    cfgs = [None if is_plain_checkpoint(d) else read_run_config(d) for d in dirs]
    stages = ["base" if c is None else c.train.stage for c in cfgs]
    notes: list[str] = []
    entries: list[dict[str, Any]] = []
    for run, cfg, label in zip(dirs, cfgs, _labels(dirs, stages)):
        if cfg is None:  # an imported model: what it scores before any stage of ours
            entries.append({"path": str(run.resolve()), "label": label, "stage": "base", "checkpoint": str(run),
                            "steps": None, "tokens": None, "wall_s": None, "validation": None, "data_set": None,
                            "baseline": None})
            continue
        ckpt = resolve_checkpoint(run, "best")
        card = registry.get(cfg.train.stage).card_baseline  # the baseline its stage's row is set beside
        data_set = text_set(cfg) if card == "text" else None
        entry: dict[str, Any] = {"path": str(run.resolve()), "label": label, "stage": cfg.train.stage,
                                 "checkpoint": str(ckpt), **stage_summary(run, data_set), "data_set": data_set,
                                 "baseline": None}
        try:
            if card == "text":
                tok = Tokenizer.load(ckpt)
                entry["baseline"] = pretrain_baselines(run, cfg, tok, text_train=train_files,
                                                       text_heldout=heldout_files, xz_train_bytes=xz_train_bytes,
                                                       device=device)
            elif card == "initial" and (entry["validation"] or {}).get("metric") == "val_bpb":
                entry["baseline"] = init_baseline(cfg, device)
                try:
                    if _sources(cfg) > 1:  # one source: its replies are the validation row's
                        entry["by_source"] = by_source(run, cfg, source_groups, device)
                except UserError as e:
                    notes.append(f"{label}: no split by source: {e}")
        except UserError as e:
            notes.append(f"{label}: no baseline: {e}")
        entries.append(entry)

    by_task: dict[str, dict[str, Any]] = {}
    if specs:
        with tempfile.TemporaryDirectory() as tmp:  # run_eval writes its JSON; the card keeps its own
            for i, (entry, run) in enumerate(zip(entries, dirs)):
                result = (scored or {}).get(str(run)) or run_eval(
                    run, specs, which="best", batch_size=batch_size, device=device, out=Path(tmp) / f"{i}.json")
                for r in result["tasks"]:
                    t = by_task.setdefault(r["task"], {"task": r["task"], "kind": r["kind"], "path": r["path"],
                                                       "results": []})
                    t["results"].append({"label": entry["label"], "path": entry["path"],
                                         "checkpoint": result["checkpoint"],
                                         **{k: v for k, v in r.items() if k not in ("items", "task", "path")}})
    return {"version": REPORT_VERSION, "runs": entries, "tasks": list(by_task.values()), "notes": notes,
            "settings": {"tasks": specs, "n": n, "text_train": train_files, "text_heldout": heldout_files,
                         "xz_train_bytes": xz_train_bytes, "source_groups": source_groups}}
