"""Benchmarks: exact scores from a model whose log-probabilities are known, every task file layout from a
real-shaped sample, malformed rows, generative answers, degeneration metrics and `nanolm eval --task`."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nanolm.errors import UserError
from nanolm.eval.degeneration import degeneration_scores, distinct_n, loop_period
from nanolm.eval.runner import find_dev, format_table, load_task, parse_task_spec
from nanolm.eval.scoring import (answers_match, continuation_logprobs, encode_pair, extract_answer, mc_strings,
                                 rolling_requests, score_gen, score_mc)
from nanolm.eval.tasks import GenItem, MCItem, read_task_file
from nanolm.infer.engine import Token

CHARS = "\x00\x01 abcdefghijklmnopqrstuvwxyz:?.,!$#\n0123456789QAPnswer"


class CharTok:
    """One token per character of CHARS; eot is id 0, im_end id 1."""

    eot_id, im_end_id, chat_format = 0, 1, None

    def __init__(self) -> None:
        self.ids = {c: i for i, c in enumerate(dict.fromkeys(CHARS))}
        self.chars = {i: c for c, i in self.ids.items()}

    def encode(self, text: str) -> list[int]:
        return [self.ids[c] for c in text]

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


TOK = CharTok()
V = len(TOK.ids)


class UnigramModel(torch.nn.Module):
    """Every position predicts the same distribution `probs` (char -> probability, the rest shared alike):
    a continuation's log-probability is the sum of log p of its characters, whatever comes before."""

    def __init__(self, probs: dict[str, float], max_seq_len: int = 512) -> None:
        super().__init__()
        p = torch.full((V,), (1 - sum(probs.values())) / (V - len(probs)), dtype=torch.float64)
        for c, q in probs.items():
            p[TOK.ids[c]] = q
        self.logp = p.log()
        self.config = SimpleNamespace(max_seq_len=max_seq_len, vocab_size=V)
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.calls: list[tuple[int, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(tuple(x.shape))
        return self.logp.to(torch.float32).expand(*x.shape, V).clone()

    def lp(self, text: str) -> float:
        return float(sum(self.logp[TOK.ids[c]] for c in text))


PROBS = {" ": 0.2, "a": 0.1, "b": 0.5, "c": 0.05}


def item(choices, answer, question="which?") -> MCItem:
    return MCItem(question, tuple(choices), answer, f"Question: {question}\nAnswer:", " ", "t:1")


def test_multiple_choice_scores_are_the_known_log_probabilities():
    model = UnigramModel(PROBS)
    # 'a' beats 'bbbb' summed (log .2 + log .1 = -3.91 vs log .2 + 4 log .5 = -4.38), loses per character
    # (log .1 = -2.30 vs log .5 = -0.69 per char): length normalisation changes the pick.
    items = [item(["a", "bbbb"], 1), item(["a", "bbbb"], 0), item(["c", "b", "cc"], 1), item(["cc", "c"], 0)]
    res = score_mc(model, TOK, items)
    lps = [it["logprobs"] for it in res["items"]]
    assert lps[0] == pytest.approx([model.lp(" a"), model.lp(" bbbb")], abs=1e-5)
    assert lps[0] == pytest.approx([math.log(.2) + math.log(.1), math.log(.2) + 4 * math.log(.5)], abs=1e-5)
    # Item 3: the delimiter's log-probability is in each sum but only the choice's characters divide it
    # (lm-eval's acc_norm): (log .2 + 2 log .05) / 2 = -3.80 beats (log .2 + log .05) / 1 = -4.61.
    assert [(it["pick"], it["pick_norm"]) for it in res["items"]] == [(0, 1), (0, 1), (1, 1), (1, 0)]
    assert [it["chars"] for it in res["items"]][0] == [1, 4]  # the choice's own length, as lm-eval's acc_norm
    assert res["n"] == 4
    assert res["acc"] == 0.5 and res["acc_norm"] == 0.75  # right: items 1, 2 summed; 0, 2, 3 per character
    chance = (1 / 2 + 1 / 2 + 1 / 3 + 1 / 2) / 4
    assert res["chance"] == pytest.approx(chance)
    assert res["centred"] == pytest.approx((0.5 - chance) / (1 - chance))
    assert res["stderr"] == pytest.approx(math.sqrt(0.25 * 4 / 3 / 4))  # sample std / sqrt(n)
    assert res["stderr_norm"] == pytest.approx(math.sqrt(0.75 * 0.25 * 4 / 3 / 4))
    # each choice alone follows <|endoftext|>, without the delimiter (lm-eval's unconditional requests)
    assert [it["logprobs_alone"] for it in res["items"]][0] == pytest.approx([model.lp("a"), model.lp("bbbb")])


class BigramModel(torch.nn.Module):
    """The next character's distribution depends on the current one only: after a character of `follow`, its
    partner has the given probability and the other characters share the rest; after any other character
    (and <|endoftext|>) every character is equally likely."""

    def __init__(self, follow: dict[str, tuple[str, float]]) -> None:
        super().__init__()
        self.config = SimpleNamespace(max_seq_len=512, vocab_size=V)
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        table = torch.full((V, V), 1 / V, dtype=torch.float64)
        for a, (b, p) in follow.items():
            table[TOK.ids[a]] = (1 - p) / (V - 1)
            table[TOK.ids[a], TOK.ids[b]] = p
        self.logp = table.log()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logp[x].to(torch.float32)


def test_mutual_information_scores_what_the_context_adds():
    # After "q", "u" has probability 0.3 (a third of the other characters' 0.7 / (V - 1) each); after "z", "a"
    # has 0.9. The right choice "ua" follows the context "q", but "za" is the likelier text (its "a" follows
    # "z"), likely enough to win the summed score; what the context adds to each (log p after "q" less log 1/V
    # after <|endoftext|>, for the first character) picks "ua".
    model = BigramModel({"q": ("u", 0.3), "z": ("a", 0.9)})
    items = [MCItem("", ("za", "ua"), 1, "q", "", "t:1"), MCItem("", ("ua", "za"), 0, "q", "", "t:2")]
    res = score_mc(model, TOK, items)
    after_q, alone = math.log(0.7 / (V - 1)), math.log(1 / V)
    assert res["items"][0]["logprobs"] == pytest.approx([after_q + math.log(0.9), math.log(0.3) + alone],
                                                        abs=1e-5)
    assert res["items"][0]["logprobs_alone"] == pytest.approx([alone + math.log(0.9), 2 * alone], abs=1e-5)
    assert [it["pick"] for it in res["items"]] == [0, 1]  # the likelier text, wrong both times
    assert [it["pick_mutual_info"] for it in res["items"]] == [1, 0]
    assert (res["acc"], res["acc_mutual_info"], res["centred_mutual_info"]) == (0.0, 1.0, 1.0)


def test_every_answer_right_is_centred_one_and_chance_zero():
    model = UnigramModel(PROBS)
    right = score_mc(model, TOK, [item(["b", "c"], 0)] * 3)
    assert (right["acc"], right["centred"], right["stderr"]) == (1.0, 1.0, 0.0)
    half = score_mc(model, TOK, [item(["b", "c"], 0), item(["b", "c"], 1)])
    assert (half["acc"], half["centred"]) == (0.5, 0.0)


def test_shots_come_first_solved_and_the_batch_does_not_change_scores():
    shot = item(["b", "c"], 1, "first?")
    ctx, conts = mc_strings(item(["a", "b"], 0), [shot])
    assert ctx == "Question: first?\nAnswer: c\n\nQuestion: which?\nAnswer:"
    assert conts == [" a", " b"]
    model = UnigramModel(PROBS)
    one = score_mc(model, TOK, [item(["a", "bb"], 0), item(["cab", "b"], 1)], shots=[shot], batch_size=1)
    four = score_mc(model, TOK, [item(["a", "bb"], 0), item(["cab", "b"], 1)], shots=[shot], batch_size=4)
    assert [i["logprobs"] for i in one["items"]] == [i["logprobs"] for i in four["items"]]


def test_long_inputs_lose_their_oldest_context_and_rolling_windows_cover_each_token_once():
    model = UnigramModel(PROBS, max_seq_len=8)
    ((lp, greedy),) = continuation_logprobs(model, [(TOK.encode("abcabcabcabc"), TOK.encode("bb"))])
    assert model.calls[-1] == (1, 8) and lp == pytest.approx(2 * math.log(.5), abs=1e-6) and greedy
    reqs = rolling_requests(list(range(2, 22)), 8, 0)
    assert [len(c) for _, c in reqs] == [8, 8, 4] and [len(ctx) for ctx, _ in reqs] == [1, 1, 5]
    assert [t for _, c in reqs for t in c] == list(range(2, 22))
    assert all(len(ctx) + len(c) <= 9 for ctx, c in reqs) and reqs[0][0] == [0]


def test_encode_pair_moves_trailing_space_to_the_continuation():
    assert encode_pair(TOK, "Answer: ", "b") == (TOK.encode("Answer:"), TOK.encode(" b"))
    assert encode_pair(TOK, "", "ab") == ([0], TOK.encode("ab"))


def test_real_model_scores_do_not_depend_on_the_batch(tok):
    from server_helpers import tiny_model
    model = tiny_model()
    items = [MCItem("q", ("一帆风顺", "all the world"), 0, "话说天下大势\n答案：", "", "x"),
             MCItem("q", ("to be", "not to be, that is"), 1, "Question: To be?\nAnswer:", " ", "y")]
    a = score_mc(model, tok, items, batch_size=1)
    b = score_mc(model, tok, items, batch_size=8)
    for x, y in zip(a["items"], b["items"]):
        assert x["logprobs"] == pytest.approx(y["logprobs"], abs=1e-4)
    # Through the chat template: the question as the user's turn, each choice as the reply.
    ctx, conts = mc_strings(items[0], chat=True, tok=tok)
    from nanolm.chat import Message
    assert ctx == tok.chat_format.render([Message("user", "q")], add_generation_prompt=True)
    assert "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n" in ctx and conts == list(items[0].choices)


def test_choices_sharing_a_context_run_it_once_and_score_as_each_alone():
    from nanolm.model.transformer import ModelConfig, Transformer
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=24,
                                    tie_embeddings=False, init_std=0.2)).eval()
    ctx, other = list(range(3, 15)), [7, 8, 9]
    # four choices of one context (one of a single token), a second item's two, and one request past the model's
    # 24 + 1 tokens, which loses its oldest context tokens (so it shares nothing)
    requests = [(ctx, [20, 21, 22]), (ctx, [30]), (ctx, [31, 32, 33, 34, 35]), (ctx, [40, 41]),
                (other, [5, 6]), (other, [6]), (ctx, list(range(20, 34)))]
    lengths = []
    hook = model.register_forward_hook(lambda m, args, out: lengths.append(tuple(args[0].shape)))
    for batch_size in (1, 2, 16):
        lengths.clear()
        together = continuation_logprobs(model, requests, batch_size=batch_size)
        assert lengths.count((1, len(ctx))) == 1 and lengths.count((1, len(other))) == 1  # each context once
        alone = [continuation_logprobs(model, [r])[0] for r in requests]  # each request on its own, uncached
        assert [g for _, g in together] == [g for _, g in alone]
        assert [lp for lp, _ in together] == pytest.approx([lp for lp, _ in alone], abs=1e-5)
    hook.remove()
    # the scores are those of the model's own log-softmax over the whole sequence
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ctx + [31, 32, 33, 34, 35]])).float(), dim=-1)[0]
    want = sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate([31, 32, 33, 34, 35]))
    assert together[2][0] == pytest.approx(want, abs=1e-5)


def test_runs_trained_on_chat_data_are_scored_through_the_chat_template_by_default(tmp_path):
    """RL prompts are rendered in the chat layout, so an RL run is a chat model, as an SFT run is."""
    from nanolm.checkpoint import save_checkpoint
    from nanolm.train.configure import load_config
    from nanolm.eval.runner import is_finetuned
    from nanolm.model.transformer import Transformer
    for stage, chat in (("pretrain", False), ("sft", True), ("dpo", True), ("grpo", True), ("ppo", True)):
        cfg = load_config("tiny", overrides={"train.stage": stage, "model.d_model": 32, "model.vocab_size": 64})
        ckpt = save_checkpoint(tmp_path / stage, 1, Transformer(cfg.model), None, cfg, {})
        assert is_finetuned(ckpt) is chat, stage


# --- task files --------------------------------------------------------------------------------------------

def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def jsonl(path: Path, rows) -> Path:
    return write(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def test_ceval_cmmlu_mmlu_csv(tmp_path):
    ceval = read_task_file(write(tmp_path / "computer_network_val.csv",
                                 "id,question,A,B,C,D,answer,explanation\n"
                                 '0,"使用位填充方法，以01111110为位首flag，数据为011011111111111111110010，求问传送时要添加几个0____",'
                                 "1,2,3,4,C,\n"
                                 "1,下列哪一项是局域网的拓扑结构？,总线型,星型,环型,以上都是,D,解释\n"))
    assert [(i.question[:4], i.choices[0], i.answer) for i in ceval.items] == [("使用位填", "1", 2), ("下列哪一", "总线型", 3)]
    assert ceval.items[1].prompt == "下列哪一项是局域网的拓扑结构？\n答案：" and ceval.items[1].delimiter == ""
    assert ceval.items[1].where == f"{tmp_path / 'computer_network_val.csv'}:3" and ceval.layout == "C-Eval/CMMLU"
    cmmlu = read_task_file(write(tmp_path / "test" / "agronomy.csv",
                                 ",Question,A,B,C,D,Answer\n0,肉类鲜度变化的过程是,僵直、成熟,成熟、僵直,自溶、腐败,僵直、自溶,A\n"))
    assert cmmlu.items[0].choices == ("僵直、成熟", "成熟、僵直", "自溶、腐败", "僵直、自溶") and cmmlu.items[0].answer == 0
    mmlu = read_task_file(write(tmp_path / "abstract_algebra_test.csv",
                                "Find all c in Z_3 such that Z_3[x]/(x^2 + c) is a field.,0,1,2,3,B\n"
                                '"Statement 1 | A factor group of a non-Abelian group is non-Abelian.",'
                                "\"True, True\",\"False, False\",\"True, False\",\"False, True\",B\n"))
    assert [i.answer for i in mmlu.items] == [1, 1] and mmlu.items[1].choices[0] == "True, True"
    assert mmlu.items[0].prompt.startswith("Question: Find all c") and mmlu.layout == "MMLU"
    # The dev split beside them, for shots.
    write(tmp_path / "computer_network_dev.csv", "id,question,A,B,C,D,answer,explanation\n0,问?,a,b,c,d,A,x\n")
    write(tmp_path / "dev" / "agronomy.csv", ",Question,A,B,C,D,Answer\n0,问?,a,b,c,d,B\n")
    assert find_dev(tmp_path / "computer_network_val.csv") == tmp_path / "computer_network_dev.csv"
    assert find_dev(tmp_path / "test" / "agronomy.csv") == tmp_path / "dev" / "agronomy.csv"
    lt = load_task(f"{tmp_path / 'test' / 'agronomy.csv'}:shots=1,name=agro")
    assert lt.task.name == "agro" and lt.shots[0].answer == 1
    # Lettered, as lm-eval's cmmlu and MiniMind's C-Eval score it: the choices listed, the letter scored.
    lettered = load_task(f"{tmp_path / 'test' / 'agronomy.csv'}:shots=1,style=letters")
    ctx, conts = mc_strings(lettered.task.items[0], lettered.shots)
    assert ctx == ("问?\nA. a\nB. b\nC. c\nD. d\n答案： B\n\n"
                   "肉类鲜度变化的过程是\nA. 僵直、成熟\nB. 成熟、僵直\nC. 自溶、腐败\nD. 僵直、自溶\n答案：")
    assert conts == [" A", " B", " C", " D"] and lettered.task.items[0].answer == 0


def test_jsonl_layouts_as_published(tmp_path):
    arc = read_task_file(jsonl(tmp_path / "ARC-Challenge-Dev.jsonl", [{
        "id": "Mercury_7175875", "question": {"stem": "An astronomer observes that a planet rotates faster after a "
                                              "meteorite impact. Which is the most likely effect of this increase "
                                              "in rotation?", "choices": [
            {"text": "Planetary density will decrease.", "label": "A"},
            {"text": "Planetary years will become longer.", "label": "B"},
            {"text": "Planetary days will become shorter.", "label": "C"},
            {"text": "Planetary gravity will become stronger.", "label": "D"}]}, "answerKey": "C"}]))
    assert arc.items[0].answer == 2 and arc.items[0].choices[2] == "Planetary days will become shorter."
    arc_hf = read_task_file(jsonl(tmp_path / "arc_hf.jsonl", [{
        "id": "x", "question": "Which of these do scientists offer as the most recent explanation?",
        "choices": {"text": ["a", "b", "c"], "label": ["1", "2", "3"]}, "answerKey": "3"}]))
    assert arc_hf.items[0].answer == 2 and arc_hf.layout == "ARC/OpenBookQA"
    obqa = read_task_file(jsonl(tmp_path / "obqa.jsonl", [{
        "id": "7-980", "question_stem": "The sun is responsible for",
        "choices": {"text": ["puppies learning new tricks", "children growing up and getting old",
                             "flowers wilting in a vase", "plants sprouting, blooming and wilting"],
                    "label": ["A", "B", "C", "D"]}, "answerKey": "D"}]))
    assert obqa.items[0].answer == 3 and obqa.items[0].prompt == "Question: The sun is responsible for\nAnswer:"
    jsonl(tmp_path / "valid.jsonl", [{"goal": "When boiling butter, when it's ready, you can",
                                      "sol1": "Pour it onto a plate", "sol2": "Pour it into a jar"},
                                     {"goal": "To permanently attach metal legs to a chair, you can",
                                      "sol1": "Weld the metal together", "sol2": "Nail the metal together"}])
    write(tmp_path / "valid-labels.lst", "1\n0\n")
    piqa = read_task_file(tmp_path / "valid.jsonl")
    assert [i.answer for i in piqa.items] == [1, 0] and piqa.layout == "PIQA"
    hs = read_task_file(jsonl(tmp_path / "hellaswag_val.jsonl", [{
        "ind": 24, "activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.",
        "ctx_b": "he", "ctx": "A man is sitting on a roof. he", "split": "val", "split_type": "indomain",
        "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                    "is holding a rubik's cube.", "starts pulling up roofing on a roof."], "source_id": "x",
        "label": 3}]))
    assert hs.items[0].prompt == "Roof shingle removal: A man is sitting on a roof. He" and hs.items[0].answer == 3
    siqa = read_task_file(jsonl(tmp_path / "siqa.jsonl", [{
        "context": "Tracy didn't go home that evening and resisted Riley's attacks.",
        "question": "What does Tracy need to do before this?", "answerA": "make a new plan",
        "answerB": "Go home and see Riley", "answerC": "Find somewhere to go", "label": "3"}]))
    assert siqa.items[0].answer == 2 and siqa.items[0].question.endswith("before this?")
    gsm = read_task_file(jsonl(tmp_path / "gsm8k_test.jsonl", [{
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                    "How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                  "altogether in April and May.\n#### 72"}]))
    assert gsm.kind == "gen" and gsm.items[0].answer == "72" and gsm.layout == "GSM8K"
    plain = read_task_file(jsonl(tmp_path / "mine.jsonl", [
        {"question": "2+2?", "choices": ["3", "4"], "answer": 1},
        {"question": "sky?", "choices": ["blue", "green"], "answer": "blue"},
        {"question": "x?", "choices": ["p", "q", "r"], "answer": "C"}]))
    assert [i.answer for i in plain.items] == [1, 0, 2]
    gen = read_task_file(jsonl(tmp_path / "qa.jsonl", [{"question": "capital of France?", "answer": "Paris"},
                                                       {"question": "6*7?", "answer": 42}]))
    assert gen.kind == "gen" and [i.answer for i in gen.items] == ["Paris", "42"]


@pytest.mark.parametrize("name, text, message", [
    ("a.csv", "id,question,A,B,C,D,answer\n0,q,a,b,c,d,E\n", r"a\.csv:2: answer 'E' is not one of A, B, C, D"),
    ("a.csv", "id,question,A,B,C,D,answer\n0,q,a,b,c,d,\n", r"a\.csv:2: the answer is empty .*val/dev split"),
    ("a.csv", "id,question,A,B,C,D,answer\n0,q,a,b\n", r"a\.csv:2: 4 columns, the header names 7"),
    ("a.csv", "q,a,b,c\n", r"a\.csv:1: 4 columns; an MMLU row is question,A,B,C,D,answer"),
    ("a.csv", "id,question,A,B,C,D,answer\n0,q,a,,c,d,A\n", r"a\.csv:2: choice B is empty"),
    ("a.jsonl", '{"question": "q", "choices": ["a", "b"], "answer": 0}\n{oops\n', r"a\.jsonl:2: not valid JSON"),
    ("a.jsonl", '{"question": "q", "choices": ["a", "b"], "answer": 5}\n',
     r"a\.jsonl:1: answer 5 is not an index of the 2 choices"),
    ("a.jsonl", '{"question": "q", "choices": ["a", "b"], "answer": 0}\n\n{"goal": "g", "sol1": "a", "sol2": "b"}\n',
     r"a\.jsonl:3: fields goal, sol1, sol2 do not fit the nanolm multiple-choice layout"),
    ("a.jsonl", '{"text": "hi"}\n', r"a\.jsonl:1: fields text match no task layout"),
    ("a.jsonl", '{"goal": "g", "sol1": "a", "sol2": "b"}\n', r"a\.jsonl:1: no 'label' field, and no a-labels\.lst"),
    ("a.jsonl", '{"question": "q", "answer": "it is 4"}\n{"question": "q", "answer": "#### 4"}\n',
     r"a\.jsonl:2: fields answer, question do not fit the nanolm generative layout"),
    ("a.jsonl", '{"question": "q", "answer": "#### 4"}\n{"question": "", "answer": "#### 4"}\n',
     r"a\.jsonl:2: field 'question' must be a non-empty string for the GSM8K layout"),
    ("a.jsonl", '{"ctx": "c", "endings": ["x", "y"], "label": 2}\n', r"a\.jsonl:1: label 2 is not an integer from 0 to 1"),
    ("a.txt", "hello\n", r"a\.txt: unknown task file type '\.txt'"),
    ("a.jsonl", "\n", r"a\.jsonl: holds no items"),
])
def test_malformed_rows_name_file_and_line(tmp_path, name, text, message):
    with pytest.raises(UserError, match=message):
        read_task_file(write(tmp_path / name, text))


def test_task_specs():
    assert parse_task_spec("x/c_val.csv:n=5,shots=2,chat=true") == parse_task_spec("x/c_val.csv:shots=2,chat=true,n=5")
    s = parse_task_spec("x/c_val.csv:n=5,shots=2,chat=true")
    assert (s.source, s.n, s.shots, s.chat) == ("x/c_val.csv", 5, 2, True)
    assert parse_task_spec("idioms").source == "idioms"
    with pytest.raises(UserError, match=r"--task a\.csv:k=1: unknown option 'k'; use n, shots, dev, chat, style, name"):
        parse_task_spec("a.csv:k=1")
    with pytest.raises(UserError, match=r"--task a\.csv:n=0: n must be a positive integer"):
        parse_task_spec("a.csv:n=0")


# --- generative ----------------------------------------------------------------------------------------------

class ReplyEngine:
    """Each prompt's reply is a fixed text chosen by what its prompt ends with, one character a step."""

    max_seq_len = 512

    def __init__(self, replies: dict[str, str]) -> None:
        self.replies = replies

    def batch(self):
        engine = self

        class Batch:
            def __init__(self) -> None:
                self.rows: dict[int, list[int]] = {}
                self.n = 0

            def add(self, prompt, params, stop_ids=(), n=1, guide=None):
                text = TOK.decode(prompt)
                reply = next(r for end, r in engine.replies.items() if text.endswith(end))
                self.rows[self.n] = TOK.encode(reply)[: params.max_new_tokens] + [TOK.eot_id]
                self.n += 1
                return [self.n - 1]

            def cancel(self, row):
                self.rows.pop(row, None)

            def step(self):
                out = []
                for row, ids in list(self.rows.items()):
                    t = ids.pop(0)
                    out.append(Token(row, None if t == TOK.eot_id else t, "stop" if t == TOK.eot_id else None))
                    if t == TOK.eot_id:
                        del self.rows[row]
                return out
        return Batch()


def test_generative_answers_are_extracted_and_compared():
    from nanolm.config import SamplingParams
    items = [GenItem("a?", "72", "Q a?\nAnswer:"), GenItem("b?", "1000", "Q b?\nAnswer:"),
             GenItem("c?", "5", "Q c?\nAnswer:"), GenItem("d?", "paris", "Q d?\nAnswer:")]
    engine = ReplyEngine({"a?\nAnswer:": " 48 and 24 is 72.\n#### 72\n\nQuestion: more", "b?\nAnswer:": " so 1,000.00",
                          "c?\nAnswer:": " 4\n\n5", "d?\nAnswer:": " Paris."})
    res = score_gen(engine, TOK, items, SamplingParams(max_new_tokens=100, temperature=0.0), rows=2)
    assert [i["predicted"] for i in res["items"]] == ["72", "1,000.00", "4", "Paris."]
    assert [i["correct"] for i in res["items"]] == [True, True, False, True]
    assert res["items"][2]["reply"] == " 4"  # cut at the first stop string
    assert (res["acc"], res["chance"], res["n"]) == (0.75, 0.0, 4)


def test_answer_extraction_and_numbers():
    assert extract_answer("so \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert extract_answer("it costs $1,250 in total") == "$1,250"
    assert extract_answer("#### 18") == "18"
    assert answers_match("$1,250", "1250") and answers_match("72.0", "72") and not answers_match("7", "72")
    assert answers_match("Paris!", "paris") and not answers_match("Lyon", "Paris")


def test_batched_generation_equals_one_prompt_at_a_time(tok):
    from server_helpers import tiny_model
    from nanolm.config import SamplingParams
    from nanolm.eval.scoring import generate_texts
    from nanolm.infer.engine import Engine
    engine = Engine(tiny_model())
    prompts = [tok.encode(p) for p in ("话说天下", "To be, or", "My fellow citizens", "滚滚长江")]
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    together = generate_texts(engine, tok, prompts, params, rows=3)
    alone = [tok.decode(engine.generate_all(p, params)) for p in prompts]
    assert together == alone
    seeded = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5)
    assert generate_texts(engine, tok, prompts, seeded, rows=4)[2] == generate_texts(engine, tok, prompts[2:], 
                                                                                      SamplingParams(max_new_tokens=12, temperature=1.0, seed=7), rows=1)[0]


# --- degeneration ------------------------------------------------------------------------------------------

def test_distinct_and_loops():
    assert distinct_n([[1, 2, 3], [1, 2, 4]], 1) == 4 / 6
    assert distinct_n([[1, 2, 3], [1, 2, 4]], 2) == 3 / 4
    assert loop_period([5] * 12) == 1 and loop_period([5] * 11) is None
    assert loop_period([9, 8] + [1, 2, 3, 4] * 3) == 4
    assert loop_period(list(range(30))) is None
    scores = degeneration_scores([[1, 2, 3, 4] * 4, list(range(20))])
    assert scores["loop_fraction"] == 0.5 and scores["n"] == 2 and scores["mean_tokens"] == 18


def test_table_lists_each_task():
    rows = [{"task": "arc", "chat": False, "n": 10, "shots": 0, "acc": 0.5, "acc_norm": 0.6, "chance": 0.25,
             "centred": 1 / 3, "stderr": 0.1}]
    lines = format_table(rows).splitlines()
    assert lines[0].split() == ["task", "n", "shots", "acc", "acc_norm", "acc_mutual_info", "chance", "centred",
                                "stderr", "score"]
    assert lines[1].split() == ["arc", "10", "0", "0.5000", "0.6000", "-", "0.2500", "+0.3333", "0.1000", "acc"]
    # centred and stderr are those of the task's score
    rows[0] |= {"metric": "acc_mutual_info", "acc_mutual_info": 0.7, "centred_mutual_info": 0.6,
                "stderr_mutual_info": 0.05}
    assert format_table(rows).splitlines()[1].split()[5:] == ["0.7000", "0.2500", "+0.6000", "0.0500",
                                                              "acc_mutual_info"]


# --- nanolm eval --task, and scores during training ---------------------------------------------------------

MINE = [{"question": "To be, or not to be?", "choices": ["that is the question.", "the state of our union."],
         "answer": 0},
        {"question": "话说天下大势", "choices": ["分久必合，合久必分。", "浪花淘尽英雄。"], "answer": 0},
        {"question": "All the world's a stage?", "choices": ["and all the men and women merely players.",
                                                            "青山依旧在"], "answer": 0},
        {"question": "The quality of mercy is not strained?", "choices": ["it is strong.",
                                                                         "it droppeth as the gentle rain."],
         "answer": 1},
        {"question": "滚滚长江东逝水", "choices": ["几度夕阳红。", "浪花淘尽英雄。", "惯看秋月春风。"], "answer": 1}]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_dir):
    """A tiny run that scores a task file, with degeneration samples, at each validation; the best checkpoint
    picked by the task's acc_norm."""
    from nanolm.train.trainer import train
    from test_train import tiny_cfg
    root = tmp_path_factory.mktemp("evaltrain")
    task = jsonl(root / "mine.jsonl", MINE)
    cfg = tiny_cfg(data_dir, root / "run", **{"train.max_steps": 10, "train.eval_interval": 5,
                                              "train.save_interval": 0, "train.eval_tasks": f"{task}:n=4",
                                              "train.degeneration_samples": 3,
                                              "train.best_metric": "task/mine/acc_norm"})
    res = train(cfg, quiet=True)
    return root, task, res


def test_tasks_are_scored_at_each_validation_and_pick_the_best_checkpoint(trained):
    from nanolm.checkpoint import load_model, step_dirs
    from nanolm.tokenizer import Tokenizer
    from test_train import read_metrics
    root, task, res = trained
    vals = [r for r in read_metrics(root / "run") if "val_loss" in r]
    assert [r["step"] for r in vals] == [5, 10]
    for r in vals:
        assert {"task/mine/acc", "task/mine/acc_norm", "task/mine/centred", "degen/distinct_1", "degen/distinct_2",
                "degen/loop_fraction"} <= set(r)
        assert r["task/mine/acc"] in (0, 0.25, 0.5, 0.75, 1.0)  # 4 items: n=4 of the 5
    # The logged scores are those of the saved weights, as `nanolm eval --task` computes them.
    model, ckpt = load_model(step_dirs(root / "run")[-1])
    again = score_mc(model, Tokenizer.load(ckpt), read_task_file(task).items[:4])
    assert (again["acc"], again["acc_norm"]) == (vals[-1]["task/mine/acc"], vals[-1]["task/mine/acc_norm"])
    assert vals[-1]["task/mine/centred"] == pytest.approx(again["centred"])
    best = json.loads((root / "run" / "checkpoints" / "best.json").read_text())["step"]
    first_best = max(vals, key=lambda r: (r["task/mine/acc_norm"], -r["step"]))["step"]
    assert best == first_best and res.best_value == max(r["task/mine/acc_norm"] for r in vals)


def test_nanolm_eval_task_prints_the_table_and_writes_json(trained, capsys):
    from nanolm.cli import main
    root, task, _ = trained
    assert main(["eval", str(root / "run"), "--last", "--task", f"{task}:name=mine5", "--task",
                 f"{task}:n=2,chat=true", "--degeneration", "2", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["task", "n", "shots"]
    assert out[1].split()[:3] == ["mine5", "5", "0"] and out[2].split()[:4] == ["mine", "(chat)", "2", "0"]
    assert out[3].startswith("degeneration (2 sampled continuations of idioms (held-out questions), up to 8 tokens)")
    report = json.loads((root / "run" / "eval" / "step-00000010.json").read_text())
    assert [t["task"] for t in report["tasks"]] == ["mine5", "mine"] and report["tasks"][0]["n"] == 5
    assert out[1].split()[3] == f"{report['tasks'][0]['acc']:.4f}"
    assert report["degeneration"]["n"] == 2


def test_eval_errors(trained, tmp_path, capsys):
    from nanolm.cli import main
    from nanolm.config import TrainConfig
    root, task, _ = trained
    assert main(["eval", str(root / "run")]) == 2
    assert "nothing to score; pass --data" in capsys.readouterr().err
    assert main(["eval", str(root / "run"), "--task", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl: no such task file" in capsys.readouterr().err
    assert main(["eval", str(root / "run"), "--task", f"{task}:shots=1"]) == 2
    assert "shots=1 needs a dev split; pass dev=FILE" in capsys.readouterr().err
    with pytest.raises(UserError, match=r"train\.best_metric must be val_loss or task/<name>/<acc\|acc_norm\|acc_mutual_info\|centred>"):
        TrainConfig(best_metric="task/x/loss")
    with pytest.raises(UserError, match=r"needs that task in train\.eval_tasks"):
        TrainConfig(best_metric="task/x/acc")
    assert TrainConfig(eval_tasks=("idioms:n=5", "chat=true", "a.jsonl")).eval_tasks == ("idioms:n=5,chat=true",
                                                                                          "a.jsonl")


def test_plot_shows_the_task_scores(trained, tmp_path):
    import struct
    from nanolm.plot import plot_runs
    root, _, _ = trained
    png = plot_runs([root / "run"], tmp_path / "p.png").read_bytes()
    assert struct.unpack(">II", png[16:24]) == (1320, 1320)  # a third row: tasks and degeneration
    svg = plot_runs([root / "run"], tmp_path / "p.svg").read_text()
    for label in ("benchmark scores (train.eval_tasks)", "mine/acc_norm", "degeneration of sampled text",
                  "loop_fraction"):
        assert label in svg
