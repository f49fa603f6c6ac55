"""Run under torchrun by tests/test_distributed.py: trains the run a config file describes, and rank 0 writes
the first optimizer step's gradient (after the all-reduce over the ranks) and the weights it was taken at, in
the optimizer's parameter order, to a safetensors file for the test to check."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from safetensors.torch import save_file

from nanolm.config import Config
from nanolm.train.trainer import train


def main(config: str, out: str) -> None:
    tensors: dict[str, torch.Tensor] = {}

    def first_step(optimizer, args, kwargs) -> None:
        if not tensors:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            for i, p in enumerate(params):
                tensors[f"weight.{i:04d}"] = p.detach().clone()
                tensors[f"grad.{i:04d}"] = p.grad.detach().clone()

    register_optimizer_step_pre_hook(first_step)
    train(Config.from_dict(json.loads(Path(config).read_text())), quiet=True)
    if int(os.environ["RANK"]) == 0:
        save_file(tensors, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as nanolm's CLI does under torchrun (see nanolm/cli.py:main)
