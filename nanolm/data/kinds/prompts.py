"""RL prompts (`nanolm prepare --format prompts`): the data of `--stage grpo`, written and read here.

A prompts directory is a prepared data directory (nanolm/data/shards.py) of
kind "prompts": each document of a split is one prompt's conversation (its
system, user and tool turns) in the tokenizer's chat layout, rendered without
a generation prompt (the GRPO stage adds the generation prompt of its
grpo.thinking setting when it samples), no loss mask; beside the shards,
`<split>.records.jsonl` holds per document, in order, {"messages", "tools",
"record"}: the prompt's messages as OpenAI dicts, its tools (JSON text each)
and the record as the user gave it, so that rewards can read its reference
answers. Records are read by `nanolm.data.formats.iter_prompt_records`
(`file:line: what is wrong` for a malformed one); a prompt longer than
max_tokens tokens is skipped and counted (its completion would have no
room). The split is by kept prompt: prompt i goes to val when i % k == 1.
Prompts are few: they are validated and tokenized in this process.

Loader (`Prompts`): the unit is a prompt; a batch is a `PromptBatch` of
batch_size prompts' conversation ids and records, each epoch in the order of
`np.random.default_rng([seed, e]).permutation(n)`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from nanolm.data.formats import iter_prompt_records
from nanolm.data.jsonl import read_jsonl
from nanolm.data.kinds.base import CountedUnits, DataKind, Order, Splits
from nanolm.data.kinds.chat import conversation_texts
from nanolm.data.provenance import val_every
from nanolm.data.shards import SPLITS, Manifest, PackedData, SplitWriter
from nanolm.errors import UserError


class PromptsKind(DataKind):
    """RL prompts with their records, for --stage grpo."""

    name = "prompts"
    about = "RL prompts for --stage grpo"
    help = ("RL prompts for --stage grpo ({\"prompt\": ...} or {\"messages\": [...]}, with reference fields such "
            "as \"answer\")")
    unit = rule_unit = "prompt"
    noun = "prompts"
    streams = records_throughput = False
    mixes_as = "prompts"
    mix_fix = "RL prompts cannot be combined with other kinds of data: train them in a run of their own"
    texts_help = "the tools offered and each prompt message's text"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.too_long = 0  # prompts longer than max_tokens, left out
        self.counts = dict.fromkeys(SPLITS, 0)  # prompts per split

    @classmethod
    def units(cls, data: PackedData, seq_len: int) -> Prompts:
        return Prompts(data, seq_len)

    read_records = staticmethod(iter_prompt_records)
    record_texts = staticmethod(lambda prompt: conversation_texts(prompt[0]))  # (conversation, record)

    def plan(self) -> str:
        return f"RL prompts, max {self.cfg.max_tokens} tokens each, "

    def write(self, tmp: Path, files: list[Path], writers: dict[str, SplitWriter]) -> None:
        tok, k = self.tok, val_every(self.cfg.val_fraction)
        fmt = tok.chat_format
        per_split: dict[str, list[tuple[list[int], dict[str, Any]]]] = {s: [] for s in SPLITS}
        i = 0
        for path in files:
            for (conv, record), _ in iter_prompt_records(path, skip_bad=self.cfg.skip_bad, stats=self.stats,
                                                         fmt=fmt, tokenizer=str(tok.path)):
                ids = tok.encode(fmt.render(conv.messages, conv.tools))
                if len(ids) > self.cfg.max_tokens:
                    self.too_long += 1
                    continue
                entry = {"messages": [m.to_dict() for m in conv.messages], "tools": list(conv.tools),
                         "record": record}
                per_split["val" if k and i % k == 1 else "train"].append((ids, entry))
                i += 1
        for split, items in per_split.items():
            writers[split].append_documents([t for t, _ in items], tok.eot_id)
            lines = "".join(json.dumps(e, ensure_ascii=False) + "\n" for _, e in items)
            (tmp / records_file(tmp, split).name).write_text(lines, encoding="utf-8")
            self.counts[split] = len(items)

    def intact(self, out_dir: Path) -> bool:
        return all(records_file(out_dir, split).is_file() for split in SPLITS)

    def empty(self, files: list[Path]) -> str:
        return (f"no prompts to train on in {', '.join(map(str, files))} ({self.stats.bad_lines} bad line(s) "
                f"skipped, {self.too_long} longer than max_tokens={self.cfg.max_tokens}); check the files, or raise "
                "--max-tokens")

    def skipped(self) -> dict[str, Any]:
        return {"bad_lines": self.stats.bad_lines, "examples": self.stats.examples, "too_long": self.too_long}

    def split_policy(self, k: int, n_docs: int) -> dict[str, Any]:
        return {"val_every": k, "rule": "prompt i goes to val when val_every > 0 and i % val_every == 1"}

    def section(self, splits: Splits, n_docs: int) -> dict[str, Any] | None:
        return {"template": self.tok.chat_format.name, "n_prompts": n_docs, "train": self.counts["train"],
                "val": self.counts["val"]}

    def summary(self, manifest: Manifest, seconds: float) -> list[str]:
        bad = self.stats.bad_lines
        return [f"prepared {manifest.totals['n_docs']} prompts (train {self.counts['train']}, val "
                f"{self.counts['val']}), {manifest.totals['n_tokens']} tokens -> {self.cfg.out}; skipped "
                f"{self.too_long} longer than {self.cfg.max_tokens} tokens"
                + (f", {bad} bad line(s) (--skip-bad), first: {self.stats.examples[0]}" if bad else "")]


def records_file(data_dir: Path, split: str) -> Path:
    return Path(data_dir) / f"{split}.records.jsonl"


@dataclass
class PromptBatch:
    """A micro-batch of RL prompts: each one's conversation ids (no generation prompt) and its entry of the
    records file ({"messages", "tools", "record"}); `index` the prompts' numbers in their split."""

    prompts: list[list[int]]
    records: list[dict[str, Any]]
    index: list[int] = field(default_factory=list)

    def to(self, device: Any, non_blocking: bool = False) -> "PromptBatch":
        return self  # token ids on the host: the rollout puts what it makes on the device

    def pin_memory(self) -> "PromptBatch":
        return self


def read_records(data_dir: Path, split: str, n_docs: int) -> list[dict[str, Any]]:
    """The split's records, checked to be one per document."""
    path = records_file(data_dir, split)
    if not path.is_file():
        raise UserError(f"{path}: missing, so the prompts of {data_dir} have no records; run `nanolm prepare "
                        "--format prompts` again")
    out = []
    damaged = "the data is damaged, run `nanolm prepare --format prompts` again"
    for rec, lineno, _ in read_jsonl(path, fix=damaged):
        if not isinstance(rec, dict) or not isinstance(rec.get("messages"), list) or \
                not isinstance(rec.get("record"), dict):
            raise UserError(f"{path}:{lineno}: not a prompt record ({{\"messages\", \"tools\", \"record\"}}); "
                            f"{damaged}")
        out.append(rec)
    if len(out) != n_docs:
        raise UserError(f"{path}: {len(out)} records for {n_docs} prompts in the shards; the data is damaged, run "
                        "`nanolm prepare --format prompts` again")
    return out


def last_user_text(messages: Sequence[dict[str, Any]]) -> str:
    """The content of the last user message: the `prompt` a reward function receives."""
    return next((m.get("content", "") for m in reversed(messages) if m.get("role") == "user"), "")


class Prompts(CountedUnits):
    """RL prompts (`PromptsKind`): the unit is a prompt, its conversation's ids
    and its record; a batch is a `PromptBatch` of batch_size of them. Epoch e's order is
    `np.random.default_rng([seed, e]).permutation(n)`."""

    name = held = "prompts"
    state_key = "n_prompts"

    def __init__(self, data: PackedData, seq_len: int) -> None:
        self.data, self.seq_len = data, seq_len
        self.shard, self.start, self.length = data.documents()
        self.n_state = len(self.length)
        if self.n_state == 0:
            raise UserError(f"{data.data_dir} ({data.split}): {self.empty()}")
        self.records = read_records(data.data_dir, data.split, self.n_state)

    def order(self, seed: int, epoch: int) -> Order:
        return np.random.default_rng([seed, epoch]).permutation(self.n_state)

    def file_order(self) -> Order:
        return np.arange(self.n_state, dtype=np.int64)

    def batch(self, parts: list[np.ndarray], pin: bool) -> PromptBatch:
        index = np.concatenate(parts).tolist()
        prompts = []
        for k in index:
            shard, start, length = int(self.shard[k]), int(self.start[k]), int(self.length[k])
            prompts.append(self.data.doc_ids(shard, start, length).tolist())
        return PromptBatch(prompts, [self.records[k] for k in index], index)

    def tokens_per_epoch(self, order: Order) -> int:
        return int(self.length.sum())

    def describe(self, order: Order, batch_size: int) -> str:
        return (f"{self.n_state} prompts ({int(self.length.sum()):,} tokens, {int(self.length.max())} the longest), "
                f"{batch_size} a micro-batch")

    def empty(self) -> str:
        return "no prompts; run `nanolm prepare --format prompts` on a file that holds some"
