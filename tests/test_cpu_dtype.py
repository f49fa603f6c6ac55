"""dtype=auto for training on a CPU: bf16 autocast where the CPU has native bf16 and the model is wide enough."""

from __future__ import annotations

import pytest
import torch

from nanolm.errors import UserError
from nanolm.runtime import BF16_MIN_D_MODEL, cpu_flags, train_dtype

CPU = torch.device("cpu")


def test_auto_picks_bf16_only_with_native_bf16_and_a_wide_model():
    assert BF16_MIN_D_MODEL == 128
    assert train_dtype("auto", CPU, 512, {"avx2", "avx512f", "avx512_bf16"}) == (
        torch.bfloat16, "auto: this CPU has avx512_bf16 (native bf16 matmuls)")
    assert train_dtype("auto", CPU, 256, {"amx_bf16", "amx_tile", "avx512_bf16"}) == (
        torch.bfloat16, "auto: this CPU has amx_bf16 (native bf16 matmuls)")
    assert train_dtype("auto", CPU, 512, {"avx2", "avx512f"}) == (
        torch.float32, "auto: this CPU has no native bf16 (no avx512_bf16 or amx_bf16)")
    assert train_dtype("auto", CPU, 128, {"avx512_bf16"})[0] == torch.bfloat16
    assert train_dtype("auto", CPU, 64, {"avx512_bf16"}) == (
        torch.float32, "auto: this CPU has avx512_bf16, but at d_model 64 < 128 bf16 autocast is no faster than "
        "float32")
    assert train_dtype("auto", CPU, 512, set()) == (
        torch.float32, "auto: this CPU has no native bf16 (no avx512_bf16 or amx_bf16)")
    # An explicit dtype is kept whatever the CPU.
    assert train_dtype("float32", CPU, 512, {"avx512_bf16"}) == (torch.float32, "as configured")
    assert train_dtype("bfloat16", CPU, 64, set()) == (torch.bfloat16, "as configured")
    with pytest.raises(UserError, match="train.dtype=float16 is for CUDA"):
        train_dtype("float16", CPU, 512, {"avx512_bf16"})


def test_cpu_flags_reads_this_machine():
    flags = cpu_flags()
    assert isinstance(flags, set)
    try:
        text = open("/proc/cpuinfo", encoding="utf-8").read()
    except OSError:
        assert flags == set()
        return
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    assert flags == set(line.partition(":")[2].split())


SMOLLM2 = dict(vocab_size=49152, d_model=576, n_layer=30, n_head=9, n_kv_head=3, n_hidden=1536)  # SmolLM2-135M
WIDE = dict(vocab_size=6400, d_model=512, n_layer=8, n_head=8, n_kv_head=2, n_hidden=1408)  # minimind-26m's widths
NARROW = dict(vocab_size=6400, d_model=256, n_layer=8, n_head=4, n_kv_head=2, n_hidden=704)


def test_the_decode_probe_has_the_models_own_widths():
    """What auto times is a decode step's products at the model's widths: the engine's fused q/k/v and gate/up, o,
    down, every layer, and the head (SmolLM2-135M: 134.5 M weights, its 49,152 x 576 head 28.3 M of them)."""
    from nanolm.config import ModelConfig
    from nanolm.runtime import DecodeShape, decode_step_seconds

    shape = DecodeShape.of(ModelConfig(**SMOLLM2))
    assert shape == DecodeShape(((960, 576), (576, 576), (3072, 576), (576, 1536)), 30, (49152, 576))
    assert shape.weights == 134_479_872 and shape.timed_layers == 9  # 32 Mi weights hold 9 of its 3.54 M layers
    assert shape.describe() == ("30 layers of 960x576, 576x576, 3072x576, 576x1536, 9 timed and scaled, and the "
                                "49152x576 head: 134.5 M weights")
    assert DecodeShape.of(ModelConfig(**WIDE)).describe() == (
        "8 layers of 768x512, 512x512, 2816x512, 512x1408, and the 6400x512 head: 25.8 M weights")
    # The real timer: a positive time, measured once per process and shape.
    tiny = DecodeShape(((24, 8), (8, 8), (32, 8), (8, 16)), 3, (50, 8))
    t = decode_step_seconds(tiny, torch.float32)
    assert t > 0 and decode_step_seconds(tiny, torch.float32) == t


def test_decoding_picks_bf16_where_a_timed_decode_step_is_faster():
    from nanolm.config import ModelConfig
    from nanolm.runtime import BF16_DECODE_MIN_D_MODEL, DecodeShape, decode_dtype
    assert BF16_DECODE_MIN_D_MODEL == 256
    smollm2, wide, narrow = ModelConfig(**SMOLLM2), ModelConfig(**WIDE), ModelConfig(**NARROW)
    asked = []

    def timer(bf16_ms, fp32_ms):  # a CPU whose decode step's products take these times
        def t(shape, dtype):
            asked.append(shape)
            return (bf16_ms if dtype == torch.bfloat16 else fp32_ms) * 1e-3
        return t

    wide_step = ("one row through a decode step's products (8 layers of 768x512, 512x512, 2816x512, 512x1408, and "
                 "the 6400x512 head: 25.8 M weights) took")
    assert decode_dtype("auto", CPU, wide, {"avx512_bf16"}, timer=timer(3, 7)) == (
        torch.bfloat16, f"auto: this CPU has avx512_bf16; {wide_step} 3.00 ms in bf16, 7.00 ms in float32")
    assert asked == [DecodeShape.of(wide)] * 2
    asked.clear()
    # Whatever the CPU's flags: an AVX2 CPU without native bf16 reads bf16 weights faster too, from a width of 512
    # (below it the conversions of a bf16 token's small operations cost what the bytes save).
    assert decode_dtype("auto", CPU, wide, {"avx2"}, timer=timer(3.5, 8.2)) == (
        torch.bfloat16, f"auto: this CPU has no native bf16; {wide_step} 3.50 ms in bf16, 8.20 ms in float32")
    assert decode_dtype("auto", CPU, narrow, {"avx2"}, timer=timer(1.7, 3.2)) == (
        torch.float32, "auto: this CPU has no native bf16, and at width 256 < 512 float32 decodes as fast")
    assert decode_dtype("auto", CPU, narrow, {"avx512_bf16"}, timer=timer(1.7, 3.2))[0] == torch.bfloat16
    # A server's many rows widen bf16 to float32 without native bf16: it keeps float32 there, untimed, and times
    # where the CPU has native bf16.
    assert decode_dtype("auto", CPU, wide, {"avx2"}, timer=timer(3.5, 8.2), many_rows=True) == (
        torch.float32, "auto: this CPU has no native bf16, and a server's many rows decode faster in float32")
    assert decode_dtype("auto", CPU, wide, {"amx_bf16"}, timer=timer(3.5, 8.2), many_rows=True)[0] == torch.bfloat16
    # neither the narrow model nor the server on AVX2 is timed
    assert asked == [DecodeShape.of(wide)] * 2 + [DecodeShape.of(narrow)] * 2 + [DecodeShape.of(wide)] * 2
    # Slower in bf16, or not faster by the margin: float32, saying why; SmolLM2-135M's step, whose layers hold more
    # than TIMED_WEIGHTS, is timed through 9 of them, scaled to its 30 (the AVX2 EPYC's first probe, one row through
    # 33.6 M weights of (4 d_model, d_model) matrices, said 61.93 ms in bf16 against 11.67 in float32).
    assert decode_dtype("auto", CPU, smollm2, {"avx2"}, timer=timer(61.93, 54.1)) == (
        torch.float32, "auto: this CPU has no native bf16, and one row through a decode step's products (30 layers "
                       "of 960x576, 576x576, 3072x576, 576x1536, 9 timed and scaled, and the 49152x576 head: 134.5 M "
                       "weights) took 61.93 ms in bf16, 54.10 ms in float32")
    assert decode_dtype("auto", CPU, wide, {"amx_bf16"}, timer=timer(1.3, 1.4))[0] == torch.float32
    # Untimed (RL's rollouts: every rank and a resumed run alike): bf16 where the CPU has native bf16 and the width
    # allows.
    asked.clear()
    assert decode_dtype("auto", CPU, wide, {"amx_bf16"}, timer=None) == (
        torch.bfloat16, "auto: this CPU has amx_bf16 and the model is 512 wide")
    assert decode_dtype("auto", CPU, wide, {"avx2"}, timer=None) == (torch.float32, "auto: this CPU has no native bf16")
    assert decode_dtype("auto", CPU, ModelConfig(**{**NARROW, "d_model": 128}), {"amx_bf16"},
                        timer=None)[0] == torch.float32
    # Narrower models decode faster in float32 (a token is mostly overhead there); not timed.
    assert decode_dtype("auto", CPU, ModelConfig(**{**NARROW, "d_model": 128}), {"avx512_bf16"},
                        timer=timer(1, 100)) == (torch.float32, "auto: at width 128 < 256 float32 decodes faster")
    assert decode_dtype("float32", CPU, wide, {"avx512_bf16"}) == (torch.float32, "as asked")
    assert decode_dtype("bfloat16", CPU, narrow, set()) == (torch.bfloat16, "as asked")
    assert asked == []
    with pytest.raises(UserError, match="--dtype half: unknown; use auto, float32, bfloat16 or float16"):
        decode_dtype("half", CPU, wide)


def test_the_server_leaves_a_core_to_its_http_side():
    from nanolm.infer.server import decode_threads
    n = torch.get_num_threads()
    assert decode_threads(3) == 3  # as asked
    assert decode_threads(0, cores=2) == 1
    assert decode_threads(0, cores=1) == 1
    assert decode_threads(0, cores=64) == n  # never more than torch's own default (OMP_NUM_THREADS)
    assert decode_threads(0, cores=n) == max(1, n - 1)
