"""What a reply may write: no tool-call tag where the conversation offers no tools, no `<think>` where thinking is off.

A model fine-tuned on tool use learns to open calls; asked something with no tools in the conversation it may
still write `<tool_call>`, a call to a tool that does not exist. `TagBan` is a row guide (the engine's `Guide`)
that never lets a reply spell a banned tag, whichever way the vocabulary spells it:

- where the tag is one token (nanolm's tokenizers: `tokenizer.tag_ids`), that token, whose bytes are the tag;
- where it is plain text of several tokens (a real model's vocabulary without the tag, SmolLM2's), any token
  whose bytes, after the bytes the reply ends with, would complete the tag.

It works on bytes (`Tokenizer.token_bytes`), as `infer/guide.py` does. Per tag it follows the longest suffix of
the reply that is a prefix of the tag (a Knuth-Morris-Pratt automaton over the tag's bytes, advanced by each
token's bytes); in state s, the tokens that would complete the tag are those holding it whole, and those that
start with tag[j:] for each j in s's border chain (s, its failure link, ... down to 0). Both are precomputed
once per vocabulary (`BanVocab`: a token holding the tag, and per j the ids starting with tag[j:], a range of the
vocabulary sorted by bytes), and each state's mask is built once: a step costs a dictionary look-up per byte of
the drawn token, and where no tag is under way and no token holds one (a vocabulary that only spells it) nothing
is masked at all. The engine applies a row's mask after every change to the logits (penalties), so no bias can
re-open a banned id.

`ReplyGuides` is the one place every path takes a reply's guide from (`nanolm chat`, `nanolm serve`, eval's
generations, the RL rollouts): with tools offered, the call guide (`ToolCallGuide`) as before; with none, the
call tag banned; with thinking off in a template that switches it (its generation prompt differs), `<think>`
banned too. `AllGuides` runs several guides on one row.
"""

from __future__ import annotations

import bisect
from typing import Any, Iterable, Sequence

import torch

from nanolm.chat import ChatError
from nanolm.infer.guide import GuideVocab, ToolCallGuide, past_prefix
from nanolm.special_tokens import THINK, TOOL_CALL


def _automaton(tag: bytes) -> tuple[list[dict[int, int]], list[int]]:
    """The KMP automaton of `tag` (length L): per state s (0..L, the bytes of the tag matched) the moves that do
    not go back to 0, {byte: next state}, and each state's failure link (its longest proper border)."""
    n = len(tag)
    fail = [0] * (n + 1)
    k = 0
    for i in range(1, n):
        while k and tag[i] != tag[k]:
            k = fail[k]
        if tag[i] == tag[k]:
            k += 1
        fail[i + 1] = k
    moves: list[dict[int, int]] = []
    for s in range(n + 1):
        m = dict(moves[fail[s]]) if s else {}  # from s, a byte that does not extend goes where its border goes
        if s < n:
            m[tag[s]] = s + 1
        moves.append(m)
    return moves, fail


class BanVocab:
    """A vocabulary's tables for banning `tags` (byte strings): the ids holding a tag whole, and per tag and j the
    ids whose bytes start with tag[j:]; masks by state, built once each.

    token_bytes: the bytes each id stands for (`Tokenizer.token_bytes()`). size: the model's vocabulary (it may be
    larger than the tokenizer's; ids past it stand for no bytes and are never banned).
    """

    def __init__(self, token_bytes: Sequence[bytes], size: int, tags: Sequence[bytes],
                 device: torch.device | str = "cpu") -> None:
        if not tags or any(not t for t in tags):
            raise ValueError("a ban needs at least one non-empty tag")
        self.token_bytes, self.size, self.tags = token_bytes, size, tuple(tags)
        self.device = torch.device(device)
        ids = sorted((i for i, b in enumerate(token_bytes[:size]) if b), key=token_bytes.__getitem__)
        keys = [token_bytes[i] for i in ids]
        self._always = sorted({i for tag in self.tags for i, b in zip(ids, keys) if tag in b})
        self._automata = [_automaton(t) for t in self.tags]
        # _starts[k][j]: the ids whose bytes start with tags[k][j:] (j = 1 .. L-1; entry 0 unused)
        self._starts: list[list[list[int]]] = []
        for tag in self.tags:
            per_j: list[list[int]] = [[]]
            for j in range(1, len(tag)):
                rest, end = tag[j:], past_prefix(tag[j:])
                lo = bisect.bisect_left(keys, rest)
                hi = len(keys) if end is None else bisect.bisect_left(keys, end, lo)
                per_j.append(ids[lo:hi])
            self._starts.append(per_j)
        self._masks: dict[tuple[int, ...], torch.Tensor | None] = {}
        self.start: tuple[int, ...] = (0,) * len(self.tags)

    def allowed(self, states: tuple[int, ...]) -> torch.Tensor | None:
        """bool (size,): the ids that may come next in `states` (one per tag), or None when none is banned."""
        if states in self._masks:
            return self._masks[states]
        banned = set(self._always)
        for (_, fail), starts, s in zip(self._automata, self._starts, states):
            while s:  # the border chain of s: each border j of the reply's end that the token could finish
                banned.update(starts[s])
                s = fail[s]
        mask = None
        if banned:
            mask = torch.ones(self.size, dtype=torch.bool)
            mask[sorted(banned)] = False
            mask = mask.to(self.device)
        self._masks[states] = mask
        return mask

    def advance(self, states: tuple[int, ...], data: bytes) -> tuple[int, ...]:
        """The states after the reply writes `data`."""
        out = []
        for (moves, fail), tag, s in zip(self._automata, self.tags, states):
            for b in data:
                s = moves[s].get(b, 0)
                if s == len(tag):  # written whole (a prompt's prefill, never a reply under the ban): go on
                    s = fail[s]
            out.append(s)
        return tuple(out)


class TagBan:
    """One row's ban of its vocabulary's tags (a `Guide`): masks the ids that would complete a tag."""

    def __init__(self, vocab: BanVocab) -> None:
        self.vocab = vocab
        self.states = vocab.start

    def fork(self) -> "TagBan":
        twin = TagBan(self.vocab)
        twin.states = self.states
        return twin

    def allowed(self) -> torch.Tensor | None:
        return self.vocab.allowed(self.states)

    def feed(self, data: bytes) -> None:
        """Take bytes the reply starts with (a prefilled opening)."""
        self.states = self.vocab.advance(self.states, data)

    def advance(self, token: int) -> None:
        if 0 <= token < len(self.vocab.token_bytes):
            self.states = self.vocab.advance(self.states, self.vocab.token_bytes[token])


class AllGuides:
    """Several guides on one row: an id may come next where every guide allows it. Should they leave nothing
    between them, the first guide's mask holds (`ReplyGuides` puts the ban first)."""

    def __init__(self, guides: Sequence[Any]) -> None:
        self.guides = list(guides)

    def fork(self) -> "AllGuides":
        return AllGuides([g.fork() for g in self.guides])

    def allowed(self) -> torch.Tensor | None:
        masks = [m for m in (g.allowed() for g in self.guides) if m is not None]
        if len(masks) < 2:
            return masks[0] if masks else None
        both = masks[0]
        for m in masks[1:]:
            both = both & m
        return both if bool(both.any()) else masks[0]

    def feed(self, data: bytes) -> None:
        for g in self.guides:
            g.feed(data)

    def advance(self, token: int) -> None:
        for g in self.guides:
            g.advance(token)


def thinking_switch(fmt: Any) -> bool:
    """Whether a chat format switches thinking: its generation prompt with thinking off differs from the one with
    it on (nanolm's QWEN3 closes the think block; Qwen3's own template does the same)."""
    try:
        return fmt.generation_prompt(False) != fmt.generation_prompt(True)
    except ChatError:
        return False


class ReplyGuides:
    """The guide of each reply of one tokenizer's conversations with one model (`size` ids): see the module doc.
    The call guide's vocabulary and each ban's tables are built at first use, then shared by every reply."""

    def __init__(self, tokenizer: Any, size: int, device: torch.device | str = "cpu") -> None:
        self.tok, self.size, self.device = tokenizer, size, torch.device(device)
        self.fmt = tokenizer.chat_format
        self.switches_thinking = thinking_switch(self.fmt)
        self._call_vocab: GuideVocab | None = None
        self._bans: dict[tuple[bytes, ...], BanVocab] = {}

    def banned(self, tools: bool, thinking: bool) -> tuple[bytes, ...]:
        """The tags a reply may not write: the call tag with no tools offered, `<think>` with thinking off."""
        return ((() if tools else (TOOL_CALL.encode(),))
                + (THINK.encode(),) * (not thinking and self.switches_thinking))

    def ban(self, tags: tuple[bytes, ...]) -> TagBan:
        vocab = self._bans.get(tags)
        if vocab is None:
            vocab = self._bans[tags] = BanVocab(self.tok.token_bytes(), self.size, tags, self.device)
        return TagBan(vocab)

    def reply(self, tools: Iterable[Any] = (), *, thinking: bool = False, guide_calls: bool = True) -> Any:
        """The guide of a reply to a conversation offering `tools` (OpenAI tool objects or bare functions; none:
        the call tag banned) with thinking on or off; guide_calls: hold calls to the tools' schemas (where the
        format writes calls in tags). None when there is nothing to guide."""
        tools = list(tools)
        guides: list[Any] = []
        tags = self.banned(bool(tools), thinking)
        if tags:
            guides.append(self.ban(tags))
        if tools and guide_calls and self.fmt.guided_calls:
            if self._call_vocab is None:
                self._call_vocab = GuideVocab.of(self.tok, self.size, self.device)
            guides.append(ToolCallGuide(self._call_vocab, tools))
        return None if not guides else guides[0] if len(guides) == 1 else AllGuides(guides)
