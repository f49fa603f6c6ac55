"""LoRA: exact no-op at init, frozen base under training, merge math, targeting by name, adapter files."""

import copy
import hashlib
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save as save_safetensors

from nanolm.config import ModelConfig
from nanolm.errors import UserError
from nanolm.checkpoint.adapter import load_adapter, read_adapter_config, save_adapter
from nanolm.model.lora import (
    DEFAULT_TARGETS,
    LoRALinear,
    apply_lora,
    base_fingerprint,
    base_state_dict,
    cast_base,
    disable_adapters,
    load_lora_state_dict,
    lora_state_dict,
    mark_only_lora_as_trainable,
    merge_lora,
    merged_weight,
    remove_lora,
)
from nanolm.model.transformer import Transformer

SETTINGS = dict(rank=4, alpha=8.0, dropout=0.0, targets=DEFAULT_TARGETS)


def tiny_model(seed: int = 0, **kw) -> Transformer:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=97, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=64)
    return Transformer(ModelConfig(**{**cfg, **kw})).eval()


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(seed))


def randomize_adapters(model: nn.Module, seed: int = 2) -> None:
    """Non-zero B (and a fresh A), so the adapter actually changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=g) * 0.1)
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.1)


def test_fresh_adapter_is_an_exact_no_op():
    model = tiny_model()
    x = tokens()
    with torch.no_grad():
        before = model(x)
        names = apply_lora(model, **SETTINGS)
        after = model(x)
    assert len(names) == 2 * 7
    assert torch.equal(before, after)


def test_training_changes_only_the_adapters():
    model = tiny_model()
    base_before = {k: v.clone() for k, v in base_state_dict(model).items()}
    apply_lora(model, **SETTINGS)
    mark_only_lora_as_trainable(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith((".lora_A", ".lora_B")) for n in trainable)
    assert len(trainable) == 2 * 2 * 7

    lora_before = {k: v.clone() for k, v in lora_state_dict(model).items()}
    # No weight decay: an A that moves got a gradient through B (which starts at zero).
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    model.train()
    x = tokens()
    for _ in range(3):
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()

    base_after = base_state_dict(model)
    assert base_after.keys() == base_before.keys()
    for k in base_before:
        assert torch.equal(base_before[k], base_after[k]), k
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, name
    for k, v in lora_state_dict(model).items():
        assert not torch.equal(v, lora_before[k]), f"{k} did not train"


def test_merged_weight_by_hand():
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # (out=3, in=2)
    a = torch.tensor([[1.0, 2.0], [0.0, -1.0]])  # (r=2, in=2)
    b = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, -1.0]])  # (out=3, r=2)
    # B A = [[1, 2], [0, -1], [2, 5]]; alpha/r = 4/2 = 2
    want = torch.tensor([[3.0, 4.0], [0.0, -1.0], [5.0, 11.0]])
    assert torch.equal(merged_weight(w, a, b, 4.0 / 2), want)


def test_lora_linear_merge_is_w_plus_scaled_ba():
    torch.manual_seed(0)
    base = nn.Linear(16, 24, bias=True)
    w, bias = base.weight.detach().clone(), base.bias.detach().clone()
    layer = LoRALinear(base, rank=4, alpha=6.0)
    with torch.no_grad():
        layer.lora_A.normal_()
        layer.lora_B.normal_()
    merged = layer.merge()
    assert type(merged) is nn.Linear
    assert torch.equal(merged.weight, w + (6.0 / 4) * (layer.lora_B @ layer.lora_A))
    assert torch.equal(merged.bias, bias)
    x = torch.randn(5, 16)
    torch.testing.assert_close(merged(x), layer(x), atol=1e-5, rtol=0)

    # bfloat16 base: the sum is formed in float32 and rounded once.
    bf = LoRALinear(nn.Linear(16, 24, bias=False).to(torch.bfloat16), rank=4, alpha=6.0)
    with torch.no_grad():
        bf.lora_B.normal_()
    assert bf.merged_weight().dtype == torch.bfloat16
    got = bf.merge().weight
    want = (bf.base.weight.float() + 1.5 * (bf.lora_B.float() @ bf.lora_A.float())).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_merged_model_matches_adapted_model_and_loads_as_a_plain_checkpoint():
    model = tiny_model()
    keys = set(model.state_dict())
    apply_lora(model, **SETTINGS)
    randomize_adapters(model)
    x = tokens()
    with torch.no_grad():
        adapted = model(x)
        merged = merge_lora(model)
        assert merged is model
        got = merged(x)
    torch.testing.assert_close(got, adapted, atol=1e-5, rtol=0)
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    assert set(merged.state_dict()) == keys
    assert merged.lm_head.weight is merged.embed_tokens.weight  # the tie survives

    fresh = tiny_model(seed=5)
    fresh.load_state_dict(merged.state_dict(), strict=True)
    with torch.no_grad():
        assert torch.equal(fresh(x), got)


def test_disabled_adapters_give_base_logits():
    model = tiny_model()
    x = tokens()
    with torch.no_grad():
        base = model(x)
        apply_lora(model, **SETTINGS)
        randomize_adapters(model)
        adapted = model(x)
        with disable_adapters(model):
            off = model(x)
        again = model(x)
    assert not torch.allclose(adapted, base)
    assert torch.equal(off, base)
    assert torch.equal(again, adapted)


def test_targets_are_chosen_by_name_not_shape():
    model = tiny_model()
    # With 2 kv heads, k_proj and v_proj have the same shape: only the named one is wrapped.
    assert model.layers[0].self_attn.k_proj.weight.shape == model.layers[0].self_attn.v_proj.weight.shape
    names = apply_lora(model, rank=2, alpha=4.0, dropout=0.0, targets=("q_proj", "v_proj"))
    assert names == ["layers.0.self_attn.q_proj", "layers.0.self_attn.v_proj",
                     "layers.1.self_attn.q_proj", "layers.1.self_attn.v_proj"]
    wrapped = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    assert wrapped == names
    assert type(model.layers[0].self_attn.k_proj) is nn.Linear
    assert type(model.lm_head) is nn.Linear


def test_a_comma_separated_string_names_targets():
    assert apply_lora(tiny_model(), 2, 4.0, 0.0, "up_proj, down_proj") == [
        "layers.0.mlp.up_proj", "layers.0.mlp.down_proj", "layers.1.mlp.up_proj", "layers.1.mlp.down_proj"]


def test_unknown_target_is_refused_and_lists_the_linear_layers():
    model = tiny_model()
    with pytest.raises(UserError) as e:
        apply_lora(model, rank=2, alpha=4.0, dropout=0.0, targets=("q_proj", "qkv"))
    assert str(e.value) == ("lora.targets: 'qkv' names no linear layer of the model; its linear layers are: "
                            "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj")
    assert not any(isinstance(m, LoRALinear) for m in model.modules())  # nothing half-applied
    with pytest.raises(UserError, match="'mlp' names no linear layer"):
        apply_lora(model, rank=2, alpha=4.0, dropout=0.0, targets=("mlp",))


def test_tied_lm_head_is_refused_untied_is_allowed():
    with pytest.raises(UserError, match=r"lm_head.weight is tied to embed_tokens.weight.*remove it"):
        apply_lora(tiny_model(), rank=2, alpha=4.0, dropout=0.0, targets=("lm_head",))
    assert apply_lora(tiny_model(tie_embeddings=False), rank=2, alpha=4.0, dropout=0.0,
                      targets=("lm_head",)) == ["lm_head"]


@pytest.mark.parametrize("field, kw", [("rank", dict(rank=0)), ("alpha", dict(alpha=0.0)),
                                       ("dropout", dict(dropout=1.0)), ("targets", dict(targets=()))])
def test_bad_settings_name_the_field(field, kw):
    with pytest.raises(UserError, match=f"^lora.{field} must be"):
        apply_lora(tiny_model(), **{**SETTINGS, **kw})


def test_lora_state_dict_holds_only_adapter_tensors():
    model = tiny_model()
    names = apply_lora(model, rank=3, alpha=6.0, dropout=0.0, targets=("q_proj", "down_proj"))
    sd = lora_state_dict(model)
    assert list(sd) == [f"{n}.{p}" for n in names for p in ("lora_A", "lora_B")]
    assert sd["layers.0.self_attn.q_proj.lora_A"].shape == (3, 32)
    assert sd["layers.0.self_attn.q_proj.lora_B"].shape == (32, 3)
    assert sd["layers.1.mlp.down_proj.lora_A"].shape == (3, model.config.n_hidden)


def test_load_lora_state_dict_is_strict():
    src = tiny_model()
    apply_lora(src, **SETTINGS)
    randomize_adapters(src)
    sd = lora_state_dict(src)
    dst = tiny_model()
    apply_lora(dst, **SETTINGS)
    load_lora_state_dict(dst, sd)
    for k, v in lora_state_dict(dst).items():
        assert torch.equal(v, sd[k])

    first = "layers.0.self_attn.q_proj.lora_A"
    missing = {k: v for k, v in sd.items() if k != first}
    with pytest.raises(UserError, match=f"^a.safetensors: the adapter has no {first} .*apply LoRA with the targets"):
        load_lora_state_dict(dst, missing, source="a.safetensors")
    extra = {**sd, "layers.0.self_attn.x_proj.lora_A": sd[first]}
    with pytest.raises(UserError, match="has layers.0.self_attn.x_proj.lora_A .*but the model has no LoRA layer"):
        load_lora_state_dict(dst, extra)
    small = tiny_model()
    apply_lora(small, **{**SETTINGS, "rank": 2})
    with pytest.raises(UserError, match=rf"{first} has shape \(4, 32\) but the model expects \(2, 32\).*rank"):
        load_lora_state_dict(small, sd)
    with pytest.raises(UserError, match="no LoRA layers"):
        load_lora_state_dict(tiny_model(), sd)


def test_dropout_applies_to_the_lora_path_in_training_only():
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(16, 8, bias=False), rank=4, alpha=4.0, dropout=0.5)
    assert not layer.base.weight.requires_grad and layer.lora_A.requires_grad and layer.lora_B.requires_grad
    x = torch.randn(64, 16)
    layer.train()
    assert torch.equal(layer(x), layer.base(x))  # B = 0: the frozen path is never dropped
    with torch.no_grad():
        layer.lora_B.normal_()
    exact = layer.base(x) + x @ layer.lora_A.T @ layer.lora_B.T
    layer.eval()
    assert torch.equal(layer(x), layer(x))
    torch.testing.assert_close(layer(x), exact, atol=1e-6, rtol=0)
    layer.train()
    a, b = layer(x), layer(x)
    assert not torch.allclose(a, exact) and not torch.allclose(a, b)


def test_fingerprint_ignores_adapters_and_sees_every_base_change():
    model = tiny_model()
    fp = base_fingerprint(model)
    assert len(fp) == 64 and fp == base_fingerprint(tiny_model())  # same seed, same weights
    assert fp != base_fingerprint(tiny_model(seed=1))
    apply_lora(model, **SETTINGS)
    randomize_adapters(model)
    assert base_fingerprint(model) == fp
    assert set(base_state_dict(model)) == set(tiny_model().state_dict())

    with torch.no_grad():
        model.layers[1].self_attn.v_proj.base.weight[3, 5] += 1e-3
    changed = base_fingerprint(model)
    assert changed != fp
    with torch.no_grad():
        model.layers[1].self_attn.v_proj.base.weight[3, 5] -= 1e-3
        model.norm.weight[0] = 1.5  # not a LoRA target
    assert base_fingerprint(model) not in (fp, changed)
    assert base_fingerprint(tiny_model().to(torch.bfloat16)) != fp  # the dtype is part of the base

    remove_lora(model)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert set(model.state_dict()) == set(tiny_model().state_dict())


def test_fingerprint_format_is_stable():
    """Saved adapters carry this value: changing the encoding would make every one of them refuse its base."""
    model = tiny_model()
    h = hashlib.sha256()
    sd = model.state_dict()
    for name in sorted(sd):
        if name == "lm_head.weight":
            continue  # tied to embed_tokens.weight: hashed once, under the first name in sorted order
        t = sd[name]
        h.update(json.dumps([name, "float32", list(t.shape)]).encode() + b"\n" + t.numpy().tobytes())
    assert base_fingerprint(model) == h.hexdigest()


def test_save_load_round_trip_gives_identical_logits(tmp_path):
    model = tiny_model()
    fp = base_fingerprint(model)
    names = apply_lora(model, rank=4, alpha=8.0, dropout=0.05, targets=("q_proj", "v_proj", "up_proj"))
    randomize_adapters(model)
    x = tokens()
    with torch.no_grad():
        want = model(x)
    out = save_adapter(tmp_path / "adapter", model, rank=4, alpha=8.0, dropout=0.05,
                       targets=("q_proj", "v_proj", "up_proj"), base_fingerprint=fp,
                       base_checkpoint="runs/base/checkpoints/step-00000300")
    assert sorted(p.name for p in out.iterdir()) == ["adapter.safetensors", "adapter_config.json"]
    cfg = read_adapter_config(out)
    assert cfg["rank"] == 4 and cfg["alpha"] == 8.0 and cfg["dropout"] == 0.05
    assert cfg["targets"] == ["q_proj", "v_proj", "up_proj"] and cfg["modules"] == names
    assert cfg["base_fingerprint"] == fp

    fresh = tiny_model()
    assert load_adapter(out, fresh) == cfg
    assert [n for n, m in fresh.named_modules() if isinstance(m, LoRALinear)] == names
    with torch.no_grad():
        assert torch.equal(fresh(x), want)


def test_adapter_refuses_another_base(tmp_path):
    model = tiny_model()
    fp = base_fingerprint(model)
    apply_lora(model, **SETTINGS)
    save_adapter(tmp_path, model, **SETTINGS, base_fingerprint=fp, base_checkpoint="runs/base")
    other = tiny_model(seed=7)
    with pytest.raises(UserError) as e:
        load_adapter(tmp_path, other)
    assert str(e.value) == (f"{tmp_path}/adapter_config.json: this adapter was trained on base {fp[:12]} but the "
                            f"model is {base_fingerprint(other)[:12]}; load it onto the checkpoint it was trained "
                            f"from (runs/base)")
    assert not any(isinstance(m, LoRALinear) for m in other.modules())


def test_damaged_adapter_files_are_named(tmp_path):
    model = tiny_model()
    fp = base_fingerprint(model)
    apply_lora(model, **SETTINGS)
    d = save_adapter(tmp_path / "a", model, **SETTINGS, base_fingerprint=fp)
    cfg_file, weights = d / "adapter_config.json", d / "adapter.safetensors"
    good_cfg, good_weights = cfg_file.read_bytes(), weights.read_bytes()

    with pytest.raises(UserError, match="no such adapter directory"):
        load_adapter(tmp_path / "nope", tiny_model())

    weights.write_bytes(good_weights[: len(good_weights) // 2])
    fresh = tiny_model()
    with pytest.raises(UserError, match=f"^{weights}: does not match adapter_config.json"):
        load_adapter(d, fresh)
    assert not any(isinstance(m, LoRALinear) for m in fresh.modules())
    weights.unlink()
    with pytest.raises(UserError, match=f"^{weights}: missing adapter weights"):
        load_adapter(d, tiny_model())
    weights.write_bytes(good_weights)

    cfg_file.write_text("{not json")
    with pytest.raises(UserError, match=f"^{cfg_file}: corrupt adapter config"):
        read_adapter_config(d)
    cfg_file.write_text(json.dumps({**json.loads(good_cfg), "rank": -1}))
    with pytest.raises(UserError, match=f"^{cfg_file}: lora.rank must be a positive integer, got -1"):
        load_adapter(d, tiny_model())
    cfg_file.unlink()
    with pytest.raises(UserError, match=f"^{cfg_file}: missing adapter config"):
        load_adapter(d, tiny_model())


def test_a_failed_load_leaves_the_model_as_it_was(tmp_path):
    model = tiny_model()
    fp = base_fingerprint(model)
    apply_lora(model, **SETTINGS)
    d = save_adapter(tmp_path, model, **SETTINGS, base_fingerprint=fp)
    # A consistent pair (hash matches) whose tensors lack one layer: caught after LoRA is applied.
    tensors = {k: v for k, v in lora_state_dict(model).items() if not k.startswith("layers.1.mlp.down_proj")}
    data = save_safetensors(tensors)
    (d / "adapter.safetensors").write_bytes(data)
    cfg = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**cfg, "weights_sha256": hashlib.sha256(data).hexdigest()}))
    fresh = tiny_model()
    with pytest.raises(UserError, match="the adapter has no layers.1.mlp.down_proj.lora_A"):
        load_adapter(d, fresh)
    assert not any(isinstance(m, LoRALinear) for m in fresh.modules())
    assert set(fresh.state_dict()) == set(tiny_model().state_dict())


@pytest.mark.parametrize("tie", [True, False])
def test_a_base_kept_in_bf16_computes_as_autocast_does(tie):
    """Under bf16 autocast a LoRA layer whose base is kept in bf16 gives exactly the output and adapter
    gradients of one whose fp32 base autocast casts; the whole model, with its embedding table rounded to bf16
    once, stays within bf16 rounding, and outside autocast it still runs (the stream stays float32)."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 24)
    a, b = LoRALinear(nn.Linear(16, 24), 4, 8.0), None
    a.base.load_state_dict(lin.state_dict())
    b = LoRALinear(nn.Linear(16, 24), 4, 8.0)
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        a.lora_B.normal_()
        b.lora_B.copy_(a.lora_B)
    b.base.to(torch.bfloat16)
    x = torch.randn(3, 5, 16)
    outs = []
    for m in (a, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x)
        y.float().square().sum().backward()
        outs.append((y, m.lora_A.grad, m.lora_B.grad))
    for ya, yb in zip(*outs):
        assert torch.equal(ya, yb)

    model = tiny_model(tie_embeddings=tie)
    apply_lora(model, **SETTINGS)
    randomize_adapters(model)
    mark_only_lora_as_trainable(model)
    ref = copy.deepcopy(model)
    n = cast_base(model, torch.bfloat16)
    frozen = [p for p in model.parameters() if p.dim() == 2 and not p.requires_grad]
    assert n == sum(p.numel() for p in frozen) and {p.dtype for p in frozen} == {torch.bfloat16}
    assert (model.lm_head.weight is model.embed_tokens.weight) == tie
    x = tokens()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = model(x), ref(x)
    torch.testing.assert_close(got.float(), want.float(), atol=0.1, rtol=0.05)
    with torch.no_grad():
        plain = model(x)
    assert plain.dtype == torch.float32
    torch.testing.assert_close(plain, ref(x), atol=0.1, rtol=0.05)
