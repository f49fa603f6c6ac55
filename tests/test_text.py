"""Streamed text (nanolm/infer/text.py): incremental decoding equal to the tokenizer's own, in bounded work;
stop strings cut streamed text exactly, however it is split."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanolm.infer.text import StopStrings, StreamDecoder, TextStream, find_stop, stop_prefix_len
from nanolm.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tokenizer_dir) -> Tokenizer:
    return Tokenizer.load(tokenizer_dir)


def streamed(tok, ids: list[int]) -> tuple[str, list[str]]:
    """(all pieces joined, the pieces), checking after every push that at most one character's bytes wait."""
    dec = StreamDecoder(tok)
    pieces = []
    for i in ids:
        pieces.append(dec.push(i))
        assert dec.pending_bytes() <= 3
    pieces.append(dec.flush())
    assert dec.pending_bytes() == 0
    return "".join(pieces), pieces


def decoded(tok, ids: list[int]) -> str:
    """What the tokenizer makes of the whole list; ids past its vocabulary stand for no text."""
    return tok.decode([i for i in ids if 0 <= i < tok.vocab_size])


def byte_ids(tok) -> dict[int, int]:
    """byte -> the id of the token standing for that byte alone (a byte-level BPE has all 256)."""
    out = {t[0]: i for i, t in enumerate(tok.token_bytes()) if len(t) == 1 and i >= 3}
    assert len(out) == 256
    return out


SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(data=st.data())
def test_pieces_equal_the_whole_decode_for_any_ids(tok, data):
    """Any ids: the specials, merged tokens, and ids past the vocabulary."""
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size + 40), max_size=40))
    assert streamed(tok, ids)[0] == decoded(tok, ids)


@SETTINGS
@given(data=st.data())
def test_pieces_equal_the_lossy_decode_of_adversarial_bytes(tok, data):
    """Byte streams that are not UTF-8 (stray continuation bytes, truncated, overlong and surrogate sequences,
    bytes past F4) mixed with whole tokens: the incremental decoder replaces exactly what `tokenizers` does."""
    one = byte_ids(tok)
    tricky = st.sampled_from([b"\xe4\xb8", b"\xf0\x9f\x98", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf4\x90\x80\x80",
                              b"\xff", b"\x80\x80", b"\xe2\x82\xac", b"\xf0\x9f\x98\x80"])
    chunks = data.draw(st.lists(st.one_of(st.binary(min_size=1, max_size=6), tricky,
                                          st.integers(0, tok.vocab_size + 5).map(lambda i: [i])), max_size=20))
    ids = [i for chunk in chunks for i in ([one[b] for b in chunk] if isinstance(chunk, bytes) else chunk)]
    assert streamed(tok, ids)[0] == decoded(tok, ids)


@SETTINGS
@given(text=st.text(alphabet=st.characters(codec="utf-8"), max_size=30))
def test_any_text_comes_back_whole(tok, text):
    """CJK, emoji and every other character: each token's bytes fed one by one rebuild the text."""
    one = byte_ids(tok)
    ids = tok.encode(text)
    assert streamed(tok, ids)[0] == text
    assert streamed(tok, [one[b] for b in text.encode("utf-8")])[0] == text  # split at every byte


def test_characters_come_out_as_soon_as_they_are_whole(tok):
    one = byte_ids(tok)
    ids = [one[b] for b in "话😀".encode("utf-8")] + tok.encode("<|im_end|>") + [tok.vocab_size + 1, one[0xE4]]
    text, pieces = streamed(tok, ids)
    assert pieces == ["", "", "话", "", "", "", "😀", "<|im_end|>", "", "", "\ufffd"]
    assert text == decoded(tok, ids)


class CountingTable(list):
    """A token_bytes table that counts its lookups."""

    lookups = 0

    def __getitem__(self, i):
        CountingTable.lookups += 1
        return super().__getitem__(i)


class RecordingTokenizer:
    """A stand-in tokenizer: records how many ids each decode call gets, and how often the table is built."""

    def __init__(self, real: Tokenizer) -> None:
        self.real = real
        self.vocab_size = real.vocab_size
        self.decode_sizes: list[int] = []
        self.tables = 0

    def decode(self, ids):
        self.decode_sizes.append(len(ids))
        return self.real.decode(ids)

    def token_bytes(self):
        self.tables += 1
        return CountingTable(self.real.token_bytes())


def test_work_per_push_does_not_grow_with_the_reply(tok):
    """4,000 tokens of mixed Chinese, English and emoji: each push reads one table entry and never hands the
    reply so far to the tokenizer; what waits between pushes is at most one character's bytes."""
    ids = (tok.encode("话说天下大势，分久必合。To be, or not to be 😀 ") * 400)[:4000]
    assert len(ids) == 4000
    stand_in = RecordingTokenizer(tok)
    dec = StreamDecoder(stand_in)
    CountingTable.lookups = 0
    pieces = []
    for i in ids:
        pieces.append(dec.push(i))
        assert dec.pending_bytes() <= 3
    pieces.append(dec.flush())
    assert CountingTable.lookups == len(ids)
    assert max(stand_in.decode_sizes, default=0) <= 1 and stand_in.tables == 1
    assert "".join(pieces) == tok.decode(ids)


# --- stop strings ------------------------------------------------------------------------------------

def test_stop_helpers_exact():
    assert find_stop("abcabc", ["ca", "bc"]) == 1
    assert find_stop("abcabc", ["ca", "bc"], 2) == 2
    assert find_stop("abcabc", ["x"]) is None and find_stop("abc", []) is None
    assert stop_prefix_len("hello wor", ["world"]) == 3
    assert stop_prefix_len("xab", ["abc", "bcd"]) == 2
    assert stop_prefix_len("abc", ["x"]) == 0 and stop_prefix_len("", ["ab"]) == 0
    assert stop_prefix_len("ab", ["b"]) == 0  # a whole stop string is find_stop's business


def cut_reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """The whole text cut before its first stop string, and whether one occurred."""
    cut = find_stop(text, stops)
    return (text, False) if cut is None else (text[:cut], True)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc话", max_size=30), stops=st.lists(st.text(alphabet="abc话", min_size=1, max_size=4),
                                                                 max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=10))
def test_stop_strings_cut_streamed_text_as_the_whole_text(text, stops, cuts):
    """However the text is split into pieces, what comes out is the whole text cut before its first stop string,
    and nothing that comes out is ever part of a stop string."""
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    s = StopStrings(stops)
    out = []
    for a, b in zip(bounds, bounds[1:]):
        out.append(s.push(text[a:b]))
        if s.stopped:
            break
    if not s.stopped:
        out.append(s.flush())
    assert ("".join(out), s.stopped) == cut_reference(text, stops)


def test_stop_strings_hold_back_a_possible_start_and_release_it():
    s = StopStrings(["world", "wx"])
    assert s.push("hello wo") == "hello "  # "wo" may begin "world"
    assert s.push("r") == ""  # "wor" still may
    assert s.push("k") == "work"  # it did not
    assert s.push("s w") == "s "
    assert s.flush() == "w" and not s.stopped
    s = StopStrings(["world"])
    assert s.push("hello wor") == "hello " and s.push("ld, and more") == "" and s.stopped
    assert s.push("after") == "" and s.flush() == ""
    assert StopStrings().push("anything") == "anything"
    with pytest.raises(ValueError, match="must not be empty"):
        StopStrings(["a", ""])


def test_a_longer_stop_string_begun_earlier_cuts_first():
    """The whole text "aca" is cut at "aca" (index 0), not at the "c" that completes first in the stream."""
    s = StopStrings(["c", "aca"])
    assert s.push("ac") == "" and not s.stopped  # "c" is there, but "aca" begun before it may still complete
    assert s.push("a") == "" and s.stopped
    s = StopStrings(["c", "aca"])
    assert s.push("ac") == "" and s.push("b") == "a" and s.stopped  # "aca" did not complete: cut at "c"
    s = StopStrings(["c", "aca"])
    assert s.push("ac") == "" and s.flush() == "a" and s.stopped  # the text ended: cut at "c"


def test_text_stream_stops_inside_a_token_and_across_split_characters(tok):
    one = byte_ids(tok)
    ids = tok.encode("To be, or not to be") + [one[b] for b in "话说".encode("utf-8")]
    text = TextStream(tok, ["not", "说"])
    pieces = []
    for i in ids:
        pieces.append(text.push(i))
        if text.stopped:
            break
    assert "".join(pieces) == "To be, or " and text.stopped
    text = TextStream(tok, ["说!"])
    assert "".join(text.push(i) for i in ids) + text.finish() == "To be, or not to be话说" and not text.stopped


class ScriptEngine:
    """An engine stand-in that replays fixed ids and records whether its generation was closed."""

    def __init__(self, script: list[int], vocab_size: int) -> None:
        self.script = script
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=vocab_size))
        self.closed = False

    def generate(self, prompt, params, stop_ids=(), guide=None):
        try:
            yield from self.script
        finally:
            self.closed = True


def test_stream_text_ends_at_a_stop_string_and_closes_the_generation(tok):
    from nanolm.config import SamplingParams
    from nanolm.infer.generate import stream_text

    engine = ScriptEngine(tok.encode("To be, or not to be"), tok.vocab_size)
    params = SamplingParams(max_new_tokens=50)
    assert "".join(stream_text(engine, tok, [0], params, (), stops=["not", "x"])) == "To be, or "
    assert engine.closed
    assert "".join(stream_text(engine, tok, [0], params, ())) == "To be, or not to be"
