"""Tests for nanolm.tokenizer: training, lossless round trips, special ids, files, chat rendering."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanolm.chat import CHAT_TEMPLATE, render_chat
from nanolm.errors import UserError
from nanolm.tokenizer import (EOT_ID, IM_END_ID, IM_START_ID, SPECIAL_TOKENS, TAG_TOKENS, Tokenizer,
                              compression_report, train_tokenizer)

EN = [
    "The quick brown fox jumps over the lazy dog.",
    "A language model predicts the next token from the tokens before it.",
    "Training a small model on a laptop takes patience, but it works.",
    "She said: \"I don't think we're ready yet; let's wait until Monday.\"",
    "In 2024, the team trained 3 models with 26 million parameters each.",
    "Tokenizers split text into pieces that the model can count and embed.",
    "def main():\n    print('hello, world')\n    return 0\n",
    "Rivers flow to the sea, and the sea never fills.",
    "Learning rate warmup keeps the first steps from blowing up the weights.",
    "We measure loss in bits per byte so tokenizers can be compared fairly.",
]
ZH = [
    "今天天气很好，我们一起去公园散步吧。",
    "语言模型根据前面的词预测下一个词。",
    "在笔记本电脑上训练一个小模型需要耐心，但是可以做到。",
    "他说：“我觉得我们还没有准备好，等到星期一再说吧。”",
    "二零二四年，团队训练了三个模型，每个有两千六百万个参数。",
    "分词器把文本切成模型可以计数和嵌入的小片段。",
    "河流汇入大海，而大海永远不会满。",
    "学习率预热让最初的几步不会把权重弄坏。",
    "我们用每字节比特数来衡量损失，这样不同的分词器可以公平比较。",
    "春眠不觉晓，处处闻啼鸟。夜来风雨声，花落知多少。",
]
VOCAB = 512


def corpus(n: int = 400, seed: int = 0) -> list[str]:
    """Documents that each join a few sentences of one language, in varied order."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        pool = ZH if i % 2 else EN
        docs.append((" " if pool is EN else "").join(rng.sample(pool, 3)))
    return docs


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(corpus(), out, VOCAB, quiet=True)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.load(tok_dir)


ROUND_TRIP = [
    "",
    "Hello, world!",
    "今天天气很好，我们一起去公园散步吧。",
    "mixed 中文 and English, 数字 12345 and emoji 😀🎉",
    "👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👍🏽 skin tone",  # zero-width joiners and modifiers
    "line one\r\nline two\r\n\r\n",
    "\ttab\t\tindented\n\t\n",
    "   three leading spaces and two trailing  ",
    "\n\n\nnewlines first",
    "nul \x00 and bell \x07 and DEL \x7f",
    "e\u0301 combining accent, \u200b zero-width space, \ufeff BOM",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "<|im_end<|im_end|>|>",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕒𝕤𝕥𝕣𝕒𝕝 \U0010ffff",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_round_trip_any_text(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_special_token_ids(tok: Tokenizer) -> None:
    assert SPECIAL_TOKENS == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert (EOT_ID, IM_START_ID, IM_END_ID) == (0, 1, 2)
    assert (tok.eot_id, tok.im_start_id, tok.im_end_id) == (0, 1, 2)
    assert tok.encode("<|endoftext|>") == [0]
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    ids = tok.encode("hi<|im_end|>")
    assert ids[-1] == 2 and 2 not in ids[:-1]
    assert tok.decode([1, 2, 0]) == "<|im_start|><|im_end|><|endoftext|>"
    assert tok.vocab_size == VOCAB


def test_plain_text_never_produces_special_ids(tok: Tokenizer) -> None:
    ids = tok.encode(" ".join(EN + ZH) + " < | im_end | > <|im_end")
    assert not {0, 1, 2} & set(ids)


def test_special_strings_in_training_text_spend_no_merges(tmp_path) -> None:
    docs = [f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n{t}<|im_end|><|endoftext|>" for t in corpus(100)]
    t = train_tokenizer(docs, tmp_path, 400, quiet=True)
    vocab = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
    assert not [v for v in vocab if ("<|" in v or "|>" in v) and v not in SPECIAL_TOKENS]
    assert t.encode(docs[0]).count(IM_END_ID) == 2


def test_files_saved(tok_dir, tok: Tokenizer) -> None:
    assert sorted(p.name for p in tok_dir.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert tok.path == (tok_dir / "tokenizer.json").resolve()
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["chat_template"] == CHAT_TEMPLATE
    assert (cfg["eos_token"], cfg["pad_token"], cfg["bos_token"]) == ("<|im_end|>", "<|endoftext|>", None)
    assert cfg["clean_up_tokenization_spaces"] is False
    assert {k: (v["content"], v["special"]) for k, v in cfg["added_tokens_decoder"].items()} == {
        "0": ("<|endoftext|>", True), "1": ("<|im_start|>", True), "2": ("<|im_end|>", True),
        "3": ("<tool_call>", False), "4": ("</tool_call>", False), "5": ("<tool_response>", False),
        "6": ("</tool_response>", False), "7": ("<think>", False), "8": ("</think>", False)}
    assert (tok.tag_ids, tok.missing_tags(), tok.chat_format.name) == (
        {t: 3 + i for i, t in enumerate(TAG_TOKENS)}, [], "qwen3")
    data = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    assert data["normalizer"] is None
    assert data["pre_tokenizer"] == {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    assert data["decoder"]["type"] == "ByteLevel"


def test_fingerprint_stable_across_save_and_load(tok_dir, tok: Tokenizer, tmp_path) -> None:
    assert re.fullmatch(r"[0-9a-f]{64}", tok.fingerprint)
    assert Tokenizer.load(tok_dir / "tokenizer.json").fingerprint == tok.fingerprint
    tok.save(tmp_path / "copy")
    copy = Tokenizer.load(tmp_path / "copy")
    assert copy.fingerprint == tok.fingerprint
    assert (tmp_path / "copy" / "tokenizer_config.json").is_file()
    # Reformatting the JSON keeps the fingerprint: it hashes content, not layout.
    data = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    (tmp_path / "compact.json").write_text(json.dumps(data, separators=(",", ":")), encoding="utf-8")
    assert Tokenizer.load(tmp_path / "compact.json").fingerprint == tok.fingerprint


def test_fingerprint_differs_for_a_different_tokenizer(tok: Tokenizer, tmp_path) -> None:
    other = train_tokenizer(corpus(), tmp_path, VOCAB - 1, quiet=True)
    assert other.vocab_size == VOCAB - 1
    assert other.fingerprint != tok.fingerprint


def test_encode_batch_matches_encode(tok: Tokenizer) -> None:
    texts = ROUND_TRIP + corpus(20, seed=1)
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_decode_accepts_numpy_and_rejects_out_of_range(tok: Tokenizer) -> None:
    ids = tok.encode("hello 你好")
    assert tok.decode(np.array(ids, dtype=np.uint16)) == "hello 你好"
    with pytest.raises(ValueError, match=f"token id {VOCAB} is outside the vocabulary"):
        tok.decode([5, VOCAB])


def test_token_byte_lengths(tok: Tokenizer) -> None:
    lengths = tok.token_byte_lengths()
    assert lengths.dtype == np.int32 and lengths.shape == (VOCAB,)
    assert lengths[:9].tolist() == [0] * 9  # the control tokens and tags
    assert int((lengths == 1).sum()) == 256  # one token per byte; every merge is longer
    assert int(lengths[9:].min()) >= 1
    spelled = tok.spelled_lengths()  # what decode writes for each: a control token's text
    assert spelled[:9].tolist() == [len(t) for t in SPECIAL_TOKENS + TAG_TOKENS]
    assert (spelled[9:] == lengths[9:]).all()
    for text in ROUND_TRIP[:-3] + [ROUND_TRIP[-1]] + corpus(10, seed=2):
        assert int(lengths[tok.encode(text)].sum()) == len(text.encode("utf-8")), text
    # Special tokens count no bytes: the text they mark is not part of the data.
    assert int(lengths[tok.encode("ab<|endoftext|>")].sum()) == 2


CHATS = [
    [{"role": "user", "content": "你好"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!\nTwo lines."},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "  spaces  "}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nok"}],
    [],
]


def test_render_chat_exact(tok: Tokenizer) -> None:
    msgs = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"}]
    assert render_chat(msgs) == "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    assert render_chat(msgs, add_generation_prompt=True).endswith(
        "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = tok.encode(render_chat(msgs))
    assert ids.count(IM_START_ID) == 2 and ids.count(IM_END_ID) == 2 and ids[0] == IM_START_ID


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("messages", CHATS)
def test_render_chat_matches_jinja_template(messages, add_generation_prompt: bool) -> None:
    jinja2 = pytest.importorskip("jinja2.sandbox")
    # The environment transformers' apply_chat_template uses.
    env = jinja2.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    want = env.from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=add_generation_prompt)
    assert render_chat(messages, add_generation_prompt=add_generation_prompt) == want


def test_render_chat_rejects_bad_message() -> None:
    with pytest.raises(ValueError, match=r"^messages\[1\]\.content must be a string, got null$"):
        render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": None}])


def test_compression(tok: Tokenizer) -> None:
    assert tok.compression(["abc", "de"]) == pytest.approx(5 / (len(tok.encode("abc")) + len(tok.encode("de"))))
    zh, en = corpus(10, seed=3)[1::2], corpus(10, seed=3)[0::2]
    line = compression_report(tok, zh, en)
    assert line == f"compression: zh {tok.compression(zh):.2f} chars/token, en {tok.compression(en):.2f} chars/token"
    # A Chinese character is 3 UTF-8 bytes and 512 tokens leave few merges for them.
    assert tok.compression(en) > 1.9 > tok.compression(zh)  # English digits are one token each
    assert compression_report(tok, [], en) == f"compression: en {tok.compression(en):.2f} chars/token"
    with pytest.raises(ValueError, match="at least one non-empty text"):
        tok.compression([""])


@pytest.mark.parametrize("bad", [100, 265, 2**32 + 1, 0, -5, True, "6400", 6400.0])
def test_bad_vocab_size(tmp_path, bad) -> None:
    with pytest.raises(UserError, match=re.escape(f"vocab_size={bad!r}: must be an integer from 266 to 4294967296")):
        train_tokenizer(["some text"], tmp_path / "out", bad, quiet=True)
    assert not (tmp_path / "out").exists()


def test_bad_min_frequency(tmp_path) -> None:
    with pytest.raises(UserError, match=r"min_frequency=0: must be an integer >= 1"):
        train_tokenizer(["some text"], tmp_path, 300, min_frequency=0, quiet=True)


def test_smallest_vocab_trains(tmp_path) -> None:
    t = train_tokenizer(["aaaa bbbb"] * 5, tmp_path, 266, quiet=True)
    assert t.vocab_size == 266
    assert t.decode(t.encode("aaaa bbbb")) == "aaaa bbbb"


def test_no_text_is_an_error(tmp_path) -> None:
    with pytest.raises(UserError, match=r"tokenizer training got no text \(2 texts, all empty\)"):
        train_tokenizer(["", ""], tmp_path / "out", 300, quiet=True)
    assert not (tmp_path / "out").exists()


def test_output_path_is_a_file(tmp_path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match=r"f: exists and is not a directory"):
        train_tokenizer(["text"], tmp_path / "f", 300, quiet=True)


def test_quiet_prints_nothing_and_loud_prints_a_summary(tmp_path, capfd) -> None:
    train_tokenizer(corpus(50), tmp_path / "a", 300, quiet=True)
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
    train_tokenizer(corpus(50), tmp_path / "b", 300)
    out, _ = capfd.readouterr()
    assert re.fullmatch(r"trained tokenizer: vocab 300 on 50 texts, \S+ chars in \S+ -> .*tokenizer\.json\n", out)


def test_missing_file(tmp_path) -> None:
    with pytest.raises(UserError, match=re.escape(f"{tmp_path / 'tokenizer.json'}: no tokenizer file here; "
                                                  "run `nanolm tokenizer train` first")):
        Tokenizer.load(tmp_path)
    with pytest.raises(UserError, match=re.escape(f"{tmp_path / 'nope.json'}: no tokenizer file")):
        Tokenizer.load(str(tmp_path / "nope.json"))


def test_corrupt_file(tmp_path, tok_dir) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{\n  "version": "1.0",\n  oops\n}', encoding="utf-8")
    with pytest.raises(UserError, match=re.escape(f"{bad}:3: not valid JSON")):
        Tokenizer.load(tmp_path)
    bad.write_text('{"version": "1.0"}', encoding="utf-8")
    with pytest.raises(UserError, match=re.escape(f"{bad}: not a tokenizer.json that `tokenizers` can read")):
        Tokenizer.load(bad)
    bad.write_bytes(b"\xff\xfe garbage")
    with pytest.raises(UserError, match=re.escape(f"{bad}: not UTF-8 text")):
        Tokenizer.load(bad)


def test_control_tokens_are_found_by_name_and_a_missing_one_is_named(tmp_path, tok_dir) -> None:
    data = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    vocab["<|im_end|>"], vocab["<|im_start|>"] = vocab["<|im_start|>"], vocab["<|im_end|>"]
    for t in data["added_tokens"]:
        t["id"] = {1: 2, 2: 1}.get(t["id"], t["id"])
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    other = Tokenizer.load(tmp_path)  # another tokenizer's layout: its own ids
    assert (other.eot_id, other.im_start_id, other.im_end_id) == (0, 2, 1)
    assert other.encode("<|im_start|>user") == [2, *other.encode("user")]
    # A tokenizer without a control token nanolm needs: named, with what to do.
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "<|im_start|>"]
    del vocab["<|im_start|>"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(UserError, match=r"tokenizer\.json: <\|im_start\|> is not in its vocabulary; nanolm needs "
                                        r"<\|endoftext\|>, <\|im_start\|>, <\|im_end\|> as special tokens .*Add them"):
        Tokenizer.load(tmp_path)


def test_transformers_loads_it(tok_dir, tok: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    assert (hf.pad_token_id, hf.eos_token_id, hf.bos_token) == (EOT_ID, IM_END_ID, None)
    assert len(hf) == VOCAB
    for text in ROUND_TRIP:
        ids = tok.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids
        assert hf.decode(ids) == text
    for messages in CHATS[:-1]:
        for gen in (False, True):
            want = render_chat(messages, add_generation_prompt=gen)
            got = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert got == want
            got_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
            if isinstance(got_ids, dict) or hasattr(got_ids, "input_ids"):  # transformers >= 5 returns a BatchEncoding
                got_ids = got_ids["input_ids"]
            assert list(got_ids) == tok.encode(want)
