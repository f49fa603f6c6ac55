"""The generation engine: KV-cached decoding equals recomputation; sampling filters."""

import copy
import math
import re

import pytest
import torch

from nanolm.config import ModelConfig, SamplingParams
from nanolm.errors import UserError
from nanolm.infer.engine import Engine, sample_next, top_k_filter, top_p_filter
from nanolm.infer.fuse import FusedAttention, FusedMLP, fuse_projections
from nanolm.model.transformer import Attention, KVCache, Transformer


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=61, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=64)
    return Transformer(cfg).eval()


def greedy_by_recompute(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_kv_cache_greedy_equals_full_recompute():
    model = _model()
    prompt = [3, 14, 15, 9, 26, 5]
    got = Engine(model).generate_all(prompt, SamplingParams(max_new_tokens=30, temperature=0))
    assert got == greedy_by_recompute(model, prompt, 30)


def test_stops_at_stop_token_and_at_context_end():
    model = _model()
    prompt = [1, 2, 3]
    full = Engine(model).generate_all(prompt, SamplingParams(max_new_tokens=20, temperature=0))
    stop = full[5]
    cut = Engine(model).generate_all(prompt, SamplingParams(max_new_tokens=20, temperature=0), stop_ids=[stop])
    assert cut == full[:full.index(stop)]
    long = Engine(model).generate_all(list(range(60)), SamplingParams(max_new_tokens=50, temperature=0))
    assert len(long) == 4  # the context is 64 tokens


def test_seeded_sampling_is_reproducible():
    model = _model()
    p = SamplingParams(max_new_tokens=20, temperature=1.0, top_k=10, top_p=0.9, seed=7)
    a = Engine(model).generate_all([5, 6], p)
    b = Engine(model).generate_all([5, 6], p)
    c = Engine(model).generate_all([5, 6], SamplingParams(max_new_tokens=20, temperature=1.0, seed=8))
    assert a == b and a != c


def test_top_k_filter_exact():
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    out = top_k_filter(logits, 2)
    assert out.tolist() == [-math.inf, 5.0, -math.inf, 4.0, -math.inf]
    assert torch.equal(top_k_filter(logits, 0), logits)


def test_top_p_filter_exact():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    # 0.5 alone < 0.8; 0.5+0.3 reaches 0.8 -> keep two tokens
    kept = torch.isfinite(top_p_filter(logits, 0.8)).tolist()
    assert kept == [True, True, False, False]
    assert torch.isfinite(top_p_filter(logits, 0.81)).tolist() == [True, True, True, False]
    assert torch.isfinite(top_p_filter(logits, 0.1)).tolist() == [True, False, False, False]  # top-1 always kept


def test_sampling_respects_filters():
    logits = torch.tensor([[0.0, 10.0, 9.0, -5.0]])
    g = torch.Generator().manual_seed(0)
    picks = {int(sample_next(logits, SamplingParams(temperature=2.0, top_k=2), g)) for _ in range(200)}
    assert picks == {1, 2}
    assert int(sample_next(logits, SamplingParams(temperature=0), g)) == 1


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(top_k=-1), dict(max_new_tokens=-1),
                                dict(temperature=float("nan")), dict(top_p=1.5), dict(top_k=2.5), dict(top_k=True),
                                dict(max_new_tokens="5"), dict(seed=2**64), dict(seed=-2**63 - 1), dict(seed=1.0)])
def test_bad_sampling_params(kw):
    (field, value), = kw.items()
    with pytest.raises(UserError, match=rf"^{field} must be .*, got {re.escape(repr(value))}$"):
        SamplingParams(**kw)


def test_one_set_of_sampling_defaults():
    """The defaults generate, chat, the server and the quickstart all take (tuned for small models)."""
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_k, p.top_p, p.seed) == (256, 0.8, 50, 0.95, None)
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1 and SamplingParams(seed=-2**63).seed == -2**63
    assert SamplingParams(temperature=1, top_p=1).top_p == 1  # integers are numbers too


# ----------------------------------------------------------------------------- fused projections

def test_fused_projections_give_the_separate_products_without_a_copy():
    model = _model()
    plain = copy.deepcopy(model)
    o_proj, down_proj = model.layers[0].self_attn.o_proj, model.layers[0].mlp.down_proj
    assert fuse_projections(model) == 2 * 2  # each layer's attention and MLP
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert type(attn) is FusedAttention and type(mlp) is FusedMLP
    ref_attn, ref_mlp = plain.layers[0].self_attn, plain.layers[0].mlp
    assert torch.equal(attn.qkv_weight, torch.cat([ref_attn.q_proj.weight, ref_attn.k_proj.weight,
                                                   ref_attn.v_proj.weight]))
    assert torch.equal(mlp.gate_up_weight, torch.cat([ref_mlp.gate_proj.weight, ref_mlp.up_proj.weight]))
    # The fused matrices are the only copy of those weights: the separate ones are gone, nothing is held twice.
    assert not any(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj"))
    assert not any(hasattr(mlp, n) for n in ("gate_proj", "up_proj"))
    assert mlp.gate_up_weight.untyped_storage().nbytes() == 2 * ref_mlp.up_proj.weight.numel() * 4
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in plain.parameters())
    assert attn.o_proj is o_proj and mlp.down_proj is down_proj and not attn.training
    x = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), rtol=1e-6, atol=1e-6)
    prompt = [3, 14, 15, 9, 26, 5]
    engine = Engine(plain)
    assert sum(type(m) in (FusedAttention, FusedMLP) for m in engine.model.modules()) == 2 * 2
    assert (engine.generate_all(prompt, SamplingParams(max_new_tokens=30, temperature=0))
            == greedy_by_recompute(plain, prompt, 30))


def test_fused_modules_load_the_models_layout_and_convert_like_any_module():
    model, plain = _model(), _model(seed=1)
    fuse_projections(model)
    fused_storage = model.layers[1].self_attn.qkv_weight.untyped_storage().data_ptr()
    # The model's own state_dict loads strictly into the fused matrices, in place.
    model.load_state_dict(plain.state_dict())
    assert model.layers[1].self_attn.qkv_weight.untyped_storage().data_ptr() == fused_storage
    assert torch.equal(model.layers[1].self_attn.qkv_weight[-8:], plain.layers[1].self_attn.v_proj.weight[-8:])
    x = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), rtol=1e-6, atol=1e-6)
    # A layout without one of the stacked weights is refused, naming the fused matrix it would fill.
    partial = {k: v for k, v in plain.state_dict().items() if k != "layers.0.mlp.up_proj.weight"}
    with pytest.raises(RuntimeError, match="layers.0.mlp.gate_up_weight"):
        model.load_state_dict(partial)
    # A dtype change converts the fused matrices with the rest: nothing goes stale.
    model.double()
    plain.double()
    assert model.layers[0].mlp.gate_up_weight.dtype == torch.float64
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), rtol=1e-12, atol=1e-12)


def _lora_model(targets):
    from nanolm.model.lora import apply_lora

    model = _model()
    apply_lora(model, rank=2, alpha=4.0, dropout=0.0, targets=targets)
    with torch.no_grad():
        for mod in model.modules():
            if hasattr(mod, "lora_B"):  # a non-zero adapter
                mod.lora_A.copy_(torch.full_like(mod.lora_A, 0.3))
                mod.lora_B.copy_(torch.full_like(mod.lora_B, 0.5))
    return model


def test_lora_layers_are_not_fused_nor_bypassed():
    from nanolm.model.lora import LoRALinear, apply_lora

    x = torch.randint(0, 61, (1, 7), generator=torch.Generator().manual_seed(4))
    # Every attention and MLP has a LoRA projection: nothing is fused, and the engine computes W x + s B A x.
    model = _lora_model(("q_proj", "up_proj"))
    engine = Engine(model)
    prepared = engine.model
    assert fuse_projections(copy.deepcopy(model)) == 0
    assert not any(type(m) in (FusedAttention, FusedMLP) for m in prepared.modules())
    assert type(prepared.layers[0].self_attn.q_proj) is LoRALinear
    with torch.no_grad():
        assert torch.equal(prepared(x), model(x))
        assert not torch.equal(prepared(x), _model()(x))  # the adapters count
    # LoRA on q_proj only: the MLPs fuse, the attentions keep their adapted separate products.
    model = _lora_model(("q_proj",))
    prepared = Engine(model).model
    assert [type(b.self_attn) for b in prepared.layers] == [Attention] * 2
    assert [type(b.mlp) for b in prepared.layers] == [FusedMLP] * 2
    with torch.no_grad():
        torch.testing.assert_close(prepared(x), model(x), rtol=1e-6, atol=1e-6)
        assert not torch.equal(prepared(x), _model()(x))
    # A fused module has no separate projection left to wrap, so a LoRA added after fusing cannot be bypassed.
    fused = _model()
    fuse_projections(fused)
    with pytest.raises(UserError, match="'q_proj' names no linear layer"):
        apply_lora(fused, rank=2, alpha=4.0, dropout=0.0, targets=("q_proj",))


def test_bf16_on_cpu_decodes_through_a_float32_cache_like_float32():
    model = _model()
    ref = copy.deepcopy(model)
    engine = Engine(model, dtype=torch.bfloat16)
    assert engine.cache_dtype == torch.float32 and engine.model.lm_head.weight.dtype == torch.bfloat16
    assert model.lm_head.weight.dtype == torch.float32  # the caller's model keeps its dtype
    ids = torch.tensor([[3, 14, 15, 9, 26, 5, 8, 9, 7, 9, 3, 2]])
    cache = KVCache.empty(model.config, 1, 16, "cpu", engine.cache_dtype)
    prepared = engine.model
    with torch.inference_mode():
        got = [prepared(ids[:, :6], cache)[0, -1]] + [prepared(ids[:, i:i + 1], cache)[0, -1] for i in range(6, 12)]
        want = ref(ids)[0, 5:12]
    assert cache.k[0].dtype == torch.float32 and got[0].dtype == torch.bfloat16
    torch.testing.assert_close(torch.stack(got).float(), want, atol=0.03, rtol=0.03)  # bf16 weights' rounding
    assert len(engine.generate_all([3, 14, 15], SamplingParams(max_new_tokens=10, temperature=0))) == 10


# ----------------------------------------------------------------------------- the engine's own copy

def _state(model):
    return {n: (p, p.detach().clone(), p.requires_grad) for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_leaves_the_callers_model_unchanged(dtype):
    model = _model()
    model.train()
    params, modules, buffers = _state(model), list(model.named_modules()), dict(model.named_buffers())
    engine = Engine(model, dtype=dtype)
    engine.generate_all([3, 14, 15], SamplingParams(max_new_tokens=10, temperature=0))
    assert model.training and not engine.model.training
    assert [(n, id(m)) for n, m in model.named_modules()] == [(n, id(m)) for n, m in modules]
    assert [n for n, _ in model.named_parameters()] == list(params)
    for name, p in model.named_parameters():
        same, value, requires_grad = params[name]
        assert p is same and p.dtype == torch.float32 and p.requires_grad == requires_grad and p.grad is None
        assert torch.equal(p, value), name
    assert all(b is buffers[n] and b.dtype == torch.float32 for n, b in model.named_buffers())
    assert model.lm_head.weight is model.embed_tokens.weight  # still tied
    # The copy shares no storage with the caller's tensors (a float32 engine too: nothing is aliased).
    ours = {t.untyped_storage().data_ptr() for t in [*engine.model.parameters(), *engine.model.buffers()]}
    theirs = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    assert not ours & theirs
    assert engine.model.lm_head.weight is engine.model.embed_tokens.weight  # tied in the copy as well
    assert all(not p.requires_grad for p in engine.model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_weights_takes_a_trained_models_current_weights(dtype):
    model = _model()
    engine = Engine(model, dtype=dtype)
    x = torch.randint(0, 61, (1, 9), generator=torch.Generator().manual_seed(3))

    def logits(m):
        with torch.inference_mode():
            return m(x).float()

    before = logits(engine.model)
    storage = [p.untyped_storage().data_ptr() for p in engine.model.parameters()]
    with torch.no_grad():  # the caller's model trains on: here, its weights become another model's
        for p, q in zip(model.parameters(), _model(seed=1).parameters()):
            p.copy_(q)
    assert torch.equal(logits(engine.model), before)  # the copy does not follow by itself
    engine.load_weights(model)
    fresh = Engine(model, dtype=dtype)
    assert not torch.equal(logits(engine.model), before)
    assert torch.equal(logits(engine.model), logits(fresh.model))
    for (name, p), q in zip(engine.model.named_parameters(), fresh.model.parameters()):
        assert torch.equal(p, q), name
    if dtype == torch.float32:
        prompt = [3, 14, 15, 9, 26, 5]
        got = engine.generate_all(prompt, SamplingParams(max_new_tokens=30, temperature=0))
        assert got == greedy_by_recompute(model, prompt, 30)
    assert [p.untyped_storage().data_ptr() for p in engine.model.parameters()] == storage  # loaded in place
    other = Transformer(ModelConfig(vocab_size=61, d_model=32, n_layer=3, n_head=4, n_kv_head=2, max_seq_len=64))
    with pytest.raises(RuntimeError, match="layers.2"):
        engine.load_weights(other)
