"""The one generation engine: KV-cached decoding of many sequences at once, streaming token ids.

The engine knows token ids and a model, nothing about text: the CLI, the chat
terminal and the HTTP server turn text into ids and back around it. It decodes
from its own prepared copy of the model, so the caller's model (one that keeps
training, say) is never changed by it.

Decoding a small model reads every weight once per step whatever the number of
rows, so rows decoded together cost little more than one. A `DecodeBatch` holds the
rows being decoded: `add` queues a prompt and its `n` samples, and at the next
`step` the prompts added since the last one are prefilled together (one
forward, right-padded, once for each prompt's samples) and their rows join;
each step decodes one token for every row, each
row at its own position with its own sampling parameters, penalties and random
generator, so a row's tokens do not depend on which other rows run beside it;
a row leaves on its stop ids, its budget or `cancel`. `Engine.generate` is one
row of a batch. Penalties, filters and the draw are pure functions
(`infer/sampling.py`). A row may carry a guide (`infer/guide.py`, tool calls
held to their schemas; `infer/bans.py`, tags a reply may not write), asked
before each draw which ids may come next.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, Sequence

import torch
import torch.nn as nn

from nanolm.checkpoint import require_causal
from nanolm.config.sampling import SEED_RANGE, SamplingParams
from nanolm.infer.fuse import choose_product_form, fuse_projections
from nanolm.infer.rows import quiet_known_break, rows_model
from nanolm.infer.sampling import Penalties, apply_penalties, sample_rows
from nanolm.model.transformer import KVCache


def inference_copy(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A copy of `model` in eval mode, its floating-point parameters and buffers in `dtype` on `device`.

    Each tensor is copied straight into `dtype` (as `model.to(device, dtype)` would convert it), so no
    second full-precision copy is held on the way; parameters are copied without their gradients and
    do not require any. `model` itself, its modules and its tensors are left as they are.
    """
    def converted(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(device=device, dtype=dtype if t.is_floating_point() else t.dtype, copy=True)

    # deepcopy takes a tensor found in the memo instead of copying it; a tied weight is one entry, so it
    # stays tied in the copy.
    memo: dict[int, object] = {id(p): nn.Parameter(converted(p), requires_grad=False) for p in model.parameters()}
    memo.update({id(b): converted(b) for b in model.buffers()})
    return copy.deepcopy(model, memo).eval()


class Engine:
    """Generates from a decoder-only model with a KV cache, decoding from its own prepared copy of it.

    Memory: the copy holds every weight once more, in the engine's dtype (minimind-26m: 103 MB in float32,
    52 MB in bfloat16), beside the caller's model, which stays as it was (its dtype, device, mode and
    tensors); a caller that has no further use for its model drops it, and only the copy remains. On the
    way, each tensor is converted straight into the engine's dtype (no float32 copy of a bf16 engine's
    weights is made), and fusing, like `load_weights`, stacks one module's q/k/v or gate/up at a time, so
    beyond the two models at most one module's projections are held once more.
    """

    def __init__(self, model: nn.Module, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        """Prepare the copy: weights in `dtype` on `device` (decoding reads every weight once per token, so
        bf16 weights halve the bytes, and nothing is re-cast under autocast), eval mode, and the q/k/v and
        gate/up products fused (`infer/fuse.py`): the same weights, fewer products; its Transformer a
        `RowsTransformer` (`infer/rows.py`), which decodes rows of different lengths."""
        require_causal(model.config, "decoding with the engine (generate, chat, serve, sampled rollouts)")
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = rows_model(inference_copy(model, self.device, dtype))  # decodes rows of different lengths
        fuse_projections(self.model)  # fewer, larger products per token
        # PyTorch's CPU kernels attend one query in bf16/fp16 several times slower than in float32 (138 vs
        # 36 us for 300 cached tokens on 2 cores), and less exactly. A float32 cache is attended as it is,
        # where a bf16 one would be cast whole at every layer of every token.
        self.cache_dtype = torch.float32 if self.device.type == "cpu" else dtype
        self.max_seq_len: int = model.config.max_seq_len
        self._compiled: nn.Module | None = None  # the decode step under torch.compile (`compile_decode`)
        self._warming = False  # compile_decode's first (compiling) steps run

    def decode(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One decode step of the copy: x (B, 1), the rows' latest tokens after `cache` -> logits (B, 1, V); compiled
        after `compile_decode` kept it. Prefills run the copy as it is.

        A compiled step that fails (a shape whose compile fails, say) is dropped for good, with one line on
        stderr, and the step runs again as the copy is, from the cache as it was before it (a step writes each
        row's new key and value at its own position, so writing them again changes nothing).
        """
        if self._compiled is None:
            return self.model(x, cache)
        pos, lengths = cache.pos, None if cache.lengths is None else cache.lengths.clone()
        try:
            return self._compiled(x, cache)
        except Exception as e:
            if self._warming:  # compile_decode's own warm-up says why, and keeps nothing
                raise
            self._compiled = None
            cache.pos, cache.lengths = pos, lengths
            print(f"the compiled decode step failed ({type(e).__name__}: {str(e)[:200]}); decoding uncompiled from "
                  "now on", file=sys.stderr, flush=True)
            return self.model(x, cache)

    def compile_decode(self, rows: int = 16, steps: int = 24, keep_faster: bool = True) -> str:
        """torch.compile the decode step (one row, and 2 or more rows of different lengths) for a process that
        decodes long enough to pay for it (the server; RL's rollouts, untimed); returns what was done and measured.

        The compile is paid here, not at a client's first request: a throwaway batch of `rows` rows (random
        prompts of different lengths, greedy) and one of a single row decode `steps` tokens each, compiled, which
        compiles both paths (rows 1: the one-row path alone, for generate and chat). Decoding shapes are dynamic
        (rows, positions, cache lengths), so later batches reuse the graphs. keep_faster: the two batches (the one)
        also decode as the copy is, alternated with compiled, and the compiled step is kept only where its medians
        (a step of each batch, summed) are the smaller; false: kept untimed (a choice every process makes alike).
        A compile that fails (inductor needs a C++ compiler) leaves the copy decoding as it is, and says why. Not
        to be called while `generate` runs.
        """
        g = torch.Generator().manual_seed(0)
        vocab, room = self.model.config.vocab_size, max(2, self.max_seq_len - steps - 8)
        prompts = [torch.randint(0, vocab, (min(room, 4 + 3 * i),), generator=g).tolist() for i in range(rows)]
        greedy = SamplingParams(max_new_tokens=steps + 2, temperature=0.0)

        def timed() -> float:  # the median step of `rows` rows plus that of one row, in seconds
            total = 0.0
            for batch_prompts in ((prompts, prompts[:1]) if rows > 1 else (prompts,)):
                batch = self.batch()
                for p in batch_prompts:
                    batch.add(p, greedy)
                batch.step()  # the prefill
                times = []
                for _ in range(steps):
                    t0 = time.perf_counter()
                    batch.step()
                    times.append(time.perf_counter() - t0)
                total += statistics.median(times)
            return total

        quiet_known_break()
        self._compiled = torch.compile(self.model, dynamic=True)
        t0 = time.perf_counter()
        self._warming = True
        try:
            timed()
        except Exception as e:  # inductor needs a C++ compiler, for one
            self._compiled = None
            return f"the decode step left uncompiled: torch.compile failed ({type(e).__name__}: {str(e)[:200]})"
        finally:
            self._warming = False
        compile_s = time.perf_counter() - t0
        if not keep_faster:
            return f"the decode step compiled in {compile_s:.0f} s"
        kept, eager, compiled = self._compiled, [], []
        for _ in range(3):
            self._compiled = None
            eager.append(timed())
            self._compiled = kept
            compiled.append(timed())
        e, c = statistics.median(eager), statistics.median(compiled)
        self._compiled = kept if c < e else None
        steps_timed = f"a step of {rows} rows plus one of 1 row" if rows > 1 else "a step of 1 row"
        return (f"the decode step {'compiled' if c < e else 'left uncompiled'} (compiled in {compile_s:.0f} s): "
                f"{steps_timed} took {c * 1e3:.2f} ms compiled, {e * 1e3:.2f} ms as it is")

    def load_weights(self, model: nn.Module) -> None:
        """Take `model`'s current weights again (a model that keeps training, for one): each is copied into
        the engine's copy in place, converted to its dtype and device (the copy's tensors are kept; a fused
        module's weights are stacked, one module at a time, on the way in).

        `model` must have the modules and shapes of the model the engine was built from (torch's
        load_state_dict error names what differs). Not to be called while `generate` runs.
        """
        with torch.no_grad():
            self.model.load_state_dict(model.state_dict())

    def time_products(self, rows: int = 16) -> str:
        """Time the copy's products at `rows` rows in both of their forms and keep the faster for 2 to 32 rows
        (`fuse.choose_product_form`; float32 on a CPU only); returns what was measured. The server does, for the
        many rows it decodes together; elsewhere each CPU's rule holds, which every process takes alike (RL's
        ranks and a resumed run decode the same way). Not to be called while `generate` runs."""
        return choose_product_form(self.model, rows)[1]

    def batch(self) -> "DecodeBatch":
        """A new, empty set of rows to decode together (see `DecodeBatch`)."""
        return DecodeBatch(self)

    def check_prompt(self, prompt: Sequence[int]) -> None:
        if len(prompt) == 0:
            raise ValueError("the prompt must hold at least one token")
        if len(prompt) >= self.max_seq_len:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the model's context is {self.max_seq_len}")
        vocab = self.model.config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"the prompt holds token id {bad}, outside the model's vocabulary of {vocab}")

    def generate(self, prompt: Sequence[int], params: SamplingParams,
                 stop_ids: Sequence[int] = (), guide: Guide | None = None) -> Iterator[int]:
        """Yield new token ids one at a time; stops at a stop id (not yielded), max_new_tokens or the context end."""
        batch = self.batch()
        batch.add(prompt, params, stop_ids, guide=guide)
        while True:
            (out,) = batch.step()
            if out.token is not None:
                yield out.token
            if out.finish is not None:
                return

    def generate_all(self, prompt: Sequence[int], params: SamplingParams, stop_ids: Sequence[int] = ()) -> list[int]:
        return list(self.generate(prompt, params, stop_ids))

    def generate_many(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                      stop_ids: Sequence[int] = (), n: int = 1,
                      guide: "Guide | Sequence[Guide | None] | None" = None) -> list[list[int]]:
        """Every prompt's reply (n replies each, in order: prompt 0's n, then prompt 1's ...), decoded together."""
        return [r.tokens for r in self.replies(prompts, params, stop_ids, n, guide)]

    def replies(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                stop_ids: Sequence[int] = (), n: int = 1,
                guide: "Guide | Sequence[Guide | None] | None" = None) -> list["Reply"]:
        """As `generate_many`, each reply with the reason it ended (`Reply`). guide: one for every prompt (each
        row gets its own fork), one per prompt, or None."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
        guides = list(guide) if isinstance(guide, (list, tuple)) else [guide] * len(prompts)
        if len(guides) != len(prompts):
            raise ValueError(f"{len(guides)} guides for {len(prompts)} prompts")
        batch = self.batch()
        rows = [row for prompt, p, g in zip(prompts, per_prompt, guides)
                for row in batch.add(prompt, p, stop_ids, n=n, guide=g)]
        replies = run_to_end(batch, rows)
        return [replies[row] for row in rows]


@dataclass
class Reply:
    """A row decoded to its end: its tokens (a stop id that ended it is not among them) and why it ended:
    "stop" (a stop id, or the caller's `until`) or "length" (its max_new_tokens, or the context's end)."""

    tokens: list[int]
    finish: str


def run_to_end(batch: "DecodeBatch", rows: Sequence[int] = (), refill: Callable[[int], Sequence[int]] | None = None,
               until: Callable[[int, list[int]], bool] | None = None) -> dict[int, Reply]:
    """The one decode driver: step `batch` until every row has ended; each row's Reply, by row id.

    rows: the ids of rows already added. refill(live), when given, is called before the first step and after
    each one with the number of rows still decoding, and returns the ids of the rows it added (a caller keeping
    a bounded number of rows in flight adds one per row that ended). until(row, tokens), when given, is asked
    after each token a row makes: True ends the row there (finish "stop"; a stop string, say). Any object with
    DecodeBatch's add, step and cancel can be driven (the server's worker steps its batch itself, to admit
    requests between steps).
    """
    live = set(rows)
    replies: dict[int, Reply] = {}
    if refill is not None:
        live.update(refill(len(live)))
    while live:
        for out in batch.step():
            if out.row not in live:
                continue
            reply = replies.setdefault(out.row, Reply([], ""))
            if out.token is not None:
                reply.tokens.append(out.token)
            if out.finish is not None:
                reply.finish = out.finish
            elif until is not None and until(out.row, reply.tokens):
                batch.cancel(out.row)
                reply.finish = "stop"
            if reply.finish:
                live.discard(out.row)
        if refill is not None:
            live.update(refill(len(live)))
    return replies


@dataclass
class Token:
    """What one step made of one row: its new token, whether the row ended, and optionally log-probabilities.

    token: the new id, or None when the row ended on a stop id (which is not part of the reply).
    finish: None while the row goes on; "stop" (a stop id) or "length" (its max_new_tokens or the context).
    logprob / top_logprobs: when asked for, the model's log-probability of the token and the most likely
    ids with theirs, from the model's own distribution (before penalties, temperature and filters).
    """

    row: int
    token: int | None
    finish: str | None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class Guide(Protocol):
    """What a row's guide answers (`infer/guide.py`'s ToolCallGuide is one; `infer/bans.py`'s TagBan, which keeps
    a reply from writing a tag, another): the ids that may come next (a bool mask over the vocabulary, or None for
    all), the token drawn, and a copy for another sample. A row's mask is applied after every change to its
    logits (penalties), so nothing re-opens an id its guide masks."""

    def allowed(self) -> torch.Tensor | None: ...

    def advance(self, token: int) -> None: ...

    def fork(self) -> "Guide": ...


class _Row:
    """One sequence being decoded: its settings and where it stands."""

    def __init__(self, row_id: int, prompt: list[int], budget: int, params: SamplingParams, stops: frozenset[int],
                 generator: torch.Generator | None, penalties: Penalties, logprobs: int | None,
                 guide: Guide | None = None) -> None:
        self.id, self.prompt_len, self.budget = row_id, len(prompt), budget
        self.params, self.stops, self.generator, self.penalties = params, stops, generator, penalties
        self.logprobs = logprobs
        self.guide = guide
        self.produced = 0
        self.last = -1  # the latest token, to be decoded at the next step
        self.prompt: list[int] | None = prompt  # until prefilled; the samples of one `add` share the list
        self.logits: torch.Tensor | None = None  # (1, V): the first token's, from prefill, until it is drawn
        self.slot = -1  # its row in the step's prefill cache, until it joins the batch's


# The most token positions (prompts x the longest of them) one prefill forward takes: prompts added together are
# prefilled together up to it, so a step's prefill activations stay bounded whatever the prompts.
PREFILL_TOKENS = 8192


def _seeded(seed: int | None, i: int, device: torch.device) -> torch.Generator | None:
    """The i-th sample's generator of a request seeded `seed` (sample 0 draws exactly as the seed alone)."""
    if seed is None:
        return None
    lo, hi = SEED_RANGE
    return torch.Generator(device=device).manual_seed((seed + i - lo) % (hi - lo) + lo)


class DecodeBatch:
    """Rows decoded together, one token per row per `step`; rows join (`add`) and leave between steps.

    Rows being decoded share one KV cache, a row per sequence, each filled to its own length
    (`KVCache.lengths`): the first rows of buffers kept for the batch's life. A row joining is copied in once,
    into the rows after the running ones; a row leaving gives its place to one of the last rows (that row's
    filled positions copied once), so neither copies the whole cache and a step costs one forward of the rows
    there are. Not thread-safe: one thread adds, steps and cancels (the server's worker thread).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._next_id = 0
        self._running: list[_Row] = []  # rows in the shared cache, in its row order
        self._joining: list[_Row] = []  # rows added since the last step
        self._cache: KVCache | None = None  # the running rows' cache: views of the buffers' first rows
        self._k_buf: list[torch.Tensor] = []  # per layer (rows, nkv, positions, hs), grown as rows join
        self._v_buf: list[torch.Tensor] = []
        self._cancelled: set[int] = set()

    def __len__(self) -> int:
        """Rows not yet ended (running, joining, or about to end)."""
        return len(self._running) + len(self._joining)

    @torch.inference_mode()
    def add(self, prompt: Sequence[int], params: SamplingParams, stop_ids: Sequence[int] = (), n: int = 1,
            logprobs: int | None = None, guide: Guide | None = None, first: int = 0) -> list[int]:
        """Add `n` rows sampling from `prompt`; returns their row ids. The prompt is prefilled once for all n, at
        the next `step`, together with the other prompts added before it.

        Sample i of a seeded request draws with seed + i, so a request of n = 1 draws as its seed alone; `first`
        numbers the rows from there (a request's samples added in parts draw as if added at once).
        logprobs: None, or how many of the most likely ids each Token lists (0: only the token's own).
        guide: the ids each row may draw next (each row gets its own fork); None: any.
        """
        engine = self.engine
        engine.check_prompt(prompt)
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        budget = min(params.max_new_tokens, engine.max_seq_len - len(prompt))
        vocab = engine.model.config.vocab_size
        prompt = list(prompt)
        rows = [_Row(self._next_id + i, prompt, budget, params, frozenset(stop_ids),
                     _seeded(params.seed, first + i, engine.device), Penalties(params, prompt, vocab, engine.device),
                     logprobs, guide.fork() if guide is not None else None) for i in range(n)]
        self._next_id += n
        self._joining += rows
        return [row.id for row in rows]

    def cancel(self, row_id: int) -> None:
        """End a row now: it makes no more tokens and leaves at the next step (its cache freed)."""
        self._cancelled.add(row_id)

    @torch.inference_mode()
    def step(self) -> list[Token]:
        """One token for every row: the running rows decode their latest token together (the prompts added since
        the last step prefilled in the same pass where they fit one forward), then every row draws its next one.
        Rows that end (stop id, budget, context) leave; rows added since the last step join."""
        if self._cancelled:
            self._leave({r.id for r in self._running if r.id in self._cancelled})
            self._joining = [r for r in self._joining if r.id not in self._cancelled]
            self._cancelled.clear()
        parts = []
        x = torch.tensor([[r.last] for r in self._running], dtype=torch.long, device=self.engine.device) \
            if self._running else None
        prefill, rows_logits = self._prefill([r for r in self._joining if r.budget > 0], x)
        if rows_logits is not None:  # the running rows decoded in the prefill's pass
            parts.append(rows_logits)
        elif self._running:
            cache = self._cache
            if len(self._running) == 1:  # one row: the plain cache path (no mask, no scattered writes)
                lengths, cache.lengths, cache.pos = cache.lengths, None, int(cache.lengths[0])
                parts.append(self.engine.decode(x, cache)[:, -1, :])  # (1, V)
                cache.lengths = lengths + 1
            else:
                parts.append(self.engine.decode(x, cache)[:, -1, :])  # (B, V)
        live = self._running + [r for r in self._joining if r.budget > 0]
        parts += [r.logits for r in self._joining if r.budget > 0]
        for r in self._joining:
            r.logits = None
        out = {r.id: Token(r.id, None, "length") for r in self._joining if r.budget <= 0}  # no room: ends at once
        if live:
            out.update((t.row, t) for t in self._draw(live, torch.cat(parts) if len(parts) > 1 else parts[0]))
        tokens = [out[r.id] for r in self._running + self._joining]
        ended = {t.row for t in tokens if t.finish is not None}
        self._leave({r.id for r in self._running if r.id in ended})
        self._join([r for r in self._joining if r.id not in ended], prefill)
        self._joining = []
        return tokens

    def _prefill(self, rows: list[_Row], x: torch.Tensor | None) -> tuple[KVCache | None, torch.Tensor | None]:
        """Prefill the prompts of the rows about to join, each prompt once for its samples, as few forwards as
        PREFILL_TOKENS allows (right-padded: a row's causal attention never reaches the padding after it, whose
        cache positions its own tokens overwrite); sets each row's first logits and its slot in the returned
        cache, whose rows are the prompts in order. x (B, 1): the running rows' latest tokens, or None; where
        the prompts take one forward and the decode step is not compiled, the running rows decode in the same
        pass (`RowsTransformer.decode_and_prefill`) and their logits (B, V) are returned too (else None)."""
        if not rows:
            return None, None
        engine = self.engine
        slots: dict[int, int] = {}  # by identity: the samples of one add share their prompt list
        order: list[list[int]] = []  # the prompts, each once, in the order added
        for r in rows:
            if id(r.prompt) not in slots:
                slots[id(r.prompt)] = len(order)
                order.append(r.prompt)
            r.slot = slots[id(r.prompt)]
        capacity = max([r.prompt_len + r.budget for r in rows] + [self._cache.max_len if self._cache is not None else 0])
        chunks, logits = [], []
        rows_logits = None
        start = 0
        while start < len(order):  # the next prompts while their padded positions fit PREFILL_TOKENS
            end, longest = start + 1, len(order[start])
            while end < len(order) and (end + 1 - start) * max(longest, len(order[end])) <= PREFILL_TOKENS:
                longest = max(longest, len(order[end]))
                end += 1
            part = order[start:end]
            tokens = torch.zeros(len(part), longest, dtype=torch.long, device=engine.device)
            for i, p in enumerate(part):
                tokens[i, :len(p)] = torch.tensor(p, dtype=torch.long, device=engine.device)
            cache = KVCache.empty(engine.model.config, len(part), capacity, engine.device, engine.cache_dtype)
            last = torch.tensor([len(p) - 1 for p in part], dtype=torch.long, device=engine.device)
            if x is not None and start == 0 and end == len(order) and engine._compiled is None:
                rows_logits, first = engine.model.decode_and_prefill(x, self._cache, tokens, cache, last)
                logits.append(first)
            else:
                logits.append(engine.model(tokens, cache, last=last)[:, 0, :])  # (P, V): each prompt's last position
            chunks.append(cache)
            start = end
        first = torch.cat(logits) if len(logits) > 1 else logits[0]
        for r in rows:
            r.logits, r.prompt = first[r.slot:r.slot + 1], None
        if len(chunks) == 1:
            return chunks[0], rows_logits
        return KVCache([torch.cat(k) for k in zip(*(c.k for c in chunks))],
                       [torch.cat(v) for v in zip(*(c.v for c in chunks))]), rows_logits

    def _draw(self, rows: list[_Row], raw: torch.Tensor) -> list[Token]:
        """Every row's next token from its logits (raw: (B, V), a row per entry of `rows`), as tensor operations
        over all rows: penalties, the guides' masks, temperature, top-k, top-p, the draw, log-probabilities."""
        device = raw.device
        penalised = [i for i, r in enumerate(rows) if r.penalties.active]
        logits = raw
        if penalised:
            logits = raw.to(torch.float32, copy=True)  # `raw` stays the model's own, for the log-probabilities
            index = torch.tensor(penalised, device=device)
            logits.index_copy_(0, index, apply_penalties(raw.index_select(0, index),
                                                         [rows[i].penalties for i in penalised]))
        masks = [(i, r.guide.allowed()) for i, r in enumerate(rows) if r.guide is not None]
        masks = [(i, m) for i, m in masks if m is not None]
        if masks:
            vocab = logits.shape[-1]
            blocked = torch.zeros(logits.shape, dtype=torch.bool, device=device)
            for i, m in masks:
                blocked[i] = ~m[:vocab]
            logits = logits.masked_fill(blocked, float("-inf"))
        temperature = torch.tensor([r.params.temperature for r in rows], device=device)
        top_k = torch.tensor([r.params.top_k for r in rows], dtype=torch.long, device=device)
        top_p = torch.tensor([r.params.top_p for r in rows], device=device)
        ids = sample_rows(logits, temperature, top_k, top_p, [r.generator for r in rows]).tolist()
        logprob: list[float | None] = [None] * len(rows)
        top: list[list[tuple[int, float]] | None] = [None] * len(rows)
        asked = [i for i, r in enumerate(rows) if r.logprobs is not None]
        if asked:
            index = torch.tensor(asked, device=device)
            logp = torch.log_softmax(raw.index_select(0, index).float(), dim=-1)
            chosen = logp.gather(-1, torch.tensor([[ids[i]] for i in asked], device=device)).squeeze(-1).tolist()
            k = min(max(rows[i].logprobs for i in asked), logp.shape[-1])
            values, best = torch.topk(logp, k, dim=-1) if k > 0 else (None, None)
            for j, i in enumerate(asked):
                logprob[i] = chosen[j]
                if rows[i].logprobs > 0:
                    n = min(rows[i].logprobs, logp.shape[-1])
                    top[i] = list(zip(best[j, :n].tolist(), values[j, :n].tolist()))
        out = []
        for i, (row, tid) in enumerate(zip(rows, ids)):
            if tid in row.stops:
                out.append(Token(row.id, None, "stop", logprob[i], top[i]))
                continue
            row.produced += 1
            row.last = tid
            if row.penalties.active:
                row.penalties.add(tid)
            if row.guide is not None:
                row.guide.advance(tid)
            out.append(Token(row.id, tid, "length" if row.produced >= row.budget else None, logprob[i], top[i]))
        return out

    def _leave(self, ids: set[int]) -> None:
        """The rows `ids` leave: the running rows after the last one kept move into their places (only those rows'
        filled positions are copied, not the whole cache), and the batch's cache views the buffers' first rows."""
        if not ids:
            return
        leaving = [r.id in ids for r in self._running]
        kept = len(self._running) - sum(leaving)
        if kept == 0:
            self._running, self._cache = [], None  # the buffers stay, for the rows that join next
            return
        holes = [i for i in range(kept) if leaving[i]]
        movers = [i for i in range(kept, len(self._running)) if not leaving[i]]
        c = self._cache
        lengths = c.lengths[:kept].clone()
        if holes:
            device = self.engine.device
            src, dst = (torch.tensor(i, dtype=torch.long, device=device) for i in (movers, holes))
            span = int(c.lengths.index_select(0, src).max())  # the movers' filled positions
            for buf in self._k_buf + self._v_buf:
                part = buf[:, :, :span]
                part.index_copy_(0, dst, part.index_select(0, src))
            lengths.index_copy_(0, dst, c.lengths.index_select(0, src))
            for i, j in zip(holes, movers):
                self._running[i] = self._running[j]
        self._running = self._running[:kept]
        self._cache = self._view(kept, lengths)

    def _join(self, rows: list[_Row], prefill: KVCache | None) -> None:
        """The rows' prefill cache rows (`slot`) join the batch's cache, after the running rows: written into the
        batch's buffers, which grow (copying the running rows once) when the rows or their positions do not fit."""
        if not rows:
            return
        device = self.engine.device
        lengths = torch.tensor([r.prompt_len + r.produced - 1 for r in rows], dtype=torch.long, device=device)
        slots = [r.slot for r in rows]
        if slots == list(range(len(prefill.k[0]))):  # the prefill's rows as they are (one prompt, one sample each)
            k, v = prefill.k, prefill.v
        else:
            index = torch.tensor(slots, dtype=torch.long, device=device)
            k, v = [t.index_select(0, index) for t in prefill.k], [t.index_select(0, index) for t in prefill.v]
        old = len(self._running)
        total, positions = old + len(rows), prefill.max_len
        if not self._k_buf or self._k_buf[0].shape[0] < total or self._k_buf[0].shape[2] < positions:
            capacity = self._k_buf[0].shape[0] if self._k_buf else 0
            capacity = capacity if capacity >= total else max(total, 2 * capacity)  # rows: doubled when short
            positions = max(positions, self._k_buf[0].shape[2] if self._k_buf else 0)
            grown = [torch.zeros(capacity, t.shape[1], positions, t.shape[3], dtype=t.dtype, device=t.device)
                     for t in k + v]  # zeros: positions past a row's length are masked, never NaN garbage
            if old:  # the running rows' filled positions move to the grown buffers
                span = int(self._cache.lengths.max())
                for was, buf in zip(self._k_buf + self._v_buf, grown):
                    buf[:old, :, :span] = was[:old, :, :span]
            self._k_buf, self._v_buf = grown[:len(k)], grown[len(k):]
        span = int(lengths.max())  # the joining rows' filled positions (their prompts)
        for buf, t in zip(self._k_buf + self._v_buf, k + v):
            buf[old:total, :, :span] = t[:, :, :span]
        self._cache = self._view(total, lengths if not old else torch.cat([self._cache.lengths, lengths]))
        self._running += rows

    def _view(self, rows: int, lengths: torch.Tensor) -> KVCache:
        """The batch's cache: the buffers' first `rows` rows (contiguous views), filled to `lengths`."""
        return KVCache([b[:rows] for b in self._k_buf], [b[:rows] for b in self._v_buf], lengths=lengths)
