"""recipes/minimind_multi_gpu.sh end to end at tiny size: 2 gloo processes under torchrun, FSDP, pretrain then
SFT then chat, and a second run of the script resumes each stage instead of starting over."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "minimind_multi_gpu.sh"


def run_recipe(work: Path, cache: Path, **env: str) -> subprocess.CompletedProcess:
    bin_dir = Path(sys.executable).parent
    full_env = {**os.environ, "SMOKE": "1", "NPROC": "2", "PARALLEL": "fsdp", "WORK": str(work),
                "NANOLM": str(bin_dir / "nanolm"), "PYTHON": sys.executable, "NANOLM_CACHE": str(cache),
                "PRETRAIN_DATA": "sanguo", "SFT_DATA": "chatterbot", "PREP_WORKERS": "1", **env}
    return subprocess.run(["bash", str(RECIPE)], capture_output=True, text=True, env=full_env, timeout=900)


@pytest.mark.slow
def test_recipe_pretrains_fine_tunes_chats_and_resumes(tmp_path):
    work, cache = tmp_path / "work", tmp_path / "cache"
    r = run_recipe(work, cache)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "2 process(es) (1 node(s) x 2), fsdp, preset tiny, grad_accum 8" in r.stdout
    assert "data parallel: 2 processes (fsdp)" in r.stdout
    for stage, steps in (("pretrain", 12), ("sft", 6)):
        assert (work / stage / "checkpoints" / f"step-{steps:08d}" / "model.safetensors").is_file()
    assert "assistant:" in r.stdout and "[recipe] done" in r.stdout

    # Run again with a longer pretraining: the data is reused and pretraining continues from step 12.
    r = run_recipe(work, cache, PRETRAIN_STEPS_SMOKE="15")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"resumed from {work / 'pretrain' / 'checkpoints' / 'step-00000012'} at step 12" in r.stdout
    assert (work / "pretrain" / "checkpoints" / "step-00000015").is_dir()
    assert f"{work / 'data'}: up to date" in r.stdout + r.stderr  # prepare skipped the unchanged data
