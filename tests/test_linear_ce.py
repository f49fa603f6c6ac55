"""The fused, chunked output projection and loss against the plain logits path, and the model's targets path."""

import pytest
import torch
import torch.nn.functional as F

import nanolm.model.linear_ce as linear_ce
import nanolm.model.transformer as transformer
from nanolm.config import ModelConfig
from nanolm.data.shards import IGNORE_INDEX
from nanolm.model.linear_ce import linear_cross_entropy
from nanolm.model.lora import apply_lora
from nanolm.model.transformer import Transformer
from nanolm.train.losses import lm_loss


def _plain(h, w, y, bf16=False):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = F.linear(h, w)
    return F.cross_entropy(logits.float(), y, ignore_index=IGNORE_INDEX, reduction="sum")


def _grads(fn, h, w, y):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(h, w, y)
    (loss * 0.5).backward()  # a non-unit upstream gradient
    return loss.detach(), h.grad, w.grad


@pytest.fixture
def small_chunks(monkeypatch):
    # 1000-token vocabulary, 2^11 logits per slice: products of 5 rows (MIN_ROWS) in slices of 2, 2 and 1, so
    # 37 rows end in a partial product of 2 rows.
    monkeypatch.setitem(linear_ce.CHUNK_LOGITS, "cpu", 1 << 11)
    monkeypatch.setattr(linear_ce, "MIN_ROWS", 5)
    cpu = torch.device("cpu")
    assert (linear_ce._chunk_rows(cpu, 1000), linear_ce._slice_rows(cpu, 1000)) == (5, 2)


def test_float32_equals_the_plain_path_with_ignored_rows_and_a_partial_chunk(small_chunks):
    torch.manual_seed(0)
    h, w = torch.randn(37, 16), torch.randn(1000, 16) * 0.3
    y = torch.randint(0, 1000, (37,))
    y[::4] = IGNORE_INDEX
    ref, ref_dh, ref_dw = _grads(_plain, h, w, y)
    got, dh, dw = _grads(linear_cross_entropy, h, w, y)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(dh, ref_dh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw, ref_dw, rtol=1e-5, atol=1e-6)
    assert torch.equal(dh[::4], torch.zeros_like(dh[::4]))  # ignored rows get no gradient


def test_without_gradients_the_loss_is_the_same(small_chunks):
    torch.manual_seed(0)
    h, w, y = torch.randn(37, 16), torch.randn(1000, 16) * 0.3, torch.randint(0, 1000, (37,))
    y[::3] = IGNORE_INDEX
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, y), _plain(h, w, y), rtol=1e-6, atol=1e-4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.testing.assert_close(linear_cross_entropy(h, w, y), _plain(h, w, y, bf16=True), rtol=1e-5,
                                       atol=1e-3)


def test_hand_computed_two_token_loss():
    h = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])  # logits: [1, 0, 0] and [0, 2, 0]
    y = torch.tensor([0, 2])
    expected = (torch.log(torch.tensor(torch.e + 2)) - 1) + torch.log(torch.tensor(2 + torch.e ** 2))
    torch.testing.assert_close(linear_cross_entropy(h, w, y), expected)


def test_all_rows_ignored_is_zero_with_zero_gradients():
    h, w = torch.randn(5, 8, requires_grad=True), torch.randn(30, 8, requires_grad=True)
    loss = linear_cross_entropy(h, w, torch.full((5,), IGNORE_INDEX))
    loss.backward()
    assert loss.item() == 0.0 and not h.grad.any() and not w.grad.any()


def test_bf16_autocast_is_as_close_to_float64_as_the_plain_bf16_path():
    torch.manual_seed(0)
    h, w = torch.randn(512, 64), torch.randn(2000, 64) * 0.1
    y = torch.randint(0, 2000, (512,))
    exact = _grads(lambda a, b, t: _plain(a.double(), b.double(), t), h, w, y)

    def fused_bf16(a, b, t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return linear_cross_entropy(a, b, t)

    plain = _grads(lambda a, b, t: _plain(a, b, t, bf16=True), h, w, y)
    fused = _grads(fused_bf16, h, w, y)
    for p, f, e in zip(plain[1:], fused[1:], exact[1:]):
        err_plain = ((p.double() - e).norm() / e.norm()).item()
        err_fused = ((f.double() - e).norm() / e.norm()).item()
        assert err_fused < 2 * err_plain + 1e-4, (err_fused, err_plain)
    assert abs(fused[0].item() - exact[0].item()) / exact[0].item() < 1e-3


def test_no_grad_needs_no_gradient_buffers():
    h, w = torch.randn(6, 8), torch.randn(40, 8)
    y = torch.randint(0, 40, (6,))
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, y), _plain(h, w, y))


def _model(**kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=97, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=64,
                                   **kw))


@pytest.mark.parametrize("masked", ["some", "most", "all"])
@pytest.mark.parametrize("tied", [True, False])
def test_model_targets_path_equals_lm_loss_of_its_logits(tied, masked):
    """Only the positions with a target are projected (a chat's masked prompt costs nothing there): the loss and
    every gradient as the whole rows' logits give them."""
    model = _model(tie_embeddings=tied)
    x, y = torch.randint(0, 97, (3, 20)), torch.randint(0, 97, (3, 20))
    y[0, :7] = IGNORE_INDEX
    if masked != "some":  # a prompt before each short reply, one row all prompt (or every row)
        y[:, :16] = IGNORE_INDEX
        y[1] = IGNORE_INDEX
    if masked == "all":
        y[:] = IGNORE_INDEX
    ref = lm_loss(model(x), y, reduction="sum")
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    got = model(x, targets=y)
    got.backward()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-4)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-5, atol=1e-6, msg=n)


def test_lora_wrapped_output_projection_takes_the_plain_path():
    model = _model(tie_embeddings=False)
    apply_lora(model, rank=2, alpha=4.0, dropout=0.0, targets=("lm_head",))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()  # adapters that change the output
    x, y = torch.randint(0, 97, (2, 12)), torch.randint(0, 97, (2, 12))
    y[0, :5] = IGNORE_INDEX
    torch.testing.assert_close(model(x, targets=y), lm_loss(model(x), y, reduction="sum"))


def test_bf16_training_on_a_cpu_runs_small_heads_attention_in_float32(monkeypatch):
    """Below SDPA_CPU_BF16_MIN_HEAD_DIM the CPU training path (no cache) hands SDPA float32 q, k, v under bf16
    autocast; at or above it, and when decoding with a cache, bf16 as autocast gives."""
    model = _model()  # head_dim 8
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append(q.dtype)
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(transformer.F, "scaled_dot_product_attention", spy)
    x = torch.randint(0, 97, (2, 16))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
        assert seen == [torch.float32] * 2 and out.dtype == torch.bfloat16
        seen.clear()
        monkeypatch.setattr(transformer, "SDPA_CPU_BF16_MIN_HEAD_DIM", 8)
        model(x)
        assert seen == [torch.bfloat16] * 2


def test_a_chunk_reads_the_output_matrix_for_enough_rows():
    """At a large vocabulary the cache rule alone gives a few rows, each chunk reading all of W: at least MIN_ROWS."""
    cpu = torch.device("cpu")
    assert linear_ce._chunk_rows(cpu, 151_936) == linear_ce.MIN_ROWS == 256
    assert linear_ce._chunk_rows(cpu, 1000) == (1 << 19) // 1000  # small vocabularies keep the cache rule
