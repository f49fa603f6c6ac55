"""Typed configuration: one dataclass per concern, one module per concern.

A training run's configuration is a `Config` (nanolm/config/train.py) made of
`ModelConfig` (model.py), `DataConfig` (data.py), `OptimConfig` (optim.py),
`TrainConfig` (train.py) and a section for each stage with settings of its own
(LoRA, DPO, distillation, GRPO, PPO): a dataclass the stage registers with
itself (registry.py holds the registered stages, so the configuration never
imports the trainer). It is built in layers by `load_config`
(nanolm/train/configure.py, above the stages), each overriding the one before:
a preset (presets.py), the stage's defaults, a TOML or JSON file, then
command-line overrides such as `--model.n_layer 4` whose names and types are
generated from the dataclass fields (load.py reads files and overrides,
fields.py converts and checks each value). Every dataclass validates itself in
`__post_init__` and names the field and what is allowed when a value is wrong.

Generation and serving have one dataclass each, apart from training:
`SamplingParams` (sampling.py: what generate, chat, the server and the
quickstart sample with) and `ServeConfig` (serve.py: where `nanolm serve`
listens and what one request may cost); their command-line options are
generated from their fields too (nanolm/cli.py).

This package re-exports the dataclasses and presets.
"""

from nanolm.config.data import DATA_MODES, DataConfig, DataSetConfig, data_overrides, default_set_name, \
    format_data_set, parse_data_set
from nanolm.config.model import ROPE_SCALINGS, ModelConfig
from nanolm.config.optim import OPTIMIZERS, OptimConfig
from nanolm.config.presets import PRESETS, preset
from nanolm.config.sampling import SEED_RANGE, SamplingParams
from nanolm.config.serve import ServeConfig
from nanolm.config.train import Config, TrainConfig

__all__ = ["DATA_MODES", "DataConfig", "DataSetConfig", "data_overrides", "default_set_name", "format_data_set",
           "parse_data_set", "ROPE_SCALINGS", "ModelConfig", "OPTIMIZERS", "OptimConfig", "PRESETS", "preset",
           "SEED_RANGE", "SamplingParams", "ServeConfig", "Config", "TrainConfig"]
