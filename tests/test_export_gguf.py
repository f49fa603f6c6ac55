"""GGUF export: every tensor, metadata key and tokenizer field read back with gguf's own reader.

The checks that matter to llama.cpp users: tensors carry llama.cpp's names
and shapes; q/k rows are in ggml's interleaved RoPE order (and that order
gives the same attention scores); the vocabulary, merges and special ids
encode text exactly as nanolm's tokenizer does; the chat template renders
ChatML; q4_0 files keep at higher precision the tensors llama-quantize keeps.
When llama-cpp-python is installed, the file is also run through llama.cpp
itself: its logits compared with nanolm's, its q4_0 type choices with
llama-quantize's own, and, on a model trained here, the perplexity and greedy
chat replies of the q4_0 file with the f16 file's and nanolm's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from nanolm.chat import CHAT_TEMPLATE, render_chat
from nanolm.checkpoint import load_model, save_checkpoint
from nanolm.config import Config, ModelConfig, TrainConfig
from nanolm.errors import UserError
from nanolm.model.transformer import Transformer, apply_rope, rope_tables
from nanolm.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")

from nanolm.export.gguf import export_gguf, rope_deinterleave, rope_interleave, tensor_type  # noqa: E402

F32, F16, Q8_0, Q4_0 = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                        gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0)
OUTTYPES = ("f32", "f16", "q8_0", "q4_0")
NORMAL, CONTROL, UNUSED = 1, 3, 5

# d_model 64 and n_hidden 80: every row is a multiple of 32 long except ffn_down's (80),
# which exercises the F16 fallback of Q8_0 and Q4_0.
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
    return {t: export_gguf(dense_run, out / f"model-{t}.gguf", outtype=t, quiet=True) for t in OUTTYPES}


# ----------------------------------------------------------------------------- tensors

def assert_q8_0_close(got: np.ndarray, w: np.ndarray, name: str) -> None:
    """Q8_0: per block of 32 values, d = max|x| / 127 stored as f16 and q = round(x / d) in int8, so
    |x - d q| <= d / 2 plus 127 times d's f16 rounding (2^-11 relative): 0.57 d bounds both."""
    blocks = w.reshape(-1, 32)
    err = np.abs(got.reshape(-1, 32) - blocks).max(axis=1)
    assert np.all(err <= 0.57 * np.abs(blocks).max(axis=1) / 127), name


def assert_q4_0_close(got: np.ndarray, w: np.ndarray, name: str) -> None:
    """Q4_0 (ggml's quantize_row_q4_0): per block of 32 values, m is the value of largest magnitude,
    d = -m / 8 (stored as f16) and q = min(15, floor(x / d + 8.5)), which dequantises to d (q - 8).

    So m itself comes back as 8 |d| exactly (up to d's f16 rounding); a value with x / d < 7.5 is off by at
    most |d| / 2 (the rounding); one with x / d >= 7.5 (near -m) is clipped to 7 d, off by at most |d|; and
    d's f16 rounding adds at most 8 |d| 2^-11 = |d| / 256 to any of them.
    """
    blocks, got = w.reshape(-1, 32).astype(np.float64), got.reshape(-1, 32).astype(np.float64)
    m = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)  # (n_blocks, 1)
    d = -m / 8
    err = np.abs(got - blocks)
    clipped = blocks / d >= 7.5
    bound = np.where(clipped, 1.0, 0.5) * np.abs(d) + np.abs(d) / 256
    assert np.all(err <= bound), name
    np.testing.assert_allclose(np.take_along_axis(got, np.abs(blocks).argmax(axis=1)[:, None], axis=1), m,
                               rtol=2**-11, err_msg=name)


def want_type(name: str, w: np.ndarray, outtype: str) -> gguf.GGMLQuantizationType:
    """The type a tensor of the tied DENSE model must have in an `outtype` file."""
    if w.ndim == 1 or outtype == "f32":
        return F32
    if outtype == "f16" or w.shape[-1] % 32:  # ffn_down's 80-long rows hold no whole number of blocks
        return F16
    if outtype == "q4_0" and name == "token_embd.weight":  # tied: it is also the output, kept at Q8_0
        return Q8_0
    return {"q8_0": Q8_0, "q4_0": Q4_0}[outtype]


@pytest.mark.parametrize("outtype", OUTTYPES)
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
        kind = want_type(name, w, outtype)
        assert t.tensor_type == kind, name
        if kind == F32:
            np.testing.assert_array_equal(got, w, err_msg=name)
        elif kind == F16:
            np.testing.assert_array_equal(got, w.astype(np.float16).astype(np.float32), err_msg=name)
        elif kind == Q8_0:
            assert_q8_0_close(got, w, name)
        else:
            assert_q4_0_close(got, w, name)
    types = {name: t.tensor_type for name, t in tensors.items()}
    if outtype in ("q8_0", "q4_0"):  # stated exactly: the test above could pass with the rules it encodes wrong
        assert types["blk.0.ffn_down.weight"] == F16 and types["blk.1.attn_norm.weight"] == F32
        assert types["blk.0.ffn_up.weight"] == types["blk.1.attn_v.weight"] == (Q8_0 if outtype == "q8_0" else Q4_0)
        assert types["token_embd.weight"] == Q8_0


def test_q4_0_error_bound_is_tight_and_can_fail():
    """The Q4_0 check on random blocks: gguf's quantiser meets it, and a one-level error anywhere breaks it."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 96)) * rng.uniform(0.01, 3, (64, 1))).astype(np.float32)
    w[0, :32] = np.linspace(-1, 1, 32)  # a block whose -m is in it: the clipped end
    got = gguf.quants.dequantize(gguf.quants.quantize(w, Q4_0), Q4_0).reshape(w.shape)
    assert_q4_0_close(got, w, "random")
    block = w[5, 32:64]  # element 40 of row 5 is in block 1 of that row
    d = -block[np.abs(block).argmax()] / 8
    assert w[5, 40] / d < 7.5  # not the clipped end: its bound is d / 2 + d / 256
    off = got.copy()
    off[5, 40] += 1.1 * abs(d)  # one quantisation level and a bit: at least 0.6 d off, whatever it was before
    with pytest.raises(AssertionError):
        assert_q4_0_close(off, w, "one value off by a level")


@pytest.mark.parametrize("name,shape,has_output,n_experts,want", [
    ("blk.0.attn_q.weight", (64, 64), False, 0, "q4_0"),
    ("blk.0.ffn_down.weight", (64, 80), False, 0, "f16"),  # rows of 80: no whole number of 32-value blocks
    ("token_embd.weight", (400, 64), False, 0, "q8_0"),  # tied: token_embd is the output projection too
    ("token_embd.weight", (400, 64), True, 0, "q4_0"),  # untied: an input embedding like any other
    ("output.weight", (400, 64), True, 0, "q8_0"),
    ("output.weight", (400, 80), True, 0, "f16"),
    ("blk.1.attn_k.weight", (32, 64), False, 8, "q8_0"),  # llama.cpp's rule for models of exactly 8 experts
    ("blk.1.attn_v.weight", (32, 64), False, 8, "q8_0"),
    ("blk.1.attn_q.weight", (64, 64), False, 8, "q4_0"),
    ("blk.1.attn_v.weight", (32, 64), False, 4, "q4_0"),
    ("blk.1.ffn_gate_exps.weight", (8, 32, 64), False, 8, "q4_0"),
    ("blk.1.ffn_gate_inp.weight", (8, 64), False, 8, "f32"),
    ("blk.1.attn_norm.weight", (64,), False, 0, "f32"),
])
def test_q4_0_tensor_types(name, shape, has_output, n_experts, want):
    assert tensor_type(name, shape, "q4_0", has_output=has_output, n_experts=n_experts) == want
    # q8_0 files have none of these exceptions but the fallback and the f32 tensors
    assert tensor_type(name, shape, "q8_0", has_output=has_output, n_experts=n_experts) == \
        (want if want in ("f16", "f32") else "q8_0")


def test_file_sizes_follow_the_type(exported):
    sizes = {t: p.stat().st_size for t, p in exported.items()}
    assert sizes["q4_0"] < sizes["q8_0"] < sizes["f16"] < sizes["f32"]


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

@pytest.mark.parametrize("outtype,file_type", [("f32", 0), ("f16", 1), ("q8_0", 7), ("q4_0", 2)])
def test_every_metadata_key(exported, tokenizer_dir, outtype, file_type):
    meta, _ = read(exported[outtype])
    tok = Tokenizer.load(tokenizer_dir)
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    tokens = [tok._tok.id_to_token(i) for i in range(tok.vocab_size)] + \
        [f"[PAD{i}]" for i in range(tok.vocab_size, 400)]
    # the ChatML tokens are control tokens; the tags user-defined ones, which llama.cpp prints
    types = [CONTROL] * 3 + [4] * 6 + [NORMAL] * (tok.vocab_size - 9) + [UNUSED] * (400 - tok.vocab_size)
    want = {
        "general.architecture": "llama", "general.type": "model", "general.name": "run",
        "general.file_type": file_type, "general.quantization_version": 2,
        "llama.vocab_size": 400, "llama.context_length": 64, "llama.embedding_length": 64,
        "llama.block_count": 2, "llama.feed_forward_length": 80, "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2, "llama.rope.freq_base": 10000.0,
        "llama.attention.layer_norm_rms_epsilon": pytest.approx(1e-6), "llama.rope.dimension_count": 16,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "starcoder" if tok.splits_digits else "gpt-2",
        "tokenizer.ggml.tokens": tokens,
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


def test_chat_template_renders_the_chat_layout(exported, tokenizer_dir):
    jinja2 = pytest.importorskip("jinja2")
    meta, _ = read(exported["q8_0"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"}]
    rendered = jinja2.Template(meta["tokenizer.chat_template"]).render(messages=messages, add_generation_prompt=True)
    assert rendered == render_chat(messages, add_generation_prompt=True)
    assert rendered == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n你好<|im_end|>\n" \
                       "<|im_start|>assistant\n<think>\n\n</think>\n\n"


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
    from nanolm.checkpoint.adapter import save_adapter
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
    with pytest.raises(UserError, match=r"outtype='q4': must be one of f32, f16, q8_0, q4_0 "
                                        r"\(K-quants: .*llama-quantize"):
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


# ----------------------------------------------------------------------------- q4_0 as llama.cpp sees it

def llama_quantize_types(src: Path, dst: Path) -> dict[str, gguf.GGMLQuantizationType]:
    """The type of each tensor when llama.cpp's own quantizer (llama-quantize's library call) makes a Q4_0 file
    of the f16 file `src`."""
    import ctypes

    llama_cpp = pytest.importorskip("llama_cpp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.nthread = 1
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) == 0
    return {t.name: t.tensor_type for t in gguf.GGUFReader(dst).tensors}


# d_model 64: llama.cpp puts the output projection at Q6_K only where its rows hold whole 256-value blocks,
# and at Q8_0 otherwise, as nanolm always does; at d_model 256 the two differ there and only there.
@pytest.mark.parametrize("over,differs", [
    ({}, None),
    ({"tie_embeddings": False}, None),
    ({"use_moe": True, "n_experts": 8, "top_k": 2, "moe_n_hidden": 32}, None),  # attn_k, attn_v at Q8_0
    ({"d_model": 256}, "token_embd.weight"),
    ({"d_model": 256, "tie_embeddings": False}, "output.weight"),
])
def test_q4_0_types_are_llama_quantize_s(tmp_path, tokenizer_dir, over, differs):
    pytest.importorskip("llama_cpp")
    run = make_run(tmp_path / "run", tokenizer_dir, n_hidden=96, **over)  # llama.cpp's Q4_0 needs 32-multiple rows
    ours = {t.name: t.tensor_type for t in gguf.GGUFReader(export_gguf(run, tmp_path / "q4.gguf", outtype="q4_0",
                                                                         quiet=True)).tensors}
    f16 = export_gguf(run, tmp_path / "f16.gguf", outtype="f16", quiet=True)
    theirs = llama_quantize_types(f16, tmp_path / "llama-q4.gguf")
    assert set(ours) == set(theirs)
    diff = {n: (ours[n], theirs[n]) for n in ours if ours[n] != theirs[n]}
    assert diff == ({} if differs is None else {differs: (Q8_0, gguf.GGMLQuantizationType.Q6_K)})
    assert sum(t == Q4_0 for t in ours.values()) >= 7 * 2  # every other matrix of both blocks
    if over.get("n_experts") == 8:
        assert ours["blk.0.attn_k.weight"] == ours["blk.0.attn_v.weight"] == Q8_0


# A model trained here a little (60 steps of pretraining, ~5 s; measured held-out perplexity 8.15, against 400
# for guessing; 40 steps leave 21.7), and the same model taught for 60 more steps to answer the first half of
# each corpus sentence with its second half. d_model 64 and n_hidden 128: every matrix but the output is Q4_0.
TRAINED = {"model.d_model": 64, "model.n_hidden": 128, "model.max_seq_len": 64, "train.seq_len": 64,
           "train.batch_size": 8, "train.max_steps": 60, "model.dropout": 0.0, "train.eval_interval": 60,
           "train.save_interval": 60, "train.log_interval": 60, "optim.warmup_steps": 5}


def sentence_halves() -> list[tuple[str, str]]:
    """(first half, second half) of every corpus sentence: split at the middle space, or after the first "，"."""
    from conftest import EN, ZH
    out = []
    for s in EN + ZH:
        if " " in s:
            words = s.split(" ")
            out.append((" ".join(words[: len(words) // 2]), " ".join(words[len(words) // 2:])))
        else:
            k = s.index("，") + 1
            out.append((s[:k], s[k:]))
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_dir, tokenizer_dir) -> dict[str, Path]:
    """{"base", "sft"}: the runs; "base-f16", "base-q8_0", "base-q4_0", "sft-f16", "sft-q4_0": GGUF files."""
    pytest.importorskip("llama_cpp")  # before the training, which only the llama.cpp tests need
    from nanolm.data.prepare import prepare
    from nanolm.train.trainer import train
    from test_train import tiny_cfg

    root = tmp_path_factory.mktemp("trained")
    with open(root / "sft.jsonl", "w", encoding="utf-8") as f:
        for i in range(100):
            user, reply = sentence_halves()[i % 10]
            f.write(json.dumps({"conversations": [{"role": "user", "content": user},
                                                  {"role": "assistant", "content": reply}]},
                               ensure_ascii=False) + "\n")
    prepare([root / "sft.jsonl"], tokenizer_dir, root / "sft-data", format="chat", val_fraction=0.1, workers=0,
            quiet=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same float sums on any machine, so the measured numbers below are this model's
    try:
        train(tiny_cfg(data_dir, root / "base", **TRAINED), quiet=True)
        train(tiny_cfg(root / "sft-data", root / "sft", **TRAINED, **{"train.stage": "sft", "optim.lr": 3e-3,
                                                                      "train.init_from": str(root / "base")}),
              quiet=True)
    finally:
        torch.set_num_threads(threads)
    out = {"base": root / "base", "sft": root / "sft"}
    for run, types in (("base", ("f16", "q8_0", "q4_0")), ("sft", ("f16", "q4_0"))):
        for t in types:
            out[f"{run}-{t}"] = export_gguf(out[run], root / f"{run}-{t}.gguf", outtype=t, quiet=True)
    return out


def held_out_windows(tmp_path: Path, tokenizer_dir: Path, T: int) -> list[list[int]]:
    """Windows of T tokens of 16 documents the model was not trained on (the corpus's sentences in new
    orders: another seed), joined with <|endoftext|> as pretraining joins them."""
    from conftest import make_corpus
    from nanolm.data.formats import iter_documents
    from nanolm.tokenizer import EOT_ID
    tok = Tokenizer.load(tokenizer_dir)
    ids: list[int] = []
    for doc in iter_documents(make_corpus(tmp_path, n_docs=16, seed=12345)):
        ids += tok.encode(doc) + [EOT_ID]
    return [ids[i:i + T] for i in range(0, len(ids) - T + 1, T)]


def llama_cpp_perplexity(path: Path, windows: list[list[int]]) -> float:
    """exp(mean NLL) llama.cpp gives each window's tokens after the first, every window from an empty cache."""
    llama_cpp = pytest.importorskip("llama_cpp")
    T = len(windows[0])
    # One thread: llama.cpp's workers spin while they wait, which costs more than it gains on 2 shared cores.
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=T, n_batch=T, n_ubatch=T, logits_all=True, n_threads=1,
                          verbose=False)
    try:
        nll, n = 0.0, 0
        for w in windows:
            llm.reset()
            llm.eval(w)
            logits = np.array(llm.scores[:T], dtype=np.float64)  # (T, V)
            logp = logits - logits.max(-1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
            nll -= logp[np.arange(T - 1), w[1:]].sum()
            n += T - 1
        return float(np.exp(nll / n))
    finally:
        llm.close()


# q4_0 may cost at most 2% perplexity (measured: 8.1912 against f16's 8.1543, +0.45%), q8_0 0.2% (measured
# 8.1566, +0.03%); f16 stays within 0.01% of nanolm's own float32 perplexity (measured 8.15430 against 8.15429).
# The files: f16 210,688 bytes, q8_0 117,568, q4_0 80,704.
def test_q4_0_perplexity_is_within_2_percent_of_f16(trained, tokenizer_dir, tmp_path):
    windows = held_out_windows(tmp_path, tokenizer_dir, 64)
    assert len(windows) == 50
    model, _ = load_model(trained["base"])
    with torch.no_grad():
        x = torch.tensor(windows)
        logp = model(x).log_softmax(-1)  # (50, 64, V)
        nanolm_ppl = float(torch.exp(-logp[:, :-1].gather(-1, x[:, 1:, None]).mean()))
    f16, q8, q4 = (llama_cpp_perplexity(trained[f"base-{t}"], windows) for t in ("f16", "q8_0", "q4_0"))
    print(f"held-out perplexity: nanolm {nanolm_ppl:.5f}, f16 {f16:.5f}, q8_0 {q8:.5f}, q4_0 {q4:.5f}; sizes "
          + ", ".join(f"{t} {trained[f'base-{t}'].stat().st_size}" for t in ("f16", "q8_0", "q4_0")))
    assert f16 < 10  # trained: guessing would be 400
    assert f16 == pytest.approx(nanolm_ppl, rel=1e-4)
    assert q8 == pytest.approx(f16, rel=0.002)
    assert q4 == pytest.approx(f16, rel=0.02)
    assert q4 != f16  # the weights did change


def llama_cpp_greedy(llm, prompt: list[int], stop_ids: tuple[int, ...], limit: int) -> list[int]:
    """llama.cpp's greedy continuation of `prompt` up to a stop id (not included) or `limit` tokens in all."""
    llm.reset()
    llm.eval(prompt)
    out: list[int] = []
    while len(prompt) + len(out) < limit:
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if token in stop_ids:
            break
        out.append(token)
        llm.eval([token])
    return out


def test_q4_0_greedy_chat_replies_equal_f16_and_nanolm(trained, tokenizer_dir):
    """For each of the 10 taught prompts, the f16 file's greedy reply is nanolm's, token for token up to <|im_end|>,
    and the q4_0 file's is too for at least 8 of them (measured: f16 10 of 10, q4_0 9 of 10)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from nanolm.config import SamplingParams
    from nanolm.infer.engine import Engine
    from nanolm.tokenizer import EOT_ID, IM_END_ID

    tok = Tokenizer.load(tokenizer_dir)
    model, _ = load_model(trained["sft"])
    engine = Engine(model)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=64)
    llms = {t: llama_cpp.Llama(model_path=str(trained[f"sft-{t}"]), n_ctx=128, n_batch=128, n_ubatch=128,
                               logits_all=True, n_threads=1, verbose=False) for t in ("f16", "q4_0")}
    try:
        taught, q4_same = 0, 0
        for user, reply in sentence_halves():
            prompt = tok.encode(render_chat([{"role": "user", "content": user}], add_generation_prompt=True))
            want = engine.generate_all(prompt, greedy, stop_ids=(IM_END_ID, EOT_ID))
            taught += tok.decode(want) == reply
            for t, llm in llms.items():
                # both within the model's 64 positions, where nanolm's reply ends
                got = llama_cpp_greedy(llm, prompt, (IM_END_ID, EOT_ID), model.config.max_seq_len)
                if t == "f16":
                    assert got == want, (t, user, tok.decode(got), tok.decode(want))
                else:
                    q4_same += got == want
        print(f"greedy replies: {taught} of 10 the taught answer, q4_0 equal to nanolm on {q4_same}")
        assert q4_same >= 8
        # the model answers as taught, so the replies are worth comparing (measured 6: the think block's
        # scaffolding leaves four replies cut at the tiny model's 64 positions)
        assert taught >= 5
    finally:
        for llm in llms.values():
            llm.close()


def test_another_familys_pre_tokenizer_is_refused(tmp_path, tokenizer_dir):
    """A tokenizer splitting text by Llama 3's regex is neither of the two pre-tokenizers GGUF export names
    (gpt-2, starcoder): exporting it under one would make llama.cpp cut text differently, so it is refused."""
    tok = tmp_path / "tok"
    Tokenizer.load(tokenizer_dir).save(tok)
    data = json.loads((tok / "tokenizer.json").read_text(encoding="utf-8"))
    data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\p{N}{1,3}"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    (tok / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    run = make_run(tmp_path / "run", tok)
    with pytest.raises(UserError, match=r"tokenizer\.json: its pre-tokenizer \(Sequence\) is not one GGUF export "
                                        r"writes .*convert_hf_to_gguf\.py"):
        export_gguf(run, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()
