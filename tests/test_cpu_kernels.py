"""nanolm's CPU training kernels: the blocked causal attention (model/cpu_attention.py), equal to PyTorch's kernel
in values and gradients and used exactly where it applies, and RMSNorm's backward."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from nanolm.config import ModelConfig
from nanolm.model import cpu_attention
from nanolm.model.cpu_attention import _blocks, causal_attention, usable
from nanolm.model.transformer import Transformer


def qkv(B: int, H: int, Hk: int, T: int, D: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, T, D, generator=g).to(dtype).requires_grad_() for h in (H, Hk, Hk)]


def reference(q, k, v, mask=None):
    """PyTorch's attention in float64 (no kernel's rounding) and its gradients for the upstream gradient `up`."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    if mask is None:
        o = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True, enable_gqa=True)
    else:
        o = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask, enable_gqa=True)
    return o, (q64, k64, v64)


def packed_mask(B: int, T: int, cuts: list[int]) -> torch.Tensor:
    """(B, 1, T, T): causal attention within the segments that start at each of `cuts`."""
    seg = torch.zeros(B, T, dtype=torch.long)
    for c in cuts:
        seg[:, c:] += 1
    return ((seg[:, :, None] == seg[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()).unsqueeze(1)


@pytest.mark.parametrize("shape", [(2, 4, 2, 128, 16), (1, 2, 2, 100, 8), (2, 6, 3, 67, 8), (1, 4, 1, 256, 32)])
@pytest.mark.parametrize("packed", [False, True])
def test_values_and_gradients_equal_pytorch_attention_in_float32(shape, packed):
    """Grouped heads (2 and 3 queries a key/value head, and one key/value head for all), lengths that do not
    split evenly into blocks, packed conversations: output and the three gradients equal float64 attention's to
    float32 rounding."""
    B, H, Hk, T, D = shape
    q, k, v = qkv(*shape)
    mask = packed_mask(B, T, [T // 3, T // 2 + 1]) if packed else None
    want, leaves = reference(q, k, v, mask)
    up = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    got = causal_attention(q, k, v, mask)
    assert got.shape == (B, H, T, D) and got.dtype == torch.float32
    got.backward(up)
    want.backward(up.double())
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
    for mine, ref in zip((q, k, v), leaves):
        torch.testing.assert_close(mine.grad.double(), ref.grad, atol=5e-6, rtol=1e-5)


def test_bfloat16_errors_are_the_size_of_pytorch_bf16_kernels():
    """In bf16 the scores and probabilities are rounded to bf16: the output's and the gradients' relative errors
    against float64 stay within twice those of PyTorch's own bf16 kernel on the same inputs."""
    q, k, v = qkv(2, 8, 2, 256, 64, torch.bfloat16)
    want, leaves = reference(q, k, v)
    up = torch.randn(want.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    want.backward(up.double())
    errors = {}
    for name, fn in (("mine", lambda: causal_attention(q, k, v)),
                     ("pytorch", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))):
        for t in (q, k, v):
            t.grad = None
        out = fn()
        assert out.dtype == torch.bfloat16
        out.backward(up)
        errors[name] = [((a.double() - b).norm() / b.norm()).item()
                        for a, b in zip((out, q.grad, k.grad, v.grad), (want, *(t.grad for t in leaves)))]
    for mine, theirs in zip(errors["mine"], errors["pytorch"]):
        assert mine < 2 * theirs + 1e-3, errors
        assert mine < 0.02


def test_blocks_cover_every_query_once():
    for T in (64, 65, 100, 127, 512, 1000):
        blocks = _blocks(T)
        assert blocks[0][0] == 0 and blocks[-1][1] == T
        assert all(a2 == b1 for (_, b1), (a2, _) in zip(blocks, blocks[1:]))
        assert len(blocks) == min(cpu_attention.BLOCKS, T // cpu_attention.MIN_BLOCK)


def test_where_it_applies():
    q = torch.zeros(2, 4, 128, 16)
    assert usable(q, torch.float32) and usable(q, torch.bfloat16)
    assert not usable(q, torch.float16)  # CPUs train in float32 or bf16
    assert not usable(torch.zeros(2, 4, 63, 16), torch.float32)  # too short to split
    assert not usable(q.to("meta"), torch.float32)  # not a CPU tensor
    # above MAX_SCORE_BYTES of held probabilities a layer PyTorch's kernel, which holds none: 16 heads of 2,048
    # queries hold 42 M values, 84 MB in bf16 and 168 MB in float32
    q = torch.empty(1, 16, 2048, 1)
    assert usable(q, torch.bfloat16) and not usable(q, torch.float32)


def _model(**kw) -> Transformer:
    base = dict(vocab_size=97, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=128)
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**base, **kw}))


def _loss_and_grads(model, x, y, **kw):
    model.zero_grad()
    loss = model(x, targets=y, **kw)
    loss.backward()
    return loss.detach(), {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("packed", [False, True])
def test_a_models_loss_and_gradients_are_those_of_pytorch_attention(packed):
    """The same model's loss and every gradient, float32, with nanolm's kernel (the default on a CPU) and with
    PyTorch's (a run that names an SDPA kernel, train.sdpa_backend): equal to float32 rounding."""
    model = _model()
    x, y = torch.randint(0, 97, (3, 96)), torch.randint(0, 97, (3, 96))
    y[:, :20] = -1
    kw = {}
    if packed:
        seg = torch.zeros(3, 96, dtype=torch.long)
        seg[:, 40:] = 1
        kw = dict(seg=seg, pos=torch.cat([torch.arange(40), torch.arange(56)]).expand(3, 96))
    calls = []
    real = cpu_attention.causal_attention

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    cpu_attention.causal_attention = spy
    try:
        mine = _loss_and_grads(model, x, y, **kw)
        assert len(calls) == 2  # both layers
        with sdpa_kernel([SDPBackend.MATH]):
            theirs = _loss_and_grads(model, x, y, **kw)
        assert len(calls) == 2  # a run limited to one SDPA kernel gets it
    finally:
        cpu_attention.causal_attention = real
    torch.testing.assert_close(mine[0], theirs[0], atol=0, rtol=1e-6)
    for n in mine[1]:
        torch.testing.assert_close(mine[1][n], theirs[1][n], atol=1e-7, rtol=1e-4, msg=n)


def test_dropout_in_training_and_short_rows_use_pytorchs_kernel(monkeypatch):
    calls = []
    real = cpu_attention.causal_attention
    monkeypatch.setattr(cpu_attention, "causal_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randint(0, 97, (2, 96))
    _model(dropout=0.1).train()(x)  # attention dropout: PyTorch's kernel draws it
    _model()(x[:, :40])  # too short to split into blocks
    assert calls == []
    _model(dropout=0.1).eval()(x)  # no dropout at evaluation: both layers take it
    assert calls == [1, 1]


def test_compiled_model_trains_through_it():
    """torch.compile traces the kernel (the dense presets compile): the loss and gradients equal eager's."""
    model = _model()
    x, y = torch.randint(0, 97, (2, 96)), torch.randint(0, 97, (2, 96))
    eager = _loss_and_grads(model, x, y)
    compiled = torch.compile(model)
    got = _loss_and_grads(compiled, x, y)
    torch.testing.assert_close(got[0], eager[0], atol=0, rtol=1e-5)
    for n in eager[1]:
        torch.testing.assert_close(got[1][n], eager[1][n], atol=1e-6, rtol=1e-4)


def test_rms_norm_on_a_cpu_trains_as_pytorchs():
    """The CPU training path's RMSNorm (its own backward): values and both gradients equal F.rms_norm's, for a
    residual stream and a QK-norm's (B, heads, T, head size) input; without gradients F.rms_norm itself runs."""
    from nanolm.model.transformer import RMSNorm

    for shape in ((3, 7, 16), (2, 4, 5, 8)):
        norm = RMSNorm(shape[-1], 1e-5)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(0), requires_grad=True)
        up = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
        got = norm(x)
        got.backward(up)
        mine = x.grad.clone(), norm.weight.grad.clone()
        x.grad = norm.weight.grad = None
        want = F.rms_norm(x, (shape[-1],), norm.weight, 1e-5)
        want.backward(up)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(mine[0], x.grad, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(mine[1], norm.weight.grad, atol=1e-6, rtol=1e-5)
        assert got.grad_fn.name().startswith("_RMSNormCPU")
        with torch.no_grad():
            assert norm(x).grad_fn is None and torch.equal(norm(x), F.rms_norm(x, (shape[-1],), norm.weight, 1e-5))
