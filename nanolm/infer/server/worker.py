"""The server's generation side: one job per request, run one at a time on a single worker thread.

One model serves every client, so generation is serialised: a single worker
thread runs one `Job` at a time (each with its own KV cache), while the event
loop keeps accepting requests and hands each job's text over an asyncio
queue. `Worker` admits at most `max_queue` jobs at once (the one generating
included); the caller answers the next with 429. `events` is how a request
reads its job: it polls for a client that went away, mid-stream or while
waiting, and cancels the job, which frees its place after at most one token.

Nothing here needs the `serve` extra: it runs and is tested without FastAPI.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from concurrent.futures import Executor, Future
from typing import Any, AsyncIterator, Callable, Sequence

from nanolm.config import SamplingParams
from nanolm.infer.engine import Engine
from nanolm.infer.text import TextStream
from nanolm.tokenizer import Tokenizer

# How often a request that waits for tokens checks whether its client is still there.
DISCONNECT_POLL_S = 0.25


class Job:
    """One request's generation: runs on the worker thread, posts events to its client's asyncio queue.

    Events: ("text", piece), then ("end", finish_reason, completion_tokens) or ("error", message).
    """

    def __init__(self, engine: Engine, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams,
                 stops: Sequence[str]) -> None:
        self.engine = engine
        self.tok = tokenizer
        self.prompt_ids = prompt_ids
        self.params = params
        self.stops = list(stops)
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()  # set when the client is gone or the server stops

    def _post(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancel.set()

    def run(self) -> None:
        try:
            if self.cancel.is_set() or not self._generate():
                self._post(("error", "the request was cancelled: the client went away or the server is stopping"))
        except Exception as e:  # reported to the client instead of dying silently in the thread
            self._post(("error", f"generation failed: {type(e).__name__}: {e}"))

    def _generate(self) -> bool:
        """Generate and post the events; False if cancelled before the end."""
        # The engine's own budget: it stops at max_new_tokens or the end of the context, or earlier at a stop
        # token (not yielded). Fewer tokens than the budget therefore means a stop token ended the reply.
        budget = min(self.params.max_new_tokens, self.engine.max_seq_len - len(self.prompt_ids))
        stop_ids = (self.tok.im_end_id, self.tok.eot_id)
        text = TextStream(self.tok, self.stops)
        n = 0  # tokens generated
        gen = self.engine.generate(self.prompt_ids, self.params, stop_ids)
        try:
            for tid in gen:
                n += 1
                self._emit(text.push(tid))
                if text.stopped:
                    self._post(("end", "stop", n))
                    return True
                if self.cancel.is_set():
                    return False
        finally:
            gen.close()  # frees the KV cache now, also when we leave early
        self._emit(text.finish())
        self._post(("end", "stop" if text.stopped or n < budget else "length", n))
        return True

    def _emit(self, piece: str) -> None:
        if piece:
            self._post(("text", piece))


class _DaemonThreadExecutor(Executor):
    """One daemon thread running submitted calls in order.

    ThreadPoolExecutor's threads are joined at interpreter exit, so a generation
    stuck behind a client that vanished could keep the process alive after the
    server is gone; a daemon thread cannot.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args, kwargs = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # handed to the awaiting coroutine
                fut.set_exception(e)

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Future:
        fut: Future = Future()
        self._queue.put((fut, fn, args, kwargs))
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._queue.put(None)
        if wait:
            self._thread.join(timeout=30)


class Worker:
    """Runs jobs one at a time on a single thread; admits at most `max_queue` at once.

    Touched only from the event loop's thread, so the counter needs no lock.
    """

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.admitted = 0
        self.jobs: set[Job] = set()
        self._executor: _DaemonThreadExecutor | None = None

    def submit(self, job: Job) -> bool:
        """Queue the job; False when the queue is full."""
        if self.admitted >= self.max_queue:
            return False
        if self._executor is None:
            self._executor = _DaemonThreadExecutor("nanolm-generate")
        self.admitted += 1
        self.jobs.add(job)
        fut = job.loop.run_in_executor(self._executor, job.run)
        fut.add_done_callback(lambda _: self._release(job))
        return True

    def _release(self, job: Job) -> None:
        self.admitted -= 1
        self.jobs.discard(job)

    def close(self) -> None:
        for job in list(self.jobs):
            job.cancel.set()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None


async def events(request: Any, job: Job) -> AsyncIterator[tuple]:
    """The job's events until its end; stops early, cancelling the job, when the client disconnects.

    The client is looked for every DISCONNECT_POLL_S, whether it waits in the queue or tokens flow (a
    non-streaming request has no other way to notice). A streaming response is also cancelled by the
    server when its client goes away; either way the `finally` tells the worker to stop.
    """
    checked = time.monotonic()
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
            if event[0] != "text":
                return
    finally:
        job.cancel.set()
