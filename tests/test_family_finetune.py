"""A model people already have, end to end, per family: a transformers checkpoint with its own tokenizer and chat
template -> `import hf` (the tokenizer carried over) -> chat data prepared through the template -> LoRA SFT ->
`lora merge` -> `export hf` -> transformers reloads it with the same logits and renders the same prompt; the
merged model's chat stops at the family's own turn end.

Qwen2.5 (biases, tied, generation markers), Llama 3.2 (llama3 RoPE, its own special tokens and none of
nanolm's), Qwen3 (QK-norm, head size apart from hidden / heads) and SmolLM2 (a Llama with ChatML)."""

from __future__ import annotations

import json

import pytest
import torch

from chat_helpers import write_jsonl
from test_families import LLAMA3 as LLAMA3_ROPE
from test_families import hf_model, max_diff
from test_family_templates import CONVS, LLAMA3, NANOLM, QWEN25, SMOLLM2, family_tokenizer

from nanolm import checkpoint as ckpt
from nanolm.chat import message_from_dict
from nanolm.config import SamplingParams
from nanolm.train.configure import load_config
from nanolm.data.prepare import prepare
from nanolm.export.hf import export_hf, import_hf
from nanolm.infer.engine import Engine
from nanolm.infer.generate import stream_text
from nanolm.tokenizer import Tokenizer
from nanolm.train.trainer import train

transformers = pytest.importorskip("transformers")

LLAMA_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA_ROLES = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
QWEN_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# family -> (transformers class prefix, its config, template, special tokens, config roles, the turn end)
CASES = {
    "qwen2.5": ("Qwen2", {"tie_word_embeddings": True}, QWEN25, NANOLM + QWEN_TAGS, {}, "<|im_end|>"),
    "llama3.2": ("Llama", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}, LLAMA3, LLAMA_TOKENS,
                 LLAMA_ROLES, "<|eot_id|>"),
    "qwen3": ("Qwen3", {"head_dim": 32, "tie_word_embeddings": True}, QWEN25, NANOLM + QWEN_TAGS, {}, "<|im_end|>"),
    "smollm2": ("Llama", {"tie_word_embeddings": True}, SMOLLM2, NANOLM,
                {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}, "<|im_end|>"),
}
CHATS = [{"messages": c} for c in CONVS] * 16


@pytest.mark.parametrize("family", CASES)
def test_import_lora_merge_export_and_chat(family, tmp_path):
    cls, over, template, specials, roles, turn_end = CASES[family]
    tok_dir = family_tokenizer(tmp_path / "tok", template, specials, roles)
    tok = Tokenizer.load(tok_dir)
    assert tok.decode([tok.im_end_id]) == turn_end
    hf = hf_model(cls, vocab_size=tok.vocab_size, **over)
    src = tmp_path / "hf"
    hf.save_pretrained(src)
    tok.save(src)

    base = import_hf(src, tmp_path / "base")
    assert Tokenizer.load(base).fingerprint == tok.fingerprint  # the family's own tokenizer came with it

    chats = write_jsonl(tmp_path / "chats.jsonl", CHATS)
    prepare([chats], base, tmp_path / "data", format="chat", val_fraction=0, workers=0, quiet=True)
    cfg = load_config(config_file=base / "config.json", overrides={
                                 "data.path": str(tmp_path / "data"), "train.out_dir": str(tmp_path / "lora"),
                                 "train.stage": "lora", "train.init_from": str(base), "lora.rank": 4,
                                 "lora.dropout": 0.0, "train.max_steps": 12, "train.batch_size": 4,
                                 "train.seq_len": 128, "train.eval_interval": 0, "train.save_interval": 0,
                                 "train.log_interval": 1, "optim.lr": 1e-2, "optim.warmup_steps": 0})
    losses = list(train(cfg, quiet=True).train_losses.values())
    assert losses[-1] < 0.8 * losses[0]  # the adapters learnt the replies

    merged = ckpt.merge_adapter_checkpoint(tmp_path / "lora", tmp_path / "merged")
    model, _ = ckpt.load_model(merged)
    model.eval()
    out = export_hf(merged, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(back) is type(hf)
    x = torch.randint(0, tok.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert max_diff(back(x).logits, model(x)) < 1e-4
        assert max_diff(back(x).logits, hf(x).logits) > 1e-3  # the fine-tuning is in the exported weights

    # the exported tokenizer renders the prompt nanolm renders, and nanolm's chat stops at the family's turn end
    ref = transformers.AutoTokenizer.from_pretrained(str(out))
    conv = CONVS[1][:-1]
    want = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    got_tok = Tokenizer.load(merged)
    msgs = [message_from_dict(f"m[{i}]", m) for i, m in enumerate(conv)]
    assert got_tok.chat_format.render(msgs, [], add_generation_prompt=True) == want
    gen_cfg = json.loads((out / "generation_config.json").read_text())
    assert tok.im_end_id in gen_cfg["eos_token_id"]
    ids = got_tok.encode(want)
    pieces = list(stream_text(Engine(model), got_tok, ids, SamplingParams(max_new_tokens=40, temperature=0.0),
                              (got_tok.im_end_id, got_tok.eot_id)))
    assert turn_end not in "".join(pieces)
