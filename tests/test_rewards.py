"""Rewards of the GRPO stage: the built-ins on exact cases, the spec, a user's function from its file, and a
local transformers reward model (a tiny one made in the test)."""

from __future__ import annotations

import pytest

from nanolm.errors import UserError
from nanolm.train.rl.rewards import (Rewards, answer_reward, answers_match, final_answer, format_reward,
                                  length_reward, normalise_answer, parse_spec, reference_of, repetition_reward,
                                  tool_call_reward)


@pytest.mark.parametrize("text, want", [
    ("so the total is \\boxed{42}.", "42"),
    ("\\boxed{\\frac{1}{2}} then \\boxed{7}", "7"),  # the last box
    ("\\boxed{x^{2}}", "x^{2}"),  # braces balanced
    ("3 + 4 = 7. #### 7", "7"),
    ("#### 1,200 dollars\nmore text", "1,200 dollars"),
    ("first 3 then 12 apples", "12"),  # no box, no ####: the last number
    ("no number here", None),
])
def test_final_answer(text, want):
    assert final_answer(text) == want


@pytest.mark.parametrize("given, ref, same", [
    ("42", "42", True), ("42 apples", "42", True), ("42元", "42", True), ("$1,200", "1200", True),
    ("1200.0", "1200", True), ("7.", "7", True), ("1/2", "0.5", True), ("-3", "3", False),
    ("Paris", "paris", True), ("\\text{Paris}", "Paris", True), ("41", "42", False),
])
def test_answers_match_after_normalisation(given, ref, same):
    assert answers_match(given, ref) is same


def test_answer_reward_reads_the_reference_fields():
    assert answer_reward("q", "3 + 4 = 7. #### 7", {"answer": "7"}) == 1.0
    assert answer_reward("q", "3 + 4 = 8. #### 8", {"answer": "7"}) == 0.0
    # a worked solution as the reference; a number as gt; the think block is not the answer
    assert answer_reward("q", "\\boxed{12}", {"solution": "6 * 2 = 12\n#### 12"}) == 1.0
    assert answer_reward("q", "<think>\nmaybe 5\n</think>\n\n6", {"gt": 6}) == 1.0
    assert answer_reward("q", "<think>\n6\n</think>\n\nno idea", {"gt": 6}) == 0.0
    assert reference_of({"answer": "", "solution": "#### 3"}) == "3"
    with pytest.raises(UserError, match="needs a reference field"):
        answer_reward("q", "7", {"prompt": "q"})
    assert normalise_answer(" 1,234 km ") == "1234"


def test_format_reward_wants_one_closed_think_block():
    plain = format_reward(thinking=False)
    assert plain("q", "<think>\nwork\n</think>\n\n7", {}) == 1.0
    assert plain("q", "7", {}) == 0.0
    assert plain("q", "<think>\nwork\n7", {}) == 0.0  # not closed
    assert plain("q", "<think>a</think><think>b</think>7", {}) == 0.0  # two blocks
    assert plain("q", "<think>\nwork\n</think>\n\n", {}) == 0.0  # no answer after it
    opened = format_reward(thinking=True)  # the generation prompt wrote <think>
    assert opened("q", "work\n</think>\n\n7", {}) == 1.0
    assert opened("q", "<think>work</think>7", {}) == 0.0


def test_length_and_repetition():
    win = length_reward(4, 10)
    assert [win("q", "x" * n, {}) for n in (0, 2, 4, 10, 15, 20, 30)] == [0.0, 0.5, 1.0, 1.0, 0.5, 0.0, 0.0]
    assert win("q", "<think>\n" + "y" * 50 + "\n</think>\n\nabcdef", {}) == 1.0  # the reply, not the thinking
    assert repetition_reward("q", "one two three four five", {}) == 0.0
    # 6 words, 4 trigrams: (a b a) (b a b) (a b a) (b a b) -> 2 distinct, half repeat
    assert repetition_reward("q", "a b a b a b", {}) == -0.5
    assert repetition_reward("q", "我我我我我", {}) == pytest.approx(-2 / 3)  # CJK: a character is a word


def test_tool_call_reward():
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    good = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
    assert tool_call_reward("q", good, {"tools": tools}) == 1.0
    assert tool_call_reward("q", good, {}) == 1.0  # no tools listed: any name
    assert tool_call_reward("q", good.replace("calculator", "search"), {"tools": tools}) == 0.0
    assert tool_call_reward("q", "<tool_call>\n{not json}\n</tool_call>", {}) == 0.0
    assert tool_call_reward("q", "4", {}) == 0.0


def test_spec_weights_and_totals(tmp_path):
    assert parse_spec("answer:1.0, format:0.2,length") == [("answer", 1.0), ("format", 0.2), ("length", 1.0)]
    with pytest.raises(UserError, match="unknown reward 'answr'"):
        parse_spec("answr:1")
    with pytest.raises(UserError, match="empty"):
        parse_spec(" , ")
    user = tmp_path / "my_rewards.py"
    user.write_text("def short(prompt, completion, record):\n    return 1.0 if len(completion) < record['n'] else -1.0\n")
    r = Rewards.from_spec(f"answer:2,{user}:short:0.5")
    assert r.names == ["answer", "my_rewards"]
    totals, per = r.score(["q", "q"], ["#### 7", "a long wrong answer #### 8"], [{"answer": "7", "n": 10}] * 2)
    assert per == {"answer": [1.0, 0.0], "my_rewards": [1.0, -1.0]}
    assert totals == [2.5, -0.5]


def test_user_function_errors_name_the_file(tmp_path):
    with pytest.raises(UserError, match="is not a file"):
        Rewards.from_spec(f"{tmp_path / 'none.py'}:f")
    bad = tmp_path / "bad.py"
    bad.write_text("def f(prompt, completion, record):\n    return 'yes'\n")
    with pytest.raises(UserError, match="has no function 'g'"):
        Rewards.from_spec(f"{bad}:g")
    with pytest.raises(UserError, match="returned 'yes'; a reward must return a finite float"):
        Rewards.from_spec(f"{bad}:f").score(["q"], ["c"], [{}])


def test_reward_model_directory(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "[PAD]", "what", "is", "2", "+", "4", "6", "five", "the", "answer"]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=len(words), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=64, num_labels=1)
    model = transformers.BertForSequenceClassification(cfg).eval()
    d = tmp_path / "rm"
    model.save_pretrained(d)
    hf_tok.save_pretrained(d)

    def direct(text: str) -> float:
        with torch.no_grad():
            return float(model(**hf_tok(text, return_tensors="pt")).logits[0, 0])

    r = Rewards.from_spec("model:0.5", reward_model=str(d))
    totals, per = r.score(["what is 2 + 4"] * 2, ["6", "<think>\nhm\n</think>\n\nfive"], [{}, {}])
    want = [direct("what is 2 + 4\n6"), direct("what is 2 + 4\nfive")]  # the reply, its think block left out
    assert per["model"] == pytest.approx(want, abs=1e-6)
    assert want[0] != want[1]
    assert totals == pytest.approx([0.5 * w for w in want], abs=1e-6)
    with pytest.raises(UserError, match="pass --grpo.reward_model"):
        Rewards.from_spec("model")
    with pytest.raises(UserError, match="must be a transformers model directory"):
        Rewards.from_spec("model", reward_model=str(tmp_path))
