"""A tokenizer nanolm did not train: a HuggingFace directory in MiniMind's layout (36 added tokens, the tags at
ids 21 ... 26, its own config and chat template) used for prepare, train and chat; one lacking a token nanolm
needs is named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from conftest import EN, ZH
from nanolm import chat
from nanolm.data.prepare import prepare
from nanolm.errors import UserError
from nanolm.tokenizer import Tokenizer

# MiniMind's added tokens, in its order: the ChatML three, Qwen's multimodal markers, the tags, spare buffers.
MINIMIND_ADDED = (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                   "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                   "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<|audio_start|>",
                   "<|audio_end|>", "<|audio_pad|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
                   "<tts_text_bos_single>"]
                  + ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
                  + [f"<|buffer{i}|>" for i in range(1, 10)])
CALC = {"type": "function", "function": {"name": "calculator", "description": "evaluate arithmetic",
                                         "parameters": {"type": "object",
                                                        "properties": {"expression": {"type": "string"}}}}}


def minimind_layout_tokenizer(out: Path, vocab_size: int = 420, added: list[str] = MINIMIND_ADDED,
                              texts: tuple[str, ...] = ()) -> Path:
    """A byte-level BPE directory as MiniMind ships its tokenizer: tokenizer.json, and a tokenizer_config.json
    with bos <|im_start|>, eos <|im_end|>, pad <|endoftext|> and a Qwen3-style chat template. texts: trained on
    too (each 20 times)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=added, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((list(ZH) + list(EN) + list(texts)) * 20, trainer=trainer)
    data = json.loads(tok.to_str())
    for t in data["added_tokens"]:
        t["special"] = not t["content"].startswith(("<tool", "</tool", "<think", "</think", "<|buffer"))
    out.mkdir(parents=True)
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    config = {"add_bos_token": False, "add_eos_token": False, "bos_token": "<|im_start|>",
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
              "model_max_length": 32768, "tokenizer_class": "PreTrainedTokenizerFast",
              "chat_template": chat.QWEN3.template}
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return out


def tool_records(n: int) -> list[dict]:
    """MiniMind's sft_t2t shape: tools as JSON text on the system message, tool_calls as JSON text."""
    out = []
    for i in range(n):
        a, b = 2 + i % 7, 3 + i % 5
        out.append({"conversations": [
            {"role": "system", "content": "You can use tools.", "tools": json.dumps([CALC])},
            {"role": "user", "content": f"What is {a} times {b}?"},
            {"role": "assistant", "content": "", "tool_calls": json.dumps(
                [{"name": "calculator", "arguments": {"expression": f"{a}*{b}"}}])},
            {"role": "tool", "content": str(a * b)},
            {"role": "assistant", "content": f"{a} times {b} is {a * b}."}]})
    return out


@pytest.fixture(scope="module")
def mm_dir(tmp_path_factory) -> Path:
    return minimind_layout_tokenizer(tmp_path_factory.mktemp("mm") / "tokenizer")


def test_minimind_layout_tokenizer_loads_with_its_own_ids_and_template(mm_dir):
    tok = Tokenizer.load(mm_dir)
    assert (tok.eot_id, tok.im_start_id, tok.im_end_id) == (0, 1, 2)
    assert tok.tag_ids == {"<tool_call>": 21, "</tool_call>": 22, "<tool_response>": 23, "</tool_response>": 24,
                           "<think>": 25, "</think>": 26}
    assert tok.chat_format is chat.QWEN3 and tok.missing_tags() == []
    assert tok.encode("<think>\nhm\n</think>")[0] == 25
    tok.save(mm_dir.parent / "copy")  # its files written back as they were
    assert json.loads((mm_dir.parent / "copy" / "tokenizer_config.json").read_text())["bos_token"] == "<|im_start|>"


def test_prepare_train_and_chat_with_a_minimind_layout_tokenizer(mm_dir, tmp_path):
    from nanolm.checkpoint import load_model
    from nanolm.config import SamplingParams
    from nanolm.train.configure import load_config
    from nanolm.infer.session import ChatSession
    from nanolm.infer.engine import Engine
    from nanolm.train.trainer import train

    tok = Tokenizer.load(mm_dir)
    src = tmp_path / "tools.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in tool_records(24)), encoding="utf-8")
    m = prepare([src], mm_dir, tmp_path / "data", format="chat", val_fraction=0, workers=0, quiet=True)
    assert m.section["template"] == "qwen3" and m.tokenizer.eot_id == 0
    ids = np.fromfile(tmp_path / "data" / "train-00000.bin", dtype=m.dtype).astype(np.int64)
    mask = np.fromfile(tmp_path / "data" / "train-00000.mask", dtype=np.uint8)
    first = ids[:int(np.flatnonzero(ids == tok.eot_id)[0])]
    assert first.tolist() == tok.encode(chat.QWEN3.render(
        [chat.message_from_dict("m", x) for x in tool_records(1)[0]["conversations"]],
        chat.tools_from_value("t", [CALC])))
    targets = tok.decode(first[(mask[:len(first)] & chat.TARGET) > 0])
    assert targets == ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
                       "<|im_end|>2 times 3 is 6.<|im_end|>")

    cfg = load_config("tiny", overrides={
        "data.path": str(tmp_path / "data"), "train.out_dir": str(tmp_path / "run"),
        "model.vocab_size": tok.vocab_size, "model.d_model": 64, "model.n_layer": 2, "model.n_head": 4,
        "model.n_kv_head": 2, "model.max_seq_len": 768, "train.seq_len": 767, "train.batch_size": 2,
        "train.max_steps": 25, "train.eval_interval": 25, "train.save_interval": 25, "optim.lr": 1e-2,
        "optim.warmup_steps": 3, "train.compile": False, "model.dropout": 0.0})
    res = train(cfg, quiet=True)
    losses = [res.train_losses[s] for s in sorted(res.train_losses)]
    assert losses[-1] < 0.75 * losses[0]  # measured 0.54
    model, ckpt = load_model(tmp_path / "run", "last")
    back = Tokenizer.load(ckpt)  # the checkpoint carries the user's tokenizer, config and template
    assert back.fingerprint == tok.fingerprint and back.config["bos_token"] == "<|im_start|>"
    session = ChatSession(Engine(model), back, SamplingParams(max_new_tokens=40, temperature=0))
    reply = "".join(session.reply("What is 2 times 3?"))
    assert isinstance(reply, str) and "<|im_end|>" not in reply


def test_a_tokenizer_without_the_chatml_tokens_is_named(tmp_path):
    d = minimind_layout_tokenizer(tmp_path / "t", added=["<|endoftext|>", "<s>", "</s>"])
    with pytest.raises(UserError, match=r"tokenizer\.json: <\|im_start\|> is not in its vocabulary; nanolm needs "
                                        r"<\|endoftext\|>, <\|im_start\|>, <\|im_end\|> as special tokens"):
        Tokenizer.load(d)


def test_a_tokenizer_without_the_tags_works_and_prepare_says_what_it_lacks(tmp_path):
    d = minimind_layout_tokenizer(tmp_path / "t", added=MINIMIND_ADDED[:3])
    tok = Tokenizer.load(d)
    assert tok.missing_tags() == ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                                  "</think>"]
    src = tmp_path / "tools.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in tool_records(3)), encoding="utf-8")
    with pytest.warns(UserWarning, match=r"tokenizer\.json: lacks <tool_call>, </tool_call>, .* as added tokens"):
        m = prepare([src], d, tmp_path / "data", format="chat", val_fraction=0, workers=0, quiet=True)
    assert m.totals["n_docs"] == 3  # spelled in pieces, the mask still placed by bytes


def test_a_minimind_3_release_with_its_tokenizer_imports_and_fine_tunes(mm_dir, tmp_path):
    """A Qwen3 checkpoint saved by transformers beside a MiniMind-layout tokenizer (MiniMind-3's release):
    `import hf` keeps the tokenizer, and the imported model fine-tunes on tool conversations in nanolm."""
    transformers = pytest.importorskip("transformers")
    import shutil

    import torch

    from nanolm.checkpoint import load_model
    from nanolm.train.configure import load_config
    from nanolm.export.hf import import_hf
    from nanolm.train.trainer import train

    tok = Tokenizer.load(mm_dir)
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_theta=1e6))
    src = tmp_path / "minimind-3"
    hf.save_pretrained(src)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(mm_dir / f, src / f)
    out = import_hf(src, tmp_path / "imported")
    model, ckpt = load_model(out)
    assert model.config.qk_norm and Tokenizer.load(ckpt).tag_ids["<think>"] == 25
    data = tmp_path / "tools.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in tool_records(8)), encoding="utf-8")
    prepare([data], ckpt, tmp_path / "data", format="chat", val_fraction=0, workers=0, quiet=True)
    cfg = load_config(None, config_file=out / "config.json", overrides={
        "data.path": str(tmp_path / "data"), "train.out_dir": str(tmp_path / "sft"), "train.stage": "sft",
        "train.init_from": str(out), "train.seq_len": 767, "train.batch_size": 1, "train.max_steps": 4,
        "train.eval_interval": 4, "train.save_interval": 4, "train.compile": False})
    res = train(cfg, quiet=True)
    assert res.step == 4
    tuned, tuned_ckpt = load_model(tmp_path / "sft", "last")
    assert Tokenizer.load(tuned_ckpt).fingerprint == tok.fingerprint
    assert not torch.equal(tuned.embed_tokens.weight, model.embed_tokens.weight)
