"""Checkpoints that describe themselves, written atomically and loaded strictly.

A run directory holds `checkpoints/step-XXXXXXXX/`, each a complete checkpoint:

    model.safetensors   the weights (tied tensors stored once), or for a LoRA run
    adapter.safetensors + adapter_config.json   only the adapter, with the fingerprint of its base
    config.json         the full run Config (model, data, optim, train)
    state.json          step, tokens seen, data position, RNG states, best validation loss
    optimizer.pt        AdamW state keyed by parameter name, unsharded (torch.save; loaded with weights_only=True)
    tokenizer.json, tokenizer_config.json   when the run knows its tokenizer

A checkpoint is written into a hidden temporary directory and renamed into
place, so a step directory exists only once it is whole: a crash during a save
leaves the previous checkpoints untouched. `best.json` names the step with the
lowest validation loss; the newest step directory is `last`. Old step
directories beyond `keep_last` are pruned, except the best one; a pruned
directory is renamed out of sight before it is deleted, so a kill mid-delete
leaves no partial `step-*`. Each state.json also records the best step
(`best_step`), so a best.json left stale by a kill is rewritten at the next
save. What killed saves leave behind (hidden directories and files named with
the pid of a process that is gone) is removed at the next save.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from nanolm.config import Config
from nanolm.errors import UserError
from nanolm.model.lora import ADAPTER_WEIGHTS, load_adapter, lora_state_dict, merge_lora, save_adapter
from nanolm.io import fsync_dir, first_line, pid_alive, read_json_object, space_note, write_failure, write_json_atomic

STEP_RE = re.compile(r"^step-(\d{8})$")
# What a killed save leaves in checkpoints/: its temp dir, a step moved aside for a re-save, a pruned
# step being deleted, a temp file of best.json; each named with the writer's pid.
LEFTOVER_RE = re.compile(r"^\.(tmp|old|del)-step-(\d{8})-(\d+)$|^\.best\.json\.(\d+)\.[0-9a-f]+\.tmp$")
WEIGHTS = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


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


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with tied tensors stored once (safetensors refuses shared storage)."""
    out: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen and t.numel() > 0:
            continue  # e.g. lm_head.weight tied to embed_tokens.weight
        seen[t.data_ptr()] = name
        if t.untyped_storage().nbytes() > t.numel() * t.element_size():
            t = t.clone()  # a block of a larger matrix (fuse_projections): safetensors wants it alone
        out[name] = t.detach().contiguous().cpu()
    return out


def step_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    ckdir = Path(run_dir) / "checkpoints"
    if not ckdir.is_dir():
        return []
    return sorted(p for p in ckdir.iterdir() if p.is_dir() and STEP_RE.match(p.name))


def save_checkpoint(run_dir: Path, step: int, model: nn.Module, optimizer_state: dict[str, Any] | None,
                    cfg: Config, state: dict[str, Any], *, tokenizer_dir: Path | None = None,
                    keep_last: int = 2, is_best: bool = False, adapter_base: dict[str, Any] | None = None,
                    weights: dict[str, torch.Tensor] | None = None) -> Path:
    """Write checkpoint `step` atomically, update best.json, prune old ones. Returns its directory.

    optimizer_state: `distributed.full_optimizer_state` (keyed by parameter name), or None.
    weights: the full weights when `model` is sharded (`distributed.full_model_state`); else taken from `model`.
    adapter_base: for a LoRA run, {"base_fingerprint": ..., "base_checkpoint": ...}; only the adapter is saved.
    """
    ckdir = Path(run_dir) / "checkpoints"
    ckdir.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(ckdir)
    final = ckdir / f"step-{step:08d}"
    earlier = [d for d in step_dirs(run_dir) if int(d.name[5:]) < step]
    best_step = step if is_best else _recorded_best_step(ckdir, earlier[-1] if earlier else None)
    tensors = None if adapter_base is not None else model_state(model) if weights is None else weights
    tmp = ckdir / f".tmp-step-{step:08d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    part = tmp.name  # the file being written, for that message
    try:
        tmp.mkdir()
        part = ADAPTER_WEIGHTS if tensors is None else WEIGHTS
        if tensors is None:
            lc = cfg.lora
            save_adapter(tmp, model, rank=lc.rank, alpha=lc.alpha, dropout=lc.dropout, targets=lc.targets,
                         **adapter_base)
        else:
            save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt", "step": str(step)})
        part = "config.json"
        write_json_atomic(tmp / "config.json", cfg.to_dict())
        part = "state.json"
        write_json_atomic(tmp / "state.json", {"step": step, **state, "best_step": best_step})
        if optimizer_state is not None:
            part = "optimizer.pt"
            torch.save(optimizer_state, tmp / "optimizer.pt")
        part = "tokenizer files"
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                if (Path(tokenizer_dir) / name).is_file():
                    shutil.copyfile(Path(tokenizer_dir) / name, tmp / name)
        part = "fsync"
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    # A full disk raises OSError here, SafetensorError from safetensors, RuntimeError from torch.save.
    except (OSError, SafetensorError, RuntimeError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        # What this save needs on disk: tensors + JSON and tokenizer files.
        needed = (_nbytes(lora_state_dict(model) if tensors is None else tensors) + _nbytes(optimizer_state)
                  + (1 << 16) + sum((Path(tokenizer_dir) / n).stat().st_size for n in TOKENIZER_FILES
                                    if tokenizer_dir is not None and (Path(tokenizer_dir) / n).is_file()))
        raise UserError(f"{final}: could not write checkpoint ({part}: {write_failure(e)}); "
                        f"{space_note(ckdir, needed)}; the previous checkpoints are untouched; free some space "
                        f"and resume with --resume") from None
    if final.exists():  # re-saving a step after a resume: swap the old copy out, then delete it
        old = ckdir / f".old-step-{step:08d}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(ckdir)

    best_file = ckdir / "best.json"
    if best_step is not None and (is_best or _read_best_step(ckdir) != best_step):
        try:
            write_json_atomic(best_file, {"step": best_step, "val_loss": state.get("best_val_loss")})
        except OSError as e:
            raise UserError(f"{best_file}: could not update it ({write_failure(e)}); checkpoint {final} is saved; "
                            f"free some space and resume with --resume") from None
    for old_dir in step_dirs(run_dir)[:-keep_last]:
        if int(STEP_RE.match(old_dir.name).group(1)) != best_step:
            # Out of sight first: a kill mid-delete must not leave a partial step-* directory.
            gone = ckdir / f".del-{old_dir.name}-{os.getpid()}"
            os.replace(old_dir, gone)
            shutil.rmtree(gone, ignore_errors=True)
    return final


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


def _remove_leftovers(ckdir: Path) -> None:
    """Remove what killed saves left in checkpoints/ (see LEFTOVER_RE) once their process is gone; a step moved
    aside for a re-save goes back into place if its new copy never arrived."""
    for p in ckdir.iterdir():
        m = LEFTOVER_RE.match(p.name)
        if m is None:
            continue
        pid = int(m.group(3) or m.group(4))
        if pid == os.getpid() or pid_alive(pid):
            continue
        if m.group(1) == "old" and not (ckdir / f"step-{m.group(2)}").exists():
            os.replace(p, ckdir / f"step-{m.group(2)}")
        elif p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


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


def read_json(path: Path, what: str) -> dict[str, Any]:
    return read_json_object(path, what, "the checkpoint is incomplete or damaged: use another one")


def load_run_config(ckpt: Path) -> Config:
    return Config.from_dict(read_json(Path(ckpt) / "config.json", "config"), source=str(Path(ckpt) / "config.json"))


def load_weights(model: nn.Module, ckpt: Path) -> None:
    """Load model.safetensors strictly; a corrupt file or a mismatch with the model is a one-line UserError."""
    path = Path(ckpt) / WEIGHTS
    try:
        tensors = load_file(str(path))
    except FileNotFoundError:
        raise UserError(f"{path}: missing weights; the checkpoint is incomplete, use another one") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path}: corrupt or truncated weights ({e}); use another checkpoint") from None
    expected = model.state_dict()
    # Tied weights are stored once; fill the alias from its twin before the strict check.
    for name, t in expected.items():
        if name not in tensors:
            twin = next((n for n, u in expected.items() if n in tensors and u.data_ptr() == t.data_ptr()), None)
            if twin is not None:
                tensors[name] = tensors[twin]
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    shapes = [f"{n} {tuple(tensors[n].shape)} vs model {tuple(t.shape)}" for n, t in expected.items()
              if n in tensors and tensors[n].shape != t.shape]
    if missing or unexpected or shapes:
        parts = []
        if shapes:
            parts.append(f"{len(shapes)} shape mismatch(es), first: {shapes[0]}")
        if missing:
            parts.append(f"{len(missing)} missing, first: {missing[0]}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected, first: {unexpected[0]}")
        raise UserError(f"{path}: checkpoint does not match the model config ({'; '.join(parts)}); "
                        f"use the config the checkpoint was trained with (its config.json)")
    model.load_state_dict(tensors, strict=True)


def read_optimizer(ckpt: Path) -> dict[str, Any]:
    """The saved optimizer state (keyed by parameter name), read without unpickling anything but tensors."""
    path = Path(ckpt) / "optimizer.pt"
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


def is_adapter(ckpt: Path) -> bool:
    return (Path(ckpt) / ADAPTER_WEIGHTS).is_file()


def base_of(ckpt: Path, cfg: Config) -> Path:
    """The full checkpoint a LoRA checkpoint was trained on (its run's train.init_from)."""
    if not cfg.train.init_from:
        raise UserError(f"{ckpt}: this LoRA adapter does not record its base (train.init_from is empty); "
                        f"pass the base checkpoint explicitly")
    return resolve_checkpoint(cfg.train.init_from, "last")


def load_model(path: str | Path, which: str = "best", device: torch.device | str = "cpu",
               adapter: str | Path | None = None) -> tuple[nn.Module, Config, Path]:
    """A model ready for inference: (model, run config, checkpoint dir).

    `path` is a run or checkpoint directory. A LoRA checkpoint is loaded onto
    the base it was trained from, unmerged; `adapter` applies a LoRA run's
    adapter on top of a full model given by `path`.
    """
    from nanolm.model.transformer import Transformer

    src = resolve_checkpoint(path, which)
    cfg = load_run_config(src)
    model = Transformer(cfg.model)
    if is_adapter(src):
        load_weights(model, base_of(src, cfg))
        load_adapter(src, model)
    else:
        load_weights(model, src)
    if adapter is not None:
        ad = resolve_checkpoint(adapter, which)
        if not is_adapter(ad):
            raise UserError(f"{ad}: not a LoRA adapter checkpoint (no {ADAPTER_WEIGHTS}); pass a LoRA run")
        load_adapter(ad, model)
    return model.to(device).eval(), cfg, src


def merge_adapter_checkpoint(adapter: str | Path, out: Path, base: str | Path | None = None) -> Path:
    """Write base + adapter merged into one full checkpoint directory at `out` (atomically)."""
    from nanolm.model.transformer import Transformer

    src = resolve_checkpoint(adapter, "best")
    if not is_adapter(src):
        raise UserError(f"{src}: not a LoRA adapter checkpoint (no {ADAPTER_WEIGHTS}); pass a LoRA run")
    cfg = load_run_config(src)
    model = Transformer(cfg.model)
    load_weights(model, resolve_checkpoint(base, "last") if base else base_of(src, cfg))
    load_adapter(src, model)
    merge_lora(model)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out}: already exists and is not empty; choose a new --out directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(model_state(model), str(tmp / WEIGHTS), metadata={"format": "pt", "merged_from": str(src)})
    write_json_atomic(tmp / "config.json", cfg.to_dict())
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, tmp / name)
    if out.exists():
        out.rmdir()
    os.replace(tmp, out)
    return out
