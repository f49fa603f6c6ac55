"""LoRA adapter files: the one writer and reader of a LoRA run's adapter.

LoRA adapter files: `adapter.safetensors` (only the A and B tensors, keyed by
the model's module names) beside `adapter_config.json` (rank, alpha, dropout,
targets, the module list, a sha256 fingerprint of the base weights, the base
checkpoint and the sha256 of the weights file), so loading an adapter onto a
base it was not trained on, or a pair left inconsistent by an interrupted
save, is refused instead of silently producing nonsense.

A training checkpoint of a LoRA run holds these two files instead of
model.safetensors (nanolm/checkpoint/__init__.py writes them through
`save_adapter` and loads them onto their base with `load_adapter`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from nanolm.errors import UserError
from nanolm.io import fsync_dir, write_bytes_atomic, write_json_atomic
from nanolm.model import lora

ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FORMAT = "nanolm-lora"
ADAPTER_VERSION = 1
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def save_adapter(directory: str | Path, model: nn.Module, *, rank: int, alpha: float, dropout: float,
                 targets: Sequence[str] | str, base_fingerprint: str, base_checkpoint: str | None = None) -> Path:
    """Write adapter.safetensors and adapter_config.json into `directory` (created if needed), each atomically.

    The settings must be those the model's LoRA layers were built with. The
    config records a sha256 of the weights file, so a pair left inconsistent
    by an interrupted re-save is detected on load. Returns the directory.
    """
    targets = lora.normalize_targets(targets)
    lora.check_settings(rank, alpha, dropout, targets)
    modules = lora.lora_modules(model)
    if not modules:
        raise ValueError("the model has no LoRA layers; call apply_lora before save_adapter")
    for name, m in modules.items():
        if (m.rank, m.alpha, m.dropout) != (rank, float(alpha), float(dropout)) or \
                name.rpartition(".")[2] not in targets:
            raise ValueError(f"{name} was built with rank={m.rank}, alpha={m.alpha:g}, dropout={m.dropout:g}, "
                             f"which does not match save_adapter's rank={rank}, alpha={alpha:g}, "
                             f"dropout={dropout:g}, targets={list(targets)}")
    if not _HEX64.match(base_fingerprint):
        raise ValueError(f"base_fingerprint must be base_fingerprint(model)'s sha256 hex, got {base_fingerprint!r}")

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous().cpu() for k, v in lora.lora_state_dict(model).items()}
    data = save_safetensors(tensors, metadata={"format": "pt", "nanolm": ADAPTER_FORMAT})
    config = {
        "format": ADAPTER_FORMAT,
        "version": ADAPTER_VERSION,
        "rank": rank,
        "alpha": float(alpha),
        "dropout": float(dropout),
        "targets": list(targets),
        "modules": list(modules),
        "base_fingerprint": base_fingerprint,
        "base_checkpoint": None if base_checkpoint is None else str(base_checkpoint),
        "weights_sha256": hashlib.sha256(data).hexdigest(),
    }
    write_bytes_atomic(d / ADAPTER_WEIGHTS, data)
    write_json_atomic(d / ADAPTER_CONFIG, config)
    fsync_dir(d)
    return d


def read_adapter_config(directory: str | Path) -> dict[str, Any]:
    """The validated adapter_config.json of an adapter directory."""
    d = Path(directory)
    path = d / ADAPTER_CONFIG
    if not d.is_dir():
        raise UserError(f"{d}: no such adapter directory; pass a directory holding {ADAPTER_CONFIG} and "
                        f"{ADAPTER_WEIGHTS}")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: missing adapter config; pass a directory written by a LoRA run") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: corrupt adapter config ({e}); save the adapter again") from None
    if not isinstance(cfg, dict) or cfg.get("format") != ADAPTER_FORMAT:
        raise UserError(f"{path}: not a nanolm LoRA adapter config (no \"format\": \"{ADAPTER_FORMAT}\"); "
                        f"pass a directory written by a LoRA run")
    if cfg.get("version") != ADAPTER_VERSION:
        raise UserError(f"{path}: adapter format version {cfg.get('version')!r} is not supported (this nanolm "
                        f"reads version {ADAPTER_VERSION}); use the nanolm version that wrote it")
    lora.check_settings(cfg.get("rank"), cfg.get("alpha"), cfg.get("dropout"), cfg.get("targets"), f"{path}: ")
    modules = cfg.get("modules")
    if not isinstance(modules, list) or not modules or not all(isinstance(m, str) for m in modules):
        raise UserError(f"{path}: \"modules\" must be a non-empty list of module names; save the adapter again")
    for key in ("base_fingerprint", "weights_sha256"):
        if not isinstance(cfg.get(key), str) or not _HEX64.match(cfg[key]):
            raise UserError(f"{path}: \"{key}\" must be a sha256 hex string, got {cfg.get(key)!r}; "
                            f"save the adapter again")
    if cfg.get("base_checkpoint") is not None and not isinstance(cfg["base_checkpoint"], str):
        raise UserError(f"{path}: \"base_checkpoint\" must be a string or null, got {cfg['base_checkpoint']!r}")
    return cfg


def load_adapter(directory: str | Path, model: nn.Module) -> dict[str, Any]:
    """Apply the saved LoRA settings to `model` and load the adapter's tensors; returns its config.

    Everything is checked before the model is touched (config, base
    fingerprint, weights file); if loading still fails the model is restored.
    """
    d = Path(directory)
    cfg = read_adapter_config(d)
    cfg_path, weights_path = d / ADAPTER_CONFIG, d / ADAPTER_WEIGHTS
    if lora.lora_modules(model):
        raise ValueError("the model already has LoRA layers; load_adapter applies them itself")
    fp = lora.base_fingerprint(model)
    if fp != cfg["base_fingerprint"]:
        origin = cfg["base_checkpoint"] or "not recorded in the adapter"
        raise UserError(f"{cfg_path}: this adapter was trained on base {cfg['base_fingerprint'][:12]} but the "
                        f"model is {fp[:12]}; load it onto the checkpoint it was trained from ({origin})")
    try:
        data = weights_path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{weights_path}: missing adapter weights; save the adapter again") from None
    if hashlib.sha256(data).hexdigest() != cfg["weights_sha256"]:
        raise UserError(f"{weights_path}: does not match {ADAPTER_CONFIG} (truncated, damaged or from an "
                        f"interrupted save); save the adapter again")
    try:
        tensors = load_safetensors(data)
    except (SafetensorError, ValueError) as e:
        raise UserError(f"{weights_path}: corrupt adapter weights ({e}); save the adapter again") from None

    try:
        names = lora.apply_lora(model, cfg["rank"], cfg["alpha"], cfg["dropout"], cfg["targets"])
    except UserError as e:
        raise UserError(f"{cfg_path}: {e}") from None
    try:
        if names != cfg["modules"]:
            odd = next((n for n in names + cfg["modules"] if (n in names) != (n in cfg["modules"])),
                       "the module order")
            raise UserError(f"{cfg_path}: \"modules\" does not match the layers its targets wrap in this model "
                            f"(first difference: {odd}); save the adapter again")
        lora.load_lora_state_dict(model, tensors, source=str(weights_path))
    except BaseException:
        lora.remove_lora(model)
        raise
    return cfg
