"""The generation engine: KV-cached decoding equals recomputation; sampling filters."""

import copy
import math
import re
import threading

import pytest
import torch
import torch.nn.functional as F

from nanolm.config import ModelConfig, SamplingParams
from nanolm.errors import UserError
from nanolm.infer.engine import Engine, Reply, run_to_end
from nanolm.infer.sampling import (Penalties, apply_penalties, greedy, nucleus,
                                   presence_frequency_penalty, repetition_penalty, sample_next, sample_rows)
from nanolm.infer import engine as engine_module, fuse
from nanolm.infer.fuse import SMALL_ROWS, DecodeLinear, FusedAttention, FusedMLP, decode_linear, fuse_projections
from nanolm.infer.rows import rows_model
from nanolm.model.transformer import Attention, KVCache, Transformer


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=61, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=64)
    return Transformer(cfg).eval()


def greedy_by_recompute(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_kv_cache_greedy_equals_full_recompute():
    model = _model()
    prompt = [3, 14, 15, 9, 26, 5]
    got = Engine(model).generate_all(prompt, SamplingParams(max_new_tokens=30, temperature=0))
    assert got == greedy_by_recompute(model, prompt, 30)


def test_stops_at_stop_token_and_at_context_end():
    model = _model()
    prompt = [1, 2, 3]
    full = Engine(model).generate_all(prompt, SamplingParams(max_new_tokens=20, temperature=0))
    stop = full[5]
    cut = Engine(model).generate_all(prompt, SamplingParams(max_new_tokens=20, temperature=0), stop_ids=[stop])
    assert cut == full[:full.index(stop)]
    long = Engine(model).generate_all(list(range(60)), SamplingParams(max_new_tokens=50, temperature=0))
    assert len(long) == 4  # the context is 64 tokens


def test_seeded_sampling_is_reproducible():
    model = _model()
    p = SamplingParams(max_new_tokens=20, temperature=1.0, top_k=10, top_p=0.9, seed=7)
    a = Engine(model).generate_all([5, 6], p)
    b = Engine(model).generate_all([5, 6], p)
    c = Engine(model).generate_all([5, 6], SamplingParams(max_new_tokens=20, temperature=1.0, seed=8))
    assert a == b and a != c


def _kept(logits, k=0, p=1.0):
    """The ids nucleus keeps of one row (weight > 0), and their weights normalised."""
    ids, w, _ = nucleus(torch.as_tensor(logits).reshape(1, -1), torch.tensor([k]), torch.tensor([p]))
    keep = w[0] > 0
    ranked = sorted(zip(ids[0][keep].tolist(), (w[0][keep] / w[0].sum()).tolist()), key=lambda t: -t[1])
    return [i for i, _ in ranked], [p for _, p in ranked]


def test_top_k_keeps_the_k_largest_and_their_ties():
    logits = [1.0, 5.0, 3.0, 4.0, 2.0]
    assert _kept(logits, k=2)[0] == [1, 3]
    assert _kept(logits, k=0)[0] == [1, 3, 2, 4, 0]  # no cut: every token, ranked
    assert _kept(logits, k=5)[0] == [1, 3, 2, 4, 0]
    assert _kept([1.0, 4.0, 3.0, 4.0, 3.0], k=2)[0] == [1, 3]
    assert sorted(_kept([1.0, 4.0, 3.0, 4.0, 3.0], k=3)[0]) == [1, 2, 3, 4]  # the tie with the 3rd is kept
    ids, w = _kept([0.0, math.log(3.0), float("-inf"), math.log(2.0)])
    assert ids == [1, 3, 0] and w == pytest.approx([0.5, 1 / 3, 1 / 6])  # a masked token is no candidate


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert _kept(logits, p=0.79)[0] == [0, 1]  # 0.5 alone < 0.79; 0.5 + 0.3 reaches it
    assert _kept(logits, p=0.81)[0] == [0, 1, 2]
    assert _kept(logits, p=0.1)[0] == [0]  # the most likely is always kept
    assert _kept(logits, p=1.0)[0] == [0, 1, 2, 3]
    assert _kept(logits, k=3, p=0.9)[0] == [0, 1, 2]  # top-p measures the mass top-k kept: 0.8 is 0.84 of 0.95
    assert _kept(logits, k=3, p=0.84)[0] == [0, 1]
    masked = logits.tolist() + [float("-inf")]
    assert _kept(masked, k=2, p=0.6)[0] == [0]  # 0.5 is 0.625 of the two kept tokens' 0.8
    assert _kept(masked, k=2, p=0.65)[0] == [0, 1]


def test_a_draw_follows_the_row_distribution():
    """4,000 draws of one row: each token's share within 4.5 standard errors of its probability; cut tokens
    never drawn."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().reshape(1, -1)
    g = torch.Generator().manual_seed(0)
    n = 4000
    draws = [int(sample_next(logits, SamplingParams(temperature=1.0, top_k=0, top_p=1.0), g)) for _ in range(n)]
    share = torch.bincount(torch.tensor(draws), minlength=4).double() / n
    assert ((share - probs).abs() <= 4.5 * (probs * (1 - probs) / n).sqrt()).all(), share.tolist()
    cut = {int(sample_next(logits, SamplingParams(temperature=1.0, top_k=0, top_p=0.79), g)) for _ in range(300)}
    assert cut == {0, 1}


def test_a_draw_without_a_cut_skips_masked_tokens_and_follows_the_rest():
    """No top-k, top-p 1 (how RL's rollouts sample), a guide's -inf on two ids: 4,000 draws of each row of a batch
    land on the unmasked ids, in shares within 4.5 standard errors of their probabilities, and a row's draws are
    those it makes alone."""
    probs = torch.tensor([0.4, 0.0, 0.3, 0.2, 0.0, 0.1])
    logits = probs.log().reshape(1, -1).repeat(3, 1)
    logits[2] = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])  # a row without a mask beside them
    n = 4000
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    draws = torch.stack([sample_rows(logits, torch.ones(3), torch.zeros(3, dtype=torch.long), torch.ones(3), gens)
                         for _ in range(n)])  # (n, 3)
    for row in (0, 1):
        share = torch.bincount(draws[:, row], minlength=6).double() / n
        assert share[1] == 0 and share[4] == 0
        assert ((share - probs).abs() <= 4.5 * (probs * (1 - probs) / n).sqrt()).all(), share.tolist()
    alone = torch.Generator().manual_seed(1)
    assert [int(sample_next(logits[1:2], params, alone)) for _ in range(n)] == draws[:, 1].tolist()


@pytest.mark.parametrize("rows,vocab", [(1, 6400), (16, 6400), (40, 1024), (8, 4100), (64, 128), (5, 6401)])
def test_greedy_is_the_first_argmax(rows, vocab):
    """greedy (blocked on a CPU for many rows: 16 x 6,400 and 40 x 1,024 here) equals torch.argmax, ties
    included: the first maximum wins."""
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows))
    x[:, vocab // 3] = x[:, vocab - 2] = x.amax(dim=-1) + 1.0  # two tied maxima, in different blocks
    x[-1] = 0.0  # a row all tied
    assert torch.equal(greedy(x), x.argmax(dim=-1))
    assert torch.equal(greedy(x)[:-1], torch.full((rows - 1,), vocab // 3))


def test_sampling_respects_filters():
    logits = torch.tensor([[0.0, 10.0, 9.0, -5.0]])
    g = torch.Generator().manual_seed(0)
    picks = {int(sample_next(logits, SamplingParams(temperature=2.0, top_k=2), g)) for _ in range(200)}
    assert picks == {1, 2}
    assert int(sample_next(logits, SamplingParams(temperature=0), g)) == 1


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(top_k=-1), dict(max_new_tokens=-1),
                                dict(temperature=float("nan")), dict(top_p=1.5), dict(top_k=2.5), dict(top_k=True),
                                dict(max_new_tokens="5"), dict(seed=2**64), dict(seed=-2**63 - 1), dict(seed=1.0),
                                dict(repetition_penalty=0), dict(repetition_penalty=11.0),
                                dict(presence_penalty=2.5), dict(frequency_penalty=-2.01),
                                dict(frequency_penalty=float("inf"))])
def test_bad_sampling_params(kw):
    (field, value), = kw.items()
    with pytest.raises(UserError, match=rf"^{field} must be .*, got {re.escape(repr(value))}$"):
        SamplingParams(**kw)


def test_one_set_of_sampling_defaults():
    """The defaults generate, chat, the server and the quickstart all take (tuned for small models)."""
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_k, p.top_p, p.seed) == (256, 0.8, 50, 0.95, None)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)  # off
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1 and SamplingParams(seed=-2**63).seed == -2**63
    assert SamplingParams(temperature=1, top_p=1).top_p == 1  # integers are numbers too


SETTINGS = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_k=5),
            dict(temperature=1.3, top_p=0.6), dict(temperature=0.9, top_k=12, top_p=0.8),
            dict(temperature=1.0, top_k=1), dict(temperature=2.0, top_k=200, top_p=0.999),
            dict(temperature=0.8, repetition_penalty=1.7), dict(temperature=0.0, presence_penalty=1.5),
            dict(temperature=1.1, frequency_penalty=0.7, presence_penalty=-0.5, repetition_penalty=0.8)]


def test_rows_sampled_together_draw_what_each_draws_alone():
    """Ten rows, each with its own temperature, top-k, top-p, penalties and seed, sampled as one batch for 25
    steps: every row's tokens and penalised logits are exactly those it gets sampled alone."""
    vocab = 40
    gen = torch.Generator().manual_seed(3)
    steps = [torch.randn(len(SETTINGS), vocab, generator=gen) * 2 for _ in range(25)]

    def rows(indices):
        params = [SamplingParams(**SETTINGS[i], seed=50 + i) for i in indices]
        pens = [Penalties(p, [i, i + 1, 2 * i], vocab, torch.device("cpu")) for i, p in zip(indices, params)]
        gens = [torch.Generator().manual_seed(p.seed) for p in params]
        return params, pens, gens

    def run(indices):
        params, pens, gens = rows(indices)
        drawn, seen = [], []
        for logits in steps:
            x = apply_penalties(logits[indices], pens)
            ids = sample_rows(x, torch.tensor([p.temperature for p in params]),
                              torch.tensor([p.top_k for p in params]), torch.tensor([p.top_p for p in params]), gens)
            for pen, t in zip(pens, ids.tolist()):
                pen.add(t)
            drawn.append(ids.tolist())
            seen.append(x)
        return drawn, seen

    together, logits_together = run(list(range(len(SETTINGS))))
    for i in range(len(SETTINGS)):
        alone, logits_alone = run([i])
        assert [step[i] for step in together] == [step[0] for step in alone], SETTINGS[i]
        assert all(torch.equal(a[i], b[0]) for a, b in zip(logits_together, logits_alone))
    assert len({tuple(step[i] for step in together) for i in range(len(SETTINGS))}) == len(SETTINGS)


def test_the_nucleus_of_rows_together_is_each_rows_alone():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(1))
    logits[4, ::2] = float("-inf")
    k, p = torch.tensor([0, 3, 30, 1, 0]), torch.tensor([1.0, 0.5, 0.9, 0.2, 0.7])
    ids, w, counts = nucleus(logits, k, p)
    assert counts.tolist() == [30, 3, 30, 1, 15]
    for i in range(5):
        one_ids, one_w, one_count = nucleus(logits[i:i + 1], k[i:i + 1], p[i:i + 1])
        n = int(one_count)
        assert torch.equal(ids[i, :n], one_ids[0, :n]) and torch.equal(w[i, :n], one_w[0, :n])
        assert (w[i, n:] == 0).all()


def _nucleus_by_hand(row: list[float], k: int, p: float) -> tuple[list[int], list[float]]:
    """One row's candidates in id order and their weights, by the rule nucleus documents, in plain Python."""
    kth = sorted(row, reverse=True)[k - 1] if 0 < k < len(row) else float("-inf")
    ranked = sorted((i for i, x in enumerate(row) if x >= kth and x > float("-inf")), key=lambda i: (-row[i], i))
    top = row[ranked[0]]
    weights = {i: math.exp(row[i] - top) for i in ranked}
    total, above, kept = sum(weights.values()), 0.0, {}
    for i in ranked:
        kept[i] = weights[i] if p >= 1.0 or above / total < p else 0.0
        above += weights[i]
    return sorted(kept), [kept[i] for i in sorted(kept)]


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("k", [[3, 5, 10, 12, 1, 7], [6] * 6, [0, 0, 40, 0, 0, 0]])
@pytest.mark.parametrize("tempered", [False, True])
def test_nucleus_ranks_by_logit_then_id(ties, k, tempered):
    """Top-k and top-p of rows without and with tied logits (which nucleus ranks by id itself), with one k or a k
    per row or none, untempered or tempered, equal the documented rule computed by hand on the tempered logits."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 40, generator=g)
    if ties:
        logits[:, 20:30] = logits[:, 0:10]  # every row's values twice
    k, p = torch.tensor(k), torch.tensor([1.0, 0.6, 0.9, 0.3, 1.0, 0.95])
    t = torch.tensor([0.5, 1.0, 1.7, 0.3, 2.0, 0.9]) if tempered else None
    ids, w, counts = nucleus(logits, k, p, t)
    x = logits / t.unsqueeze(-1) if tempered else logits
    for i in range(6):
        want_ids, want_w = _nucleus_by_hand(x[i].tolist(), int(k[i]), float(p[i]))
        n = int(counts[i])
        assert ids[i, :n].tolist() == want_ids
        assert w[i, :n].tolist() == pytest.approx(want_w, rel=1e-6)


# ----------------------------------------------------------------------------- penalties

def test_repetition_penalty_exact():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 4.0]])
    seen = torch.tensor([[True, True, False, False, True]])
    got = repetition_penalty(logits, seen, 2.0)
    assert got.tolist() == [[1.0, -2.0, 0.5, -3.0, 2.0]]  # positive / 2, negative x 2, unseen unchanged
    assert repetition_penalty(logits, seen, 0.5).tolist() == [[4.0, -0.5, 0.5, -3.0, 8.0]]  # < 1 favours them
    assert repetition_penalty(logits, seen, 1.0) is logits


def test_presence_and_frequency_penalties_exact():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    counts = torch.tensor([[0.0, 1.0, 3.0, 0.0]])
    got = presence_frequency_penalty(logits, counts, 0.5, 0.25)
    assert got.tolist() == [[1.0, 1.0 - 0.5 - 0.25, 1.0 - 0.5 - 0.75, 1.0]]
    assert presence_frequency_penalty(logits, counts, -1.0, 0.0).tolist() == [[1.0, 2.0, 2.0, 1.0]]
    assert presence_frequency_penalty(logits, counts, 0.0, 0.0) is logits


def test_penalties_count_the_prompt_for_repetition_and_only_the_reply_for_openai():
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.5)
    pen = Penalties(p, [0, 0, 2], vocab_size=4, device=torch.device("cpu"))
    logits = torch.tensor([[4.0, 4.0, 4.0, 4.0]])
    assert pen.apply(logits).tolist() == [[2.0, 4.0, 2.0, 4.0]]  # prompt tokens 0 and 2: repetition only
    pen.add(1)
    pen.add(1)
    assert pen.apply(logits).tolist() == [[2.0, 2.0 - 1.0 - 1.0, 2.0, 4.0]]  # token 1: seen, twice in the reply
    assert not Penalties(SamplingParams(), [0], 4, torch.device("cpu")).active


def test_greedy_decoding_takes_the_argmax_of_the_penalised_logits():
    """Each token the engine picks is the argmax of the model's logits (recomputed without a cache) after the
    penalties computed from the history by hand."""
    model = _varied_model()
    prompt = [3, 14, 15, 9]
    params = SamplingParams(max_new_tokens=25, temperature=0, repetition_penalty=1.3, presence_penalty=0.4,
                            frequency_penalty=0.3)
    got = Engine(model).generate_all(prompt, params)
    plain = Engine(model).generate_all(prompt, SamplingParams(max_new_tokens=25, temperature=0))
    assert got != plain  # the penalties change this reply
    ids = list(prompt)
    with torch.no_grad():
        for tid in got:
            logits = model(torch.tensor([ids]))[0, -1]
            reply = ids[len(prompt):]
            for t in set(ids):
                logits[t] = logits[t] / 1.3 if logits[t] > 0 else logits[t] * 1.3
            for t in set(reply):
                logits[t] -= 0.4 + 0.3 * reply.count(t)
            assert tid == int(logits.argmax())
            ids.append(tid)


# ----------------------------------------------------------------------------- many rows at once

def _varied_model(seed=0):
    """Weights large enough that greedy replies wander instead of repeating the prompt's last token."""
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=61, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=64, init_std=0.3)
    return Transformer(cfg).eval()


def _prompts():
    return [[3, 14, 15], list(range(5, 30)), [7], list(range(40, 52)), [9, 9, 9, 9, 9, 2]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_decoded_together_equal_each_alone(dtype, temperature):
    """Prompts of different lengths, each row with its own params and seed, some ending early on a stop id or a
    smaller budget: every row's tokens are the tokens it gets alone."""
    engine = Engine(_varied_model(), dtype=dtype)
    prompts = _prompts()
    params = [SamplingParams(max_new_tokens=12 + 5 * i, temperature=temperature, top_k=20 if i % 2 else 0,
                             top_p=0.9 if i == 3 else 1.0, seed=100 + i,
                             repetition_penalty=1.2 if i == 4 else 1.0) for i in range(len(prompts))]
    alone = [engine.generate_all(p, sp) for p, sp in zip(prompts, params)]
    cut = next(i for i in range(3, len(alone[1])) if alone[1][i] not in alone[1][:i])
    stop = alone[1][cut]  # row 1 ends early on a stop id
    alone[1] = engine.generate_all(prompts[1], params[1], stop_ids=[stop])
    assert len(alone[1]) == cut
    batch = engine.batch()
    rows = [batch.add(p, sp, stop_ids=[stop] if i == 1 else ())[0] for i, (p, sp) in enumerate(zip(prompts, params))]
    got = {r: [] for r in rows}
    finish = {}
    while batch:
        for out in batch.step():
            if out.token is not None:
                got[out.row].append(out.token)
            if out.finish is not None:
                finish[out.row] = out.finish
    assert [got[r] for r in rows] == alone
    assert finish == {r: "stop" if i == 1 else "length" for i, r in enumerate(rows)}


@pytest.mark.parametrize("limit, forwards", [(8192, 1), (30, 4)])
def test_prompts_added_together_are_prefilled_together(monkeypatch, limit, forwards):
    """Prompts of different lengths added before a step are prefilled in one right-padded forward (in as many as
    PREFILL_TOKENS allows: prompts of 3, 25, 1, 12 and 6 tokens within 30 padded positions take 4), and every
    row makes the tokens it makes alone."""
    monkeypatch.setattr(engine_module, "PREFILL_TOKENS", limit)
    engine = Engine(_varied_model())
    prompts = _prompts()
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    alone = [engine.generate_all(p, params) for p in prompts]
    prefills = []
    hook = engine.model.register_forward_pre_hook(
        lambda _m, args, kwargs: prefills.append(args[0].shape[0]) if "last" in kwargs else None, with_kwargs=True)
    try:
        got = engine.generate_many(prompts, params)
    finally:
        hook.remove()
    assert got == alone
    assert len(prefills) == forwards and sum(prefills) == len(prompts)


def test_logits_at_the_last_positions_only():
    model = _varied_model()
    x = torch.randint(0, 61, (3, 9), generator=torch.Generator().manual_seed(2))
    last = torch.tensor([8, 0, 4])
    with torch.no_grad():
        full, picked = model(x), model(x, last=last)
    assert picked.shape == (3, 1, 61)
    torch.testing.assert_close(picked[:, 0], full[torch.arange(3), last], rtol=1e-6, atol=1e-6)


def test_a_prompt_outside_the_vocabulary_is_refused_when_added():
    batch = Engine(_varied_model()).batch()
    with pytest.raises(ValueError, match="token id 61, outside the model's vocabulary of 61"):
        batch.add([3, 61, 4], SamplingParams())
    assert len(batch) == 0


def test_rows_join_and_leave_between_steps():
    """Rows added while others decode, and rows cancelled mid-way, leave every other row's tokens as they are
    alone; a cancelled row makes no more tokens and its cache rows are freed."""
    engine = Engine(_varied_model())
    prompts = _prompts()
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=5)
    alone = [engine.generate_all(p, params) for p in prompts]
    batch = engine.batch()
    got: dict[int, list[int]] = {}
    ids = {}
    ids[0] = batch.add(prompts[0], params)[0]
    for step in range(40):
        if step == 3:
            ids[1] = batch.add(prompts[1], params)[0]
            ids[2] = batch.add(prompts[2], params)[0]
        if step == 7:
            ids[3] = batch.add(prompts[3], params)[0]
        if step == 9:
            batch.cancel(ids[2])
        if step == 12:
            ids[4] = batch.add(prompts[4], params)[0]
        for out in batch.step():
            assert out.row != ids.get(2) or step < 9
            if out.token is not None:
                got.setdefault(out.row, []).append(out.token)
        if step == 10:
            assert batch._cache.k[0].shape[0] == len(batch) == 3  # rows 0, 1 and 3: row 2 is gone
    assert not batch
    assert [got[ids[i]] for i in (0, 1, 3, 4)] == [alone[i] for i in (0, 1, 3, 4)]
    assert got[ids[2]] == alone[2][:len(got[ids[2]])] and len(got[ids[2]]) == 6  # steps 3..8 drew 6 tokens


def test_rows_leaving_from_the_middle_and_a_grown_cache_keep_every_row_as_alone():
    """Rows that end at once from the front and middle of the batch give their places to the last rows (whose
    filled positions move), and a later row needing more positions than the batch's buffers grows them while
    rows decode: every row's tokens are still its tokens alone, and the cache holds the running rows only."""
    engine = Engine(_varied_model())
    prompts = [[3, 14, 15], list(range(5, 30)), [7], list(range(40, 52)), [9, 9, 9, 9, 9, 2], list(range(1, 21))]
    budgets = [4, 30, 4, 25, 6, 40]  # rows 0, 2 and 4 end early, the rows after them move into their places
    params = [SamplingParams(max_new_tokens=b, temperature=1.0, seed=40 + i) for i, b in enumerate(budgets)]
    alone = [engine.generate_all(p, q) for p, q in zip(prompts, params)]
    batch = engine.batch()
    got: dict[int, list[int]] = {}
    ids = {i: batch.add(prompts[i], params[i])[0] for i in range(5)}
    for step in range(60):
        if step == 8:  # 20 + 40 positions: more than any row so far asked for
            ids[5] = batch.add(prompts[5], params[5])[0]
            assert batch._k_buf[0].shape[2] < 60
        for out in batch.step():
            if out.token is not None:
                got.setdefault(out.row, []).append(out.token)
        if step == 8:
            assert batch._k_buf[0].shape[2] >= 60 and batch._cache.k[0].shape[0] == len(batch) == 3
    assert not batch
    assert [got[ids[i]] for i in range(6)] == alone


def test_n_samples_share_one_prefill():
    """n samples of one prompt cost one prefill; sample 0 draws as the seed alone, sample i as seed + i."""
    engine = Engine(_varied_model())
    prompt = list(range(10, 30))
    prefills = []
    hook = engine.model.register_forward_pre_hook(lambda _m, args: prefills.append(args[0].shape[1] > 1))
    try:
        replies = engine.generate_many([prompt], SamplingParams(max_new_tokens=15, temperature=1.0, seed=11), n=4)
    finally:
        hook.remove()
    assert sum(prefills) == 1 and len(prefills) == 15  # one prefill, then one forward per step for all 4
    assert len({tuple(r) for r in replies}) == 4
    for i, reply in enumerate(replies):
        assert reply == engine.generate_all(prompt, SamplingParams(max_new_tokens=15, temperature=1.0, seed=11 + i))


def test_samples_added_in_parts_draw_as_if_added_at_once():
    """The server starts a request's choices in parts when others wait: sample first + i draws with seed +
    first + i, so the parts give the samples of one add of all n."""
    engine = Engine(_varied_model())
    prompt, params = list(range(10, 30)), SamplingParams(max_new_tokens=12, temperature=1.0, seed=5)
    whole = engine.generate_many([prompt], params, n=4)
    batch = engine.batch()
    rows = batch.add(prompt, params, n=2) + batch.add(prompt, params, n=1, first=2) + \
        batch.add(prompt, params, n=1, first=3)
    got = {r: [] for r in rows}
    while batch:
        for out in batch.step():
            got[out.row] += [out.token] if out.token is not None else []
    assert [got[r] for r in rows] == whole


def test_a_row_at_the_end_of_the_context_ends_alone():
    engine = Engine(_varied_model())  # context 64
    batch = engine.batch()
    short = batch.add(list(range(60)), SamplingParams(max_new_tokens=50, temperature=0))[0]
    other = batch.add([1, 2], SamplingParams(max_new_tokens=10, temperature=0))[0]
    got = {short: [], other: []}
    finishes = {}
    while batch:
        for out in batch.step():
            got[out.row] += [out.token] if out.token is not None else []
            if out.finish:
                finishes[out.row] = out.finish
    assert len(got[short]) == 4 and len(got[other]) == 10 and finishes == {short: "length", other: "length"}
    assert got[other] == engine.generate_all([1, 2], SamplingParams(max_new_tokens=10, temperature=0))


def test_the_one_driver_runs_rows_to_their_end_with_why_they_ended():
    """run_to_end: a row ending on a stop id ("stop", the id not in its tokens), on its budget ("length"), at the
    context's end ("length"), or where `until` says ("stop"), each with the tokens it makes alone; refill keeps
    at most two rows decoding and adds the rest as rows end."""
    engine = Engine(_varied_model())  # context 64
    greedy = SamplingParams(max_new_tokens=9, temperature=0)
    free = engine.generate_all([5, 6, 7], greedy)
    stop = free[4]
    prompts = [([5, 6, 7], [stop]), ([1, 2], []), (list(range(58)), []), ([9, 3], [])]
    assert engine.replies([p for p, _ in prompts[:1]], greedy, [stop]) == [Reply(free[:free.index(stop)], "stop")]
    batch = engine.batch()
    pending = list(range(len(prompts)))
    index, most = {}, []

    def refill(live):
        most.append(live)
        added = []
        while pending and live + len(added) < 2:
            i = pending.pop(0)
            (row,) = batch.add(prompts[i][0], greedy, prompts[i][1])
            index[row] = i
            added.append(row)
        return added

    replies = run_to_end(batch, refill=refill, until=lambda row, toks: index[row] == 3 and len(toks) == 2)
    got = {index[r]: rep for r, rep in replies.items()}
    assert got[0] == Reply(free[:free.index(stop)], "stop")
    assert got[1] == Reply(engine.generate_all([1, 2], greedy), "length") and len(got[1].tokens) == 9
    assert got[2] == Reply(engine.generate_all(list(range(58)), greedy), "length") and len(got[2].tokens) == 6
    assert got[3] == Reply(engine.generate_all([9, 3], greedy)[:2], "stop")
    assert max(most) <= 2 and not pending


def test_logprobs_are_the_models_own_distribution():
    """A row's log-probabilities, decoded beside another row, equal log_softmax of the model's logits recomputed
    without a cache (before the penalties and the temperature), and the top list is sorted and holds the token."""
    model = _varied_model()
    engine = Engine(model)
    prompt = [4, 8, 15, 16, 23]
    batch = engine.batch()
    row = batch.add(prompt, SamplingParams(max_new_tokens=8, temperature=0.7, seed=1, repetition_penalty=1.5),
                    logprobs=3)[0]
    batch.add(list(range(30)), SamplingParams(max_new_tokens=8, temperature=0))
    ids = list(prompt)
    while batch:
        for out in batch.step():
            if out.row != row or out.token is None:
                continue
            with torch.no_grad():
                want = torch.log_softmax(model(torch.tensor([ids]))[0, -1], dim=-1)
            assert out.logprob == pytest.approx(float(want[out.token]), abs=1e-5)
            assert [t for t, _ in out.top_logprobs] == want.topk(3).indices.tolist()
            assert [lp for _, lp in out.top_logprobs] == pytest.approx(want.topk(3).values.tolist(), abs=1e-5)
            ids.append(out.token)
    assert len(ids) == len(prompt) + 8


# ----------------------------------------------------------------------------- fused projections

@pytest.mark.parametrize("rows", [1, 2, 5, SMALL_ROWS, SMALL_ROWS + 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("right", [True, False])  # both forms, whichever this CPU takes
def test_decode_linear_is_the_linear_product(rows, dtype, right, monkeypatch):
    monkeypatch.setattr(fuse, "ROWS_ON_THE_RIGHT", right)
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 32, generator=g).to(dtype)
    x = torch.randn(rows, 1, 32, generator=g).to(dtype)
    got = decode_linear(x, w)
    assert got.shape == (rows, 1, 48) and got.is_contiguous()
    assert torch.equal(decode_linear(x, w, right=right), got)  # the form asked for, whatever the CPU's rule
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), (x.double() @ w.double().T).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_products_of_many_rows_widen_to_float32_without_native_kernels(native, dtype, monkeypatch):
    """Without oneDNN's bf16 (fp16) products (an AVX2 CPU), a product of more than HALF_ROWS rows multiplies float32
    copies of the weight and rows, the result in their dtype; fewer rows, or a CPU with them, take F.linear as it
    is."""
    monkeypatch.setattr(fuse, "HALF_NATIVE", {torch.bfloat16: native, torch.float16: native})
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(48, 32, generator=g).to(dtype), torch.randn(48, generator=g).to(dtype)
    for rows in (1, fuse.HALF_ROWS, fuse.HALF_ROWS + 1, SMALL_ROWS + 7):
        x = torch.randn(rows, 1, 32, generator=g).to(dtype)
        got = decode_linear(x, w, b, right=False)
        assert got.dtype == dtype and got.shape == (rows, 1, 48)
        widened = rows > fuse.HALF_ROWS and not native
        want = F.linear(x.float(), w.float(), b.float()).to(dtype) if widened else F.linear(x, w, b)
        assert torch.equal(got, want), rows
    # float32 weights are never widened, whatever the table says
    x = torch.randn(9, 1, 32, generator=g)
    assert torch.equal(decode_linear(x, w.float(), right=False), F.linear(x, w.float()))
    # a PyTorch without oneDNN's check keeps its own kernels: nothing is widened
    assert fuse._onednn_has("_no_such_check") is True


@pytest.mark.parametrize("dtype,native", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)])
def test_the_server_keeps_the_product_form_it_timed_faster(dtype, native, monkeypatch):
    """Engine.time_products times both forms of the few-row products and sets every product module to the faster;
    bf16 keeps F.linear where the CPU multiplies it natively (the form is float32's) and is timed where its
    products widen to float32; either form decodes 16 float32 rows as the model computes them."""
    monkeypatch.setattr(fuse, "HALF_NATIVE", {torch.bfloat16: native, torch.float16: native})
    model = _model()
    engine = Engine(model, dtype=dtype)
    products = [m for m in engine.model.modules() if isinstance(m, (DecodeLinear, FusedAttention, FusedMLP))]
    assert len(products) == 2 * 2 + 2 * 2 + 1  # per layer: o_proj, down_proj, the fused attention and MLP; the head
    assert all(m.rows_on_the_right is None for m in products)  # until timed: the CPU's rule
    said = engine.time_products()
    if dtype == torch.bfloat16 and native:
        assert said == "F.linear (the rows' form applies to float32 on a CPU only)"
        assert all(m.rows_on_the_right is None for m in products)
        return
    right = said.startswith("16-row products as (W @ x.T).T")
    assert re.fullmatch(r"16-row products as (\(W @ x\.T\)\.T|F\.linear): a pass took [\d.]+ ms with the rows on "
                        r"the right, [\d.]+ ms with F\.linear", said)
    assert all(m.rows_on_the_right is right for m in products)
    if dtype == torch.bfloat16:
        return
    right = said.startswith("16-row products as (W @ x.T).T")
    assert re.fullmatch(r"16-row products as (\(W @ x\.T\)\.T|F\.linear): a pass took [\d.]+ ms with the rows on "
                        r"the right, [\d.]+ ms with F\.linear", said)
    assert all(m.rows_on_the_right is right for m in products)
    prompts = [[5 + i, 7, 9 + i] for i in range(16)]
    params = SamplingParams(max_new_tokens=6, temperature=0)
    for form in (True, False):
        for m in products:
            m.rows_on_the_right = form
        assert engine.generate_many(prompts, params) == [greedy_by_recompute(model, p, 6) for p in prompts]


def test_a_compiled_decode_step_decodes_what_the_copy_does():
    """compile_decode compiles the one-row and the many-row step at once (the compile paid before any request),
    and then rows of different lengths, each with its own params and seed, sampled together (and joining as others
    leave) make the tokens each makes alone with an uncompiled engine; keep_faster keeps it only where it timed
    faster, and says so."""
    model = _varied_model()
    engine, eager = Engine(model), Engine(model)
    said = engine.compile_decode(rows=4, steps=4, keep_faster=False)
    assert re.fullmatch(r"the decode step compiled in \d+ s", said) and engine._compiled is not None
    prompts = _prompts()
    params = [SamplingParams(max_new_tokens=10 + 3 * i, temperature=1.0 if i % 2 else 0.0, top_k=20 if i != 2 else 0,
                             top_p=0.9 if i == 3 else 1.0, seed=200 + i) for i in range(len(prompts))]
    alone = [eager.generate_all(p, sp) for p, sp in zip(prompts, params)]
    compiled, rows = engine._compiled, []
    engine._compiled = lambda x, cache: rows.append(x.shape[0]) or compiled(x, cache)
    assert engine.generate_many(prompts, params) == alone
    assert engine.generate_all(prompts[1], params[1]) == alone[1]
    assert 1 in rows and len(prompts) in rows  # both paths, one row and many, decoded compiled
    engine._compiled = compiled
    got = []  # the server's worker runs the step compiled at start-up on a thread of its own
    worker = threading.Thread(target=lambda: got.append(engine.generate_many(prompts, params)))
    worker.start()
    worker.join(120)
    assert got == [alone]
    # RL's rollouts refresh the copy's weights in place each step (load_weights): the compiled step decodes with
    # the new ones, as an uncompiled engine of them does.
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for i, p in enumerate(moved.parameters()):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.5)
    engine.load_weights(moved)
    want = [Engine(moved).generate_all(p, sp) for p, sp in zip(prompts, params)]
    assert want != alone and engine.generate_many(prompts, params) == want
    engine.load_weights(model)
    said = engine.compile_decode(rows=4, steps=4)
    m = re.fullmatch(r"the decode step (compiled|left uncompiled) \(compiled in \d+ s\): a step of 4 rows plus one "
                     r"of 1 row took ([\d.]+) ms compiled, ([\d.]+) ms as it is", said)
    assert m and (engine._compiled is not None) == (m[1] == "compiled")
    assert float(m[2]) <= float(m[3]) if m[1] == "compiled" else float(m[2]) >= float(m[3])
    assert engine.generate_many(prompts, params) == alone


def test_a_compiled_step_that_fails_later_is_dropped_and_the_step_runs_again(capsys):
    """A compiled step that raises mid-way (after it moved the rows' lengths) is dropped with one line on stderr;
    the step runs again uncompiled from the cache as it was, and every row makes the tokens it makes alone."""
    model = _varied_model()
    engine, eager = Engine(model), Engine(model)
    prompts = _prompts()[:4]
    params = [SamplingParams(max_new_tokens=8, temperature=1.0, seed=300 + i) for i in range(len(prompts))]
    alone = [eager.generate_all(p, sp) for p, sp in zip(prompts, params)]
    calls = []

    def flaky(x, cache):
        calls.append(x.shape[0])
        if len(calls) == 3:  # the third step: the model runs, then the step fails after it
            engine.model(x, cache)
            raise RuntimeError("a shape inductor could not compile")
        return engine.model(x, cache)

    engine._compiled = flaky
    assert engine.generate_many(prompts, params) == alone
    assert len(calls) == 3 and engine._compiled is None
    assert capsys.readouterr().err == ("the compiled decode step failed (RuntimeError: a shape inductor could not "
                                       "compile); decoding uncompiled from now on\n")


def test_a_decode_step_that_fails_to_compile_is_left_as_it_was(monkeypatch):
    """Without a working compiler the engine says why and decodes as before."""
    def broken(model, **kw):
        def run(*a, **k):
            raise RuntimeError("no C++ compiler found")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    engine = Engine(_varied_model())
    said = engine.compile_decode(rows=3, steps=2)
    assert said == "the decode step left uncompiled: torch.compile failed (RuntimeError: no C++ compiler found)"
    assert engine._compiled is None
    prompts = _prompts()[:3]
    greedy = SamplingParams(max_new_tokens=5, temperature=0)
    assert engine.generate_many(prompts, greedy) == [greedy_by_recompute(engine.model, p, 5) for p in prompts]


def test_fused_projections_give_the_separate_products_without_a_copy():
    model = _model()
    plain = copy.deepcopy(model)
    o_proj, down_proj = model.layers[0].self_attn.o_proj, model.layers[0].mlp.down_proj
    assert fuse_projections(model) == 2 * 2  # each layer's attention and MLP
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert type(attn) is FusedAttention and type(mlp) is FusedMLP
    ref_attn, ref_mlp = plain.layers[0].self_attn, plain.layers[0].mlp
    assert torch.equal(attn.qkv_weight, torch.cat([ref_attn.q_proj.weight, ref_attn.k_proj.weight,
                                                   ref_attn.v_proj.weight]))
    assert torch.equal(mlp.gate_up_weight, torch.cat([ref_mlp.gate_proj.weight, ref_mlp.up_proj.weight]))
    # The fused matrices are the only copy of those weights: the separate ones are gone, nothing is held twice.
    assert not any(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj"))
    assert not any(hasattr(mlp, n) for n in ("gate_proj", "up_proj"))
    assert mlp.gate_up_weight.untyped_storage().nbytes() == 2 * ref_mlp.up_proj.weight.numel() * 4
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in plain.parameters())
    # The other products keep their weights (no copy; the tied LM head stays tied) and compute as decode_linear.
    assert attn.o_proj.weight is o_proj.weight and mlp.down_proj.weight is down_proj.weight and not attn.training
    assert type(attn.o_proj) is DecodeLinear and type(model.lm_head) is DecodeLinear
    assert model.lm_head.weight is model.embed_tokens.weight
    x = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), rtol=1e-6, atol=1e-6)
    prompt = [3, 14, 15, 9, 26, 5]
    engine = Engine(plain)
    assert sum(type(m) in (FusedAttention, FusedMLP) for m in engine.model.modules()) == 2 * 2
    assert (engine.generate_all(prompt, SamplingParams(max_new_tokens=30, temperature=0))
            == greedy_by_recompute(plain, prompt, 30))


def test_fused_modules_load_the_models_layout_and_convert_like_any_module():
    model, plain = _model(), _model(seed=1)
    fuse_projections(model)
    fused_storage = model.layers[1].self_attn.qkv_weight.untyped_storage().data_ptr()
    # The model's own state_dict loads strictly into the fused matrices, in place.
    model.load_state_dict(plain.state_dict())
    assert model.layers[1].self_attn.qkv_weight.untyped_storage().data_ptr() == fused_storage
    assert torch.equal(model.layers[1].self_attn.qkv_weight[-8:], plain.layers[1].self_attn.v_proj.weight[-8:])
    x = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), rtol=1e-6, atol=1e-6)
    # A layout without one of the stacked weights is refused, naming the fused matrix it would fill.
    partial = {k: v for k, v in plain.state_dict().items() if k != "layers.0.mlp.up_proj.weight"}
    with pytest.raises(RuntimeError, match="layers.0.mlp.gate_up_weight"):
        model.load_state_dict(partial)
    # A dtype change converts the fused matrices with the rest: nothing goes stale.
    model.double()
    plain.double()
    assert model.layers[0].mlp.gate_up_weight.dtype == torch.float64
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), rtol=1e-12, atol=1e-12)


def _lora_model(targets):
    from nanolm.model.lora import apply_lora

    model = _model()
    apply_lora(model, rank=2, alpha=4.0, dropout=0.0, targets=targets)
    with torch.no_grad():
        for mod in model.modules():
            if hasattr(mod, "lora_B"):  # a non-zero adapter
                mod.lora_A.copy_(torch.full_like(mod.lora_A, 0.3))
                mod.lora_B.copy_(torch.full_like(mod.lora_B, 0.5))
    return model


def test_lora_layers_are_not_fused_nor_bypassed():
    from nanolm.model.lora import LoRALinear, apply_lora

    # More rows than decode_linear's SMALL_ROWS, so the engine's unfused products are F.linear, as the model's.
    x = torch.randint(0, 61, (1, SMALL_ROWS + 8), generator=torch.Generator().manual_seed(4))
    # Every attention and MLP has a LoRA projection: nothing is fused, and the engine computes W x + s B A x.
    model = _lora_model(("q_proj", "up_proj"))
    engine = Engine(model)
    prepared = engine.model
    assert fuse_projections(copy.deepcopy(model)) == 0
    assert not any(type(m) in (FusedAttention, FusedMLP) for m in prepared.modules())
    assert type(prepared.layers[0].self_attn.q_proj) is LoRALinear
    with torch.no_grad():
        assert torch.equal(prepared(x), model(x))
        assert not torch.equal(prepared(x), _model()(x))  # the adapters count
    # LoRA on q_proj only: the MLPs fuse, the attentions keep their adapted separate products.
    model = _lora_model(("q_proj",))
    prepared = Engine(model).model
    assert [type(b.self_attn) for b in prepared.layers] == [Attention] * 2
    assert [type(b.mlp) for b in prepared.layers] == [FusedMLP] * 2
    with torch.no_grad():
        torch.testing.assert_close(prepared(x), model(x), rtol=1e-6, atol=1e-6)
        assert not torch.equal(prepared(x), _model()(x))
    # A fused module has no separate projection left to wrap, so a LoRA added after fusing cannot be bypassed.
    fused = _model()
    fuse_projections(fused)
    with pytest.raises(UserError, match="'q_proj' names no linear layer"):
        apply_lora(fused, rank=2, alpha=4.0, dropout=0.0, targets=("q_proj",))


def test_bf16_on_cpu_decodes_through_a_float32_cache_like_float32():
    model = _model()
    ref = copy.deepcopy(model)
    engine = Engine(model, dtype=torch.bfloat16)
    assert engine.cache_dtype == torch.float32 and engine.model.lm_head.weight.dtype == torch.bfloat16
    assert model.lm_head.weight.dtype == torch.float32  # the caller's model keeps its dtype
    ids = torch.tensor([[3, 14, 15, 9, 26, 5, 8, 9, 7, 9, 3, 2]])
    cache = KVCache.empty(model.config, 1, 16, "cpu", engine.cache_dtype)
    prepared = engine.model
    with torch.inference_mode():
        got = [prepared(ids[:, :6], cache)[0, -1]] + [prepared(ids[:, i:i + 1], cache)[0, -1] for i in range(6, 12)]
        want = ref(ids)[0, 5:12]
    assert cache.k[0].dtype == torch.float32 and got[0].dtype == torch.bfloat16
    torch.testing.assert_close(torch.stack(got).float(), want, atol=0.03, rtol=0.03)  # bf16 weights' rounding
    assert len(engine.generate_all([3, 14, 15], SamplingParams(max_new_tokens=10, temperature=0))) == 10


# ----------------------------------------------------------------------------- the engine's own copy

def _state(model):
    return {n: (p, p.detach().clone(), p.requires_grad) for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_leaves_the_callers_model_unchanged(dtype):
    model = _model()
    model.train()
    params, modules, buffers = _state(model), list(model.named_modules()), dict(model.named_buffers())
    engine = Engine(model, dtype=dtype)
    engine.generate_all([3, 14, 15], SamplingParams(max_new_tokens=10, temperature=0))
    assert model.training and not engine.model.training
    assert [(n, id(m)) for n, m in model.named_modules()] == [(n, id(m)) for n, m in modules]
    assert [n for n, _ in model.named_parameters()] == list(params)
    for name, p in model.named_parameters():
        same, value, requires_grad = params[name]
        assert p is same and p.dtype == torch.float32 and p.requires_grad == requires_grad and p.grad is None
        assert torch.equal(p, value), name
    assert all(b is buffers[n] and b.dtype == torch.float32 for n, b in model.named_buffers())
    assert model.lm_head.weight is model.embed_tokens.weight  # still tied
    # The copy shares no storage with the caller's tensors (a float32 engine too: nothing is aliased).
    ours = {t.untyped_storage().data_ptr() for t in [*engine.model.parameters(), *engine.model.buffers()]}
    theirs = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    assert not ours & theirs
    assert engine.model.lm_head.weight is engine.model.embed_tokens.weight  # tied in the copy as well
    assert all(not p.requires_grad for p in engine.model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_weights_takes_a_trained_models_current_weights(dtype):
    model = _model()
    engine = Engine(model, dtype=dtype)
    x = torch.randint(0, 61, (1, 9), generator=torch.Generator().manual_seed(3))

    def logits(m):
        with torch.inference_mode():
            return m(x).float()

    before = logits(engine.model)
    storage = [p.untyped_storage().data_ptr() for p in engine.model.parameters()]
    with torch.no_grad():  # the caller's model trains on: here, its weights become another model's
        for p, q in zip(model.parameters(), _model(seed=1).parameters()):
            p.copy_(q)
    assert torch.equal(logits(engine.model), before)  # the copy does not follow by itself
    engine.load_weights(model)
    fresh = Engine(model, dtype=dtype)
    assert not torch.equal(logits(engine.model), before)
    assert torch.equal(logits(engine.model), logits(fresh.model))
    for (name, p), q in zip(engine.model.named_parameters(), fresh.model.parameters()):
        assert torch.equal(p, q), name
    if dtype == torch.float32:
        prompt = [3, 14, 15, 9, 26, 5]
        got = engine.generate_all(prompt, SamplingParams(max_new_tokens=30, temperature=0))
        assert got == greedy_by_recompute(model, prompt, 30)
    assert [p.untyped_storage().data_ptr() for p in engine.model.parameters()] == storage  # loaded in place
    other = Transformer(ModelConfig(vocab_size=61, d_model=32, n_layer=3, n_head=4, n_kv_head=2, max_seq_len=64))
    with pytest.raises(RuntimeError, match="layers.2"):
        engine.load_weights(other)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_joining_running_rows_is_prefilled_in_their_decode_pass(dtype):
    """A prompt added while rows decode is prefilled in the same pass through the layers as their step
    (decode_and_prefill: no separate forward), and every row's tokens are still its tokens alone."""
    engine = Engine(_varied_model(), dtype=dtype)
    prompts = _prompts()
    params = [SamplingParams(max_new_tokens=14, temperature=1.0, seed=70 + i) for i in range(len(prompts))]
    alone = [engine.generate_all(p, q) for p, q in zip(prompts, params)]
    forwards, folded = [], []
    hook = engine.model.register_forward_pre_hook(lambda _m, args: forwards.append(args[0].shape))
    fold = engine.model.decode_and_prefill
    engine.model.decode_and_prefill = lambda *a: folded.append(a[2].shape) or fold(*a)
    batch = engine.batch()
    got: dict[int, list[int]] = {}
    ids = {0: batch.add(prompts[0], params[0])[0]}
    for step in range(30):
        if step == 2:
            ids[1] = batch.add(prompts[1], params[1])[0]
            ids[2] = batch.add(prompts[2], params[2])[0]
        if step == 5:
            ids[3] = batch.add(prompts[3], params[3])[0]
            ids[4] = batch.add(prompts[4], params[4])[0]
        before = len(forwards)
        for out in batch.step():
            if out.token is not None:
                got.setdefault(out.row, []).append(out.token)
        if step in (2, 5):
            assert len(forwards) == before  # the prompts rode on the rows' pass
    hook.remove()
    assert folded == [(2, 25), (2, 12)]  # two prompts each time, right-padded to the longer
    assert [got[ids[i]] for i in range(5)] == alone


def test_decode_and_prefill_computes_what_the_two_forwards_compute():
    """Rows of different lengths decoding one token and right-padded prompts prefilled in one pass: the same
    logits and caches as the decode step and the prefill run apart."""
    model = rows_model(_varied_model())
    cfg = model.config
    rows = [list(range(3, 12)), [5, 6], list(range(20, 40))]
    with torch.inference_mode():
        def running() -> KVCache:
            cache = KVCache.empty(cfg, len(rows), 48, "cpu", torch.float32)
            for i, r in enumerate(rows):
                one = KVCache.empty(cfg, 1, 48, "cpu", torch.float32)
                model(torch.tensor([r]), one)
                for a, b in zip(cache.k + cache.v, one.k + one.v):
                    a[i] = b[0]
            cache.lengths = torch.tensor([len(r) for r in rows])
            return cache
        x = torch.tensor([[7], [8], [9]])
        prompts = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 0, 0, 0]])
        last = torch.tensor([4, 1])
        apart, together = running(), running()
        rows_ref = model(x, apart)[:, 0]
        prompt_ref_cache = KVCache.empty(cfg, 2, 20, "cpu", torch.float32)
        prompt_ref = model(prompts, prompt_ref_cache, last=last)[:, 0]
        prompt_cache = KVCache.empty(cfg, 2, 20, "cpu", torch.float32)
        rows_logits, prompt_logits = model.decode_and_prefill(x, together, prompts, prompt_cache, last)
    torch.testing.assert_close(rows_logits, rows_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(prompt_logits, prompt_ref, rtol=1e-5, atol=1e-5)
    assert together.lengths.tolist() == apart.lengths.tolist() == [10, 3, 21] and prompt_cache.pos == 5
    for a, b in zip(together.k + together.v + prompt_cache.k + prompt_cache.v,
                    apart.k + apart.v + prompt_ref_cache.k + prompt_ref_cache.v):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_rows_of_different_lengths_are_the_engine_models_path_not_the_architectures():
    """The architecture's forward refuses a cache of rows of different lengths (it would read `pos` and write every
    row at one position); rows_model makes the Transformer a wrapper holds decode them, sharing its tensors."""
    model = _varied_model()
    cache = KVCache.empty(model.config, 2, 16, "cpu", torch.float32)
    cache.lengths = torch.tensor([3, 5])
    with pytest.raises(ValueError, match="rows of different lengths"):
        model(torch.tensor([[1], [2]]), cache)
    wrapper = torch.nn.Sequential(model)
    assert rows_model(wrapper) is wrapper and type(wrapper[0]).__name__ == "RowsTransformer"
    assert wrapper[0].lm_head.weight is model.lm_head.weight
    with torch.no_grad():
        assert wrapper[0](torch.tensor([[1], [2]]), cache).shape == (2, 1, 61)
    assert cache.lengths.tolist() == [4, 6]
