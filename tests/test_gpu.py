"""The CUDA paths, checked on a GPU (`pytest -m gpu`, run by bench/gpu_check.sh); every test skips without one.

bf16 autocast and compiled training steps against the eager float32 reference, fused AdamW against the
unfused one, SDPA's backends against each other, DDP and FSDP over NCCL with one process against the plain
model, resuming on the GPU, the engine's rows decoded together against each alone, and the server.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from nanolm import checkpoint as ckpt
from nanolm.config import ModelConfig, SamplingParams
from nanolm.model.transformer import Transformer
from nanolm.train.trainer import train
from test_train import read_metrics, tiny_cfg

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda", 0)


def small_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=512, d_model=128, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=128))


def step_loss_and_grads(model: Transformer, x: torch.Tensor, autocast: bool) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = model(x[:, :-1], targets=x[:, 1:]) / x[:, 1:].numel()
    loss.backward()
    return loss.item(), [p.grad.float().clone() for p in model.parameters()]


def test_a_bf16_autocast_step_follows_the_float32_one():
    model = small_model().to(CUDA)
    x = torch.randint(0, 512, (4, 65), device=CUDA)
    ref_loss, ref = step_loss_and_grads(model, x, autocast=False)
    loss, got = step_loss_and_grads(model, x, autocast=True)
    assert loss == pytest.approx(ref_loss, rel=2e-2)
    cos = torch.nn.functional.cosine_similarity(torch.cat([g.flatten() for g in got]),
                                                torch.cat([g.flatten() for g in ref]), dim=0)
    assert cos > 0.99


def test_compiled_training_follows_eager(data_dir, tmp_path):
    over = {"train.device": "cuda", "train.max_steps": 6, "train.eval_interval": 0, "train.save_interval": 0,
            "model.dropout": 0.0}
    eager = train(tiny_cfg(data_dir, tmp_path / "eager", **over, **{"train.compile": False}), quiet=True)
    compiled = train(tiny_cfg(data_dir, tmp_path / "compiled", **over, **{"train.compile": True}), quiet=True)
    for s in range(1, 7):
        assert compiled.train_losses[s] == pytest.approx(eager.train_losses[s], rel=2e-3), s


def test_fused_adamw_takes_the_unfused_step():
    models = [small_model().to(CUDA) for _ in range(2)]
    x = torch.randint(0, 512, (4, 65), device=CUDA)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=fused) for m, fused in zip(models, (True, False))]
    for _ in range(3):
        for m, opt in zip(models, opts):
            step_loss_and_grads(m, x, autocast=False)
            opt.step()
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sdpa_backends_agree(dtype):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn(2, 4, 256, 64, device=CUDA, dtype=dtype) for _ in range(3))
    outs = {}
    for backend in (SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION):
        try:
            with sdpa_kernel(backend):
                outs[backend] = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).float()
        except RuntimeError:  # not built for this GPU
            continue
    assert SDPBackend.MATH in outs and len(outs) >= 2
    for backend, out in outs.items():
        torch.testing.assert_close(out, outs[SDPBackend.MATH], rtol=2e-2, atol=2e-2, msg=str(backend))


@pytest.fixture
def nccl_group():
    import torch.distributed as dist
    with tempfile.TemporaryDirectory() as d:
        store = dist.FileStore(os.path.join(d, "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=CUDA)
        try:
            yield
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_ddp_and_fsdp_over_nccl_step_as_the_plain_model(nccl_group, parallel):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    plain, wrapped = small_model().to(CUDA), small_model().to(CUDA)
    x = torch.randint(0, 512, (4, 65), device=CUDA)
    if parallel == "ddp":
        module = DDP(wrapped, device_ids=[0])
    else:
        mesh = init_device_mesh("cuda", (1,))
        for block in wrapped.layers:
            fully_shard(block, mesh=mesh)
        module = fully_shard(wrapped, mesh=mesh)
    ref_loss, ref = step_loss_and_grads(plain, x, autocast=False)
    module.zero_grad(set_to_none=True)
    loss = module(x[:, :-1], targets=x[:, 1:]) / x[:, 1:].numel()
    loss.backward()
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
    got = [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).float() for p in wrapped.parameters()]
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


def test_resume_on_the_gpu_continues_the_run(data_dir, tmp_path):
    over = {"train.device": "cuda", "model.dropout": 0.0}
    full = train(tiny_cfg(data_dir, tmp_path / "full", **over), quiet=True)
    part = train(tiny_cfg(data_dir, tmp_path / "part", **{**over, "train.max_tokens": 10 * 4 * 32}), quiet=True)
    assert part.step == 10
    resumed = train(tiny_cfg(data_dir, tmp_path / "part", **over), resume=True, quiet=True)
    for s in range(11, 21):  # GPU kernels may sum in another order from run to run: to float tolerance
        assert resumed.train_losses[s] == pytest.approx(full.train_losses[s], rel=1e-4), s
    a = ckpt.load_model(tmp_path / "full", "last")[0].state_dict()
    b = ckpt.load_model(tmp_path / "part", "last")[0].state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-5)


def test_the_engine_decodes_rows_together_as_each_alone_on_the_gpu():
    from nanolm.infer.engine import Engine
    engine = Engine(small_model(), CUDA, torch.float32)
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40)]
    params = SamplingParams(max_new_tokens=24, temperature=0)
    together = engine.generate_many(prompts, params)
    assert together == [engine.generate_all(p, params) for p in prompts]


def test_the_server_answers_on_the_gpu(tokenizer_dir):
    pytest.importorskip("fastapi")
    import httpx

    from nanolm.config import ServeConfig
    from nanolm.infer.engine import Engine
    from nanolm.infer.server import create_app
    from nanolm.tokenizer import Tokenizer
    from server_helpers import running
    tok = Tokenizer.load(tokenizer_dir)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=400, d_model=64, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=128))
    engine = Engine(model, CUDA, torch.float32)  # the batch and the one-off decode agree exactly in float32
    want = tok.decode(engine.generate_all(tok.encode("To be"), SamplingParams(max_new_tokens=8, temperature=0),
                                          (tok.im_end_id, tok.eot_id)))  # where the server stops a completion
    with running(create_app(engine, tok, ServeConfig(model_name="gpu"))) as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": "To be", "max_tokens": 8, "temperature": 0},
                       timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want


def test_a_short_run_on_the_gpu_logs_mfu_against_the_datasheet(data_dir, tmp_path):
    run = tmp_path / "run"
    train(tiny_cfg(data_dir, run, **{"train.device": "cuda", "train.max_steps": 4, "train.eval_interval": 0,
                                     "train.save_interval": 0}), quiet=True)
    recs = [r for r in read_metrics(run) if "mfu" in r]
    assert recs and all(0 < r["mfu"] < 1 for r in recs)
    assert Path(run / "config.json").is_file()
