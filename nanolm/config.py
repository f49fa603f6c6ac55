"""Typed configuration: one dataclass per concern, presets, files and overrides.

A run's configuration is a `Config` made of `ModelConfig`, `DataConfig`,
`OptimConfig` and `TrainConfig`. It is built in layers, each overriding the one
before: a preset (a plain function below), a TOML or JSON file, then
command-line overrides such as `--model.n_layer 4` whose names and types are
generated from the dataclass fields. Every dataclass validates itself in
`__post_init__` and names the field and what is allowed when a value is wrong.

Generation and serving have one dataclass each: `SamplingParams` (what
generate, chat, the server and the quickstart sample with) and `ServeConfig`
(where `nanolm serve` listens and what one request may cost); their
command-line options are generated from their fields too (nanolm/cli.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from nanolm.errors import UserError


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise UserError(msg)


@dataclass
class ModelConfig:
    """A Llama-style decoder: RoPE (optionally YaRN-scaled), RMSNorm, SwiGLU, grouped-query attention
    (optionally with Qwen3's QK-norm), dense or mixture-of-experts MLPs."""

    vocab_size: int = 6400
    d_model: int = 512
    n_layer: int = 8
    n_head: int = 8
    n_kv_head: int = 2  # grouped-query attention; == n_head is plain multi-head attention
    n_hidden: int = 0  # SwiGLU hidden size; 0 = 8/3 * d_model rounded up to a multiple of 64
    max_seq_len: int = 512  # longest context the model is trained and served at
    rope_theta: float = 1e6
    # YaRN (Peng et al. 2023) stretches RoPE to a context rope_factor times the one the model was trained at,
    # computed as transformers computes it: dimensions that turn more than rope_beta_fast times over the
    # original context keep their frequency, those that turn fewer than rope_beta_slow times are divided by
    # rope_factor, a linear ramp blends the ones between, and cos/sin are scaled by rope_attention_factor.
    rope_scaling: str = "none"  # none: plain RoPE; yarn
    rope_factor: float = 1.0  # yarn: how many times the trained context is stretched, e.g. 4 for 512 -> 2048
    rope_original_max_len: int = 0  # yarn: the context length the model was trained at
    rope_beta_fast: float = 32.0  # yarn
    rope_beta_slow: float = 1.0  # yarn
    rope_attention_factor: float = 0.0  # yarn: the cos/sin scale; 0 = 0.1 ln(rope_factor) + 1, as in the paper
    norm_eps: float = 1e-5
    qk_norm: bool = False  # RMSNorm each head's queries and keys before RoPE (Qwen3, MiniMind-3)
    dropout: float = 0.0
    tie_embeddings: bool = True
    init_std: float = 0.02
    # false: every position attends to the whole input block (bd4sur's Nano's non-causal mode): the model reads a
    # block and writes the next block in one pass, trained with --stage blocks; no KV cache, no token-by-token decoding.
    causal: bool = True
    # Mixture of experts: routed SwiGLU experts (+ shared ones) replace the MLP of every moe_every-th block.
    use_moe: bool = False
    n_experts: int = 4  # routed experts per MoE layer
    n_shared_experts: int = 1  # experts every token goes through
    top_k: int = 2  # routed experts per token
    moe_n_hidden: int = 0  # width of each expert; 0 = n_hidden
    moe_every: int = 1  # block i is MoE when (i + 1) % moe_every == 0 (HF Qwen2-MoE's decoder_sparse_step)
    norm_topk: bool = True  # renormalise the top-k router probabilities to sum to 1
    aux_loss_coef: float = 0.01  # weight of the load-balancing loss added to the training loss

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layer", "n_head", "n_kv_head", "max_seq_len"):
            _check(getattr(self, name) > 0, f"model.{name} must be a positive integer, got {getattr(self, name)}")
        _check(self.d_model % self.n_head == 0,
               f"model.d_model ({self.d_model}) must be divisible by model.n_head ({self.n_head})")
        _check((self.d_model // self.n_head) % 2 == 0,
               f"model.d_model / model.n_head = {self.d_model // self.n_head} must be even for RoPE")
        _check(self.n_head % self.n_kv_head == 0,
               f"model.n_head ({self.n_head}) must be a multiple of model.n_kv_head ({self.n_kv_head})")
        _check(self.n_hidden >= 0, f"model.n_hidden must be >= 0 (0 = automatic), got {self.n_hidden}")
        _check(0.0 <= self.dropout < 1.0, f"model.dropout must be in [0, 1), got {self.dropout}")
        _check(self.rope_theta > 0, f"model.rope_theta must be > 0, got {self.rope_theta}")
        self._check_rope_scaling()
        _check(self.norm_eps > 0, f"model.norm_eps must be > 0, got {self.norm_eps}")
        _check(self.init_std >= 0, f"model.init_std must be >= 0, got {self.init_std}")
        if self.n_hidden == 0:
            self.n_hidden = 64 * math.ceil(8 * self.d_model / 3 / 64)
        if self.use_moe:
            _check(self.n_experts >= 1, f"model.n_experts must be >= 1, got {self.n_experts}")
            _check(1 <= self.top_k <= self.n_experts,
                   f"model.top_k must be in [1, model.n_experts={self.n_experts}], got {self.top_k}")
            _check(self.n_shared_experts >= 0, f"model.n_shared_experts must be >= 0, got {self.n_shared_experts}")
            _check(self.moe_n_hidden >= 0, f"model.moe_n_hidden must be >= 0 (0 = n_hidden), got {self.moe_n_hidden}")
            _check(1 <= self.moe_every <= self.n_layer,
                   f"model.moe_every must be in [1, model.n_layer={self.n_layer}], got {self.moe_every}")
            _check(self.aux_loss_coef >= 0, f"model.aux_loss_coef must be >= 0, got {self.aux_loss_coef}")
            if self.moe_n_hidden == 0:
                self.moe_n_hidden = self.n_hidden

    def _check_rope_scaling(self) -> None:
        _check(self.rope_scaling in ROPE_SCALINGS,
               f"model.rope_scaling must be one of {', '.join(ROPE_SCALINGS)}, got {self.rope_scaling!r}")
        if self.rope_scaling == "none":
            for name, default in _YARN_DEFAULTS.items():
                _check(getattr(self, name) == default, f"model.{name}={getattr(self, name)} applies only with "
                       f"model.rope_scaling yarn; set that, or leave model.{name} at {default}")
            return
        _check(self.rope_factor >= 1,
               f"model.rope_factor must be >= 1 (how many times the context is stretched), got {self.rope_factor}")
        _check(0 < self.rope_original_max_len <= self.max_seq_len,
               f"model.rope_original_max_len must be in [1, model.max_seq_len={self.max_seq_len}] (the context the "
               f"model was trained at) with model.rope_scaling yarn, got {self.rope_original_max_len}")
        _check(self.rope_beta_fast > self.rope_beta_slow > 0,
               f"model.rope_beta_fast ({self.rope_beta_fast}) must exceed model.rope_beta_slow "
               f"({self.rope_beta_slow}), and both be > 0 (YaRN's defaults: 32 and 1)")
        _check(self.rope_attention_factor >= 0,
               f"model.rope_attention_factor must be >= 0 (0 = 0.1 ln(rope_factor) + 1), got "
               f"{self.rope_attention_factor}")

    def with_yarn(self, factor: float, trained_len: int | None = None) -> "ModelConfig":
        """This model with its context stretched `factor` times by YaRN, for a model trained without it:
        rope_original_max_len is `trained_len` (the window it was trained on; default max_seq_len) and
        max_seq_len becomes trained_len * factor, rounded down. The weights are unchanged."""
        _check(self.rope_scaling == "none",
               f"the model already uses YaRN (model.rope_factor={self.rope_factor:g}, model.rope_original_max_len="
               f"{self.rope_original_max_len}); it cannot be stretched again")
        _check(math.isfinite(factor) and factor > 1, f"the YaRN factor must be > 1, got {factor:g}")
        trained_len = self.max_seq_len if trained_len is None else trained_len
        _check(0 < trained_len <= self.max_seq_len,
               f"the trained length must be in [1, model.max_seq_len={self.max_seq_len}], got {trained_len}")
        return dataclasses.replace(self, rope_scaling="yarn", rope_factor=float(factor),
                                   rope_original_max_len=trained_len, max_seq_len=math.floor(trained_len * factor))

    def is_moe_layer(self, i: int) -> bool:
        return self.use_moe and (i + 1) % self.moe_every == 0

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "ModelConfig":
        """A model config alone (a checkpoint's "model" section), validated as in a whole Config."""
        return _build(cls, d, source, prefix="model.")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


ROPE_SCALINGS = ("none", "yarn")
# The YaRN fields, which plain RoPE leaves at these values.
_YARN_DEFAULTS = {"rope_factor": 1.0, "rope_original_max_len": 0, "rope_beta_fast": 32.0, "rope_beta_slow": 1.0,
                  "rope_attention_factor": 0.0}
DATA_MODES = ("curriculum", "mixture")
# Keys of one data set on the command line (`--data DIR:epochs=2,name=wiki`).
_SET_KEYS = ("epochs", "tokens", "weight", "name")
_SET_OPTIONS = re.compile(r"^\w+=[^,=]*(,\w+=[^,=]*)*$")
_SET_NAME = re.compile(r"^[\w.-]+$")
_COUNT_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def default_set_name(path: str) -> str:
    """A data set's name when none is given: its directory's basename, with characters other than
    letters, digits, '_', '.' and '-' replaced by '_' (the name is part of a metrics key, val_loss/<name>)."""
    base = os.path.basename(os.path.normpath(path)) if path else ""
    return re.sub(r"[^\w.-]", "_", base) if base not in ("", ".", "..") else "data"


@dataclass
class DataSetConfig:
    """One prepared data set of a curriculum or a mixture (a `[[data.sets]]` table in TOML).

    In a curriculum it is used for `epochs` (of its epoch 0; fractions
    allowed) or `tokens`, then the next set takes over; with neither (the last
    set only) until the run stops. In a mixture, `weight` is its share of the
    micro-batches. `DataConfig` checks it, as it knows the set's place.
    """

    path: str = ""
    epochs: float = 0.0
    tokens: int = 0
    weight: float = 1.0
    name: str = ""  # "" = the directory's basename, made unique

    @property
    def has_budget(self) -> bool:
        return bool(self.epochs or self.tokens)


@dataclass
class DataConfig:
    """Where the prepared token shards are (the output of `nanolm prepare`).

    One data set is `path`. Several are `sets`: used in turn, each for its
    epochs or tokens (`mode = "curriculum"`), or sampled by weight (`mode =
    "mixture"`); see nanolm/data/sources.py.
    """

    path: str = ""
    sets: tuple[DataSetConfig, ...] = ()
    mode: str = "curriculum"  # how data.sets are used: curriculum (in order) or mixture (by weight)

    def __post_init__(self) -> None:
        _check(isinstance(self.path, str), "data.path must be a string (a directory made by `nanolm prepare`)")
        _check(self.mode in DATA_MODES, f"data.mode must be one of {', '.join(DATA_MODES)}, got {self.mode!r}")
        _check(isinstance(self.sets, (tuple, list)) and all(isinstance(s, DataSetConfig) for s in self.sets),
               "data.sets must be a list of data sets ([[data.sets]] tables in TOML, objects in JSON)")
        _check(not (self.path and self.sets),
               "data.path and data.sets are both set; give one data set as data.path or several as data.sets")
        sets: list[DataSetConfig] = []
        taken = {s.name for s in self.sets}
        for i, s in enumerate(self.sets):
            _check(isinstance(s.path, str) and bool(s.path),
                   f"data.sets[{i}].path is empty; give a directory made by `nanolm prepare`")
            if s.name:
                _check(bool(_SET_NAME.match(s.name)),
                       f"data.sets[{i}].name {s.name!r} may hold only letters, digits, '_', '.' and '-'")
                _check(sum(t.name == s.name for t in self.sets) == 1,
                       f"data.sets[{i}].name {s.name!r} is used twice; give each data set its own name")
            else:  # the basename, with -2, -3 ... where two sets would share it
                base, n, name = default_set_name(s.path), 1, default_set_name(s.path)
                while name in taken:
                    n += 1
                    name = f"{base}-{n}"
                taken.add(name)
                s = dataclasses.replace(s, name=name)
            where = f"data.sets[{i}] ({s.name})"
            _check(s.epochs >= 0 and math.isfinite(s.epochs), f"{where}: epochs must be >= 0, got {s.epochs}")
            _check(s.tokens >= 0, f"{where}: tokens must be >= 0, got {s.tokens}")
            _check(not (s.epochs and s.tokens), f"{where}: give epochs or tokens, not both")
            _check(s.weight > 0 and math.isfinite(s.weight), f"{where}: weight must be > 0, got {s.weight:g}")
            if self.mode == "mixture":
                _check(not s.has_budget, f"{where}: epochs and tokens are budgets of a curriculum; a mixture samples "
                       "its sets by weight until the run stops (drop them, or use data.mode curriculum)")
            else:
                _check(s.weight == 1, f"{where}: weight {s.weight:g} applies only to a mixture; a curriculum uses "
                       "its sets in turn (use data.mode mixture, or drop the weight)")
                _check(s.has_budget or i == len(self.sets) - 1,
                       f"{where} needs epochs or tokens: in a curriculum every set but the last has a budget "
                       "(the last one may repeat until the run stops)")
            sets.append(s)
        self.sets = tuple(sets)


def parse_data_set(spec: str) -> dict[str, Any]:
    """`DIR` or `DIR:key=value[,key=value]` (keys epochs, tokens, weight, name) -> a data set's fields.

    The options start after the last ':' when what follows is a list of
    key=value pairs, so a directory whose name holds ':' still reads as a
    path. tokens takes K, M, B (or G) and T suffixes: 5M = 5,000,000.
    """
    path, sep, options = spec.rpartition(":")
    if not sep or not _SET_OPTIONS.match(options):
        return {"path": spec}
    where = f"--data {_shown(spec, 200)}"
    out: dict[str, Any] = {"path": path}
    for item in options.split(","):
        key, value = item.split("=", 1)
        if key not in _SET_KEYS:
            raise UserError(f"{where}: unknown key {key!r}; use {', '.join(_SET_KEYS)}")
        if key == "tokens":
            out[key] = _parse_count(value, f"{where}: tokens")
        elif key == "name":
            out[key] = value
        else:
            try:
                out[key] = float(value)
            except ValueError:
                raise UserError(f"{where}: {key} must be a number, got {value!r}") from None
    return out


def _parse_count(value: str, where: str) -> int:
    """'5000000', '5M', '2B', '1.5K', '1e6' -> an integer."""
    v = value.strip()
    scale = _COUNT_SUFFIXES.get(v[-1:].upper(), 1)
    try:
        n = float(v[:-1] if scale > 1 else v) * scale
    except ValueError:
        n = float("nan")
    if not (math.isfinite(n) and n >= 0 and n.is_integer()):
        raise UserError(f"{where} must be a whole number of tokens such as 5000000, 5M or 2B, got {value!r}")
    return int(n)


def data_overrides(values: Sequence[str]) -> dict[str, Any]:
    """The values of `--data` as overrides: one plain directory is data.path; otherwise each value,
    `DIR` or `DIR:key=value,...`, is one of data.sets. Either replaces the data a preset or file chose."""
    specs = [parse_data_set(v) for v in values]
    if len(specs) == 1 and len(specs[0]) == 1:
        return {"data.path": specs[0]["path"], "data.sets": []}
    return {"data.path": "", "data.sets": specs}


def format_data_set(d: dict[str, Any]) -> str:
    """A data set's fields (as `Config.to_dict` gives them) in the command-line spelling `DIR:key=value,...`."""
    opts = [f"epochs={d['epochs']:g}"] if d.get("epochs") else []
    opts += [f"tokens={d['tokens']}"] if d.get("tokens") else []
    opts += [f"weight={d['weight']:g}"] if d.get("weight", 1.0) != 1.0 else []
    opts.append(f"name={d.get('name')}")
    return f"{d.get('path')}:{','.join(opts)}"


OPTIMIZERS = ("adamw", "muon")


@dataclass
class OptimConfig:
    """The optimizer (AdamW, or Muon for the hidden matrices beside AdamW; see nanolm/train/optim.py) and the
    learning-rate schedule, whose factor applies to every parameter group."""

    name: str = "adamw"  # adamw; muon: Muon for the blocks' 2-D weights, AdamW for embeddings, norms, head
    muon_lr: float = 0.02  # muon: the peak learning rate of the Muon matrices (nanochat's); lr stays AdamW's
    muon_momentum: float = 0.95  # muon: Muon's (Nesterov) momentum
    lr: float = 5e-4
    min_lr: float = 5e-5
    schedule: str = "cosine"  # cosine: linear warmup then cosine decay to min_lr; constant: warmup then lr
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping

    def __post_init__(self) -> None:
        _check(self.lr > 0, f"optim.lr must be > 0, got {self.lr}")
        _check(self.name in OPTIMIZERS, f"optim.name must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}")
        _check(self.muon_lr > 0, f"optim.muon_lr must be > 0, got {self.muon_lr}")
        _check(0 <= self.muon_momentum < 1, f"optim.muon_momentum must be in [0, 1), got {self.muon_momentum}")
        _check(0 <= self.min_lr <= self.lr, f"optim.min_lr must be in [0, optim.lr={self.lr}], got {self.min_lr}")
        _check(self.schedule in ("cosine", "constant"),
               f"optim.schedule must be 'cosine' or 'constant', got {self.schedule!r}")
        _check(self.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        _check(self.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        _check(self.eps > 0, f"optim.eps must be > 0, got {self.eps}")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1,
               f"optim.beta1 and optim.beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")
        _check(self.grad_clip >= 0, f"optim.grad_clip must be >= 0 (0 disables), got {self.grad_clip}")


@dataclass
class LoRAConfig:
    """Low-rank adapters for `train.stage = "lora"`: W x + (alpha / rank) * B A x on the target projections."""

    enabled: bool = False  # train adapters in any fine-tuning stage (dpo, distill); stage "lora" implies it
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def __post_init__(self) -> None:
        _check(self.rank > 0, f"lora.rank must be a positive integer, got {self.rank}")
        _check(self.alpha > 0, f"lora.alpha must be > 0, got {self.alpha}")
        _check(0.0 <= self.dropout < 1.0, f"lora.dropout must be in [0, 1), got {self.dropout}")
        self.targets = tuple(self.targets)
        _check(len(self.targets) > 0, "lora.targets must name at least one module (e.g. q_proj,v_proj)")


@dataclass
class DPOConfig:
    """Direct preference optimisation (`train.stage = "dpo"`)."""

    beta: float = 0.1  # how far the policy may move from the reference
    ref_from: str = ""  # the frozen reference checkpoint; "" = the initial weights (train.init_from)

    def __post_init__(self) -> None:
        _check(self.beta > 0, f"dpo.beta must be > 0, got {self.beta}")


@dataclass
class DistillConfig:
    """Knowledge distillation (`train.stage = "distill"`): loss = alpha * T^2 * KL(teacher_T || student_T)
    + (1 - alpha) * cross-entropy."""

    teacher: str = ""  # the teacher's run or checkpoint (same tokenizer as the data)
    temperature: float = 2.0
    alpha: float = 0.5

    def __post_init__(self) -> None:
        _check(self.temperature > 0, f"distill.temperature must be > 0, got {self.temperature}")
        _check(0.0 <= self.alpha <= 1.0, f"distill.alpha must be in [0, 1], got {self.alpha}")


@dataclass
class GRPOConfig:
    """RL from rewards (`train.stage = "grpo"`): group_size sampled completions per prompt, group-relative
    advantages, a clipped (or CISPO) policy loss and a k3 KL penalty to the frozen initial model."""

    group_size: int = 8  # completions sampled per prompt (a group; its rewards are compared with each other)
    temperature: float = 1.0  # sampling of the completions
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 256  # completion budget; a completion cut here counts in the `truncated` metric
    thinking: bool = False  # open a <think> block in the generation prompt (the chat template's thinking switch)
    scale_rewards: bool = True  # divide by the group's std (off: Dr. GRPO)
    loss: str = "grpo"  # grpo (PPO's clipped ratio) or cispo (clipped importance weight, stop-gradient)
    epsilon: float = 0.2  # clip ratios below 1 - epsilon
    epsilon_high: float = 0.2  # clip ratios above 1 + epsilon_high (DAPO's clip-higher: > epsilon)
    cispo_clip: float = 5.0  # cispo: the importance weight is clipped at this
    average: str = "token"  # token: every completion token of the step weighs alike (DAPO); sequence: each one
    beta: float = 0.04  # weight of the k3 KL to the reference; 0 drops the reference (no copy is kept)
    inner_epochs: int = 1  # optimizer updates per rollout batch (the behaviour log-probs are kept)
    rewards: str = "answer:1.0"  # weighted rewards by name (nanolm/train/rewards.py), e.g. answer:1,format:0.2
    reward_model: str = ""  # a transformers sequence-classification directory, for the `model` reward
    length_min: int = 1  # the `length` reward's window, in characters of the reply
    length_max: int = 512

    def __post_init__(self) -> None:
        _check(self.group_size >= 2, f"grpo.group_size must be >= 2 (a group compares completions), got "
                                     f"{self.group_size}")
        _check(self.temperature > 0, f"grpo.temperature must be > 0 (the completions of a group must differ), "
                                     f"got {self.temperature}")
        _check(0 < self.top_p <= 1, f"grpo.top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"grpo.top_k must be >= 0 (0 = off), got {self.top_k}")
        _check(self.max_new_tokens > 0, f"grpo.max_new_tokens must be > 0, got {self.max_new_tokens}")
        _check(self.loss in ("grpo", "cispo"), f"grpo.loss must be grpo or cispo, got {self.loss!r}")
        _check(0 < self.epsilon < 1, f"grpo.epsilon must be in (0, 1), got {self.epsilon}")
        _check(self.epsilon_high > 0, f"grpo.epsilon_high must be > 0, got {self.epsilon_high}")
        _check(self.cispo_clip > 0, f"grpo.cispo_clip must be > 0, got {self.cispo_clip}")
        _check(self.average in ("token", "sequence"), f"grpo.average must be token or sequence, got "
                                                      f"{self.average!r}")
        _check(self.beta >= 0, f"grpo.beta must be >= 0 (0 disables the KL penalty), got {self.beta}")
        _check(self.inner_epochs >= 1, f"grpo.inner_epochs must be >= 1, got {self.inner_epochs}")
        _check(self.length_min >= 0, f"grpo.length_min must be >= 0, got {self.length_min}")
        _check(self.length_max > 0 and self.length_max >= self.length_min,
               f"grpo.length_max must be > 0 and >= grpo.length_min ({self.length_min}), got {self.length_max}")


STAGES = ("pretrain", "sft", "lora", "dpo", "distill", "grpo", "blocks")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda", "mps")
TRACKERS = ("tensorboard", "wandb", "swanlab")
WANDB_MODES = ("offline", "online")
SWANLAB_MODES = ("local", "offline", "online")
TASK_METRICS = ("acc", "acc_norm", "centred")
PARALLEL = ("ddp", "fsdp")
SDPA_BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")


def _joined_task_specs(items: tuple[str, ...]) -> tuple[str, ...]:
    """Task specs as given; on the command line the list is comma-separated, so a `key=value` item after a
    spec is one more option of that spec (`idioms:n=64,chat=true,arc.jsonl` is two specs)."""
    out: list[str] = []
    for item in items:
        if out and re.fullmatch(r"[a-z_]+=[^:/]*", item):
            out[-1] += "," + item
        else:
            out.append(item)
    return tuple(out)


@dataclass
class TrainConfig:
    """The training loop: batch shape, budget, evaluation, checkpoints, precision."""

    stage: str = "pretrain"
    out_dir: str = "runs/nanolm"
    batch_size: int = 8  # sequences per micro-batch (per process)
    seq_len: int = 512
    grad_accum: int = 1  # micro-batches per optimizer step
    # Optimizer steps; the schedule decays over these. 0 = fitted to the budget: ceil(max_tokens / tokens per step),
    # or what max_minutes holds at the step rate timed in the first steps (recorded in state.json for --resume).
    # A budget given on the command line or in a file without max_steps means 0.
    max_steps: int = 1000
    max_tokens: int = 0  # stop after this many training tokens (0 = no token budget)
    max_minutes: float = 0.0  # stop after this much wall-clock time (0 = no time budget)
    eval_interval: int = 100  # steps between validation passes (0 = only at the end)
    eval_batches: int = 20  # micro-batches per validation pass
    log_interval: int = 10
    save_interval: int = 100  # steps between `last` checkpoints (0 = only at the end)
    keep_last: int = 2  # step checkpoints to keep (the best one is always kept)
    dtype: str = "auto"  # auto: bfloat16 autocast on CUDA with bf16 support, else float32
    device: str = "auto"
    compile: bool = False  # torch.compile the model: faster steps after a compile at start (15-30 s at 26M here)
    activation_checkpointing: bool = False  # recompute each block in backward: less memory, one more forward
    sdpa_backend: str = "auto"  # attention kernel: auto (PyTorch picks), flash, efficient, cudnn (CUDA), math
    parallel: str = "ddp"  # with torchrun: ddp (a full copy per process) or fsdp (FSDP2: all state sharded)
    seed: int = 1337
    max_nonfinite_steps: int = 3  # steps with a NaN/inf loss or gradient are skipped; this many in a row stop the run
    init_from: str = ""  # a checkpoint to start from (weights only)
    track: tuple[str, ...] = ()  # extra metric sinks beside metrics.jsonl: tensorboard, wandb, swanlab
    wandb_project: str = "nanolm"
    wandb_mode: str = "offline"  # offline: logs under <run>/wandb, upload later with `wandb sync`
    swanlab_project: str = "nanolm"
    swanlab_mode: str = "local"  # local/offline: files under <run>/swanlog (`swanlab watch`); online: uploads
    # Benchmarks scored at each validation (`nanolm eval --task` specs: idioms, a task file, `:n=...`), each on
    # its first eval_task_items items unless its spec gives n; logged as task/<name>/acc, acc_norm, centred.
    eval_tasks: tuple[str, ...] = ()
    eval_task_items: int = 100
    degeneration_samples: int = 0  # sampled continuations of val-split prompts per validation (0 = none)
    best_metric: str = "val_loss"  # what picks the best checkpoint: val_loss (lowest), or task/<name>/<metric>

    def __post_init__(self) -> None:
        _check(self.stage in STAGES, f"train.stage must be one of {', '.join(STAGES)}, got {self.stage!r}")
        for name in ("batch_size", "seq_len", "grad_accum", "eval_batches", "log_interval", "keep_last",
                     "max_nonfinite_steps"):
            _check(getattr(self, name) > 0, f"train.{name} must be a positive integer, got {getattr(self, name)}")
        for name in ("max_tokens", "eval_interval", "save_interval"):
            _check(getattr(self, name) >= 0, f"train.{name} must be >= 0, got {getattr(self, name)}")
        _check(self.max_minutes >= 0, f"train.max_minutes must be >= 0, got {self.max_minutes}")
        _check(self.max_steps >= 0, f"train.max_steps must be >= 0 (0 = fitted to the budget), got {self.max_steps}")
        _check(self.max_steps > 0 or bool(self.max_tokens or self.max_minutes),
               "train.max_steps 0 fits the schedule to a budget; give --train.max_minutes or --train.max_tokens, "
               "or a max_steps > 0")
        # torch.manual_seed takes at most 64 bits and numpy's generators no negative seed.
        _check(0 <= self.seed < 2**63, f"train.seed must be in [0, 2**63), got {self.seed}")
        _check(self.dtype in DTYPES, f"train.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _check(self.device in DEVICES, f"train.device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        _check(self.parallel in PARALLEL, f"train.parallel must be one of {', '.join(PARALLEL)}, got {self.parallel!r}")
        _check(self.sdpa_backend in SDPA_BACKENDS,
               f"train.sdpa_backend must be one of {', '.join(SDPA_BACKENDS)}, got {self.sdpa_backend!r}")
        self.track = tuple(dict.fromkeys(self.track))  # a list from code or a file; repeats dropped
        for name in self.track:
            _check(name in TRACKERS, f"train.track: unknown tracker {name!r}; choose from {', '.join(TRACKERS)}")
        _check(self.wandb_mode in WANDB_MODES,
               f"train.wandb_mode must be one of {', '.join(WANDB_MODES)}, got {self.wandb_mode!r}")
        _check(bool(self.wandb_project.strip()), "train.wandb_project must not be empty")
        _check(self.swanlab_mode in SWANLAB_MODES,
               f"train.swanlab_mode must be one of {', '.join(SWANLAB_MODES)}, got {self.swanlab_mode!r}")
        _check(bool(self.swanlab_project.strip()), "train.swanlab_project must not be empty")
        self.eval_tasks = _joined_task_specs(tuple(self.eval_tasks))
        _check(self.eval_task_items > 0, f"train.eval_task_items must be a positive integer, got {self.eval_task_items}")
        _check(self.degeneration_samples >= 0,
               f"train.degeneration_samples must be >= 0, got {self.degeneration_samples}")
        m = re.fullmatch(r"task/(.+)/([a-z_]+)", self.best_metric)
        _check(self.best_metric == "val_loss" or (m is not None and m.group(2) in TASK_METRICS),
               f"train.best_metric must be val_loss or task/<name>/<{'|'.join(TASK_METRICS)}> of a task in "
               f"train.eval_tasks, got {self.best_metric!r}")
        _check(m is None or bool(self.eval_tasks),
               f"train.best_metric={self.best_metric} needs that task in train.eval_tasks (e.g. --train.eval_tasks "
               f"{m.group(1) if m else ''})")


@dataclass
class Config:
    """Everything a training run needs; saved as config.json in the run directory."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)

    # How the config was chosen where the user did not say (load_config's budget preset); not a field: not saved.
    note: typing.ClassVar[str] = ""

    def __post_init__(self) -> None:
        _check(self.train.seq_len <= self.model.max_seq_len,
               f"train.seq_len ({self.train.seq_len}) must not exceed model.max_seq_len ({self.model.max_seq_len})")
        _check(self.train.stage != "distill" or bool(self.distill.teacher),
               "train.stage=distill needs a teacher: pass --distill.teacher <run or checkpoint>")

    @property
    def uses_lora(self) -> bool:
        return self.train.stage == "lora" or self.lora.enabled

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> list[str]:
        """One line per section, `section: field=value ...`, for the start-of-run print."""
        def fmt(v: Any) -> str:
            if isinstance(v, (tuple, list)):  # names, or data sets (as --data spells them)
                return " ".join(map(format_data_set, v)) if v and isinstance(v[0], dict) else ",".join(v)
            return repr(v) if v == "" else str(v)
        def shown(name: str) -> bool:  # stage-specific sections only where they apply
            if name == "lora":
                return self.uses_lora
            return name not in ("dpo", "distill", "grpo") or name == self.train.stage
        return [f"{name}: " + " ".join(f"{k}={fmt(v)}" for k, v in section.items())
                for name, section in self.to_dict().items() if shown(name)]

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "Config":
        return _build(cls, d, source, prefix="")


# ----------------------------------------------------------------------------- generation

# What torch.Generator.manual_seed takes.
SEED_RANGE = (-2**63, 2**64)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class SamplingParams:
    """How the next token is drawn and how many are drawn: the one set of defaults that `nanolm generate`,
    `nanolm chat`, the server (for the fields a request leaves out) and the quickstart all take.

    The defaults are the command line's long-standing ones, tuned for small models: top-k 50 and top-p 0.95
    cut the long tail of unlikely tokens a small model's sampled text otherwise wanders into. The command-line
    options (`--temperature`, `--top-k`, ...) are generated from these fields; `help` is their help text.
    """

    max_new_tokens: int = field(default=256, metadata={"help": "the most tokens to generate"})
    temperature: float = field(default=0.8, metadata={"help": "0 = greedy"})
    top_k: int = field(default=50, metadata={"help": "keep the k most likely tokens; 0 = off"})
    top_p: float = field(default=0.95, metadata={"help": "keep the most likely tokens up to this mass; 1 = off"})
    seed: int | None = field(default=None, metadata={"help": "makes sampling reproducible"})
    repetition_penalty: float = field(default=1.0, metadata={
        "help": "> 1 makes tokens already in the prompt or reply less likely (logit / p, or x p if negative); 1 = off"})
    presence_penalty: float = field(default=0.0, metadata={
        "help": "subtracted from the logit of every token the reply already holds (OpenAI's, -2 to 2); 0 = off"})
    frequency_penalty: float = field(default=0.0, metadata={
        "help": "subtracted, times its count in the reply so far, from each token's logit (-2 to 2); 0 = off"})

    def __post_init__(self) -> None:
        _check(_is_int(self.max_new_tokens) and self.max_new_tokens >= 0,
               f"max_new_tokens must be >= 0, got {self.max_new_tokens!r}")
        _check(_is_number(self.temperature) and self.temperature >= 0,
               f"temperature must be >= 0, got {self.temperature!r}")
        _check(_is_int(self.top_k) and self.top_k >= 0, f"top_k must be >= 0, got {self.top_k!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(self.seed is None or (_is_int(self.seed) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1]),
               f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        _check(_is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= 10,
               f"repetition_penalty must be in (0, 10] (1 = off, 1.1-1.3 is usual), got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, f"{name} must be in [-2, 2] (0 = off), got {value!r}")


@dataclass
class ServeConfig:
    """`nanolm serve`'s settings: where it listens, who may use it, its name, and what one request may cost.

    It listens on loopback unless `host` says otherwise. At most `max_queue` requests are admitted at once
    (the next gets 429) and at most `max_batch` rows of them decode together; a body over `max_body_bytes`
    gets 413 unread, and one that does not arrive within `body_timeout_s` of its headers gets 408; a connection
    that has not sent a request's headers within `header_timeout_s` is closed, and at most `max_connections`
    are open at once. The `nanolm serve` options are generated from these fields.
    """

    host: str = field(default="127.0.0.1", metadata={"help": "listen address; 0.0.0.0 for every interface"})
    port: int = field(default=8000, metadata={"help": "0 picks a free port"})
    api_key: str | None = field(default=None, repr=False,
                                metadata={"help": "require `Authorization: Bearer KEY` (or set NANOLM_API_KEY)"})
    model_name: str = field(default="", metadata={"help": "the name clients see; \"\" = the run directory's name"})
    max_queue: int = field(default=64,
                           metadata={"help": "requests admitted at once (running or waiting); more get 429"})
    # Decoding reads every weight once per step whatever the rows, so rows decoded together cost little more
    # than one, up to where the products become bound by arithmetic: about 16 rows of a small model on a CPU.
    max_batch: int | None = field(default=None, metadata={
        "help": "rows (choices of requests) decoded together; the rest wait; default 16 on a CPU, 64 on a GPU"})
    # A whole context of text, JSON-escaped, is far less than 1 MiB for nanolm's models.
    max_body_bytes: int = field(default=1 << 20,
                                metadata={"help": "largest request body; a larger one gets 413 unread"})
    # A client that stops sending gets 408 instead of holding its connection open for good.
    body_timeout_s: float = field(default=30.0, metadata={
        "flag": "--body-timeout", "help": "seconds a request body may take to arrive after its headers; then 408"})
    # A connection that never finishes its request's headers (a half-open or idle socket) is closed after
    # this; uvicorn's own keep-alive time-out starts only after a first response.
    header_timeout_s: float = field(default=10.0, metadata={
        "flag": "--header-timeout", "help": "seconds a connection may take to send a request's headers; then closed"})
    max_connections: int = field(default=256, metadata={
        "help": "open connections at once; one more is closed at once"})
    guide_calls: bool = field(default=True, metadata={
        "help": "once the model opens a tool call, hold what it writes to the offered tools' schemas"})
    # Decoding is bound by reading the weights, which one core nearly saturates, while the HTTP side (parsing,
    # tokenizing, streaming) needs a core of its own: on 2 cores, 16 requests of `tiny` together ran 4.8x one
    # alone with 1 decoding thread and 3.3x with 2 (bench/server_load.py --scaling); minimind-26m decodes a
    # token in 11.3 ms on 1 thread and 11.1 ms on 2.
    threads: int = field(default=0, metadata={
        "help": "CPU threads that decode; 0 = one fewer than the CPU's cores (at least 1, at most torch's own "
                "default)"})

    @property
    def loopback(self) -> bool:
        """Whether it listens on loopback only (then a page cannot reach it but through a loopback name)."""
        return self.host in ("127.0.0.1", "localhost", "::1")

    def __post_init__(self) -> None:
        _check(isinstance(self.host, str) and bool(self.host.strip()),
               f"host={self.host!r}: must be a host name or address, such as 127.0.0.1 (loopback only)")
        _check(_is_int(self.port) and 0 <= self.port <= 65535,
               f"--port {self.port!r}: must be an integer from 0 to 65535 (0 picks a free port)")
        _check(self.api_key is None or (isinstance(self.api_key, str) and bool(self.api_key)),
               "api_key: must be a non-empty string, or None for a server without a key")
        _check(isinstance(self.model_name, str), f"model_name={self.model_name!r}: must be a string")
        _check(_is_int(self.max_queue) and self.max_queue >= 1,
               f"max_queue={self.max_queue!r}: must be an integer >= 1 (requests admitted at once)")
        _check(self.max_batch is None or (_is_int(self.max_batch) and self.max_batch >= 1),
               f"max_batch={self.max_batch!r}: must be an integer >= 1 (rows decoded together), or unset")
        _check(_is_int(self.threads) and self.threads >= 0,
               f"threads={self.threads!r}: must be an integer >= 0 (0 = one fewer than the CPU's cores)")
        _check(_is_int(self.max_body_bytes) and self.max_body_bytes >= 1,
               f"max_body_bytes={self.max_body_bytes!r}: must be an integer >= 1 (the largest request body)")
        _check(isinstance(self.guide_calls, bool), f"guide_calls={self.guide_calls!r}: must be true or false")
        _check(_is_number(self.body_timeout_s) and self.body_timeout_s > 0,
               f"body_timeout_s={self.body_timeout_s!r}: must be a number of seconds > 0")
        _check(_is_number(self.header_timeout_s) and self.header_timeout_s > 0,
               f"header_timeout_s={self.header_timeout_s!r}: must be a number of seconds > 0")
        _check(_is_int(self.max_connections) and self.max_connections >= 1,
               f"max_connections={self.max_connections!r}: must be an integer >= 1 (open connections at once)")


# ----------------------------------------------------------------------------- presets

def _preset_tiny() -> Config:
    return Config(
        model=ModelConfig(vocab_size=6400, d_model=128, n_layer=4, n_head=4, n_kv_head=2, max_seq_len=256),
        optim=OptimConfig(lr=2e-3, min_lr=2e-4, warmup_steps=20),
        train=TrainConfig(batch_size=8, seq_len=256, max_steps=300, eval_interval=50, eval_batches=8,
                          save_interval=100),
    )


# The dense presets compile the model: measured on a 2-core CPU at minimind-26m's shape (README, Benchmark),
# torch.compile raises training MFU from 79% to 86% (fp32) and 42% to 50% (bf16) and lowers peak memory by
# about a quarter, after a first step of 15-30 s. Pass --train.compile false for short runs.
def _preset_minimind_26m() -> Config:
    return Config(
        model=ModelConfig(vocab_size=6400, d_model=512, n_layer=8, n_head=8, n_kv_head=2, max_seq_len=512),
        optim=OptimConfig(lr=5e-4, min_lr=5e-5, warmup_steps=200),
        train=TrainConfig(compile=True, batch_size=32, seq_len=512, max_steps=10000),
    )


def _preset_minimind_104m() -> Config:
    return Config(
        model=ModelConfig(vocab_size=6400, d_model=768, n_layer=16, n_head=8, n_kv_head=2, max_seq_len=512),
        optim=OptimConfig(lr=5e-4, min_lr=5e-5, warmup_steps=500),
        train=TrainConfig(compile=True, batch_size=32, seq_len=512, max_steps=20000),
    )


def _preset_gpt2_124m() -> Config:
    # GPT-2-small sized (124M parameters with a 50304-token vocabulary), in the Llama layout.
    return Config(
        model=ModelConfig(vocab_size=50304, d_model=768, n_layer=12, n_head=12, n_kv_head=12, n_hidden=2048,
                          max_seq_len=1024, rope_theta=1e4),
        optim=OptimConfig(lr=6e-4, min_lr=6e-5, warmup_steps=700),
        train=TrainConfig(compile=True, batch_size=16, seq_len=1024, grad_accum=32, max_steps=20000),
    )


def _preset_minimind_moe() -> Config:
    # MiniMind2-MoE-like: d_model 640, 8 layers, 1 shared + 4 routed experts, top-2, in every block.
    return Config(
        model=ModelConfig(vocab_size=6400, d_model=640, n_layer=8, n_head=8, n_kv_head=2, max_seq_len=512,
                          use_moe=True, n_experts=4, n_shared_experts=1, top_k=2),
        optim=OptimConfig(lr=5e-4, min_lr=5e-5, warmup_steps=200),
        train=TrainConfig(batch_size=32, seq_len=512, max_steps=10000),
    )


def _preset_minimind_26m_moe() -> Config:
    # minimind-26m with its MLP split into fine-grained experts: a shared expert and the top-1 of 8 routed
    # experts, each half the dense width, so a token's active parameters and FLOPs equal minimind-26m's.
    return Config(
        model=ModelConfig(vocab_size=6400, d_model=512, n_layer=8, n_head=8, n_kv_head=2, max_seq_len=512,
                          use_moe=True, n_experts=8, n_shared_experts=1, top_k=1, moe_n_hidden=704),
        optim=OptimConfig(lr=5e-4, min_lr=5e-5, warmup_steps=200),
        train=TrainConfig(batch_size=32, seq_len=512, max_steps=10000),
    )


# MiniMind-3 (jingyaogong/minimind, model/model_minimind.py): Qwen3's layout at d_model 768, 8 layers, 8 query and
# 4 key/value heads of 96, QK-norm, SwiGLU of ceil(768 pi / 64) * 64 = 2432, 32768 positions at RoPE theta 1e6,
# RMSNorm eps 1e-6, tied embeddings; 63.9 M parameters. Trained here on 768-token windows (MiniMind's setting
# for its mini pretraining and SFT data); its optimiser is AdamW at 5e-4 decaying to a tenth.
_MINIMIND_3 = dict(vocab_size=6400, d_model=768, n_layer=8, n_head=8, n_kv_head=4, n_hidden=2432, max_seq_len=32768,
                   rope_theta=1e6, norm_eps=1e-6, qk_norm=True, tie_embeddings=True)


def _preset_minimind_3() -> Config:
    return Config(
        model=ModelConfig(**_MINIMIND_3),
        optim=OptimConfig(lr=5e-4, min_lr=5e-5, warmup_steps=200),
        train=TrainConfig(compile=True, batch_size=32, seq_len=768, max_steps=10000),
    )


def _preset_minimind_3_moe() -> Config:
    # MiniMind-3-MoE: the same with every MLP replaced by 4 routed experts of the dense width, top-1, no shared
    # expert, renormalised top-k weights (Qwen3-MoE's block) and MiniMind's balance-loss weight 5e-4;
    # 198.4 M parameters, 63.9 M active per token.
    return Config(
        model=ModelConfig(**_MINIMIND_3, use_moe=True, n_experts=4, top_k=1, n_shared_experts=0, moe_n_hidden=2432,
                          norm_topk=True, aux_loss_coef=5e-4),
        optim=OptimConfig(lr=5e-4, min_lr=5e-5, warmup_steps=200),
        train=TrainConfig(batch_size=32, seq_len=768, max_steps=10000),
    )


def _preset_cpu_small() -> Config:
    # What a time budget without a preset trains (BUDGET_PRESET_MINUTES): tiny's shape with Muon, which reached
    # 2.32 bits per byte against AdamW's 2.43 in 3 CPU-minutes on 1 MB of Shakespeare held out by position
    # (bench/quality.py; README, "Quality per CPU-minute").
    return Config(
        model=ModelConfig(vocab_size=6400, d_model=128, n_layer=4, n_head=4, n_kv_head=2, max_seq_len=256),
        optim=OptimConfig(name="muon", lr=2e-3, min_lr=2e-4, warmup_steps=20),
        train=TrainConfig(batch_size=8, seq_len=256, max_steps=300, eval_interval=50, eval_batches=8,
                          save_interval=100),
    )


PRESETS: dict[str, Callable[[], Config]] = {
    "tiny": _preset_tiny,
    "cpu-small": _preset_cpu_small,
    "minimind-26m": _preset_minimind_26m,
    "minimind-104m": _preset_minimind_104m,
    "gpt2-124m": _preset_gpt2_124m,
    "minimind-moe": _preset_minimind_moe,
    "minimind-26m-moe": _preset_minimind_26m_moe,
    "minimind-3": _preset_minimind_3,
    "minimind-3-moe": _preset_minimind_3_moe,
}


def stage_defaults(stage: str, base: Config) -> dict[str, Any]:
    """What a stage changes in a preset before the user's file and overrides apply.

    Fine-tuning starts from trained weights, so it takes smaller steps than
    pretraining: SFT at a tenth of the preset's pretraining lr, decaying to a
    hundredth; LoRA trains only small fresh adapters, which tolerate half the
    pretraining lr; DPO, which must stay near its reference, a fiftieth, and GRPO too, at a constant lr.
    Short warmups, as fine-tuning runs are short. Distillation trains like
    pretraining and keeps the preset's schedule.
    """
    lr = base.optim.lr
    if stage == "sft":
        return {"optim": {"lr": lr / 10, "min_lr": lr / 100, "warmup_steps": 20, "weight_decay": 0.0}}
    if stage == "lora":
        return {"optim": {"lr": lr / 2, "min_lr": lr / 20, "warmup_steps": 20, "weight_decay": 0.0}}
    if stage == "dpo":
        return {"optim": {"lr": lr / 50, "min_lr": lr / 500, "warmup_steps": 10, "weight_decay": 0.0}}
    if stage == "grpo":  # on-policy RL: small steps near the SFT model, as DPO takes
        return {"optim": {"lr": lr / 50, "min_lr": lr / 50, "warmup_steps": 0, "weight_decay": 0.0}}
    return {}


def preset(name: str) -> Config:
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]()


# ----------------------------------------------------------------------------- building from dicts

@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # slow (it evaluates the annotations), and the same every time


def _field_type(cls: type, f: dataclasses.Field) -> Any:
    return _type_hints(cls)[f.name]


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Check/convert a JSON/TOML/CLI value to the field's declared type."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], where)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise UserError(f"{where}: expected true or false, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise UserError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(float(value)) if ("e" in value.lower() and float(value).is_integer()) else int(value)
            except ValueError:
                pass
        raise UserError(f"{where}: expected an integer, got {value!r}")
    if typ is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise UserError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(number):  # no field means "unlimited" by inf; nan passes no range check
            raise UserError(f"{where}: expected a finite number, got {value!r}")
        return number
    if typ is str:
        if isinstance(value, str):
            return value
        raise UserError(f"{where}: expected a string, got {value!r}")
    if origin is tuple:  # tuple[str, ...]: a list in files, comma-separated on the command line
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) and i.strip() for i in items):
            raise UserError(f"{where}: expected a list of names (comma-separated on the command line), got {value!r}")
        return tuple(i.strip() for i in items)
    return value


def _dataclass_items(typ: Any) -> type | None:
    """The item type of a `tuple[SomeDataclass, ...]` field, else None."""
    args = typing.get_args(typ)
    if typing.get_origin(typ) is tuple and args and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _shown(key: str, limit: int = 40) -> str:
    """A user's key for a one-line message: as is when short and printable, else quoted with escapes and cut."""
    if len(key) <= limit and key.isprintable():
        return key
    return json.dumps(key[:limit]) + ("..." if len(key) > limit else "")


def _build(cls: type, d: Any, source: str, prefix: str) -> Any:
    if not isinstance(d, dict):
        raise UserError(f"{source}: {prefix.rstrip('.') or 'top level'} must be a table/object, got {type(d).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise UserError(f"{source}: unknown field {prefix}{_shown(unknown[0])}; known fields: "
                        f"{', '.join(prefix + k for k in known)}")
    kwargs = {}
    for name, value in d.items():
        typ = _field_type(cls, known[name])
        if dataclasses.is_dataclass(typ):
            kwargs[name] = _build(typ, value, source, prefix + name + ".")
        elif (item := _dataclass_items(typ)) is not None:  # tuple[DataSetConfig, ...]: a list of tables
            if not isinstance(value, (list, tuple)):
                raise UserError(f"{source}: {prefix}{name} must be a list of tables/objects ([[{prefix}{name}]] in "
                                f"TOML), got {type(value).__name__}")
            kwargs[name] = tuple(_build(item, v, source, f"{prefix}{name}[{i}].") for i, v in enumerate(value))
        else:
            kwargs[name] = _coerce(value, typ, f"{source}: {prefix}{name}")
    try:
        return cls(**kwargs)
    except UserError as e:
        raise UserError(f"{source}: {e}") from None


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML or JSON config file into a nested dict."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: config file not found; pass an existing .toml or .json file")
    text = p.read_bytes()
    if p.suffix == ".json":
        try:
            d = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{p}: invalid JSON ({e}); fix the file") from None
        except RecursionError:
            raise UserError(f"{p}: invalid JSON (nested too deeply); fix the file") from None
    elif p.suffix == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib
        try:
            d = tomllib.loads(text.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{p}: invalid TOML ({e}); fix the file") from None
        except RecursionError:
            raise UserError(f"{p}: invalid TOML (nested too deeply); fix the file") from None
    else:
        raise UserError(f"{p}: config files must end in .toml or .json")
    if not isinstance(d, dict):
        raise UserError(f"{p}: the top level must be a table/object with model/data/optim/train sections")
    return d


def override_fields(cls: type = Config, prefix: str = "") -> dict[str, Any]:
    """All dotted override names (`model.n_layer`, ...) with their field types, from the dataclasses."""
    out: dict[str, Any] = {}
    for f in fields(cls):
        typ = _field_type(cls, f)
        if dataclasses.is_dataclass(typ):
            out.update(override_fields(typ, prefix + f.name + "."))
        else:
            out[prefix + f.name] = typ
    return out


def overrides_to_dict(overrides: dict[str, Any]) -> dict[str, Any]:
    """{'model.n_layer': '4'} -> {'model': {'n_layer': '4'}} (values are coerced when the Config is built)."""
    nested: dict[str, Any] = {}
    known = override_fields()
    for key, value in overrides.items():
        if key not in known:
            raise UserError(f"unknown option --{_shown(key)}; see `nanolm train --help` for the list")
        node = nested
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return nested


def _nonzero(value: Any) -> bool:
    """Whether a budget value from a file or the command line (a number or its text) is set and not 0."""
    try:
        return float(value) != 0
    except (TypeError, ValueError):
        return value is not None  # not a number: the Config build reports it


# A time budget up to this many minutes, with no preset and no model settings, trains BUDGET_PRESET: nanolm's
# default model (minimind-26m's shape) takes ~33 steps in 3 CPU-minutes and ends far behind a small one.
BUDGET_PRESET, BUDGET_PRESET_MINUTES = "cpu-small", 30.0


def budget_preset(preset_name: str | None, file_d: dict[str, Any], over_d: dict[str, Any]) -> str | None:
    """The preset a short time budget picks when neither a preset nor any model.* setting is given, else None."""
    if preset_name:
        return None
    given = [d for d in (file_d, over_d) if isinstance(d, dict)]
    if any(isinstance(d.get("model"), dict) and set(d["model"]) - {"vocab_size"} for d in given):
        return None
    minutes = [t.get("max_minutes") for d in given if isinstance(t := d.get("train"), dict)]
    try:
        last = float([m for m in minutes if m is not None][-1])
    except (IndexError, TypeError, ValueError):
        return None
    return BUDGET_PRESET if 0 < last <= BUDGET_PRESET_MINUTES else None


def load_config(preset_name: str | None = None, config_file: str | Path | None = None,
                overrides: dict[str, Any] | None = None) -> Config:
    """preset -> file -> overrides, validated once at the end. With no preset, a time budget of at most
    BUDGET_PRESET_MINUTES and no model settings, the preset is BUDGET_PRESET (the config's `note` says so)."""
    file_d = read_config_file(config_file) if config_file else {}
    over_d = overrides_to_dict(overrides) if overrides else {}
    note = ""
    if (picked := budget_preset(preset_name, file_d, over_d)) is not None:
        preset_name = picked
        note = (f"preset {picked}: no preset or model settings were given and the time budget is at most "
                f"{BUDGET_PRESET_MINUTES:g} minutes, so the model is sized for it (pass --preset or --model.* to "
                f"choose)")
    base = preset(preset_name) if preset_name else Config()
    d = base.to_dict()
    source = f"preset {preset_name}" if preset_name else "defaults"
    # The stage (from the overrides, else the file, else the preset) brings its defaults first.
    # (A "train" that is no table is reported when the Config is built.)
    stage = next((t.get("stage") for t in (over_d.get("train"), file_d.get("train")) if isinstance(t, dict)
                  and t.get("stage")), base.train.stage)
    d = _deep_merge(d, stage_defaults(stage, base) if stage in STAGES else {})
    if config_file:
        d = _deep_merge(d, file_d)
        source = str(config_file)
    if overrides:
        d = _deep_merge(d, over_d)
        source = "command line" if not config_file else f"{config_file} + command line"
    # A budget the user gives without max_steps shapes the schedule (max_steps 0: fitted at the start of the run).
    given = [t for t in (file_d.get("train"), over_d.get("train")) if isinstance(t, dict)]
    if any(_nonzero(t.get(k)) for t in given for k in ("max_minutes", "max_tokens")) \
            and not any("max_steps" in t for t in given):
        d["train"]["max_steps"] = 0
    cfg = Config.from_dict(d, source)
    cfg.note = note
    return cfg
