"""Chat data (`nanolm prepare --format chat`): conversations for fine-tuning, with a loss mask on the
assistant turns, and the blocks of packed conversations the loader makes of them.

Prepare: each conversation (read by `iter_chat_records` of
nanolm.data.formats) becomes one document: its ids and loss mask in the
tokenizer's chat layout (`nanolm.chat.encode_chats`: exactly the ids of
`tok.encode(fmt.render(messages, tools))`, the mask on the assistant turns),
then `<|endoftext|>` (mask 0). A conversation longer than `max_tokens` tokens
is cut by ChatML's truncation policy (`fit_conversation`), or skipped when no
target would be left; both are counted in the manifest's "chat" section.

Loader (`PackedConversations`). The unit is a block of seq_len + 1 tokens
holding whole conversations (each without its trailing end-of-text token),
padded at the end with id 0. A conversation longer than the block is cut by
`fit_conversation`, ChatML's truncation policy, as `nanolm prepare` cuts it
(one that cannot be cut to fit is left out; the loader says how many). Epoch e
shuffles the conversations with `np.random.default_rng([seed, e])`, packs them
into blocks with `pack_blocks` (over consecutive chunks of `PACK_CHUNK`
conversations), then shuffles the blocks with the same generator. So each
epoch sees every conversation once, in other company, and epochs can differ by
a few blocks; `Loader.describe()` tells how full the blocks are. In a row, seg
numbers the conversations 0, 1, ... (the padding gets the next number), pos
restarts at 0 with each of them, and y is -1 where the loss mask of the target
token is 0 (system and user turns, template scaffolding, padding) and at the
last token of every segment, so nothing predicts across a boundary.

SFT augmentations, as MiniMind applies them (each off by default, each
conversation's draw from `--seed` and its place in the input, so the bytes
written do not depend on the workers; the manifest's section counts them):
`--system-ratio` gives that share of the conversations without a system
message one of `SYSTEM_PROMPTS`, so the model learns to follow one without
depending on it; `--empty-think-ratio` trains that share's empty think blocks
(`<think>\n\n</think>` before a reply without reasoning, always in the
layout, otherwise untrained), so a model asked to think closes the block when
it has nothing to reason about.

The conversations' shared parts (reading, the worker's encoding, `Documents`,
`Conversations`) serve preference pairs too (nanolm/data/kinds/pairs.py).
"""

from __future__ import annotations

import bisect
import random
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from nanolm.chat import QWEN3, TARGET, Conversation, Message, Span, check_spelling, fit_conversation
from nanolm.chat import encode_chats as encode_with_masks
from nanolm.data.formats import iter_chat_records
from nanolm.data.jsonl import ReadStats
from nanolm.data.kinds.base import Chunk, DataKind, Order, Record, Splits, encode_batch, pinned
from nanolm.data.shards import IGNORE_INDEX, Batch, Manifest, PackedData, SplitWriter, write_splits
from nanolm.errors import UserError
from nanolm.progress import fmt_count
from nanolm.special_tokens import THINK_END
from nanolm.tokenizer import Tokenizer

# Conversations packed together (see pack_blocks); a larger chunk packs
# tighter, a smaller one varies the blocks' make-up more between epochs.
PACK_CHUNK = 4096
# Below this fraction of positions holding a token, pack_blocks tries a second packer.
GOOD_FILL = 0.99
# The span that closes an empty think block in the Qwen3 layout (chat/templates.py).
EMPTY_THINK_CLOSE = f"\n{THINK_END}\n\n"
# The system prompts `--system-ratio` draws from: plain assistant instructions, in English and Chinese.
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a concise assistant. Answer briefly and accurately.",
    "You are a friendly assistant who explains things clearly.",
    "You are a careful assistant: when you are not sure, say so.",
    "You are an assistant that answers in the language of the question.",
    "Answer the user's questions helpfully and honestly.",
    "你是一个乐于助人的助手。",
    "你是一个简洁的助手，请简明准确地回答。",
    "你是一个耐心的助手，会把事情解释清楚。",
    "请认真、诚实地回答用户的问题。",
    "你是一个知识丰富的助手，回答要准确、有条理。",
    "你是一个友好的 AI 助手，用提问的语言回答。",
)


class ChatKind(DataKind):
    """Conversations for fine-tuning: ids and a loss mask on the assistant turns, packed into blocks."""

    name = "chat"
    about = "conversations for fine-tuning"
    help = ("conversations (MiniMind, OpenAI messages or Alpaca JSONL) rendered with the ChatML template, loss "
            "only on assistant replies")
    unit = "conversation"
    noun = "conversations"
    masked = True
    jsonl_only = "chat data must be .jsonl (one conversation per line)"
    augments = True
    segments = True  # a block packs whole conversations, each a segment
    texts_help = "the tools offered and each message's reasoning, content and tool calls"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.truncated = self.too_long = 0  # conversations cut to fit max_tokens, and skipped as too long
        self.read = 0  # conversations read so far, in input order: each one's augmentation draw
        self.augmented = {"system_prompt": 0, "empty_think": 0}
        if self.cfg.empty_think_ratio and self.tok.chat_format is not QWEN3:
            raise UserError(f"empty_think_ratio={self.cfg.empty_think_ratio:g}: the tokenizer {self.tok.path} "
                            f"carries a chat template ({self.tok.chat_format.name}) without nanolm's think block; "
                            "drop it")

    @classmethod
    def units(cls, data: PackedData, seq_len: int) -> PackedConversations:
        return PackedConversations(data, seq_len)

    read_records = staticmethod(iter_chat_records)
    record_texts = staticmethod(lambda conv: conversation_texts(conv))  # defined below: looked up when called

    def check_tokenizer(self) -> None:
        tok = self.tok
        if tok.chat_format is QWEN3 and tok.missing_tags():  # the tags nanolm's layout writes
            warnings.warn(f"{tok.path}: lacks {', '.join(tok.missing_tags())} as added tokens; the chat template "
                          "writes them, so each is spelled in several tokens (longer sequences, a tag the model "
                          "must learn to spell). Add them to the tokenizer (tokenizers' add_tokens, then resize the "
                          "model's embeddings) or train one with `nanolm tokenizer train`", stacklevel=4)

    def options(self) -> dict[str, Any]:
        augment = ({"system_ratio": self.cfg.system_ratio, "empty_think_ratio": self.cfg.empty_think_ratio,
                    "seed": self.cfg.seed} if self.cfg.system_ratio or self.cfg.empty_think_ratio else {})
        return {**super().options(), **augment}

    def plan(self) -> str:
        return f"chat, max {self.cfg.max_tokens} tokens per conversation, "

    def records(self, path: Path) -> Iterator[Record]:
        for conv, *rest in chat_records(self.cfg.skip_bad, self.stats, self.tok)(path):
            yield (self.augment(conv), *rest)

    def augment(self, conv: Conversation) -> Conversation:
        """The SFT augmentations, drawn for this conversation alone from the seed and its place in the input: a
        built-in system prompt where it has no system message (a share `system_ratio`), its empty think blocks
        trained on (a share `empty_think_ratio`)."""
        cfg, n = self.cfg, self.read
        self.read += 1
        if not (cfg.system_ratio or cfg.empty_think_ratio):
            return conv
        rng = random.Random(f"{cfg.seed}:{n}")
        system, think, pick = rng.random() < cfg.system_ratio, rng.random() < cfg.empty_think_ratio, rng.random()
        messages = conv.messages
        if system and messages[0].role != "system":
            messages = (Message("system", SYSTEM_PROMPTS[int(pick * len(SYSTEM_PROMPTS))]), *messages)
            self.augmented["system_prompt"] += 1
        self.augmented["empty_think"] += think
        return replace(conv, messages=messages, empty_think=think)

    def job(self, chunk: Chunk) -> tuple[Callable[..., Any], tuple]:
        return encode_chats, (chunk.items, self.cfg.max_tokens)

    def consume(self, writers: dict[str, SplitWriter], chunk: Chunk, tokens: np.ndarray, mask: np.ndarray,
                lens: np.ndarray, truncated: int, too_long: int) -> None:
        kept = lens > 0  # conversations skipped as too long have no tokens
        write_splits(writers, np.array(chunk.is_val, dtype=bool)[kept], tokens, lens[kept],
                     np.ones(int(kept.sum()), dtype=bool), mask)
        self.truncated += truncated
        self.too_long += too_long

    def empty(self, files: list[Path]) -> str:
        return (f"no conversations in {', '.join(map(str, files))} ({self.stats.bad_lines} bad line(s) skipped, "
                f"{self.too_long} longer than max_tokens={self.cfg.max_tokens}); check the files, or raise "
                "--max-tokens")

    def section(self, splits: Splits, n_docs: int) -> dict[str, Any] | None:
        augmented = {"augmented": dict(self.augmented)} if self.cfg.system_ratio or self.cfg.empty_think_ratio else {}
        return {"template": self.tok.chat_format.name, "mask": True, "max_tokens": self.cfg.max_tokens,
                "n_trainable": sum(s["n_trainable"] for s in splits.values()), "truncated": self.truncated,
                "skipped_too_long": self.too_long, **augmented}

    def fitting(self, manifest: Manifest) -> list[str]:
        n_trainable, n_tokens = manifest.section["n_trainable"], manifest.totals["n_tokens"]  # type: ignore[index]
        return [f"trainable (assistant) tokens: {fmt_count(n_trainable)} = {100 * n_trainable / n_tokens:.1f}% of "
                f"all; truncated {self.truncated} conversation(s) longer than {self.cfg.max_tokens} tokens, "
                f"skipped {self.too_long} that could not be cut to fit"]


def _check_masks(data: PackedData) -> None:
    """UserError when a split of a masked kind carries no loss mask (its manifest lists none)."""
    if data.masks is None:
        raise UserError(data.no_mask(data.shard_entries()[0]["bin"]))


def message_texts(m: Message) -> Iterator[str]:
    """What a tokenizer trains on of a message: its reasoning, its content and its tool calls."""
    yield from (t for t in (m.reasoning, m.content) if t)
    for c in m.tool_calls:
        yield f'{{"name": "{c.name}", "arguments": {c.arguments}}}'


def conversation_texts(conv: Conversation) -> Iterator[str]:
    """What a tokenizer trains on of a conversation: the tools it offers, then its messages' texts."""
    yield from conv.tools
    for m in conv.messages:
        yield from message_texts(m)


def conversation_chars(conv: Conversation) -> int:
    return sum(len(m.content) + len(m.reasoning) + sum(len(c.arguments) for c in m.tool_calls)
               for m in conv.messages) + sum(map(len, conv.tools))


def chat_records(skip_bad: bool, stats: ReadStats, tok: Tokenizer) -> Callable[[Path], Iterator[Record]]:
    """Conversations, each one that the tokenizer's chat layout can render."""
    def records(path: Path) -> Iterator[Record]:
        for conv, nbytes in iter_chat_records(path, skip_bad=skip_bad, stats=stats, fmt=tok.chat_format,
                                              tokenizer=str(tok.path)):
            yield conv, True, conversation_chars(conv), nbytes, None
    return records


def encode_chats(state: dict[str, Any], convs: list[Conversation],
                 max_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """Ids and mask of each conversation (each followed by EOT, mask 0), fitted to max_tokens.

    Returns (tokens, mask, lens, n_truncated, n_too_long); lens[i] is conversation i's
    length with its EOT, 0 for one skipped as too long.
    """
    fmt = chat_state(state).chat_format
    rendered = encode_spans(state, [empty_think_trained(fmt.spans(c.messages, c.tools)) if c.empty_think
                                    else fmt.spans(c.messages, c.tools) for c in convs])
    out = Documents(len(convs), state["dtype"], state["eot"])
    for i, doc in enumerate(rendered):
        fitted = out.fitted(doc, len(doc[0]), max_tokens, fit_conversation)
        if fitted is not None:
            out.add(i, *fitted)
    return out.result()


def empty_think_trained(spans: list[Span]) -> list[Span]:
    """The spans with each empty think block's close (`\n</think>\n\n`) trained where the reply after it is."""
    out = list(spans)
    for i in range(len(out) - 1):
        if out[i].text == EMPTY_THINK_CLOSE and not out[i].trains and out[i + 1].trains:
            out[i] = replace(out[i], trains=True)
    return out


def chat_state(state: dict[str, Any]) -> Tokenizer:
    """The worker's nanolm Tokenizer (its chat layout, the bytes of its tokens), loaded on first use."""
    if "tokenizer" not in state:
        state["tokenizer"] = Tokenizer.load(state["file"])
        state["lengths"] = state["tokenizer"].spelled_lengths()
    return state["tokenizer"]


def encode_spans(state: dict[str, Any], spans: list[list[Span]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """`chat.encode_chats` of the conversations' spans, the texts encoded in one batch; the first one is also
    checked to be spelled byte for byte by its tokens (`chat.check_spelling`)."""
    texts = ["".join(s.text for s in sp) for sp in spans]
    ids = encode_batch(state["tok"], texts)
    if texts:
        check_spelling(texts[0], ids[0], chat_state(state).token_bytes(), state["file"])
    return encode_with_masks(spans, ids, state["lengths"], state["file"])


class Documents:
    """The documents a chat or pair job gives back: each one's ids and mask followed by EOT (mask 0), and
    how many were truncated or skipped as too long."""

    def __init__(self, n: int, dtype: np.dtype, eot: int) -> None:
        self.dtype = dtype
        self.eot = np.array([eot], dtype=np.int64)
        self.ids: list[np.ndarray] = []
        self.mask: list[np.ndarray] = []
        self.lens = np.zeros(n, dtype=np.int64)  # 0 for a document left out
        self.truncated = self.too_long = 0

    def fitted(self, doc: Any, longest: int, max_tokens: int, fit: Callable[..., Any]) -> Any:
        """`doc` (a conversation's (ids, mask), or a pair of them) as it is written: itself where its longest
        conversation (`longest` tokens) fits max_tokens, else fit(*doc, max_tokens) counted as truncated, or None
        counted as too long where it cannot be cut to fit."""
        if longest <= max_tokens:
            return doc
        fitted = fit(*doc, max_tokens)
        if fitted is None:
            self.too_long += 1
        else:
            self.truncated += 1
        return fitted

    def add(self, i: int, ids: np.ndarray, mask: np.ndarray) -> None:
        self.ids += [ids, self.eot]
        self.mask += [mask, np.zeros(1, dtype=np.uint8)]
        self.lens[i] = len(ids) + 1

    def result(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
        """(tokens, mask, lens, n_truncated, n_too_long)."""
        if not self.ids:
            return np.zeros(0, dtype=self.dtype), np.zeros(0, dtype=np.uint8), self.lens, self.truncated, self.too_long
        return (np.concatenate(self.ids).astype(self.dtype), np.concatenate(self.mask), self.lens,
                self.truncated, self.too_long)


def pack_blocks(lengths: np.ndarray, capacity: int, chunk: int = PACK_CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """Group items of the given lengths (each in [1, capacity]) into blocks of at most `capacity`.

    Each run of `chunk` consecutive items is packed on its own, by best-fit
    decreasing (`_best_fit_decreasing`) or by `_fill_exactly`. The first chunk
    that best-fit leaves more than 1 - GOOD_FILL empty is packed both ways, and
    the way that needs fewer blocks packs the chunks after it too: the items
    come in random order, so one chunk is much like another, and trying both on
    every chunk would cost up to ten times as long. Returns (order, starts): the
    item indices block by block, and where each block starts in order
    (n_blocks + 1 entries). Deterministic.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(f"item lengths must be in [1, {capacity}], got {lengths.min()}..{lengths.max()}")
    blocks: list[list[int]] = []
    exact: bool | None = None  # whether _fill_exactly packs; None until a chunk has decided it
    for c0 in range(0, len(lengths), chunk):
        sub = lengths[c0:c0 + chunk].tolist()
        if exact:
            packed = _fill_exactly(sub, capacity)
        else:
            packed = _best_fit_decreasing(sub, capacity)
            if exact is None and sum(sub) < GOOD_FILL * len(packed) * capacity:
                other = _fill_exactly(sub, capacity)
                exact = len(other) < len(packed)
                packed = other if exact else packed
        blocks += [[c0 + i for i in b] for b in packed]
    order = np.fromiter((i for b in blocks for i in b), dtype=np.int64, count=len(lengths))
    starts = np.zeros(len(blocks) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in blocks], out=starts[1:])
    return order, starts


def _best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Blocks of item indices: the longest item first, each into the open block it leaves the least room in,
    or into a new one. Near-optimal when a block holds many items."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep their order
    smallest = min(lengths)
    blocks: list[list[int]] = []
    free: list[int] = []  # room left in the open blocks, ascending
    owner: list[int] = []  # the block of each entry of `free`
    for i in order:
        n = lengths[i]
        j = bisect.bisect_left(free, n)
        if j == len(free):
            b, room = len(blocks), capacity - n
            blocks.append([i])
        else:
            b, room = owner.pop(j), free.pop(j) - n
            blocks[b].append(i)
        if room >= smallest:  # a block with less room can take nothing more
            j = bisect.bisect_left(free, room)
            free.insert(j, room)
            owner.insert(j, b)
    return blocks


def _fill_exactly(lengths: list[int], capacity: int) -> list[list[int]]:
    """Blocks of item indices, one at a time: the longest item left, then the subset of the items left
    that fills the room best (subset sum over lengths, as bitsets). Better than best-fit when a block
    holds only a few items, where best-fit leaves gaps smaller than any item."""
    by_length: dict[int, list[int]] = {}
    for i in range(len(lengths) - 1, -1, -1):  # pop() then takes items in their given order
        by_length.setdefault(lengths[i], []).append(i)
    present = sorted(by_length)  # distinct lengths left, ascending
    blocks: list[list[int]] = []

    def take(n: int) -> int:
        items = by_length[n]
        i = items.pop()
        if not items:
            del by_length[n]
            present.remove(n)
        return i

    while present:
        first = present[-1]
        block = [take(first)]
        room = capacity - first
        # reach: bit v set when some subset of the lengths tried so far sums to v (<= room).
        reach, full, steps = 1, (1 << (room + 1)) - 1, []
        for n in present[:bisect.bisect_right(present, room)]:
            for _ in range(min(len(by_length[n]), room // n)):
                steps.append((n, reach))
                reach = (reach | (reach << n)) & full
            if reach >> room & 1:
                break  # the room can be filled exactly
        v = reach.bit_length() - 1  # the best sum; walk back through the steps that made it
        for n, before in reversed(steps):
            if v == 0:
                break
            if not before >> v & 1:
                v -= n
                block.append(take(n))
        blocks.append(block)
    return blocks


class Conversations:
    """What the kinds made of whole conversations of a chat or preference split (with their loss masks)
    share: the documents, fitted to seq_len + 1 tokens each by ChatML's truncation policy.

    A subclass fits its units (`_fit`) and says what they are called (noun, short_noun, each, cut_what).
    """

    noun: str  # what n_state counts: "conversations", "preference pairs"
    short_noun: str  # the same, named again in a message
    each: str  # what must fit in a block: "" (a conversation: the unit), " a conversation" (of a pair)
    cut_what: str  # what of a unit was too long: "" (a conversation), " with a conversation" (a pair)

    def __init__(self, data: PackedData, seq_len: int) -> None:
        _check_masks(data)
        self.data, self.seq_len, self.block = data, seq_len, seq_len + 1
        self.shard, self.start, self.length = data.documents()
        fitted, long, kept = self._fit()
        self.n_state = len(long)  # units of the split, trained on or not
        self.n_cut = int((long & kept).sum())
        self.kept = np.flatnonzero(kept)  # unit ids that are trained on
        self.n_dropped = self.n_state - len(self.kept)
        if len(self.kept) == 0:
            raise UserError(f"{data.data_dir} ({data.split}): {self.empty()}")
        self.lengths = fitted[self.kept]  # fitted length(s) of each kept unit

    def _fit(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per unit: its fitted length(s), 0 when it cannot be cut to fit; whether it was longer than a block;
        whether it is kept (trained on)."""
        raise NotImplementedError

    def _raw(self, doc: int) -> tuple[np.ndarray, np.ndarray]:
        """Ids and mask of document `doc` of the split, as stored."""
        shard, start, length = int(self.shard[doc]), int(self.start[doc]), int(self.length[doc])
        ids = self.data.doc_ids(shard, start, length)
        return ids, np.asarray(self.data.masks[shard][start:start + length])  # type: ignore[index]

    def amount(self, count: Any, seq_len: Any, again: bool = False) -> str:
        return f"{count} {self.short_noun if again else self.noun} at seq_len {seq_len}"

    def empty(self) -> str:
        return (f"none of its {self.n_state} {self.noun} fits in seq_len+1 = {self.block} tokens{self.each} with "
                f"a reply token left; raise seq_len, or run `nanolm prepare --format {self.data.kind} --max-tokens "
                f"{self.block}` on shorter {self.short_noun}")

    def _cut_note(self) -> str:
        """The end of `describe`: the units cut to fit, and those left out."""
        return (f"; {self.n_cut}{self.cut_what} longer than {self.block} tokens cut to fit" if self.n_cut else "") + \
               (f", {self.n_dropped} left out (no reply token would fit)" if self.n_dropped else "")


class PackedConversations(Conversations):
    """Chat data: blocks of seq_len + 1 tokens, each packing whole conversations that do not see each other."""

    name = "blocks"
    state_key = "n_conversations"
    noun = short_noun = "conversations"
    each = cut_what = ""

    def __init__(self, data: PackedData, seq_len: int) -> None:
        super().__init__(data, seq_len)
        self.n_real = int(self.lengths.sum())
        self._positions = np.arange(self.block, dtype=np.int64)

    def _fit(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        long = self.length > self.block
        fitted = self.length.copy()
        for c in np.flatnonzero(long).tolist():
            cut = fit_conversation(*self._raw(c), self.block)
            fitted[c] = 0 if cut is None else len(cut[0])
        return fitted, long, fitted > 0

    def tokens(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Ids and mask of kept conversation k, fitted to the block."""
        ids, mask = self._raw(int(self.kept[k]))
        if len(ids) > self.block:
            ids, mask = fit_conversation(ids, mask, self.block)  # type: ignore[misc]
        return ids, mask

    def _plan(self, order: np.ndarray) -> _Blocks:
        """Blocks of the kept conversations taken in `order`."""
        packed, starts = pack_blocks(self.lengths[order], self.block)
        return _Blocks(order[packed], starts)

    def order(self, seed: int, epoch: int) -> Order:
        # The conversations shuffled, packed, then the blocks shuffled, all with one generator.
        rng = np.random.default_rng([seed, epoch])
        return self._plan(rng.permutation(len(self.kept))).shuffled(rng)

    def file_order(self) -> Order:
        return self._plan(np.arange(len(self.kept)))

    def batch(self, parts: list[list[np.ndarray]], pin: bool) -> Batch:
        """Rows of x, y, pos, seg from blocks given as arrays of kept-conversation indices."""
        blocks = [b for part in parts for b in part]
        rows, width = len(blocks), self.block
        ids = np.zeros((rows, width), dtype=np.int64)  # padding is id 0, mask 0
        mask = np.zeros((rows, width), dtype=np.uint8)
        seg = np.empty((rows, width), dtype=np.int64)
        pos = np.empty((rows, width), dtype=np.int64)
        for r, convs in enumerate(blocks):
            at = 0
            for s, k in enumerate(convs.tolist()):
                t, m = self.tokens(k)
                n = len(t)
                ids[r, at:at + n], mask[r, at:at + n] = t, m
                seg[r, at:at + n], pos[r, at:at + n] = s, self._positions[:n]
                at += n
            seg[r, at:], pos[r, at:] = len(convs), self._positions[:width - at]
        y = targets(ids, mask)
        y[seg[:, 1:] != seg[:, :-1]] = IGNORE_INDEX  # the last token of a segment predicts nothing
        return pinned(Batch(torch.from_numpy(np.ascontiguousarray(ids[:, :-1])), torch.from_numpy(y),
                             torch.from_numpy(np.ascontiguousarray(pos[:, :-1])),
                             torch.from_numpy(np.ascontiguousarray(seg[:, :-1]))), pin)

    def tokens_per_epoch(self, order: Order) -> int:
        return len(order) * self.seq_len

    def describe(self, order: Order, batch_size: int) -> str:
        fill = self.n_real / (len(order) * self.block)  # of the positions, those holding a real token
        hint = "" if fill >= 0.97 else " (the conversations are long for this seq_len: few fit together)"
        return (f"{len(self.kept)} conversations ({self.n_real:,} tokens) packed into {len(order)} blocks of "
                f"seq_len+1 = {self.block}: {100 * fill:.1f}% of positions hold a real token{hint}{self._cut_note()}")

    def holds(self, n_units: int) -> str:
        return f"{len(self.kept)} conversations make {n_units} blocks of seq_len+1 = {self.block} tokens"

    def needs(self, step: int) -> str:
        return f"{step}; prepare more conversations, or lower batch_size"


class _Blocks:
    """A chat epoch's order: its blocks, each a run of kept-conversation indices; a slice is a list of blocks."""

    def __init__(self, convs: np.ndarray, starts: np.ndarray) -> None:
        self.convs, self.starts = convs, starts  # the conversations block by block; where each block starts

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, s: slice) -> list[np.ndarray]:
        lo, hi, _ = s.indices(len(self))
        return [self.convs[self.starts[j]:self.starts[j + 1]] for j in range(lo, hi)]

    def shuffled(self, rng: np.random.Generator) -> _Blocks:
        """The same blocks in a random order."""
        counts = np.diff(self.starts)
        perm = rng.permutation(len(counts))
        new_counts = counts[perm]
        new_starts = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(new_counts, out=new_starts[1:])
        # Entry i of the new order is entry (old start of its block) + (i - new start of its block).
        shift = np.repeat(self.starts[:-1][perm] - new_starts[:-1], new_counts)
        return _Blocks(self.convs[np.arange(len(self.convs)) + shift], new_starts)


def targets(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """(R, W - 1) next-token targets of rows of ids (R, W), IGNORE_INDEX where the mask of the target is 0."""
    y = ids[:, 1:].copy()
    y[(mask[:, 1:] & TARGET) == 0] = IGNORE_INDEX
    return y
