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
room). The split is prepare's: prompt i goes to val when i % k == 1.

`PromptBatch` is what the loader's `Prompts` unit kind (nanolm/data/loader.py)
gives for a slice of prompts.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from nanolm.data.provenance import check_replaceable, manifest_head, sha256_of, source_stat, val_every
from nanolm.data.formats import ReadStats, expand_sources, iter_prompt_records
from nanolm.data.shards import MANIFEST, SPLITS, SplitWriter, token_dtype
from nanolm.errors import UserError
from nanolm.io import atomic_directory, write_json_atomic
from nanolm.tokenizer import Tokenizer


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
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: not JSON ({e.msg}); the data is damaged, run `nanolm prepare "
                                "--format prompts` again") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("messages"), list) or \
                    not isinstance(rec.get("record"), dict):
                raise UserError(f"{path}:{lineno}: not a prompt record ({{\"messages\", \"tools\", \"record\"}}); the "
                                "data is damaged, run `nanolm prepare --format prompts` again")
            out.append(rec)
    if len(out) != n_docs:
        raise UserError(f"{path}: {len(out)} records for {n_docs} prompts in the shards; the data is damaged, run "
                        "`nanolm prepare --format prompts` again")
    return out


def last_user_text(messages: Sequence[dict[str, Any]]) -> str:
    """The content of the last user message: the `prompt` a reward function receives."""
    return next((m.get("content", "") for m in reversed(messages) if m.get("role") == "user"), "")


def prepare_prompts(sources: Sequence[Path], tokenizer_path: Path, out_dir: Path, *, max_tokens: int,
                    val_fraction: float, skip_bad: bool, shard_tokens: int, quiet: bool = False) -> dict[str, Any]:
    """Validate and tokenize RL prompts into out_dir (see the module doc); returns the manifest."""
    k = val_every(val_fraction)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir}: exists and is not a directory; choose another output directory")
    files = expand_sources(sources)
    tok = Tokenizer.load(tokenizer_path)
    fmt, dtype = tok.chat_format, token_dtype(tok.vocab_size)
    before = [source_stat(f) for f in files]
    check_replaceable(out_dir)
    stats = ReadStats()
    per_split: dict[str, list[tuple[list[int], dict[str, Any]]]] = {s: [] for s in SPLITS}
    too_long, i = 0, 0
    for path in files:
        for (conv, record), _ in iter_prompt_records(path, skip_bad=skip_bad, stats=stats, fmt=fmt,
                                                     tokenizer=str(tok.path)):
            ids = tok.encode(fmt.render(conv.messages, conv.tools))
            if len(ids) > max_tokens:
                too_long += 1
                continue
            entry = {"messages": [m.to_dict() for m in conv.messages], "tools": list(conv.tools), "record": record}
            per_split["val" if k and i % k == 1 else "train"].append((ids, entry))
            i += 1
    if not per_split["train"]:
        raise UserError(f"no prompts to train on in {', '.join(map(str, files))} ({stats.bad_lines} bad line(s) "
                        f"skipped, {too_long} longer than max_tokens={max_tokens}); check the files, or raise "
                        "--max-tokens")
    options = {"format": "prompts", "max_tokens": max_tokens, "val_fraction": val_fraction, "skip_bad": skip_bad,
               "shard_tokens": shard_tokens}
    with atomic_directory(out_dir, replace=True) as tmp:
        splits = {}
        for split, items in per_split.items():
            writer = SplitWriter(tmp, split, dtype, shard_tokens)
            writer.append_documents([t for t, _ in items], tok.eot_id)
            splits[split] = writer.finish()
            lines = "".join(json.dumps(e, ensure_ascii=False) + "\n" for _, e in items)
            (tmp / records_file(tmp, split).name).write_text(lines, encoding="utf-8")
        manifest = manifest_head(
            tok, dtype, splits, i, [{**b, "sha256": sha256_of(f)} for f, b in zip(files, before)], options,
            {"val_every": k, "rule": "prompt i goes to val when val_every > 0 and i % val_every == 1"})
        manifest["skipped"] = {"bad_lines": stats.bad_lines, "examples": stats.examples, "too_long": too_long}
        manifest["prompts"] = {"template": fmt.name, "n_prompts": i, "train": len(per_split["train"]),
                               "val": len(per_split["val"])}
        n_tokens = manifest["totals"]["n_tokens"]
        write_json_atomic(tmp / MANIFEST, manifest)
    if not quiet:
        print(f"prepared {i} prompts (train {len(per_split['train'])}, val {len(per_split['val'])}), {n_tokens} "
              f"tokens -> {out_dir}; skipped {too_long} longer than {max_tokens} tokens"
              + (f", {stats.bad_lines} bad line(s) (--skip-bad), first: {stats.examples[0]}" if stats.bad_lines
                 else ""), file=sys.stderr, flush=True)
    return manifest
