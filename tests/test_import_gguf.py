"""`nanolm import gguf`: nanolm's own GGUF exports come back bit for bit (F32) or as exactly their dequantized
weights (F16, Q8_0, Q4_0), and files in llama.cpp's converter layout (Llama's permuted q/k, Qwen2's biases) in
every tensor type the `gguf` package dequantizes import with the logits of transformers' own GGUF loader."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from nanolm.checkpoint import load_model, save_checkpoint
from nanolm.config import Config, ModelConfig, TrainConfig
from nanolm.errors import UserError
from nanolm.model.transformer import Transformer
from nanolm.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")

from nanolm.export.gguf import gguf_vocab, tensor_type, write_gguf  # noqa: E402
from nanolm.export.gguf_import import import_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType
TINY = dict(vocab_size=400, d_model=64, n_layer=2, n_head=4, n_kv_head=2, n_hidden=96, max_seq_len=64,
            rope_theta=10000.0, norm_eps=1e-6, init_std=0.1)
IDS = torch.tensor([[5, 17, 99, 3, 250, 42, 7, 311]])

# nanolm's per-layer names -> llama.cpp's
BLOCK = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
         "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
         "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
         "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def llama_cpp_name(name: str) -> str:
    top = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    _, i, rest = name.split(".", 2)
    return f"blk.{i}.{BLOCK[rest]}"


def random_model(seed: int = 0, **over) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**{**TINY, **over}))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms and biases random too, so each is checked
                p.uniform_(0.5, 1.5)
    return model.eval()


def logits(model: torch.nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return (out[0] if isinstance(out, tuple) else out).float()


def export(tmp_path: Path, tokenizer_dir: Path, model: Transformer, outtype: str) -> Path:
    ckpt = tmp_path / "run"
    cfg = Config(model=model.config, train=TrainConfig(seq_len=TINY["max_seq_len"], out_dir=str(ckpt)))
    save_checkpoint(ckpt, 1, model, None, cfg, {}, tokenizer_dir=tokenizer_dir)
    out = tmp_path / f"model-{outtype}.gguf"
    write_gguf(model, ckpt / "checkpoints" / "step-00000001", out, outtype=outtype, quiet=True)
    return out


VARIANTS = {"llama": {}, "llama-untied": {"tie_embeddings": False}, "qwen2": {"qkv_bias": True},
            "qwen3": {"qk_norm": True, "head_dim": 32}}


@pytest.mark.parametrize("variant", VARIANTS)
def test_f32_export_comes_back_bit_for_bit(tmp_path, tokenizer_dir, variant):
    model = random_model(**VARIANTS[variant])
    out = import_gguf(export(tmp_path, tokenizer_dir, model, "f32"), tmp_path / "imported", quiet=True)
    back, _ = load_model(out)
    assert dataclasses.replace(back.config, init_std=model.config.init_std) == model.config  # init: not in GGUF
    got, want = back.state_dict(), model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(logits(back), logits(model))
    # the tokenizer came back through transformers' GGUF conversion, chat template and all
    tok, orig = Tokenizer.load(out), Tokenizer.load(tokenizer_dir)
    text = "Hello world, 12 apples.\n<|im_start|>user\nhi<|im_end|>"
    assert tok.encode(text) == orig.encode(text)
    assert tok.chat_format.template == (orig.chat_template or orig.chat_format.template)


@pytest.mark.parametrize("outtype", ["f16", "q8_0", "q4_0"])
def test_quantized_exports_import_as_their_dequantized_weights(tmp_path, tokenizer_dir, outtype):
    model = random_model(seed=1, tie_embeddings=False)
    out = import_gguf(export(tmp_path, tokenizer_dir, model, outtype), tmp_path / "imported", quiet=True)
    back, _ = load_model(out)
    # The reference: each weight quantized and dequantized by gguf in the type the exporter chose for it.
    qtypes = {"f32": Q.F32, "f16": Q.F16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}
    ref = random_model(seed=1, tie_embeddings=False)
    seen = set()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            kind = tensor_type(llama_cpp_name(name), tuple(p.shape), outtype, has_output=True)
            seen.add(kind)
            q = gguf.quants.quantize(p.numpy(), qtypes[kind])
            p.copy_(torch.from_numpy(gguf.quants.dequantize(q, qtypes[kind]).reshape(p.shape)))
    assert seen >= {"f32", outtype}
    assert not torch.equal(logits(ref), logits(model)) or outtype == "f32"
    assert torch.equal(logits(back), logits(ref))


# ----------------------------------------------------------------------------- llama.cpp's converter layout

def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, as llama.cpp writes it."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_blocks(qtype, n_rows: int, row_len: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks (the gguf package cannot quantize K-types) with small, finite f16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_rows, row_len // block, size), dtype=np.uint8)
    # weights of about a trained model's size: Q4_K's d * 6-bit scale * 4-bit quant, Q6_K's d * int8 * 6-bit
    scale = np.frombuffer(np.float16(1e-4 if qtype == Q.Q4_K else 2e-5).tobytes(), dtype=np.uint8)
    if qtype == Q.Q4_K:  # d, dmin (f16) first
        raw[..., 0:2], raw[..., 2:4] = scale, scale
    else:  # Q6_K: ql, qh, scales, then d (f16) last
        raw[..., size - 2:size] = scale
    return raw.reshape(n_rows, -1)


# Each tensor of the file in another type: every kind the gguf package dequantizes, K-quants included.
TYPES = {"token_embd": Q.Q8_0, "output": Q.Q6_K, "attn_q": Q.Q4_K, "attn_k": Q.Q4_1, "attn_v": Q.BF16,
         "attn_output": Q.Q4_0, "ffn_gate": Q.Q6_K, "ffn_up": Q.F16, "ffn_down": Q.Q4_K}


def write_converter_file(path: Path, arch: str, tokenizer_dir: Path) -> None:
    """A tiny random transformers model written as llama.cpp's convert_hf_to_gguf.py writes one."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    common = dict(vocab_size=400, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=False)
    hf_cfg = (transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config)(**common)
    hf = (transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM)(hf_cfg)
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    vocab = gguf_vocab(tokenizer_dir, 400)
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(256)
    w.add_feed_forward_length(256)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.eot_id)
    w.add_eos_token_id(vocab.im_end_id)
    w.add_add_bos_token(False)
    w.add_chat_template(vocab.chat_template)

    def add(name: str, t: np.ndarray, kind: str | None = None) -> None:
        qtype = TYPES.get(kind, Q.F32)
        if qtype in (Q.Q4_K, Q.Q6_K):  # random blocks; transformers dequantizes the same bytes
            data = random_blocks(qtype, t.shape[0], t.shape[1], rng)
        else:
            data = gguf.quants.quantize(np.ascontiguousarray(t, dtype=np.float32), qtype)
        w.add_tensor(name, data, raw_dtype=qtype)  # the writer reads the logical shape off the bytes

    add("token_embd.weight", sd["model.embed_tokens.weight"], "token_embd")
    for i in range(2):
        p = f"model.layers.{i}."
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if arch == "llama":
            q, k = permute(q, 4), permute(k, 2)
        add(f"blk.{i}.attn_q.weight", q, "attn_q")
        add(f"blk.{i}.attn_k.weight", k, "attn_k")
        add(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"], "attn_v")
        if arch == "qwen2":
            for n in "qkv":
                add(f"blk.{i}.attn_{n}.bias", sd[p + f"self_attn.{n}_proj.bias"] + 0.1 * rng.standard_normal(
                    sd[p + f"self_attn.{n}_proj.bias"].shape).astype(np.float32))
        add(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"], "attn_output")
        add(f"blk.{i}.attn_norm.weight", 1 + 0.1 * rng.standard_normal(256).astype(np.float32))
        add(f"blk.{i}.ffn_norm.weight", 1 + 0.1 * rng.standard_normal(256).astype(np.float32))
        for n in ("gate", "up", "down"):
            add(f"blk.{i}.ffn_{n}.weight", sd[p + f"mlp.{n}_proj.weight"], f"ffn_{n}")
    add("output_norm.weight", 1 + 0.1 * rng.standard_normal(256).astype(np.float32))
    add("output.weight", sd["lm_head.weight"], "output")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_converter_layout_in_every_type_matches_transformers_gguf_loader(tmp_path, tokenizer_dir, arch):
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "model.gguf"
    write_converter_file(path, arch, tokenizer_dir)
    types = {t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types == {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K}
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                               dtype=torch.float32).eval()
        hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    except (ImportError, ValueError, OSError) as e:
        pytest.skip(f"transformers cannot load this GGUF file here: {e}")
    out = import_gguf(path, tmp_path / "imported", quiet=True)
    model, _ = load_model(out)
    assert model.config.qkv_bias == (arch == "qwen2") and not model.config.tie_embeddings
    with torch.no_grad():
        want = hf(IDS).logits.float()
    got = logits(model)
    assert 0.1 < want.abs().max() < 50  # not a degenerate comparison, nor one drowned in float32 rounding
    assert (got - want).abs().max().item() < 1e-4
    tok = Tokenizer.load(out)
    for text in ["Hello world, 12345 apples!", "  two  spaces\nand lines", "<|im_start|>user\nhi<|im_end|>\n"]:
        assert tok.encode(text) == hf_tok(text, add_special_tokens=False)["input_ids"]


def test_refusals_are_one_line_user_errors(tmp_path, tokenizer_dir):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(UserError, match="bad.gguf: not a GGUF file") as e:
        import_gguf(bad, tmp_path / "o1", quiet=True)
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="no such file"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "o2", quiet=True)
    other = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(other), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UserError, match="general.architecture is 'gpt2'; nanolm imports .*llama, qwen2, qwen3"):
        import_gguf(other, tmp_path / "o3", quiet=True)
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o3").exists()
