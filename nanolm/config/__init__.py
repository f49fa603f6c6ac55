"""Typed configuration: one dataclass per concern, one module per concern.

A training run's configuration is a `Config` (nanolm/config/train.py) made of
`ModelConfig` (model.py), `DataConfig` (data.py), `OptimConfig` (optim.py),
`TrainConfig` (train.py) and the training methods' sections (methods.py:
LoRA, DPO, distillation, GRPO, PPO). It is built in layers by `load_config`
(load.py), each overriding the one before: a preset (presets.py), the stage's
defaults (nanolm/train/stages.py), a TOML or JSON file, then command-line
overrides such as `--model.n_layer 4` whose names and types are generated from
the dataclass fields (fields.py converts and checks each value). Every
dataclass validates itself in `__post_init__` and names the field and what is
allowed when a value is wrong.

Generation and serving have one dataclass each, apart from training:
`SamplingParams` (sampling.py: what generate, chat, the server and the
quickstart sample with) and `ServeConfig` (serve.py: where `nanolm serve`
listens and what one request may cost); their command-line options are
generated from their fields too (nanolm/cli.py).

This package re-exports the dataclasses and presets; `load_config` is imported
from nanolm.config.load (it reads the stage registry, which sits above the
dataclasses).
"""

from nanolm.config.data import DATA_MODES, DataConfig, DataSetConfig, data_overrides, default_set_name, \
    format_data_set, parse_data_set
from nanolm.config.methods import DistillConfig, DPOConfig, GRPOConfig, LoRAConfig, PPOConfig
from nanolm.config.model import ROPE_SCALINGS, ModelConfig
from nanolm.config.optim import OPTIMIZERS, OptimConfig
from nanolm.config.presets import PRESETS, preset
from nanolm.config.sampling import SEED_RANGE, SamplingParams
from nanolm.config.serve import ServeConfig
from nanolm.config.train import Config, TrainConfig

__all__ = ["DATA_MODES", "DataConfig", "DataSetConfig", "data_overrides", "default_set_name", "format_data_set",
           "parse_data_set", "DistillConfig", "DPOConfig", "GRPOConfig", "LoRAConfig", "PPOConfig", "ROPE_SCALINGS",
           "ModelConfig", "OPTIMIZERS", "OptimConfig", "PRESETS", "preset", "SEED_RANGE", "SamplingParams",
           "ServeConfig", "Config", "TrainConfig"]
