"""GGUF export: every tensor, metadata key and tokenizer field read back with gguf's own reader.

The checks that matter to llama.cpp users: tensors carry llama.cpp's names
and shapes; q/k rows are in ggml's interleaved RoPE order (and that order
gives the same attention scores); the vocabulary, merges and special ids
encode text exactly as nanolm's tokenizer does; the chat template renders
ChatML. When llama-cpp-python is installed, the file is also run through
llama.cpp itself and its logits compared with nanolm's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from nanolm.checkpoint import load_model, save_checkpoint
from nanolm.config import Config, ModelConfig, TrainConfig
from nanolm.data.chatml import CHAT_TEMPLATE, render_chat
from nanolm.errors import UserError
from nanolm.model.transformer import Transformer, apply_rope, rope_tables
from nanolm.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")

from nanolm.export.gguf import export_gguf, rope_deinterleave, rope_interleave  # noqa: E402

F32, F16, Q8_0 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0
NORMAL, CONTROL, UNUSED = 1, 3, 5

# d_model 64 and n_hidden 80: every row is a multiple of 32 long except ffn_down's (80),
# which exercises the F16 fallback of Q8_0.
DENSE = dict(vocab_size=400, d_model=64, n_layer=2, n_head=4, n_kv_head=2, n_hidden=80, max_seq_len=64,
             rope_theta=10000.0, norm_eps=1e-6, init_std=0.1)


def make_run(root: Path, tokenizer_dir: Path, seed: int = 0, **model_over) -> Path:
    """A run directory with one checkpoint of a random model; norms random too, so they are checked."""
    mc = ModelConfig(**{**DENSE, **model_over})
    cfg = Config(model=mc, train=TrainConfig(seq_len=mc.max_seq_len, out_dir=str(root)))
    torch.manual_seed(seed)
    model = Transformer(mc)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    save_checkpoint(root, 1, model, None, cfg, {}, tokenizer_dir=tokenizer_dir)
    return root


def read(path: Path) -> tuple[dict, dict]:
    """(metadata key -> python value, tensor name -> ReaderTensor) of a GGUF file."""
    r = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return meta, {t.name: t for t in r.tensors}


def expected_tensors(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """llama.cpp name -> nanolm weight as written out by hand (q/k still in nanolm's rotate-half order)."""
    sd = model.state_dict()
    out = {"token_embd.weight": sd["embed_tokens.weight"], "output_norm.weight": sd["norm.weight"]}
    names = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for i in range(cfg.n_layer):
        for g, n in names.items():
            out[f"blk.{i}.{g}.weight"] = sd[f"layers.{i}.{n}.weight"]
    if not cfg.tie_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    return out


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order by its definition: file row h*hs + 2i + j holds row h*hs + j*hs/2 + i."""
    hs = w.shape[0] // n_heads
    out = np.empty_like(w)
    for h in range(n_heads):
        for i in range(hs // 2):
            for j in range(2):
                out[h * hs + j * hs // 2 + i] = w[h * hs + 2 * i + j]
    return out


def values(t) -> np.ndarray:
    """A ReaderTensor's values as float32 in PyTorch's (out, in) layout."""
    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory, tokenizer_dir) -> Path:
    return make_run(tmp_path_factory.mktemp("gguf") / "run", tokenizer_dir)


@pytest.fixture(scope="module")
def exported(dense_run, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("gguf-out")
    return {t: export_gguf(dense_run, out / f"model-{t}.gguf", outtype=t, quiet=True) for t in ("f32", "f16", "q8_0")}


# ----------------------------------------------------------------------------- tensors

@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0"])
def test_every_tensor_has_llama_cpp_name_shape_type_and_value(dense_run, exported, outtype):
    model, _ = load_model(dense_run, "best")
    want = expected_tensors(model, model.config)
    _, tensors = read(exported[outtype])
    assert set(tensors) == set(want)  # tied embeddings: no output.weight, llama.cpp reuses token_embd
    for name, w in want.items():
        t = tensors[name]
        w = w.numpy()
        assert tuple(int(d) for d in t.shape) == tuple(reversed(w.shape)), name  # ggml order {in, out}
        got = values(t)
        if name.endswith((".attn_q.weight", ".attn_k.weight")):
            got = unpermute(got, model.config.n_head if ".attn_q." in name else model.config.n_kv_head)
        if w.ndim == 1 or outtype == "f32":
            assert t.tensor_type == F32, name
            np.testing.assert_array_equal(got, w, err_msg=name)
        elif outtype == "f16" or (outtype == "q8_0" and w.shape[-1] % 32):
            assert t.tensor_type == F16, name
            np.testing.assert_array_equal(got, w.astype(np.float16).astype(np.float32), err_msg=name)
        else:
            assert t.tensor_type == Q8_0, name
            # Q8_0: per block of 32 values, d = max|x| / 127 stored as f16 and q = round(x / d) in int8, so
            # |x - d q| <= d / 2 plus 127 times d's f16 rounding (2^-11 relative): 0.57 d bounds both.
            blocks = w.reshape(-1, 32)
            err = np.abs(got.reshape(-1, 32) - blocks).max(axis=1)
            assert np.all(err <= 0.57 * np.abs(blocks).max(axis=1) / 127), name
    if outtype == "q8_0":  # ffn_down's rows are 80 long, not a whole number of 32-value blocks
        assert tensors["blk.0.ffn_down.weight"].tensor_type == F16
        assert tensors["blk.0.ffn_up.weight"].tensor_type == Q8_0


def test_file_sizes_follow_the_type(exported):
    sizes = {t: p.stat().st_size for t, p in exported.items()}
    assert sizes["q8_0"] < sizes["f16"] < sizes["f32"]


def test_rope_permutation_is_its_own_inverse_pair_and_matches_the_definition():
    w = torch.randn(4 * 16, 8)
    p = rope_interleave(w, 4)
    assert torch.equal(rope_deinterleave(p, 4), w)
    np.testing.assert_array_equal(unpermute(p.numpy(), 4), w.numpy())
    # first head: rows 0..7 (first half) land on even rows, rows 8..15 on odd rows
    assert torch.equal(p[0::2][:8], w[:8]) and torch.equal(p[1::2][:8], w[8:16])


def ggml_rope_norm(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """ggml's normal RoPE (what llama.cpp's llama graph runs): rotate pairs (2i, 2i+1) by pos * theta^(-2i/hs).

    x: (T, n, hs); pos: (T,).
    """
    hs = x.shape[-1]
    inv = theta ** (-torch.arange(0, hs, 2, dtype=torch.float64) / hs)  # (hs/2,)
    ang = pos[:, None].double() * inv[None]  # (T, hs/2)
    cos, sin = ang.cos()[:, None].float(), ang.sin()[:, None].float()
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def test_permuted_weights_under_ggml_rope_give_nanolm_attention_scores():
    """The reason for the permutation: interleaved RoPE on permuted q/k = rotate-half RoPE on the originals."""
    torch.manual_seed(1)
    n_head, n_kv, hs, C, T, theta = 4, 2, 16, 32, 9, 10000.0
    wq, wk = torch.randn(n_head * hs, C), torch.randn(n_kv * hs, C)
    x = torch.randn(T, C)
    cos, sin = rope_tables(hs, T, theta)
    q = apply_rope((x @ wq.T).view(T, n_head, hs).transpose(0, 1), cos, sin)  # (nh, T, hs)
    k = apply_rope((x @ wk.T).view(T, n_kv, hs).transpose(0, 1), cos, sin)
    nanolm_scores = q @ k.repeat_interleave(n_head // n_kv, 0).transpose(1, 2)  # (nh, T, T)

    pos = torch.arange(T)
    qg = ggml_rope_norm((x @ rope_interleave(wq, n_head).T).view(T, n_head, hs), pos, theta).transpose(0, 1)
    kg = ggml_rope_norm((x @ rope_interleave(wk, n_kv).T).view(T, n_kv, hs), pos, theta).transpose(0, 1)
    ggml_scores = qg @ kg.repeat_interleave(n_head // n_kv, 0).transpose(1, 2)
    torch.testing.assert_close(ggml_scores, nanolm_scores, rtol=1e-4, atol=1e-4)
    # without the permutation the scores differ: the test can fail
    kg_wrong = ggml_rope_norm((x @ wk.T).view(T, n_kv, hs), pos, theta).transpose(0, 1)
    qg_wrong = ggml_rope_norm((x @ wq.T).view(T, n_head, hs), pos, theta).transpose(0, 1)
    wrong = qg_wrong @ kg_wrong.repeat_interleave(n_head // n_kv, 0).transpose(1, 2)
    assert (wrong - nanolm_scores).abs().max() > 1.0


# ----------------------------------------------------------------------------- metadata and tokenizer

@pytest.mark.parametrize("outtype,file_type", [("f32", 0), ("f16", 1), ("q8_0", 7)])
def test_every_metadata_key(exported, tokenizer_dir, outtype, file_type):
    meta, _ = read(exported[outtype])
    tok = Tokenizer.load(tokenizer_dir)
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    tokens = [tok._tok.id_to_token(i) for i in range(tok.vocab_size)] + \
        [f"[PAD{i}]" for i in range(tok.vocab_size, 400)]
    types = [CONTROL] * 3 + [NORMAL] * (tok.vocab_size - 3) + [UNUSED] * (400 - tok.vocab_size)
    want = {
        "general.architecture": "llama", "general.type": "model", "general.name": "run",
        "general.file_type": file_type, "general.quantization_version": 2,
        "llama.vocab_size": 400, "llama.context_length": 64, "llama.embedding_length": 64,
        "llama.block_count": 2, "llama.feed_forward_length": 80, "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2, "llama.rope.freq_base": 10000.0,
        "llama.attention.layer_norm_rms_epsilon": pytest.approx(1e-6), "llama.rope.dimension_count": 16,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.eot_token_id": 2,
        "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.add_eos_token": False, "tokenizer.chat_template": CHAT_TEMPLATE,
    }
    assert meta == want
    assert len(merges) > 50 and tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_vocabulary_and_merges_encode_like_nanolm(exported, tokenizer_dir):
    """A BPE built only from the GGUF's tokens and merges tokenizes text exactly as nanolm does."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    meta, _ = read(exported["f16"])
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {t: i for i, (t, kind) in enumerate(zip(tokens, meta["tokenizer.ggml.token_type"])) if kind == NORMAL}
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    bpe = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    tok = Tokenizer.load(tokenizer_dir)
    for text in ["To be, or not to be, that is the question.", "滚滚长江东逝水，浪花淘尽英雄。", "  x\n\ty 123 ok?!"]:
        ids = tok.encode(text)
        assert bpe.encode(text).ids == ids
        assert bpe.decode(ids) == text


def test_chat_template_renders_chatml(exported, tokenizer_dir):
    jinja2 = pytest.importorskip("jinja2")
    meta, _ = read(exported["q8_0"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"}]
    rendered = jinja2.Template(meta["tokenizer.chat_template"]).render(messages=messages, add_generation_prompt=True)
    assert rendered == render_chat(messages, add_generation_prompt=True)
    assert rendered == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n"


# ----------------------------------------------------------------------------- other models

def test_untied_model_writes_output_and_larger_vocab_is_padded(tmp_path, tokenizer_dir):
    run = make_run(tmp_path / "untied", tokenizer_dir, tie_embeddings=False, vocab_size=448)
    out = export_gguf(run, tmp_path / "u.gguf", outtype="f32", quiet=True)
    model, _ = load_model(run)
    meta, tensors = read(out)
    np.testing.assert_array_equal(values(tensors["output.weight"]), model.lm_head.weight.detach().numpy())
    assert tuple(int(d) for d in tensors["token_embd.weight"].shape) == (64, 448)
    n = Tokenizer.load(tokenizer_dir).vocab_size
    assert meta["tokenizer.ggml.tokens"][n:] == [f"[PAD{i}]" for i in range(n, 448)]
    assert meta["tokenizer.ggml.token_type"][n:] == [UNUSED] * (448 - n)
    assert meta["llama.vocab_size"] == 448


def test_lora_adapter_is_merged(tmp_path, tokenizer_dir, dense_run):
    from nanolm.checkpoint import save_adapter
    from nanolm.model.lora import apply_lora, base_fingerprint

    model, _ = load_model(dense_run)
    apply_lora(model, rank=2, alpha=4.0, dropout=0.0, targets=("v_proj",))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_()
    lora = model.layers[1].self_attn.v_proj
    merged = lora.base.weight + 2.0 * lora.lora_B @ lora.lora_A  # scaling = alpha / rank
    save_adapter(tmp_path / "lora", model, rank=2, alpha=4.0, dropout=0.0, targets=("v_proj",),
                 base_fingerprint=base_fingerprint(model))
    out = export_gguf(dense_run, tmp_path / "m.gguf", adapter=tmp_path / "lora", outtype="f32", quiet=True)
    _, tensors = read(out)
    np.testing.assert_allclose(values(tensors["blk.1.attn_v.weight"]), merged.detach().numpy(), rtol=1e-6, atol=1e-6)
    assert not np.allclose(values(tensors["blk.1.attn_v.weight"]), lora.base.weight.detach().numpy())


@pytest.mark.parametrize("shared,norm_topk,arch", [(0, True, "llama"), (1, True, "bailingmoe"),
                                                   (0, False, "bailingmoe")])
def test_moe_experts_are_stacked(tmp_path, tokenizer_dir, shared, norm_topk, arch):
    run = make_run(tmp_path / "moe", tokenizer_dir, use_moe=True, n_experts=3, top_k=2, n_shared_experts=shared,
                   norm_topk=norm_topk, moe_n_hidden=32)
    out = export_gguf(run, tmp_path / "moe.gguf", outtype="f32", quiet=True)
    model, _ = load_model(run)
    meta, tensors = read(out)
    assert meta["general.architecture"] == arch
    assert meta[f"{arch}.expert_count"] == 3 and meta[f"{arch}.expert_used_count"] == 2
    assert meta[f"{arch}.feed_forward_length"] == 32
    moe = model.layers[1].mlp
    np.testing.assert_array_equal(values(tensors["blk.1.ffn_gate_inp.weight"]), moe.gate.weight.detach().numpy())
    assert tensors["blk.1.ffn_gate_inp.weight"].tensor_type == F32
    for n in ("gate", "up", "down"):
        t = tensors[f"blk.1.ffn_{n}_exps.weight"]
        want = np.stack([getattr(e, f"{n}_proj").weight.detach().numpy() for e in moe.experts])  # (E, out, in)
        assert tuple(int(d) for d in reversed(t.shape)) == want.shape
        np.testing.assert_array_equal(values(t), want)
    if arch == "llama":
        assert not any("shexp" in name for name in tensors) and "output.weight" not in tensors
        return
    assert meta["bailingmoe.expert_weights_norm"] is norm_topk
    assert meta["bailingmoe.expert_shared_count"] == 1 and meta["bailingmoe.expert_feed_forward_length"] == 32
    assert meta["bailingmoe.leading_dense_block_count"] == 0
    # bailingmoe requires an output tensor even for tied embeddings
    np.testing.assert_array_equal(values(tensors["output.weight"]), model.embed_tokens.weight.detach().numpy())
    for n in ("gate", "up", "down"):
        got = values(tensors[f"blk.1.ffn_{n}_shexp.weight"])
        if shared:
            np.testing.assert_array_equal(got, getattr(moe.shared_expert, f"{n}_proj").weight.detach().numpy())
        else:  # a zero shared expert adds exactly nothing
            assert got.shape == ((64, 32) if n == "down" else (32, 64)) and not got.any()


# ----------------------------------------------------------------------------- refusals and atomicity

def test_refusals_are_one_line_user_errors(tmp_path, tokenizer_dir, dense_run):
    with pytest.raises(UserError, match=r"outtype='q4'.*one of f32, f16, q8_0"):
        export_gguf(dense_run, tmp_path / "m.gguf", outtype="q4", quiet=True)
    mixed = make_run(tmp_path / "mixed", tokenizer_dir, use_moe=True, n_experts=2, top_k=1, moe_every=2)
    with pytest.raises(UserError, match=r"model.moe_every=2: .*nanolm export hf"):
        export_gguf(mixed, tmp_path / "m.gguf", quiet=True)
    small = make_run(tmp_path / "small", tokenizer_dir, vocab_size=300)
    with pytest.raises(UserError, match=r"tokenizer.json: token id \d+ is outside the model's vocabulary"):
        export_gguf(small, tmp_path / "m.gguf", quiet=True)
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(UserError, match="is a directory"):
        export_gguf(dense_run, tmp_path / "dir.gguf", quiet=True)
    assert not (tmp_path / "m.gguf").exists()


def test_failed_export_leaves_the_old_file_and_no_temp(tmp_path, dense_run, monkeypatch):
    target = tmp_path / "m.gguf"
    export_gguf(dense_run, target, outtype="f32", quiet=True)
    before = target.read_bytes()
    calls = {"n": 0}
    real = gguf.quants.quantize

    def failing(data, qtype):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("disk on fire")
        return real(data, qtype)

    monkeypatch.setattr(gguf.quants, "quantize", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        export_gguf(dense_run, target, outtype="f16", quiet=True)
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


# ----------------------------------------------------------------------------- the real consumer

def llama_cpp_logits(path: Path, ids: list[int], text: str) -> np.ndarray:
    """Logits (T, V) of llama.cpp on `ids`, after checking that llama.cpp tokenizes `text` to the same ids."""
    llama_cpp = pytest.importorskip("llama_cpp")
    # An f32 KV cache (llama.cpp's default is f16), so an f32 file is compared in f32 throughout.
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, n_ubatch=64, logits_all=True,
                          n_threads=2, type_k=0, type_v=0, verbose=False)
    try:
        assert llm.tokenize(text.encode("utf-8"), add_bos=False, special=True) == ids
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)])
    finally:
        llm.close()


CHAT = [{"role": "user", "content": "To be, or not to be? 滚滚长江东逝水"}, {"role": "assistant", "content": "ok"}]


# Largest logit error relative to the largest logit. f32 is exact up to summation order (measured 5e-7;
# the same file without the q/k permutation is off by 0.57). f16 and Q8_0 add the weights' rounding and, for
# Q8_0, llama.cpp's 8-bit quantisation of activations (measured 1.1e-3 and 0.032).
@pytest.mark.parametrize("outtype,tol", [("f32", 1e-4), ("f16", 5e-3), ("q8_0", 0.1)])
def test_llama_cpp_logits_match_nanolm(dense_run, exported, tokenizer_dir, outtype, tol):
    pytest.importorskip("llama_cpp")
    model, _ = load_model(dense_run)
    tok = Tokenizer.load(tokenizer_dir)
    text = render_chat(CHAT)
    ids = tok.encode(text)
    with torch.no_grad():
        want = model(torch.tensor([ids]))[0].numpy()  # (T, V)
    got = llama_cpp_logits(exported[outtype], ids, text)
    assert np.abs(got - want).max() <= tol * np.abs(want).max()
    if outtype == "f32":
        assert np.array_equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("shared,norm_topk", [(0, True), (1, True), (1, False), (0, False)])
def test_llama_cpp_runs_moe_exports_like_nanolm(tmp_path, tokenizer_dir, shared, norm_topk):
    pytest.importorskip("llama_cpp")
    run = make_run(tmp_path / "moe", tokenizer_dir, use_moe=True, n_experts=4, top_k=2, n_shared_experts=shared,
                   norm_topk=norm_topk, moe_n_hidden=32)
    out = export_gguf(run, tmp_path / "moe.gguf", outtype="f32", quiet=True)
    model, _ = load_model(run)
    tok = Tokenizer.load(tokenizer_dir)
    text = render_chat(CHAT)
    ids = tok.encode(text)
    with torch.no_grad():
        want = model(torch.tensor([ids]))[0].numpy()
    got = llama_cpp_logits(out, ids, text)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()  # measured < 1e-6 for every layout
