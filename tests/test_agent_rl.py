"""RL over tool calls (`--stage grpo --grpo.tools ...`): trajectory rows and their masks with exact ids on a
scripted batch, rows that wait for a tool not holding the others, the tools' results, the `finished` reward,
and agentic GRPO end to end (it trains, logs its rewards, and resumes exactly)."""

from __future__ import annotations

from collections import deque

import torch

from engine_doubles import ScriptBatch, Signals
from nanolm.chat import Message, ToolCall
from nanolm.config.sampling import SamplingParams
from nanolm.data.shards import IGNORE_INDEX
from nanolm.train.rl.agent import AgentSampler, AgentTools, ToolTurns, run_trajectories, trajectory_rows
from nanolm.train.rl.rewards import Completion, Rewards
from nanolm.train.trainer import train
from test_grpo import arith_files, base_run, grpo_cfg, prompts_dir  # noqa: F401 (fixtures)
from test_train import read_metrics, same_weights

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17*23"}}\n</tool_call>'


class CountingBatch(ScriptBatch):
    """A ScriptBatch that numbers its steps and notes at which step each row made each token."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.steps = 0
        self.made: dict[int, list[int]] = {}  # row -> the step of each of its tokens

    def step(self):
        out = super().step()
        self.steps += 1
        for t in out:
            if t.token is not None:
                self.made.setdefault(t.row, []).append(self.steps)
        return out


def prompt_ids(tok, question: str) -> list[int]:
    texts = AgentTools.from_spec("builtin").box.texts()
    return tok.encode(tok.chat_format.render([Message("user", question)], texts, add_generation_prompt=True))


def test_a_trajectory_row_targets_exactly_the_model_segments(tok):
    turns = ToolTurns(tok, AgentTools.from_spec("builtin"), thinking=False)
    prompt = prompt_ids(tok, "What is 17 times 23?")
    first, final = tok.encode(CALL), tok.encode("It is 391.")
    batch = ScriptBatch([], Signals(), replies=deque([first, final]))
    params = [SamplingParams(max_new_tokens=256, temperature=1.0, seed=5)]
    (t,) = run_trajectories(batch, [prompt], 1, params, tok.im_end_id, turns, max_rounds=3)
    # By hand: the tool turn as the template writes it after the reply's <|im_end|>, then the generation prompt
    # (with thinking off, an empty think block).
    tool = tok.encode("\n<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
                      "<think>\n\n</think>\n\n")
    end = [tok.im_end_id]
    assert t.ids() == prompt + first + end + tool + final + end
    assert t.finished and t.finish == "stop" and t.replies == [CALL, "It is 391."]
    assert [c.name for c in t.calls[0]] == ["calculator"] and t.calls[1] == []
    # The continuation's prompt was everything so far.
    assert batch.signals.adds[1] == (prompt + first + end + tool, 1, 0)
    x, y = trajectory_rows([t])
    row = t.ids()
    assert x[0].tolist() == row[:-1]
    a = len(prompt)
    b = a + len(first) + 1 + len(tool)
    want = [IGNORE_INDEX] * (len(row) - 1)
    for k in list(range(a, a + len(first) + 1)) + list(range(b, b + len(final) + 1)):
        want[k - 1] = row[k]  # y[k - 1] is the target of token k
    assert y[0].tolist() == want
    targets = [row[k + 1] for k in range(len(row) - 1) if y[0, k] != IGNORE_INDEX]
    assert targets == first + end + final + end  # the model's tokens, nothing of the tool turn


def test_a_row_waiting_for_a_tool_does_not_delay_the_others(tok):
    turns = ToolTurns(tok, AgentTools.from_spec("builtin"), thinking=False)
    call, long_reply, final = tok.encode(CALL), list(range(100, 130)), tok.encode("391")
    batch = CountingBatch([], Signals(), replies=deque([call, long_reply, final]))
    params = [SamplingParams(max_new_tokens=256, temperature=1.0, seed=s) for s in (1, 2)]
    a, b = run_trajectories(batch, [prompt_ids(tok, "17*23?"), prompt_ids(tok, "hi")], 1, params, tok.im_end_id,
                            turns, max_rounds=3)
    # Row 1 (no call) makes a token at every step from the first; it ends at step 31 (its stop) either way.
    assert batch.made[1] == list(range(1, 31))
    # Row 0 called, ended at step len(call) + 1; its continuation (row 2) joined and decoded beside row 1.
    assert batch.made[0] == list(range(1, len(call) + 1))
    assert batch.made[2] == list(range(len(call) + 2, len(call) + 2 + len(final)))
    assert batch.steps == max(31, len(call) + 2 + len(final))
    assert a.finished and b.finished and b.replies == [tok.decode(long_reply)]


class Forced:
    """A guide that allows only the next token of `script` (then anything): the real engine writes a call."""

    def __init__(self, script: list[int], vocab: int) -> None:
        self.script, self.vocab, self.at = script, vocab, 0

    def allowed(self):
        if self.at >= len(self.script):
            return None
        mask = torch.zeros(self.vocab, dtype=torch.bool)
        mask[self.script[self.at]] = True
        return mask

    def advance(self, token: int) -> None:
        self.at += 1

    def fork(self):
        return Forced(self.script, self.vocab)


def test_on_the_real_engine_each_round_joins_the_batch_and_runs_out_of_rounds(tok):
    from server_helpers import tiny_model

    from nanolm.infer.engine import Engine
    engine = Engine(tiny_model(max_seq_len=2048))
    turns = ToolTurns(tok, AgentTools.from_spec("builtin"), thinking=False)
    prompt = prompt_ids(tok, "17*23?")
    call = tok.encode(CALL)
    guide = Forced(call + [tok.im_end_id], 400)  # every reply is the call: the trajectory runs out of rounds
    params = [SamplingParams(max_new_tokens=512, temperature=1.0, seed=3)]
    trajs = run_trajectories(engine.batch(), [prompt], 2, params, tok.im_end_id, turns, max_rounds=2,
                             guides=[guide])
    tool = turns.tokens(["391"])
    for t in trajs:
        assert t.ids() == prompt + call + [tok.im_end_id] + tool + call + [tok.im_end_id]
        assert not t.finished and len(t.replies) == 2
    agent = AgentSampler.sampled(trajs)
    assert agent.tokens[0] == call + [tok.im_end_id] + call + [tok.im_end_id]


def test_a_tool_turn_past_the_context_ends_the_trajectory_before_it(tok):
    """A call whose tool turn would carry the row past the model's context ends the trajectory at the call: the
    row holds what the model wrote and fits the model (a GRPO run at temperature 1.0 once failed on a 544-token
    row of a 512-token model, in the reference model's forward)."""
    from server_helpers import tiny_model

    from nanolm.infer.engine import Engine
    turns = ToolTurns(tok, AgentTools.from_spec("builtin"), thinking=False)
    prompt, call = prompt_ids(tok, "17*23?"), tok.encode(CALL)
    tool = turns.tokens(["391"])
    context = len(prompt) + len(call) + 1 + len(tool) - 1  # room for the call, one token short of its turn
    engine = Engine(tiny_model(max_seq_len=context))
    guide = Forced(call + [tok.im_end_id], 400)
    params = [SamplingParams(max_new_tokens=512, temperature=1.0, seed=3)]
    (t,) = run_trajectories(engine.batch(), [prompt], 1, params, tok.im_end_id, turns, max_rounds=2, guides=[guide])
    assert t.ids() == prompt + call + [tok.im_end_id]
    assert t.finish == "length" and not t.finished and t.replies == [CALL]
    x, y = trajectory_rows([t])
    assert x.shape[1] == len(t.ids()) - 1 < context
    assert engine.model(x).shape[1] == x.shape[1]  # the reference's forward of the row runs


def test_the_calculator_computes_and_user_functions_and_errors_answer(tmp_path):
    tools = AgentTools.from_spec("builtin")
    assert tools.run(ToolCall("calculator", '{"expression": "17*23"}')) == "391"
    assert tools.run(ToolCall("nope", "{}")).startswith("error: there is no tool named 'nope'")
    (tmp_path / "tools.json").write_text(
        '[{"type": "function", "function": {"name": "double", "parameters": {"type": "object", "properties": '
        '{"x": {"type": "integer"}}, "required": ["x"]}}}]')
    (tmp_path / "fns.py").write_text("def double(arguments):\n    return 2 * arguments['x']\n")
    mine = AgentTools.from_spec(f"builtin,{tmp_path / 'tools.json'},{tmp_path / 'fns.py'}:double")
    assert [t["function"]["name"] for t in mine.tools] == ["calculator", "current_time", "double"]
    assert mine.run(ToolCall("double", '{"x": 21}')) == "42"
    assert mine.run(ToolCall("double", '{"y": 1}')) == "error: KeyError: 'x'"


def test_the_finished_reward():
    r = Rewards.from_spec("finished:1.0,tool_call:1.0")
    done = Completion("It is 391.", CALL + "It is 391.", finished=True)
    cut = Completion("It is", CALL + "It is", finished=False)  # out of tokens
    rounds = Completion(CALL, CALL + CALL, finished=False)  # out of rounds: its last reply called
    totals, per = r.score(["q"] * 3, [done, cut, rounds], [{}] * 3)
    assert per == {"finished": [1.0, 0.0, 0.0], "tool_call": [1.0, 1.0, 1.0]}
    assert r.score(["q"], ["plain reply"], [{}])[1]["finished"] == [1.0]


def agent_cfg(prompts_dir, out, base, **over):  # noqa: F811
    return grpo_cfg(prompts_dir, out, base, **{
        "grpo.tools": "builtin", "grpo.max_rounds": 2, "grpo.max_new_tokens": 8, "model.max_seq_len": 1024,
        "grpo.rewards": "answer:1.0,tool_call:0.2,finished:0.2,length:0.5", **over})


def test_agentic_grpo_trains_and_logs_its_rewards(prompts_dir, base_run, tmp_path):  # noqa: F811
    from nanolm.train import stages
    cfg = agent_cfg(prompts_dir, tmp_path / "run", base_run)
    # the start-up line says what a trajectory is: the model's tokens over its replies, the tool turns untrained
    assert "(at most 8 tokens over up to 2 replies, calling tools builtin; tool results not trained)" in \
        stages.get("grpo").describe(cfg)
    res = train(cfg, quiet=True)
    assert res.step == 4
    steps = [r for r in read_metrics(tmp_path / "run") if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    keys = {"reward_answer", "reward_tool_call", "reward_finished", "reward_length", "loss", "completion_len"}
    assert all(keys <= r.keys() for r in steps)
    assert all(0 < r["completion_len"] for r in steps)


def test_agentic_grpo_resumes_as_the_uninterrupted_run(prompts_dir, base_run, tmp_path):  # noqa: F811
    over = {"grpo.inner_epochs": 2, "grpo.epsilon": 0.1}
    full = train(agent_cfg(prompts_dir, tmp_path / "full", base_run, **over), quiet=True)
    train(agent_cfg(prompts_dir, tmp_path / "part", base_run, **{**over, "train.max_steps": 2}), quiet=True)
    resumed = train(agent_cfg(prompts_dir, tmp_path / "part", base_run, **over), resume=True, quiet=True)
    assert full.step == resumed.step == 4
    assert same_weights(tmp_path / "full", tmp_path / "part")

