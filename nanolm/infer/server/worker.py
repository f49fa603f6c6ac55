"""The server's generation side: one worker thread decodes every admitted request together.

Decoding a small model is bound by reading its weights, so rows decoded
together cost little more than one. One worker thread owns the engine's
`DecodeBatch`: between decode steps it admits waiting jobs, in order, while
the batch has free rows (a job's choices admitted together share one
prefill), steps every row at once, and hands each job's text to its client's
asyncio queue. While other jobs wait, a job starts at most half the batch's
rows at a time (`share`); its other choices start when rows are free and its
turn comes round again, so one request's `n` cannot hold every row while
others queue behind it. A row ends on its stop ids, its budget, a stop string,
or its client going away, and leaves the batch at the next step. Whatever
goes wrong with one job (its guide, its text) fails that job alone; the
thread goes on serving the others.

`Worker` admits at most `max_queue` jobs at once (those decoding included);
the caller answers the next with 429. `events` is how a request reads its
job: it polls for a client that went away, mid-stream or while waiting, and
cancels the job, which frees its rows at the next step.

Nothing here needs the `serve` extra: it runs and is tested without FastAPI.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable, Sequence

from nanolm.config.sampling import SamplingParams
from nanolm.infer.engine import Token
from nanolm.infer.text import TextStream
from nanolm.tokenizer import Tokenizer

# How often a request that waits for tokens checks whether its client is still there.
DISCONNECT_POLL_S = 0.25

CANCELLED = "the request was cancelled: the client went away or the server is stopping"


class Job:
    """One request: `n` choices of one prompt, decoded as rows of the worker's batch.

    Events posted to `events`, for choice i: ("text", i, piece, logprobs) with the token log-probabilities
    (a list of `Token`s) that came since the last piece (empty unless asked for), then ("end", i,
    finish_reason, completion_tokens, logprobs); or one ("error", message) for the whole job. A job that is
    not streamed (`stream` false) gets each choice's whole text as one piece at its end: a waking of the
    event loop per choice, not per token.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams, stops: Sequence[str],
                 n: int = 1, logprobs: int | None = None, guide: Any = None, stream: bool = True) -> None:
        self.tok = tokenizer
        self.guide = guide  # the rows' guide (infer/guide.py), or None
        self.prompt_ids = prompt_ids
        self.params = params
        self.n = n
        self.stream = stream
        self.logprobs = logprobs  # None: none; k: the token's own and the k most likely
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()  # set when the client is gone or the server stops
        self.on_done: Callable[[Job], None] | None = None  # called on the event loop once the job has ended
        self._texts = [TextStream(tokenizer, stops) for _ in range(n)]
        self._tokens = [0] * n
        self._lps: list[list[Token]] = [[] for _ in range(n)]
        self._held: list[list[str]] = [[] for _ in range(n)]  # a choice's pieces not yet posted (not streamed)
        self._open = n  # choices not yet ended
        self.started = 0  # choices whose rows have joined the batch
        self._over = False

    @property
    def stop_ids(self) -> tuple[int, int]:
        return self.tok.im_end_id, self.tok.eot_id

    def _post(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancel.set()

    def _done(self) -> None:
        self._over = True
        if self.on_done is not None:
            try:
                self.loop.call_soon_threadsafe(self.on_done, self)
            except RuntimeError:
                pass

    def fail(self, message: str) -> None:
        """End the whole job with an error event (once)."""
        if not self._over:
            self._post(("error", message))
            self._done()

    def take(self, i: int, out: Token) -> bool:
        """Choice i's new token (or its end); True when the choice has ended (a stop string included)."""
        text = self._texts[i]
        if self.logprobs is not None and out.logprob is not None:
            self._lps[i].append(out)
        piece = ""
        if out.token is not None:
            self._tokens[i] += 1
            piece = text.push(out.token)
        finish = "stop" if text.stopped else out.finish
        if finish is not None and not text.stopped:
            piece += text.finish()  # the rest held back for stop strings or an unfinished character
            finish = "stop" if text.stopped else finish  # a stop string the held rest held
        if finish is None and not self.stream:
            if piece:
                self._held[i].append(piece)
            return False
        if self._held[i]:
            piece, self._held[i] = "".join(self._held[i]) + piece, []
        if piece:
            self._post(("text", i, piece, self._lps[i]))
            self._lps[i] = []
        if finish is None:
            return False
        self._post(("end", i, finish, self._tokens[i], self._lps[i]))
        self._open -= 1
        if self._open == 0:
            self._done()
        return True


class Worker:
    """Admits at most `max_queue` jobs at once and decodes them on one thread, at most `max_batch` rows together.

    `submit`, `admitted` and `close` belong to the event loop's thread; the decoding thread touches jobs only
    through their thread-safe parts (events, cancel, the done callback).
    """

    def __init__(self, engine: Any, max_queue: int, max_batch: int) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.admitted = 0
        self.jobs: set[Job] = set()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, job: Job) -> bool:
        """Queue the job; False when the queue is full."""
        if self.admitted >= self.max_queue:
            return False
        if self._thread is None:
            # A daemon thread: a generation stuck behind a client that vanished must not keep the process
            # alive after the server is gone.
            self._thread = threading.Thread(target=self._run, name="nanolm-generate", daemon=True)
            self._thread.start()
        self.admitted += 1
        self.jobs.add(job)
        job.on_done = self._release
        self._inbox.put(job)
        return True

    def _release(self, job: Job) -> None:
        if job in self.jobs:
            self.admitted -= 1
            self.jobs.discard(job)

    def close(self) -> None:
        for job in list(self.jobs):
            job.cancel.set()
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join(timeout=30)
            self._thread = None

    # --- the decoding thread -------------------------------------------------------------------------

    def _run(self) -> None:
        batch = self.engine.batch()
        rows: dict[int, tuple[Job, int]] = {}  # row id -> (job, choice)
        waiting: collections.deque[Job] = collections.deque()
        while True:
            try:
                item = self._inbox.get(block=not batch and not waiting)
                while True:
                    if item is None:  # closing
                        for job in list(waiting) + [j for j, _ in rows.values()]:
                            job.fail(CANCELLED)
                        return
                    waiting.append(item)
                    item = self._inbox.get_nowait()
            except queue.Empty:
                pass
            self._admit(batch, rows, waiting)
            for row, (job, _) in list(rows.items()):
                if job.cancel.is_set():  # its client went away: the row leaves at this step
                    batch.cancel(row)
                    del rows[row]
                    job.fail(CANCELLED)
            if not batch:
                continue
            try:
                outs = batch.step()
            except Exception as e:  # reported to every client of the batch instead of dying silently
                for job, _ in rows.values():
                    job.fail(f"generation failed: {type(e).__name__}: {e}")
                rows.clear()
                batch = self.engine.batch()
                continue
            for out in outs:
                if out.row not in rows:
                    continue
                job, i = rows[out.row]
                if job.cancel.is_set():
                    continue  # cancelled while this step ran: dropped above at the next turn
                try:
                    ended = job.take(i, out)
                except Exception as e:  # this job's text alone went wrong: it ends, its rows leave
                    job.fail(f"generation failed: {type(e).__name__}: {e}")
                    job.cancel.set()
                    continue
                if ended:
                    del rows[out.row]
                    if out.finish is None:  # a stop string ended it; the engine does not know
                        batch.cancel(out.row)

    def share(self, others_waiting: bool) -> int:
        """The most rows a job starts at once: all it asks for when nobody else waits, else half the batch."""
        return self.max_batch if not others_waiting else max(1, self.max_batch // 2)

    def _admit(self, batch: Any, rows: dict[int, tuple[Job, int]], waiting: collections.deque[Job]) -> None:
        """Start waiting jobs, in order, while the batch has free rows: each its choices not yet started, at most
        `share` at once; a job with choices left goes to the back of the queue. Cancelled ones end here."""
        for _ in range(len(waiting) + self.max_batch):  # each pass starts a row or ends a job: bounded
            if not waiting:
                break
            job = waiting[0]
            if job.cancel.is_set():
                waiting.popleft()
                job.fail(CANCELLED)
                continue
            take = min(job.n - job.started, self.share(len(waiting) > 1), self.max_batch - len(batch))
            if take < 1:
                break
            waiting.popleft()
            try:
                ids = batch.add(job.prompt_ids, job.params, job.stop_ids, n=take, logprobs=job.logprobs,
                                guide=job.guide, first=job.started)
            except Exception as e:
                job.fail(f"generation failed: {type(e).__name__}: {e}")
                continue
            for i, row in enumerate(ids):
                rows[row] = (job, job.started + i)
            job.started += take
            if job.started < job.n:
                waiting.append(job)  # its other choices start on a later turn
        # cancelled jobs further back free their place now rather than when they reach the front
        for job in [j for j in waiting if j.cancel.is_set()]:
            waiting.remove(job)
            job.fail(CANCELLED)


async def events(request: Any, job: Job) -> AsyncIterator[tuple]:
    """The job's events until every choice has ended; stops early, cancelling the job, when the client
    disconnects.

    The client is looked for every DISCONNECT_POLL_S, whether it waits in the queue or tokens flow (a
    non-streaming request has no other way to notice). A streaming response is also cancelled by the
    server when its client goes away; either way the `finally` tells the worker to stop.
    """
    checked = time.monotonic()
    open_choices = job.n
    try:
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), timeout=DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                event = None
            if time.monotonic() - checked >= DISCONNECT_POLL_S:
                if await request.is_disconnected():
                    return
                checked = time.monotonic()
            if event is None:
                continue
            yield event
            if event[0] == "error":
                return
            if event[0] == "end":
                open_choices -= 1
                if open_choices == 0:
                    return
    finally:
        job.cancel.set()
