"""HuggingFace export/import: transformers loads the export with no custom code and computes what nanolm does.

Tiny float32 models: logit parity (dense Llama with GQA, tied and untied; MoE
as Qwen2-MoE with and without shared experts, every layer and every other
layer), equal greedy generations, the chat template rendered by transformers,
a LoRA adapter merged on export, import(export(model)) weight-identical,
import of a sharded checkpoint written by transformers itself, training from
an import, and the errors for what nanolm cannot express.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nanolm import checkpoint as ckpt
from nanolm.chat import render_chat
from nanolm.checkpoint.adapter import save_adapter
from nanolm.config import Config, ModelConfig, SamplingParams, TrainConfig
from nanolm.train.configure import load_config
from nanolm.errors import UserError
from nanolm.export.hf import export_hf, from_hf, import_hf, to_hf
from nanolm.infer.engine import Engine
from nanolm.model.lora import apply_lora, base_fingerprint
from nanolm.model.transformer import Transformer
from nanolm.tokenizer import EOT_ID, IM_END_ID, Tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 400  # the conftest tokenizer's requested size (its real vocabulary is at most this)
DENSE = {"tied-gqa": {}, "untied-mha": {"tie_embeddings": False, "n_kv_head": 4}}
MOE = {
    "shared-every-layer": {"use_moe": True, "n_experts": 4, "top_k": 2, "n_shared_experts": 1},
    "no-shared-every-2nd-untied": {"use_moe": True, "n_experts": 4, "top_k": 1, "n_shared_experts": 0,
                                   "moe_every": 2, "norm_topk": False, "moe_n_hidden": 32,
                                   "tie_embeddings": False},
    "two-shared-every-2nd": {"use_moe": True, "n_experts": 3, "top_k": 2, "n_shared_experts": 2,
                             "moe_every": 2, "moe_n_hidden": 32},
}


def model_cfg(**over) -> ModelConfig:
    # init_std 0.1 spreads the logits, so greedy choices are not near-ties that float noise could flip.
    kw = dict(vocab_size=VOCAB, d_model=64, n_layer=4, n_head=4, n_kv_head=2, max_seq_len=64, init_std=0.1)
    return ModelConfig(**{**kw, **over})


def make_run(root: Path, tokenizer_dir: Path, seed: int = 0, **over) -> tuple[Path, Transformer]:
    """A nanolm run directory holding one checkpoint of a random model, with the tokenizer."""
    torch.manual_seed(seed)
    mc = model_cfg(**over)
    model = Transformer(mc).eval()
    with torch.no_grad():  # norms away from 1, so a mix-up of norm weights would show
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    run = root / "run"
    ckpt.save_checkpoint(run, 1, model, None, Config(model=mc, train=TrainConfig(seq_len=mc.max_seq_len)), {},
                         tokenizer_dir=tokenizer_dir)
    return run, model


def load_hf(path: Path, **kw):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kw)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    assert info["mismatched_keys"] == set() and not info["error_msgs"], info
    return model.eval()


def max_logit_diff(ours: torch.nn.Module, hf: torch.nn.Module, seed: int = 0, T: int = 48) -> float:
    x = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return (ours(x) - hf(x).logits).abs().max().item()


@pytest.mark.parametrize("over", DENSE.values(), ids=DENSE.keys())
def test_dense_export_is_a_llama_with_the_same_logits(over, tmp_path, tokenizer_dir):
    run, model = make_run(tmp_path, tokenizer_dir, **over)
    out = export_hf(run, tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer.json", "tokenizer_config.json"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    mc = model.config
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"], cfg["max_position_embeddings"]) == \
        (64, mc.n_hidden, 4, 4, mc.n_kv_head, VOCAB, 64)
    assert (cfg["rms_norm_eps"], cfg["rope_theta"], cfg["tie_word_embeddings"]) == \
        (mc.norm_eps, mc.rope_theta, mc.tie_embeddings)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"], cfg["torch_dtype"]) == \
        (None, IM_END_ID, EOT_ID, "float32")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [IM_END_ID, EOT_ID]
    # The tied head is stored once, as transformers itself stores it.
    assert ("lm_head.weight" in load_file(str(out / "model.safetensors"))) == (not mc.tie_embeddings)

    hf = load_hf(out)
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert max_logit_diff(model, hf) < 1e-4


@pytest.mark.parametrize("over", MOE.values(), ids=MOE.keys())
def test_moe_export_is_a_qwen2_moe_with_the_same_logits(over, tmp_path, tokenizer_dir):
    run, model = make_run(tmp_path, tokenizer_dir, **over)
    out = export_hf(run, tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    mc = model.config
    assert cfg["model_type"] == "qwen2_moe" and cfg["architectures"] == ["Qwen2MoeForCausalLM"]
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
            cfg["decoder_sparse_step"], cfg["norm_topk_prob"], cfg["mlp_only_layers"]) == \
        (mc.n_experts, mc.top_k, mc.moe_n_hidden, mc.moe_every, mc.norm_topk, [])
    hf = load_hf(out)
    assert type(hf).__name__ == "Qwen2MoeForCausalLM"
    n_sparse = sum(type(layer.mlp).__name__ == "Qwen2MoeSparseMoeBlock" for layer in hf.model.layers)
    assert n_sparse == 4 // mc.moe_every
    assert max_logit_diff(model, hf) < 1e-4


@pytest.mark.parametrize("over", [DENSE["tied-gqa"], MOE["shared-every-layer"]], ids=["dense", "moe"])
def test_greedy_generation_is_the_same_in_transformers(over, tmp_path, tokenizer_dir):
    run, model = make_run(tmp_path, tokenizer_dir, **over)
    hf = load_hf(export_hf(run, tmp_path / "hf"))
    tok = Tokenizer.load(run / "checkpoints" / "step-00000001")
    prompt = tok.encode("To be, or not to be 天下大势")
    ours = Engine(model).generate_all(prompt, SamplingParams(max_new_tokens=20, temperature=0),
                                      stop_ids=(IM_END_ID, EOT_ID))
    x = torch.tensor([prompt])
    # transformers stops at the generation_config.json eos ids, as the engine at its stop ids.
    theirs = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=20)[0, len(prompt):]
    theirs = theirs.tolist()
    if theirs and theirs[-1] in (IM_END_ID, EOT_ID):
        theirs = theirs[:-1]  # transformers keeps the stop token; the engine does not yield it
    assert len(set(ours)) > 1 and ours == theirs


def test_transformers_chat_template_renders_what_nanolm_does(tmp_path, tokenizer_dir):
    run, _ = make_run(tmp_path, tokenizer_dir)
    out = export_hf(run, tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    ours = Tokenizer.load(out)
    assert hf_tok.model_max_length == 64
    assert (hf_tok.eos_token, hf_tok.pad_token, hf_tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    conversations = [
        [{"role": "system", "content": "你是一个乐于助人的助手。"},
         {"role": "user", "content": "滚滚长江东逝水，下一句是什么？"},
         {"role": "assistant", "content": "浪花淘尽英雄。"},
         {"role": "user", "content": "And in English?"}],
        [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "To be, or not to be?"},
         {"role": "assistant", "content": "That is the question.\n是非成败转头空。"}],
    ]
    for messages in conversations:
        for gen in (False, True):
            text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert text == render_chat(messages, add_generation_prompt=gen)
            assert hf_tok(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and text.count("<|im_start|>") == 4


def test_lora_adapter_is_merged_into_the_export(tmp_path, tokenizer_dir):
    run, model = make_run(tmp_path, tokenizer_dir)
    fp = base_fingerprint(model)
    apply_lora(model, rank=2, alpha=4.0, dropout=0.0, targets=("q_proj", "v_proj", "down_proj"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0.0, 0.1)
    adapter = save_adapter(tmp_path / "adapter", model, rank=2, alpha=4.0, dropout=0.0,
                           targets=("q_proj", "v_proj", "down_proj"), base_fingerprint=fp)
    hf = load_hf(export_hf(run, tmp_path / "hf", adapter=adapter))
    base = ckpt.load_model(run)[0]
    assert max_logit_diff(model, hf) < 1e-4  # base + adapter
    assert max_logit_diff(base, hf) > 1e-2  # and not the base alone


def test_bfloat16_export(tmp_path, tokenizer_dir):
    run, _ = make_run(tmp_path, tokenizer_dir)
    out = export_hf(run, tmp_path / "hf", dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
    assert next(load_hf(out).parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("over", [DENSE["tied-gqa"], DENSE["untied-mha"], MOE["no-shared-every-2nd-untied"],
                                  MOE["two-shared-every-2nd"]], ids=["tied", "untied", "moe-no-shared", "moe-shared"])
def test_import_of_an_export_is_weight_identical(over, tmp_path, tokenizer_dir):
    run, model = make_run(tmp_path, tokenizer_dir, **over)
    back = import_hf(export_hf(run, tmp_path / "hf"), tmp_path / "back")
    reloaded, _ = ckpt.load_model(back)
    assert reloaded.config == model.config
    a, b = model.state_dict(), reloaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert Tokenizer.load(back).fingerprint == Tokenizer.load(run / "checkpoints" / "step-00000001").fingerprint


def test_adapter_is_pure_and_inverse(tokenizer_dir):
    mc = model_cfg(**MOE["two-shared-every-2nd"])
    sd = ckpt.model_state(Transformer(mc))
    hf_sd, hf_cfg = to_hf(sd, mc)
    assert hf_sd["model.layers.1.mlp.shared_expert_gate.weight"].count_nonzero() == 0
    assert torch.equal(hf_sd["model.layers.1.mlp.shared_expert.down_proj.weight"],
                       2 * sd["layers.1.mlp.shared_expert.down_proj.weight"])
    back, mc2 = from_hf(hf_sd, hf_cfg)
    assert mc2 == mc and back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)


def test_import_of_a_sharded_llama_written_by_transformers(tmp_path, data_dir, tokenizer_dir):
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                                      rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                      initializer_range=0.1)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    src = tmp_path / "hf"
    hf.save_pretrained(src, max_shard_size="100KB")
    assert (src / "model.safetensors.index.json").is_file()
    Tokenizer.load(tokenizer_dir).save(src)  # a tokenizer with nanolm's special ids is copied along
    out = import_hf(src, tmp_path / "nano")
    assert {p.name for p in out.iterdir()} == {"model.safetensors", "config.json", "tokenizer.json",
                                               "tokenizer_config.json"}
    model, _ = ckpt.load_model(out)
    cfg = model.config
    assert (cfg.n_kv_head, cfg.n_hidden, cfg.rope_theta, cfg.norm_eps) == (1, 96, 1e4, 1e-6)
    assert max_logit_diff(model, hf) < 1e-4

    # `nanolm train --config <import>/config.json --init-from <import>` continues training it.
    from nanolm.train.trainer import train
    run_cfg = load_config(config_file=out / "config.json", overrides={
        "data.path": str(data_dir), "train.out_dir": str(tmp_path / "run"), "train.init_from": str(out),
        "train.max_steps": 2, "train.batch_size": 2, "train.seq_len": 32, "train.eval_interval": 0,
        "train.eval_batches": 1, "train.device": "cpu"})
    res = train(run_cfg, quiet=True)
    assert res.step == 2
    trained = ckpt.load_model(tmp_path / "run", "last")[0].state_dict()
    start = model.state_dict()
    assert not torch.equal(trained["layers.0.self_attn.q_proj.weight"], start["layers.0.self_attn.q_proj.weight"])


def write_hf(dir: Path, **config_over) -> Path:
    """A tiny exported Llama with its config.json edited."""
    cfg = json.loads((dir / "config.json").read_text())
    cfg.update(config_over)
    (dir / "config.json").write_text(json.dumps(cfg))
    return dir


@pytest.mark.parametrize("field, value, says", [
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}, "rope_scaling"),
    ("rope_parameters", {"rope_type": "longrope", "rope_theta": 5e5, "factor": 8.0}, "rope_parameters"),
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "beta_fast": 32}, "rope_parameters"),
    ("attention_bias", True, "attention_bias"),
    ("mlp_bias", True, "mlp_bias"),
    ("head_dim", 33, "head_dim"),
    ("hidden_act", "gelu", "hidden_act"),
    ("model_type", "mistral", "model_type"),
])
def test_import_refuses_what_nanolm_cannot_express(field, value, says, tmp_path, tokenizer_dir):
    run, _ = make_run(tmp_path, tokenizer_dir, n_layer=1)
    src = write_hf(export_hf(run, tmp_path / "hf"), **{field: value})
    with pytest.raises(UserError, match=rf"config\.json: {says} = .* is not supported; "):
        import_hf(src, tmp_path / "nano")
    assert not (tmp_path / "nano").exists()


def test_import_errors_for_files(tmp_path, tokenizer_dir):
    run, _ = make_run(tmp_path, tokenizer_dir, n_layer=1)
    src = export_hf(run, tmp_path / "hf")
    sd = load_file(str(src / "model.safetensors"))
    from safetensors.torch import save_file
    del sd["model.layers.0.mlp.up_proj.weight"]
    save_file(sd, str(src / "model.safetensors"))
    with pytest.raises(UserError, match=r"1 tensor\(s\) missing, first: model\.layers\.0\.mlp\.up_proj\.weight"):
        import_hf(src, tmp_path / "nano")
    (src / "model.safetensors").unlink()
    (src / "pytorch_model.bin").write_bytes(b"not opened")
    with pytest.raises(UserError, match=r"pytorch_model\.bin \(a pickle, which nanolm never loads\)"):
        import_hf(src, tmp_path / "nano")
    with pytest.raises(UserError, match=r"--dtype int8: choose one of float32, bfloat16, float16"):
        export_hf(run, tmp_path / "other", dtype="int8")
    with pytest.raises(UserError, match="already exists and is not an empty directory"):
        export_hf(run, src)


def test_import_with_a_foreign_tokenizer_warns_and_keeps_the_weights(tmp_path, tokenizer_dir):
    run, model = make_run(tmp_path, tokenizer_dir, n_layer=1)
    src = export_hf(run, tmp_path / "hf")
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models
    # A Llama-style vocabulary: <unk>, <s>, </s> first.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3}
    (src / "tokenizer.json").write_text(HFTokenizer(models.WordLevel(vocab, unk_token="<unk>")).to_str())
    with pytest.warns(UserWarning, match=r"imported the weights without a tokenizer .*<\|endoftext\|> is not in its "
                                         r"vocabulary\); nanolm needs .* as special tokens"):
        out = import_hf(src, tmp_path / "nano")
    assert not (out / "tokenizer.json").exists()
    assert torch.equal(ckpt.load_model(out)[0].embed_tokens.weight, model.embed_tokens.weight)
