"""The server's worker alone (nanolm/infer/server/worker.py), without FastAPI or HTTP: a job's events, the
admission limit, and a client that goes away cancelling its generation."""

from __future__ import annotations

import asyncio
import pytest

from nanolm.config import SamplingParams
from nanolm.infer.server import worker as worker_mod
from nanolm.infer.server.worker import Job, Worker, events
from nanolm.tokenizer import Tokenizer

from engine_doubles import ScriptBatch, Watched


class ScriptEngine(Watched):
    """An engine whose batches replay fixed ids (at most max_new_tokens per row), each step once its `gate` is
    open; `closed` is set when a row leaves, `tokens` counts what it made."""

    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.watch()

    def batch(self) -> ScriptBatch:
        return ScriptBatch(self.script, self.signals)


class Client:
    """A request stand-in: `gone` says whether the client has disconnected."""

    def __init__(self) -> None:
        self.gone = False

    async def is_disconnected(self) -> bool:
        return self.gone


@pytest.fixture(scope="module")
def tok(tokenizer_dir) -> Tokenizer:
    return Tokenizer.load(tokenizer_dir)


async def run_job(engine, tok, max_new_tokens: int, stops=(), client=None, n=1, stream=True) -> list[tuple]:
    worker = Worker(engine, max_queue=1, max_batch=4)
    job = Job(tok, [0], SamplingParams(max_new_tokens=max_new_tokens), stops, n=n, stream=stream)
    assert worker.submit(job)
    out = [e async for e in events(client or Client(), job)]
    worker.close()
    return out


def texts(evs: list[tuple], choice: int = 0) -> str:
    return "".join(e[2] for e in evs if e[0] == "text" and e[1] == choice)


def test_a_job_posts_its_text_then_how_it_ended(tok):
    script = tok.encode("To be, or not to be")
    evs = asyncio.run(run_job(ScriptEngine(script), tok, 50))
    assert texts(evs) == "To be, or not to be" and evs[-1] == ("end", 0, "stop", len(script), [])  # the model ended
    evs = asyncio.run(run_job(ScriptEngine(script), tok, 3))
    assert texts(evs) == tok.decode(script[:3]) and evs[-1] == ("end", 0, "length", 3, [])
    engine = ScriptEngine(script)
    evs = asyncio.run(run_job(engine, tok, 50, stops=["not"]))
    assert texts(evs) == "To be, or " and evs[-1][:3] == ("end", 0, "stop") and engine.closed.wait(10)
    assert engine.tokens < len(script)  # the stop string ended the generation
    # The budget ends the row while "be" is held (it may begin "be, or", which would cut before the "e" found):
    # the held text is cut at "e", and the finish is "stop", not "length".
    short = tok.encode("To be")
    evs = asyncio.run(run_job(ScriptEngine(short), tok, len(short), stops=["e", "be, or"]))
    assert texts(evs) == "To b" and evs[-1][:3] == ("end", 0, "stop")
    evs = asyncio.run(run_job(ScriptEngine(script), tok, 4, n=3))  # three choices, each its own events
    assert [texts(evs, i) for i in range(3)] == [tok.decode(script[:4])] * 3
    assert sorted(e[1:4] for e in evs if e[0] == "end") == [(i, "length", 4) for i in range(3)]


def test_a_job_not_streamed_posts_each_choice_whole_at_its_end(tok):
    """The same texts and ends as streamed, as one text event per choice: the event loop wakes per choice, not
    per token."""
    script = tok.encode("To be, or not to be")
    for stops, budget, n in (((), 50, 1), (["not"], 50, 1), ((), 4, 3)):
        streamed = asyncio.run(run_job(ScriptEngine(script), tok, budget, stops=stops, n=n))
        whole = asyncio.run(run_job(ScriptEngine(script), tok, budget, stops=stops, n=n, stream=False))
        assert len([e for e in streamed if e[0] == "text"]) > n  # streamed: a piece per token or so
        for i in range(n):
            mine = [e for e in whole if e[1] == i]
            assert [e[0] for e in mine] == ["text", "end"]
            assert mine[0][2] == texts(streamed, i) and mine[1] == next(e for e in streamed if e[:2] == ("end", i))


def test_the_queue_admits_at_most_max_queue_and_frees_the_slot(tok):
    async def scenario() -> None:
        engine = ScriptEngine(tok.encode("To be"))
        engine.gate.clear()
        worker = Worker(engine, max_queue=2, max_batch=4)
        jobs = [Job(tok, [0], SamplingParams(max_new_tokens=5), ()) for _ in range(3)]
        assert worker.submit(jobs[0]) and worker.submit(jobs[1])
        assert not worker.submit(jobs[2]) and worker.admitted == 2
        engine.gate.set()
        for job in jobs[:2]:
            assert [e async for e in events(Client(), job)][-1][0] == "end"
        for _ in range(100):  # released by the job's done callback, just after the end
            if worker.admitted == 0:
                break
            await asyncio.sleep(0.01)
        assert worker.admitted == 0 and worker.submit(jobs[2])
        worker.close()

    asyncio.run(scenario())


def test_a_client_that_goes_away_cancels_its_generation(tok, monkeypatch):
    monkeypatch.setattr(worker_mod, "DISCONNECT_POLL_S", 0.01)

    async def scenario() -> None:
        engine = ScriptEngine(tok.encode("To be, or not to be, that is the question.") * 20)
        engine.gate.clear()  # the job holds before its first token
        worker = Worker(engine, max_queue=1, max_batch=4)
        job = Job(tok, [0], SamplingParams(max_new_tokens=10**6), ())
        assert worker.submit(job)
        client = Client()
        client.gone = True
        assert [e async for e in events(client, job)] == []  # noticed by polling, with no event to wait for
        assert job.cancel.is_set()
        engine.gate.set()
        posted = [await asyncio.wait_for(job.events.get(), 10)]
        while posted[-1][0] == "text":
            posted.append(await asyncio.wait_for(job.events.get(), 10))
        assert len(posted) <= 2 and posted[-1][0] == "error" and "cancelled" in posted[-1][1]
        assert engine.closed.wait(10) and engine.tokens == 1  # it stopped after the token it was making
        worker.close()

    asyncio.run(scenario())


async def released(worker: Worker, within: float = 5.0) -> bool:
    """Whether the worker's admitted count falls to 0 within `within` s (it is released on the event loop)."""
    deadline = asyncio.get_running_loop().time() + within
    while worker.admitted and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    return worker.admitted == 0


@pytest.mark.parametrize("when", ["waiting", "mid-step", "after-the-end"])
def test_a_slot_is_freed_whenever_the_client_leaves(tok, when):
    """The interleavings of a client leaving and the decoding thread, forced one by one: while its job waits
    behind a full batch, while the step that makes its token runs, and after its last token but before its
    events are read. Each time its queue slot comes back (the assertion the HTTP test could not make reliably)."""
    async def scenario() -> None:
        engine = ScriptEngine(tok.encode("To be, or not to be") * 4)
        worker = Worker(engine, max_queue=2, max_batch=1)
        first = Job(tok, [0], SamplingParams(max_new_tokens=3), ())
        job = Job(tok, [0], SamplingParams(max_new_tokens=3 if when == "after-the-end" else 10**6), ())
        engine.gate.clear()
        if when == "waiting":  # the batch's one row is the first job's: this one waits behind it
            assert worker.submit(first) and worker.submit(job)
        else:
            assert worker.submit(job)
        await asyncio.sleep(0.05)  # the thread takes the job(s) and blocks in the step, at the gate
        if when == "after-the-end":
            engine.gate.set()
            while not job._over:  # every token made and posted, nothing read yet
                await asyncio.sleep(0.01)
        client = Client()
        client.gone = True
        assert [e async for e in events(client, job) if e[0] == "text"] == [] or when == "after-the-end"
        engine.gate.set()
        if when == "waiting":
            assert [e async for e in events(Client(), first)][-1][0] == "end"
        assert await released(worker)
        assert worker.submit(Job(tok, [0], SamplingParams(max_new_tokens=2), ()))  # the slot is usable
        worker.close()

    asyncio.run(scenario())


def test_a_job_that_fails_alone_leaves_the_thread_serving_the_others(tok, monkeypatch):
    async def scenario() -> None:
        engine = ScriptEngine(tok.encode("To be, or not to be"))
        worker = Worker(engine, max_queue=3, max_batch=4)
        bad, good = (Job(tok, [0], SamplingParams(max_new_tokens=5), ()) for _ in range(2))

        def broken(i, out):
            raise UnicodeError("a broken text stream")
        bad.take = broken
        engine.gate.clear()
        assert worker.submit(bad) and worker.submit(good)
        engine.gate.set()
        got = [e async for e in events(Client(), bad)]
        assert got[-1][0] == "error" and "UnicodeError: a broken text stream" in got[-1][1]
        assert [e async for e in events(Client(), good)][-1][:3] == ("end", 0, "length")
        assert await released(worker)
        later = Job(tok, [0], SamplingParams(max_new_tokens=2), ())
        assert worker.submit(later) and [e async for e in events(Client(), later)][-1][0] == "end"
        worker.close()

    asyncio.run(scenario())


def test_one_requests_n_does_not_hold_every_row_while_another_waits(tok):
    """max_batch 4, one row busy: a request of n = 4 and a request of n = 1 arrive together. The first starts 2
    of its rows (half the batch, as another waits), the second its row beside them at once, and the first's
    other rows start as rows come free, numbered on (a seeded sample draws as if all started together); every
    choice gets its whole text."""
    async def scenario() -> None:
        script = tok.encode("To be, or not to be")
        engine = ScriptEngine(script)
        engine.gate.clear()
        worker = Worker(engine, max_queue=3, max_batch=4)
        blocker = Job(tok, [1], SamplingParams(max_new_tokens=1), ())
        assert worker.submit(blocker)
        await asyncio.sleep(0.05)  # the thread is in the blocker's first step, at the gate
        big = Job(tok, [2], SamplingParams(max_new_tokens=len(script)), (), n=4)
        small = Job(tok, [3], SamplingParams(max_new_tokens=3), ())
        assert worker.submit(big) and worker.submit(small)
        engine.gate.set()
        small_events = [e async for e in events(Client(), small)]
        big_events = [e async for e in events(Client(), big)]
        assert small_events[-1][:4] == ("end", 0, "length", 3)
        assert sorted(e[1:4] for e in big_events if e[0] == "end") == [(i, "length", len(script)) for i in range(4)]
        assert [texts(big_events, i) for i in range(4)] == [tok.decode(script)] * 4
        adds = engine.signals.adds  # (prompt, n, first) of each prefill
        assert adds[:3] == [([1], 1, 0), ([2], 2, 0), ([3], 1, 0)]
        assert sorted(first + k for p, n, first in adds if p == [2] for k in range(n)) == [0, 1, 2, 3]
        assert await released(worker)
        worker.close()

    asyncio.run(scenario())
