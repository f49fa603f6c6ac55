"""Run under `torchrun --max-restarts 1` by tests/test_distributed.py: trains the run a config file describes,
and on the first attempt rank 1 kills itself with SIGKILL right after the given optimizer step (as the kernel's
out-of-memory killer would), so that torchrun restarts both workers; the restarted ones continue the run."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from nanolm.config import Config
from nanolm.train import distributed
from nanolm.train.trainer import Trainer


def main(config: str, kill_after: int) -> None:
    trainer = Trainer(Config.from_dict(json.loads(Path(config).read_text())), quiet=True)
    if distributed.restart_count() == 0 and int(os.environ["RANK"]) == 1:
        step = trainer.train_step

        def train_step(*a, **kw):
            out = step(*a, **kw)
            if trainer.step == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
            return out
        trainer.train_step = train_step
    trainer.run()
    print(f"rank {os.environ['RANK']} attempt {distributed.restart_count()}: done at step {trainer.step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as nanolm's CLI does under torchrun (see nanolm/cli.py:main)
