"""Tests for digit splitting in nanolm.tokenizer: a new tokenizer spells every digit as a token of its own and
still round-trips every byte; a tokenizer.json trained without it encodes exactly as `tokenizers` reads it."""

from __future__ import annotations

import json
import random
import re
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

from nanolm.chat import check_spelling, render_chat
from nanolm.tokenizer import EOT_ID, IM_END_ID, IM_START_ID, TAG_TOKENS, Tokenizer, train_tokenizer

VOCAB = 600
GPT2_PRE_TOKENIZER = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def corpus(n: int = 300, seed: int = 0) -> list[str]:
    """Short documents full of numbers (years, prices, sums, decimals) in English and Chinese, so that a
    tokenizer free to merge digits would spend merges on them."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        a, b, year = rng.randint(0, 999), rng.randint(0, 99), rng.choice([1999, 2000, 2023, 2024, 2025])
        docs.append(f"In {year}, Tom bought {a} apples for {b}.{rng.randint(0, 99):02d} dollars; "
                    f"{a} + {b} = {a + b}, and {a} x 12 = {a * 12}. Call 555-{rng.randint(1000, 9999)}.")
        if i % 3 == 0:
            docs.append(f"{year}年，小明有{a}个苹果，又买了{b}个，一共{a + b}个。圆周率约为3.14159。")
    return docs


@pytest.fixture(scope="module")
def new_dir(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("digits")
    train_tokenizer(corpus(), out, VOCAB, quiet=True)
    return out


@pytest.fixture(scope="module")
def old_dir(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("no-digits")
    train_tokenizer(corpus(), out, VOCAB, split_digits=False, quiet=True)
    return out


@pytest.fixture(scope="module")
def new(new_dir) -> Tokenizer:
    return Tokenizer.load(new_dir)


@pytest.fixture(scope="module")
def old(old_dir) -> Tokenizer:
    return Tokenizer.load(old_dir)


EVERY_BYTE = "".join(chr(c) for c in range(256))  # as UTF-8: every byte 0-127 alone, 0xC2/0xC3 with 0x80-0xBF
# One character for each other lead byte of UTF-8 (0xC4-0xF4): with EVERY_BYTE, every byte UTF-8 text can hold.
EVERY_LEAD = "".join([*(chr((lead - 0xC0) << 6) for lead in range(0xC4, 0xE0)),
                      *(chr(max(0x800, (lead - 0xE0) << 12)) for lead in range(0xE0, 0xF0)),
                      *(chr(max(0x10000, (lead - 0xF0) << 18)) for lead in range(0xF0, 0xF5))])
ROUND_TRIP = [
    EVERY_BYTE, EVERY_LEAD, EVERY_LEAD + "0" + EVERY_BYTE[::-1] + "9",
    "12345", "3.14", "-0.5e10", "1,000,000", "v1.2.3", "0x1F", "a1b2c3", "2024年3月14日",
    " 7", "  42", "\t9\n", "1\n\n2", "x 12 y  345 z   6789",
    "١٢٣ ٤٥٦", "１２３", "۱۲۳", "१२३", "²³½⅓Ⅻ①", "١2٣", "1１١",
    "你好，世界 123", "日本語テキスト42", "한국어 7", "emoji 🙂👍🏽 9", "👨‍👩‍👧 3", "\u200b1\u200d2",
    "<|im_start|>user\n12+30=?<|im_end|>\n", "<think>\n1+1=2\n</think>\n\n2", "<tool_call>{\"a\": 12}</tool_call>",
    "", " ", "\x00\x01 0", "\ufeff1", "\U0010ffff5",
]


def spelled(tok: Tokenizer, ids: list[int]) -> list[bytes]:
    table = tok.token_bytes()
    return [table[i] for i in ids]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip_exact(new: Tokenizer, old: Tokenizer, text: str) -> None:
    for tok in (new, old):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        # The loss mask of a chat relies on the tokens spelling the text byte for byte.
        assert b"".join(spelled(tok, ids)) == text.encode("utf-8")
        check_spelling(text, ids, tok.token_bytes(), str(tok.path))


def test_every_byte_value_is_covered() -> None:
    covered = {b for t in ROUND_TRIP for b in t.encode("utf-8")}
    assert covered == set(range(256)) - {0xC0, 0xC1, *range(0xF5, 0x100)}  # the bytes UTF-8 never holds


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_round_trip_any_text(new: Tokenizer, text: str) -> None:
    assert new.decode(new.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 10**12).map(str), st.sampled_from([" ", "  ", ".", ",", "-", "\n", "年",
                                                                             "a", "١٢", "１"])), max_size=20))
def test_round_trip_number_text(new: Tokenizer, parts: list[str]) -> None:
    text = "".join(parts)
    ids = new.encode(text)
    assert new.decode(ids) == text
    assert all(len(p) == 1 for p in spelled(new, ids) if any(48 <= b <= 57 for b in p))


def test_one_token_per_ascii_digit(new: Tokenizer) -> None:
    assert new.splits_digits
    text = "In 2024, 12345 apples cost 3.14 each; 1000000 + 7 = 1000007. x  99"
    ids = new.encode(text)
    pieces = spelled(new, ids)
    digits = [p for p in pieces if any(48 <= b <= 57 for b in p)]
    assert digits == [d.encode() for d in re.findall(r"[0-9]", text)]
    for run in re.findall(r"[0-9]+", text):
        assert spelled(new, new.encode(run)) == [d.encode() for d in run]
    assert new.decode(ids) == text


def test_no_token_holds_a_digit_with_anything_else(new: Tokenizer) -> None:
    for token in new.token_bytes():
        try:
            chars = token.decode("utf-8")
        except UnicodeDecodeError:  # part of a character: no digit (ASCII digits are whole bytes)
            assert not any(48 <= b <= 57 for b in token), token
            continue
        # \p{N}, what tokenizers' Digits splits off (str.isnumeric would count 一, 三 ... too)
        if any(unicodedata.category(c)[0] == "N" for c in chars):
            assert len(chars) == 1, token
    assert int((new.token_byte_lengths() > 1).sum()) > 50  # the vocabulary did merge the other text


def test_digit_free_text_tokenizes_as_without_splitting(new_dir, new: Tokenizer, old_dir) -> None:
    data = json.loads((new_dir / "tokenizer.json").read_text(encoding="utf-8"))
    assert data["pre_tokenizer"] == {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, GPT2_PRE_TOKENIZER]}
    assert data["decoder"]["type"] == "ByteLevel"
    # Same model, GPT-2 pre-tokenizer: a text without digits gets the same pieces either way.
    data["pre_tokenizer"] = GPT2_PRE_TOKENIZER
    plain = HFTokenizer.from_str(json.dumps(data))
    for text in ["The quick brown fox, said Tom.", "小明有个苹果。", " a  b\n\nc"]:
        assert plain.encode(text, add_special_tokens=False).ids == new.encode(text)


def test_old_tokenizer_keeps_its_ids(old_dir, old: Tokenizer) -> None:
    data = json.loads((old_dir / "tokenizer.json").read_text(encoding="utf-8"))
    assert data["pre_tokenizer"] == GPT2_PRE_TOKENIZER  # as every tokenizer nanolm trained before digit splitting
    assert not old.splits_digits
    text = "In 2024, Tom bought 12 apples for 3.14 dollars; 100 + 200 = 300. 2024年，小明有12个苹果。"
    want = HFTokenizer.from_file(str(old_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert old.encode(text) == want
    assert old.encode_batch([text, text[::-1]]) == [want, old.encode(text[::-1])]
    multi = [p for p in spelled(old, want) if sum(48 <= b <= 57 for b in p) > 1]
    assert multi, "the old tokenizer merges digits"
    assert old.decode(want) == text
    # Saving it back leaves the file's pre-tokenizer (and so its ids) as they were.
    assert Tokenizer.load(old.save(old_dir.parent / "old-copy")).fingerprint == old.fingerprint


def test_chat_and_special_tokens(new: Tokenizer) -> None:
    msgs = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 12 + 30?"},
            {"role": "assistant", "content": "<think>\n12 + 30 = 42\n</think>\n\n42"}]
    text = render_chat(msgs)
    ids = new.encode(text)
    assert ids[0] == IM_START_ID and ids.count(IM_START_ID) == 3 and ids.count(IM_END_ID) == 3
    assert new.tag_ids["<think>"] in ids and new.tag_ids["</think>"] in ids
    assert new.decode(ids) == text
    assert new.encode("<|endoftext|>1<|im_end|>") == [EOT_ID, new.encode("1")[0], IM_END_ID]
    assert (new.tag_ids, new.missing_tags()) == ({t: 3 + i for i, t in enumerate(TAG_TOKENS)}, [])


def test_transformers_round_trips(new_dir, new: Tokenizer, old_dir, old: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    for d, tok in ((new_dir, new), (old_dir, old)):
        for hf in (transformers.AutoTokenizer.from_pretrained(str(d)),
                   transformers.PreTrainedTokenizerFast.from_pretrained(str(d))):
            for text in ROUND_TRIP:
                ids = tok.encode(text)
                assert hf.encode(text, add_special_tokens=False) == ids, text
                assert hf.decode(ids) == text
            msgs = [{"role": "user", "content": "What is 37 times 24?"}, {"role": "assistant", "content": "888"}]
            got = hf.apply_chat_template(msgs, tokenize=True)
            if isinstance(got, dict) or hasattr(got, "input_ids"):  # transformers >= 5 returns a BatchEncoding
                got = got["input_ids"]
            assert list(got) == tok.encode(render_chat(msgs))


def test_split_digits_must_be_a_bool(tmp_path) -> None:
    from nanolm.errors import UserError
    with pytest.raises(UserError, match=r"split_digits=1: must be True"):
        train_tokenizer(["text 12"], tmp_path, 300, split_digits=1, quiet=True)  # type: ignore[arg-type]
