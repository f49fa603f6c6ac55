"""Stand-ins for the engine's DecodeBatch in the server tests: one that replays a script, one that is the real
batch slowed down and held at a gate. Both count the tokens they make and say when a row has left."""

from __future__ import annotations

import threading
import time

from nanolm.infer.engine import DecodeBatch, Token


class Signals:
    """What a test watches and holds: `gate` (each step waits for it), `tokens` made, `closed` (set when a row
    leaves the batch: ended or cancelled), `prompts` (each row's prompt ids, as added)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.closed = threading.Event()
        self.tokens = 0
        self.prompts: list[list[int]] = []
        self.adds: list[tuple[list[int], int, int]] = []  # (prompt, n, first) of each add


class Watched:
    """For an engine stand-in whose batches report to `signals`: its gate, closed and tokens as its own."""

    signals: Signals

    def watch(self) -> None:
        self.signals = Signals()
        self.gate, self.closed = self.signals.gate, self.signals.closed

    @property
    def tokens(self) -> int:
        return self.signals.tokens

    @tokens.setter
    def tokens(self, value: int) -> None:
        self.signals.tokens = value


class ScriptBatch:
    """Every row replays `script` (at most its max_new_tokens), each step once `signals.gate` is open and `delay`
    s have passed, then ends on a stop id as a model would; a row whose budget the script fills ends with
    "length". With `replies` (a deque of scripts), each new row replays the next one instead, and `script` once
    they are used up. Asked for log-probabilities, the k-th token of a reply (from 0) has logprob -(k + 1) / 100,
    its own id as the one alternative, so a test can tell which tokens it was given."""

    def __init__(self, script: list[int], signals: Signals, delay: float = 0.0, replies=None) -> None:
        self.script, self.signals, self.delay, self.replies = script, signals, delay, replies
        self.rows: dict[int, list] = {}  # row -> [ids iterator, budget, produced, logprobs]
        self.cancelled: set[int] = set()
        self.next_id = 0

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, prompt, params, stop_ids=(), n=1, logprobs=None, guide=None, first=0) -> list[int]:
        self.signals.adds.append((list(prompt), n, first))
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        for row in ids:
            script = self.replies.popleft() if self.replies else self.script
            self.rows[row] = [iter(script), params.max_new_tokens, 0, logprobs]
            self.signals.prompts.append(list(prompt))
        return ids

    def cancel(self, row: int) -> None:
        self.cancelled.add(row)

    def _leave(self, row: int) -> None:
        del self.rows[row]
        self.signals.closed.set()

    def step(self) -> list[Token]:
        for row in self.cancelled & set(self.rows):
            self._leave(row)
        self.cancelled.clear()
        if not self.rows:
            return []
        self.signals.gate.wait(10)
        time.sleep(self.delay)
        out = []
        for row, state in list(self.rows.items()):
            tid = next(state[0], None) if state[2] < state[1] else None
            if tid is None:
                out.append(Token(row, None, "stop"))
                self._leave(row)
                continue
            state[2] += 1
            self.signals.tokens += 1
            finish = "length" if state[2] >= state[1] else None
            lp = None if state[3] is None else -state[2] / 100
            out.append(Token(row, tid, finish, lp, None if lp is None else [(tid, lp)][:state[3]]))
            if finish:
                self._leave(row)
        return out


class SlowBatch(DecodeBatch):
    """The real batch, each step waiting for `signals.gate` and then `delay` seconds; `closed` is set once the
    batch is empty after a step (its rows ended or were cancelled)."""

    def __init__(self, engine, signals: Signals, delay: float) -> None:
        super().__init__(engine)
        self.signals, self.delay = signals, delay

    def step(self) -> list[Token]:
        self.signals.gate.wait()
        time.sleep(self.delay)
        out = super().step()
        self.signals.tokens += sum(t.token is not None for t in out)
        if not self:
            self.signals.closed.set()
        return out
