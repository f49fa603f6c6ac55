"""The on-disk layout of models and training checkpoints: one owner for writing and reading them.

Training, inference, evaluation and export all read and write model
directories through this package; it sits below `train/`, `infer/` and
`export/` and imports none of them.

A model directory (a training checkpoint, a merged LoRA model, an imported HF
model) holds:

    model.safetensors   the weights (tied tensors stored once), or for a LoRA run
    adapter.safetensors + adapter_config.json   only the adapter, with the fingerprint of its base
    config.json         the model config under "model"; a training checkpoint has the whole run Config
    state.json          (training) step, tokens seen, data position, RNG states, best validation loss
    optimizer.pt        (training) AdamW state keyed by parameter name, unsharded (torch.save; read with
                        weights_only=True)
    <name>.safetensors + <name>.optimizer.pt   (training) a module trained beside the model (PPO's critic
                        as critic.*): its weights and optimizer state, restored on --resume
    tokenizer.json, tokenizer_config.json   when the model's tokenizer is known

A model is built from its model config alone (`read_model_config`), and its
weights are checked against that config before anything is allocated: the
safetensors header (tensor names and shapes) must hold the layers, experts and
shapes the config describes (`check_weights`), so a config.json that claims
100,000,000 layers is a one-line error naming `model.n_layer`, not an
allocation that runs until the process is killed. Loading is strict: every
tensor present, none extra, every shape equal.

A run directory holds `checkpoints/step-XXXXXXXX/`. Each is written with
`nanolm.io.atomic_directory`, so a step directory exists only once it is
whole: a crash during a save leaves the previous checkpoints untouched.
`best.json` names the step with the best value of the run's best metric (`metric`,
`value`: the lowest val_loss, the highest val_reward or task score); the newest step
directory is `last`. Old step directories beyond `keep_last` are pruned,
except the best one (renamed out of sight before they are deleted). Each
state.json also records the best step (`best_step`), so a best.json left
stale by a kill is rewritten at the next save. What killed saves leave behind
is removed at the next save.

The LoRA adapter files are written and read by `checkpoint/adapter.py`, and a
weights file is checked against its config (from the safetensors header
alone) by `checkpoint/weights.py`; this module holds the rest of the layout.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from nanolm.checkpoint.adapter import ADAPTER_WEIGHTS, load_adapter, read_adapter_config, save_adapter
from nanolm.checkpoint.weights import check_weights
from nanolm.config import Config, ModelConfig
from nanolm.errors import UserError
from nanolm.io import (atomic_directory, check_crc32, crc32_of, first_line, read_json_object, remove_directory,
                       remove_leftovers, space_note, write_failure, write_json_atomic)
from nanolm.model import lora

STEP_RE = re.compile(r"^step-(\d{8})$")
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
DAMAGED = "the checkpoint is incomplete or damaged: use another one"
STATE = "state.json"  # a training checkpoint's step, data position, RNG, and its files' CRC-32s
OPTIMIZER = "optimizer.pt"


# ----------------------------------------------------------------------------- finding checkpoints

def step_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    ckdir = Path(run_dir) / "checkpoints"
    if not ckdir.is_dir():
        return []
    return sorted(p for p in ckdir.iterdir() if p.is_dir() and STEP_RE.match(p.name))


def _read_best_step(ckdir: Path) -> int | None:
    try:
        return int(json.loads((ckdir / "best.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resolve_checkpoint(path: str | Path, which: str = "last") -> Path:
    """A checkpoint directory from a run directory (its `last` or `best`) or a checkpoint directory itself."""
    p = Path(path)
    if (p / WEIGHTS).is_file() or (p / ADAPTER_WEIGHTS).is_file():
        return p
    if not p.exists():
        raise UserError(f"{p}: no such run or checkpoint directory")
    steps = step_dirs(p)
    if not steps:
        raise UserError(f"{p}: no checkpoint found (expected {p}/checkpoints/step-*/{WEIGHTS}); "
                        f"train first with `nanolm train`")
    if which == "best":
        best = _read_best_step(p / "checkpoints")
        if best is not None and (p / "checkpoints" / f"step-{best:08d}").is_dir():
            return p / "checkpoints" / f"step-{best:08d}"
    return steps[-1]


def run_name(ckpt: Path) -> str:
    """A model's name: its run directory's for a checkpoint inside `<run>/checkpoints/`, else the directory's own
    (what the server calls the model and GGUF's general.name)."""
    ckpt = Path(ckpt).resolve()
    return ckpt.parent.parent.name if ckpt.parent.name == "checkpoints" else ckpt.name


def is_adapter(ckpt: Path) -> bool:
    return (Path(ckpt) / ADAPTER_WEIGHTS).is_file()


# ----------------------------------------------------------------------------- configs

def read_json(path: Path, what: str) -> dict[str, Any]:
    return read_json_object(path, what, DAMAGED)


def read_model_config(ckpt: Path) -> ModelConfig:
    """The model config of a model directory: the "model" section of its config.json, validated."""
    path = Path(ckpt) / CONFIG
    d = read_json(path, "config")
    if not isinstance(d.get("model"), dict):
        raise UserError(f"{path}: no \"model\" section; {DAMAGED}")
    return ModelConfig.from_dict(d["model"], source=str(path))


def read_run_config(ckpt: Path) -> Config:
    """The whole run config of a training checkpoint (resume, a LoRA run's settings)."""
    return Config.from_dict(read_json(Path(ckpt) / CONFIG, "config"), source=str(Path(ckpt) / CONFIG))


def trained_seq_len(ckpt: Path) -> int:
    """The window the model was trained on (its run's train.seq_len), else its context length."""
    d = read_json(Path(ckpt) / CONFIG, "config")
    seq_len = d.get("train", {}).get("seq_len") if isinstance(d.get("train"), dict) else None
    model = read_model_config(ckpt)
    return seq_len if isinstance(seq_len, int) and 0 < seq_len <= model.max_seq_len else model.max_seq_len


# ----------------------------------------------------------------------------- weights

def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with tied tensors stored once (safetensors refuses shared storage)."""
    out: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen and t.numel() > 0:
            continue  # e.g. lm_head.weight tied to embed_tokens.weight
        seen[t.data_ptr()] = name
        out[name] = t.detach().contiguous().cpu()
    return out


def load_weights(model: nn.Module, ckpt: Path) -> None:
    """Load model.safetensors into `model` strictly (checked first against the model's config, header only)."""
    check_weights(Path(ckpt) / WEIGHTS, model.config, Path(ckpt) / CONFIG)
    _read_weights(model, Path(ckpt) / WEIGHTS)


def recorded_checksums(ckpt: Path) -> dict[str, str]:
    """The CRC-32 of each weights file that a training checkpoint's state.json recorded when it was written
    ({} for a model directory without one, a checkpoint from before checksums were kept, or an unreadable
    state.json, which the paths that need it report themselves)."""
    try:
        sums = json.loads((Path(ckpt) / STATE).read_text(encoding="utf-8")).get("checksums")
    except (OSError, ValueError, AttributeError, RecursionError):
        return {}
    return {k: v for k, v in sums.items() if isinstance(k, str) and isinstance(v, str)} \
        if isinstance(sums, dict) else {}


def verify_file(path: Path, want: str | None = None) -> None:
    """Check a checkpoint file's bytes against the CRC-32 its state.json recorded (`want`, else read from there;
    none recorded: no check): one line naming the file when it was damaged since."""
    path = Path(path)
    want = want if want is not None else recorded_checksums(path.parent).get(path.name)
    if want is not None and path.is_file():
        check_crc32(path, want, str(path.parent / STATE),
                    "use an earlier checkpoint of the run (`nanolm train --resume` falls back to the newest one "
                    "that verifies)")


def verify_checkpoint(ckpt: Path) -> None:
    """Every file of a training checkpoint whose CRC-32 its state.json recorded, checked (UserError naming the
    first that differs or is missing)."""
    for name, want in recorded_checksums(ckpt).items():
        if not (Path(ckpt) / name).is_file():
            raise UserError(f"{Path(ckpt) / name}: missing, though {STATE} lists it; the checkpoint is incomplete")
        verify_file(Path(ckpt) / name, want)


def _read_weights(model: nn.Module, path: Path) -> None:
    """The tensors of a weights file that `check_weights` passed, into `model` (after its checksum)."""
    verify_file(path)
    try:
        tensors = load_file(str(path))
    except FileNotFoundError:
        raise UserError(f"{path}: missing weights; the checkpoint is incomplete, use another one") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path}: corrupt or truncated weights ({e}); use another checkpoint") from None
    state = model.state_dict()
    for name, t in state.items():  # tied weights are stored once: fill the alias from its twin
        if name not in tensors:
            twin = next((n for n, u in state.items() if n in tensors and u.data_ptr() == t.data_ptr()), None)
            if twin is not None:
                tensors[name] = tensors[twin]
    model.load_state_dict(tensors, strict=True)


def build_model(cfg: ModelConfig, weights: Path | None = None) -> nn.Module:
    """The one way a model is made: a fresh Transformer of `cfg`, with the weights of the model directory
    `weights` loaded strictly when given (checked against `cfg` before the model is allocated)."""
    from nanolm.model.transformer import Transformer

    if weights is not None:
        check_weights(Path(weights) / WEIGHTS, cfg, Path(weights) / CONFIG)
    model = Transformer(cfg)
    if weights is not None:
        _read_weights(model, Path(weights) / WEIGHTS)
    return model


def base_of(ckpt: Path) -> Path:
    """The full checkpoint a LoRA checkpoint was trained on: the base its adapter_config.json records, else
    its run's train.init_from."""
    recorded = read_adapter_config(ckpt).get("base_checkpoint")
    if recorded:
        return resolve_checkpoint(recorded, "best")
    init_from = read_json(Path(ckpt) / CONFIG, "config").get("train", {}).get("init_from")
    if not init_from:
        raise UserError(f"{ckpt}: this LoRA adapter does not record its base (train.init_from is empty); "
                        f"pass the base checkpoint explicitly")
    return resolve_checkpoint(init_from, "best")


def load_model(path: str | Path, which: str = "best", device: torch.device | str = "cpu",
               adapter: str | Path | None = None, yarn: float | None = None) -> tuple[nn.Module, Path]:
    """A model ready for inference, and its checkpoint directory; its config is `model.config`.

    `path` is a run or checkpoint directory. A LoRA checkpoint is loaded onto
    the base it was trained from, unmerged; `adapter` applies a LoRA run's
    adapter on top of a full model given by `path`. `yarn` stretches the
    context of a model trained without YaRN that many times: from the window it
    was trained on (`trained_seq_len`) to that times `yarn`.
    """
    src = resolve_checkpoint(path, which)
    cfg = read_model_config(src)
    if yarn is not None:
        try:
            cfg = cfg.with_yarn(yarn, trained_seq_len(src))
        except UserError as e:
            raise UserError(f"--yarn {yarn:g}: {src}: {e}") from None
    model = build_model(cfg, base_of(src) if is_adapter(src) else src)
    if is_adapter(src):
        load_adapter(src, model)
    if adapter is not None:
        ad = resolve_checkpoint(adapter, which)
        if not is_adapter(ad):
            raise UserError(f"{ad}: not a LoRA adapter checkpoint (no {ADAPTER_WEIGHTS}); pass a LoRA run")
        load_adapter(ad, model)
    return model.to(device).eval(), src


def require_causal(cfg: ModelConfig, what: str, src: Path | str | None = None) -> None:
    """Refuse a non-causal model (`model.causal` false) on a path that decodes token by token or reads a causal
    language model: one line naming the field and what the model can do instead."""
    if not cfg.causal:
        where = f"{Path(src) / CONFIG}: " if src is not None else ""
        raise UserError(f"{where}model.causal is false: this model reads a whole block and writes the next one in "
                        f"one pass, and {what} needs a causal model that writes token by token; `nanolm generate` "
                        "prints a non-causal model's output block")


def copy_tokenizer(src: Path | None, dest: Path) -> None:
    """The tokenizer files of `src` (when it has them) into `dest`."""
    for name in TOKENIZER_FILES:
        if src is not None and (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, dest / name)


def save_model(out: Path, model: nn.Module, *, tokenizer_from: Path | None,
               metadata: dict[str, str] | None = None) -> Path:
    """Write a model directory (weights, {"model": its config}, the tokenizer) at `out`, whole or not at all;
    `out` must not exist or be empty. Returns `out`."""
    return write_model_dir(out, model_state(model), model.config, tokenizer_from=tokenizer_from, metadata=metadata)


def write_model_dir(out: Path, tensors: dict[str, torch.Tensor], cfg: ModelConfig, *, tokenizer_from: Path | None,
                    metadata: dict[str, str] | None = None) -> Path:
    """`save_model` from the tensors themselves (an imported model has no nanolm module yet)."""
    out = Path(out)
    with atomic_directory(out) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt", **(metadata or {})})
        write_json_atomic(tmp / CONFIG, {"model": cfg.to_dict()})
        copy_tokenizer(tokenizer_from, tmp)
    return out


def merge_adapter_checkpoint(adapter: str | Path, out: Path, base: str | Path | None = None) -> Path:
    """Write base + adapter merged into one full model directory at `out` (atomically)."""
    src = resolve_checkpoint(adapter, "best")
    if not is_adapter(src):
        raise UserError(f"{src}: not a LoRA adapter checkpoint (no {ADAPTER_WEIGHTS}); pass a LoRA run")
    model = build_model(read_model_config(src), resolve_checkpoint(base, "last") if base else base_of(src))
    load_adapter(src, model)
    lora.merge_lora(model)
    return save_model(out, model, tokenizer_from=src, metadata={"merged_from": str(src)})


# ----------------------------------------------------------------------------- training checkpoints

def rng_state() -> dict[str, Any]:
    """Torch RNG states as base64 strings, so they fit in JSON."""
    enc = lambda t: base64.b64encode(t.numpy().tobytes()).decode("ascii")  # noqa: E731
    state = {"torch": enc(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = [enc(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    dec = lambda s: torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)  # noqa: E731
    torch.set_rng_state(dec(state["torch"]))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([dec(s) for s in state["cuda"]])


def companion_files(name: str) -> tuple[str, str]:
    """The weights and optimizer files of a module trained beside the model (PPO's critic: "critic")."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or f"{name}.safetensors" == WEIGHTS:
        raise ValueError(f"a companion module needs a lower-case name of its own, got {name!r}")
    return f"{name}.safetensors", f"{name}.optimizer.pt"


def load_companion(ckpt: Path, name: str, module: nn.Module) -> None:
    """The weights of companion `name` from training checkpoint `ckpt` into `module`, strictly (after their
    checksum)."""
    path = Path(ckpt) / companion_files(name)[0]
    if not path.is_file():
        raise UserError(f"{path}: missing; this checkpoint holds no {name} (written by another stage?), so the run "
                        f"cannot resume from it")
    try:
        _read_weights(module, path)
    except RuntimeError as e:  # load_state_dict: a missing or unexpected tensor, a shape
        raise UserError(f"{path}: does not fit this run's {name} ({first_line(e)}); resume with the settings the "
                        f"run was saved with") from None


def save_checkpoint(run_dir: Path, step: int, model: nn.Module, optimizer_state: dict[str, Any] | None,
                    cfg: Config, state: dict[str, Any], *, tokenizer_dir: Path | None = None,
                    keep_last: int = 2, is_best: bool = False, adapter_base: dict[str, Any] | None = None,
                    weights: dict[str, torch.Tensor] | None = None,
                    companions: dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]] | None = None) -> Path:
    """Write checkpoint `step` atomically, update best.json, prune old ones. Returns its directory.

    optimizer_state: `distributed.full_optimizer_state` (keyed by parameter name), or None.
    weights: the full weights when `model` is sharded (`distributed.full_model_state`); else taken from `model`.
    adapter_base: for a LoRA run, {"base_fingerprint": ..., "base_checkpoint": ...}; only the adapter is saved.
    companions: {name: (weights, optimizer state)} of modules trained beside the model (`companion_files`).
    """
    companions = companions or {}
    ckdir = Path(run_dir) / "checkpoints"
    ckdir.mkdir(parents=True, exist_ok=True)
    remove_leftovers(ckdir)
    final = ckdir / f"step-{step:08d}"
    earlier = [d for d in step_dirs(run_dir) if int(d.name[5:]) < step]
    best_step = step if is_best else _recorded_best_step(ckdir, earlier[-1] if earlier else None)
    tensors = None if adapter_base is not None else model_state(model) if weights is None else weights
    part = final.name  # the file being written, for the message of a failed write
    try:
        with atomic_directory(final, replace=True) as tmp:
            part = ADAPTER_WEIGHTS if tensors is None else WEIGHTS
            if tensors is None:
                lc = cfg.lora
                save_adapter(tmp, model, rank=lc.rank, alpha=lc.alpha, dropout=lc.dropout, targets=lc.targets,
                             **adapter_base)
            else:
                save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt", "step": str(step)})
            part = CONFIG
            write_json_atomic(tmp / CONFIG, cfg.to_dict())
            if optimizer_state is not None:
                part = OPTIMIZER
                torch.save(optimizer_state, tmp / OPTIMIZER)
            extra_files: list[str] = []
            for name, (tensors_of, optim_of) in companions.items():
                weights_file, optim_file = companion_files(name)
                part = weights_file
                save_file(tensors_of, str(tmp / weights_file), metadata={"format": "pt", "step": str(step)})
                part = optim_file
                torch.save(optim_of, tmp / optim_file)
                extra_files += [weights_file, optim_file]
            part = STATE
            # CRC-32 of each weights file, read back as written (from the page cache): what every load checks
            checksums = {n: crc32_of(tmp / n) for n in (WEIGHTS, OPTIMIZER, *extra_files) if (tmp / n).is_file()}
            write_json_atomic(tmp / STATE, {"step": step, **state, "best_step": best_step, "checksums": checksums})
            part = "tokenizer files"
            copy_tokenizer(tokenizer_dir, tmp)
            part = "fsync"  # atomic_directory syncs every file as the block ends
    # A full disk raises OSError here, SafetensorError from safetensors, RuntimeError from torch.save.
    except (OSError, SafetensorError, RuntimeError) as e:
        # What this save needs on disk: tensors + JSON and tokenizer files.
        needed = (_nbytes(lora.lora_state_dict(model) if tensors is None else tensors) + _nbytes(optimizer_state)
                  + _nbytes(list(companions.values()))
                  + (1 << 16) + sum((Path(tokenizer_dir) / n).stat().st_size for n in TOKENIZER_FILES
                                    if tokenizer_dir is not None and (Path(tokenizer_dir) / n).is_file()))
        raise UserError(f"{final}: could not write checkpoint ({part}: {write_failure(e)}); "
                        f"{space_note(ckdir, needed)}; the previous checkpoints are untouched; free some space "
                        f"and resume with --resume") from None

    best_file = ckdir / "best.json"
    if best_step is not None and (is_best or _read_best_step(ckdir) != best_step):
        try:
            write_json_atomic(best_file, {"step": best_step, "metric": state.get("best_metric"),
                                          "value": state.get("best_value")})
        except OSError as e:
            raise UserError(f"{best_file}: could not update it ({write_failure(e)}); checkpoint {final} is saved; "
                            f"free some space and resume with --resume") from None
    for old_dir in step_dirs(run_dir)[:-keep_last]:
        if int(STEP_RE.match(old_dir.name).group(1)) != best_step:
            remove_directory(old_dir)
    return final


def tokenizer_fingerprint(src: Path) -> str | None:
    """The fingerprint of the tokenizer checkpoint `src` was trained with; None when it does not hold it."""
    from nanolm.tokenizer import Tokenizer
    return Tokenizer.load(src).fingerprint if (src / "tokenizer.json").is_file() else None


def _nbytes(obj: Any) -> int:
    """Bytes of the tensors in a (nested) state: about what save_file or torch.save write for it."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def _recorded_best_step(ckdir: Path, newest: Path | None) -> int | None:
    """The best step as of checkpoint `newest` (its state.json; best.json for checkpoints from before
    state.json recorded it)."""
    if newest is None:
        return None
    try:
        state = json.loads((newest / "state.json").read_text(encoding="utf-8"))
        if "best_step" in state:
            return None if state["best_step"] is None else int(state["best_step"])
    except (OSError, ValueError, TypeError):
        pass
    return _read_best_step(ckdir)


def read_optimizer(ckpt: Path, file: str = OPTIMIZER) -> dict[str, Any]:
    """The saved optimizer state (keyed by parameter name), read without unpickling anything but tensors; `file`:
    the model's, or a companion's (`companion_files`)."""
    path = Path(ckpt) / file
    verify_file(path)
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"{path}: missing optimizer state; cannot resume exactly from this checkpoint") from None
    except Exception as e:  # torch raises several types for truncated or foreign files
        raise UserError(f"{path}: corrupt optimizer state ({type(e).__name__}: {first_line(e)}); "
                        f"resume from another checkpoint") from None
    if not (isinstance(sd, dict) and isinstance(sd.get("state"), dict) and isinstance(sd.get("param_groups"), list)
            and all(isinstance(k, str) for k in sd["state"])):
        raise UserError(f"{path}: not an optimizer state keyed by parameter name (written by an older nanolm?); "
                        f"resume from another checkpoint, or start from its weights with --init-from")
    return sd
