"""Run under torchrun by tests/test_distributed.py: each rank takes its batches of two epochs of a data set
through the real set-up path (`distributed.setup`, `Loader` with this rank), and rank 0 writes every rank's
rows to a JSON file for the test to check."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from nanolm.data.loader import Loader
from nanolm.data.shards import PackedData
from nanolm.train import distributed


def main(data_dir: str, out: str, batch_size: int, seq_len: int) -> None:
    info = distributed.setup("cpu")
    loader = Loader(PackedData(Path(data_dir)), batch_size, seq_len, seed=7, rank=info.rank,
                    world_size=info.world_size)
    steps = 2 * loader.epoch_windows // (batch_size * info.world_size)
    rows = torch.stack([loader.next_batch().x for _ in range(steps)])  # (steps, B, T)
    gathered = [torch.empty_like(rows) for _ in range(info.world_size)]
    dist.all_gather(gathered, rows)
    if info.is_main:
        Path(out).write_text(json.dumps({"epoch_windows": loader.epoch_windows, "steps": steps,
                                         "rows": [g.tolist() for g in gathered]}))
    distributed.teardown(info)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
