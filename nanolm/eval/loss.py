"""Loss, perplexity and bits per byte of a trained model on any text (`nanolm eval`).

The text is either .txt/.jsonl files or built-in corpus names (read as
`nanolm prepare` reads them and tokenized in memory with the checkpoint's own
tokenizer, each document followed by `<|endoftext|>`), or a directory made by
`nanolm prepare` with the checkpoint's tokenizer (its val split, else its
train split). Either way the tokens form one stream, cut into non-overlapping
windows of seq_len + 1 tokens at stride seq_len, as training reads them, plus
a last shorter window for the tail, so every token but the first is
predicted exactly once. Chat data prepared with `--format chat` is read in
blocks of whole conversations instead, with the loss on the assistant replies
only.

Results: `loss`, the mean cross-entropy in nats per predicted token; `ppl`
= exp(loss); `bpb`, bits per byte: the summed loss in bits over the UTF-8
bytes the predicted tokens stand for (the tokenizer's token_byte_lengths;
special tokens count no bytes). Loss per token depends on the tokenizer,
bits per byte does not, so bpb compares models with different tokenizers on
the same text.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
import torch.nn as nn

from nanolm.data import kinds
from nanolm.data.loader import iter_eval_batches
from nanolm.data.shards import IGNORE_INDEX, MANIFEST, Batch, Manifest, PackedData
from nanolm.errors import UserError
from nanolm.infer.generate import check_vocab
from nanolm.progress import Progress, fmt_count
from nanolm.runtime import autocast, resolve_device, resolve_dtype
from nanolm.tokenizer import Tokenizer

ENCODE_CHARS = 1 << 20  # characters of documents tokenized per encode_batch call


def is_prepared(path: str | Path) -> bool:
    """True for a directory made by `nanolm prepare`."""
    return Path(path).is_dir() and (Path(path) / MANIFEST).is_file()


def tokenize_files(files: Sequence[Path], tok: Tokenizer, limit: int | None = None) -> np.ndarray:
    """The documents of `files` as one int64 token stream, each followed by EOT; stops after `limit` tokens."""
    from nanolm.data.formats import iter_documents

    chunks: list[np.ndarray] = []
    total = 0

    def flush(docs: list[str]) -> None:
        nonlocal total
        for ids in tok.encode_batch(docs):
            chunks.append(np.array([*ids, tok.eot_id], dtype=np.int64))
            total += len(ids) + 1

    pending: list[str] = []
    pending_chars = 0
    for file in files:
        for doc in iter_documents(file):
            pending.append(doc)
            pending_chars += len(doc)
            if pending_chars >= ENCODE_CHARS:
                flush(pending)
                pending, pending_chars = [], 0
                if limit is not None and total >= limit:
                    return np.concatenate(chunks)[:limit]
    if pending:
        flush(pending)
    stream = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
    return stream if limit is None else stream[:limit]


def window_batches(tokens: np.ndarray, seq_len: int, batch_size: int) -> Iterator[Batch]:
    """Batches of non-overlapping windows of seq_len + 1 tokens at stride seq_len, then the tail as a
    shorter one-row batch, so each token after the first is a target exactly once."""
    n_windows = (len(tokens) - 1) // seq_len
    cols = np.arange(seq_len + 1)
    for start in range(0, n_windows, batch_size):
        rows = np.arange(start, min(start + batch_size, n_windows))
        win = torch.from_numpy(np.asarray(tokens[rows[:, None] * seq_len + cols], dtype=np.int64))  # (b, T+1)
        yield Batch(win[:, :-1].contiguous(), win[:, 1:].contiguous())
    tail = np.asarray(tokens[n_windows * seq_len:], dtype=np.int64)
    if len(tail) >= 2:
        win = torch.from_numpy(tail)[None]  # (1, t+1), t < seq_len
        yield Batch(win[:, :-1].contiguous(), win[:, 1:].contiguous())


def _prepared_stream(data: PackedData, limit: int | None) -> np.ndarray:
    """The split's shards end to end (each ends with a whole document), at most `limit` tokens."""
    parts, total = [], 0
    for i, shard in enumerate(data.shards):
        take = len(shard) if limit is None else min(len(shard), limit - total)
        parts.append(data.check_ids(np.asarray(shard[:take], dtype=np.int64), i))  # a damaged shard: UserError
        total += take
        if limit is not None and total >= limit:
            break
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _open_prepared(path: Path, tok: Tokenizer, ckpt_dir: Path) -> PackedData:
    """The val split of a prepared directory, else its train split, checked against the checkpoint's tokenizer."""
    splits = Manifest.read(path).splits  # a UserError names what is wrong with it
    data = PackedData(path, "val" if splits.get("val", {}).get("shards") else "train")
    theirs = data.manifest.tokenizer.fingerprint
    if theirs != tok.fingerprint:
        raise UserError(f"{path / MANIFEST}: the data was tokenized with tokenizer {theirs[:12]}, but {ckpt_dir} "
                        f"uses tokenizer {tok.fingerprint[:12]}; pass the raw .txt/.jsonl files instead (nanolm eval "
                        f"tokenizes them with the checkpoint's tokenizer), or prepare the data with this tokenizer")
    unscorable = kinds.get(data.kind, str(path / MANIFEST)).unscorable
    if unscorable:
        raise UserError(f"{path}: {unscorable}")
    return data


@torch.no_grad()
def lm_scores(model: nn.Module, batches: Iterable[Batch], autocast: Callable[[], AbstractContextManager],
              token_bytes: torch.Tensor | None, on_batch: Callable[[int], None] | None = None
              ) -> tuple[float, int, float]:
    """(summed cross-entropy in nats, target tokens, UTF-8 bytes those targets stand for) over the batches: what
    `nanolm eval` reports and what a run's validation measures (`train/objectives.py`), one computation.

    Only targets != IGNORE_INDEX count (chat data: the assistant replies). token_bytes maps a token id to its
    byte length (None: bytes are not counted). on_batch(n_targets) is called after each batch.
    """
    loss_sum, n_tokens, n_bytes = 0.0, 0, 0.0
    for batch in batches:
        with autocast():
            # The model's fused output projection and loss, summed over the targets (no logits written).
            loss_sum += model(batch.x, pos=batch.pos, seg=batch.seg, targets=batch.y).item()
        targets = batch.y[batch.y != IGNORE_INDEX].cpu()
        n_tokens += targets.numel()
        if token_bytes is not None:
            n_bytes += token_bytes[targets].sum().item()
        if on_batch is not None:
            on_batch(targets.numel())
    return loss_sum, n_tokens, n_bytes


def evaluate(checkpoint: str | Path, sources: Sequence[str | Path], *, which: str = "best", batch_size: int = 8,
             seq_len: int | None = None, max_tokens: int | None = None, device: str = "auto",
             adapter: str | Path | None = None, quiet: bool = False) -> dict[str, Any]:
    """Score a checkpoint on text. Returns {"loss", "ppl", "bpb", "tokens", "bytes", "seq_len", "split",
    "checkpoint", "data"}.

    checkpoint: a run or checkpoint directory (`which` = best or last of a run); adapter: a LoRA run to
    apply. sources: .txt/.jsonl files, directories of them and built-in corpus names, or one prepared
    directory. seq_len: the window (default the model's training seq_len). max_tokens: score only the
    first max_tokens predicted tokens (chat data: whole blocks, at least that many positions).
    """
    from nanolm.checkpoint import load_model, require_causal, trained_seq_len
    from nanolm.corpora import resolve_sources

    if which not in ("best", "last"):
        raise UserError(f"which={which!r}: use 'best' (lowest validation loss) or 'last'")
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("max_tokens", max_tokens)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UserError(f"{name}={value!r}: must be a positive integer")
    if not sources:
        raise UserError("no data given; pass .txt/.jsonl files, built-in corpus names or a prepared directory")
    dev = resolve_device(device)
    model, ckpt_dir = load_model(checkpoint, which, dev, adapter=adapter)
    require_causal(model.config, "loss and perplexity of text (next-token prediction)", ckpt_dir)
    cfg = model.config
    if not (ckpt_dir / "tokenizer.json").is_file():
        raise UserError(f"{ckpt_dir}: holds no tokenizer.json, so its text cannot be tokenized; "
                        "use a checkpoint written by nanolm train")
    tok = Tokenizer.load(ckpt_dir)
    check_vocab(tok, cfg.vocab_size)
    T = seq_len or trained_seq_len(ckpt_dir)
    if T > cfg.max_seq_len:
        raise UserError(f"seq_len={T}: the model was built for at most {cfg.max_seq_len} tokens "
                        f"(model.max_seq_len); pass a smaller --seq-len")
    limit = None if max_tokens is None else max_tokens + 1  # n tokens give n - 1 targets

    split: str | None = None
    prepared = [s for s in sources if is_prepared(s)]
    if prepared:
        if len(sources) > 1:
            raise UserError(f"{prepared[0]}: a prepared directory is evaluated alone; pass it, or text files, "
                            "not both")
        data = _open_prepared(Path(prepared[0]), tok, ckpt_dir)
        split, described = data.split, f"{prepared[0]} ({data.split} split)"
        if kinds.get(data.kind).masked:  # scored where its loss mask says, through the loader's batches
            max_batches = None if max_tokens is None else math.ceil(max_tokens / (batch_size * T))
            batches: Iterator[Batch] = iter_eval_batches(data, batch_size, T, max_batches)
            expected = None
        else:
            stream = _prepared_stream(data, limit)
            batches, expected = window_batches(stream, T, batch_size), len(stream) - 1
    else:
        files = resolve_sources(sources)
        stream = tokenize_files(files, tok, limit)
        described = ", ".join(str(s) for s in sources)
        batches, expected = window_batches(stream, T, batch_size), len(stream) - 1
    if expected is not None and expected < 1:
        raise UserError(f"{described}: no text to score (fewer than two tokens); pass more text")

    token_bytes = torch.from_numpy(tok.token_byte_lengths().astype(np.float64))
    dtype = resolve_dtype("auto", dev)
    with Progress(expected, "eval", "tok", enabled=not quiet) as bar:
        loss_sum, n_tokens, n_bytes = lm_scores(model, (b.to(dev) for b in batches), lambda: autocast(dev, dtype),
                                                token_bytes, on_batch=bar.update)
    if n_tokens == 0:
        raise UserError(f"{described}: no target tokens to score; pass more text")
    loss = loss_sum / n_tokens
    return {
        "loss": loss,
        "ppl": math.exp(loss) if loss < 700 else float("inf"),
        "bpb": loss_sum / (math.log(2) * n_bytes) if n_bytes > 0 else float("nan"),
        "tokens": n_tokens,
        "bytes": int(n_bytes),
        "seq_len": T,
        "split": split,
        "checkpoint": str(ckpt_dir),
        "data": described,
    }


def format_result(result: dict[str, Any]) -> str:
    """One line for the terminal: loss, perplexity, bits per byte and how much text they cover."""
    return (f"loss {result['loss']:.4f} nats/token | ppl {result['ppl']:.2f} | bpb {result['bpb']:.4f} | "
            f"{fmt_count(result['tokens'])} tokens, {fmt_count(result['bytes'])} bytes, seq_len "
            f"{result['seq_len']} | {result['checkpoint']} on {result['data']}")


def reply_batches(tok: Tokenizer, conversations: Sequence[Any], max_len: int, batch_size: int) -> Iterator[Batch]:
    """Batches of one conversation per row, teacher-forced with the loss on its replies: each conversation
    (`nanolm.chat.Conversation`) rendered through the tokenizer's chat template with its tools, ids and mask as
    `nanolm prepare --format chat` stores them (`chat.encode_chat`), cut to max_len + 1 tokens by ChatML's
    truncation policy (left out when no reply token would be left). A row's x is ids[:-1], y is ids[1:] with
    IGNORE_INDEX where the target is not a reply token; rows are padded at the end (x 0, y IGNORE_INDEX)."""
    from nanolm.chat import TARGET, encode_chat, fit_conversation

    fmt, lengths = tok.chat_format, tok.spelled_lengths()
    rows: list[tuple[np.ndarray, np.ndarray]] = []

    def batch() -> Batch:
        width = max(len(ids) for ids, _ in rows) - 1
        x = torch.zeros(len(rows), width, dtype=torch.long)
        y = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        for r, (ids, mask) in enumerate(rows):
            n = len(ids) - 1
            x[r, :n] = torch.from_numpy(ids[:-1].astype(np.int64))
            y[r, :n] = torch.from_numpy(np.where(mask[1:] & TARGET, ids[1:], IGNORE_INDEX).astype(np.int64))
        return Batch(x, y)  # (rows, width) each

    for conv in conversations:
        spans = fmt.spans(conv.messages, conv.tools)
        ids, mask = encode_chat(spans, tok.encode("".join(s.text for s in spans)), lengths, str(tok.path))
        fitted = fit_conversation(ids, mask, max_len + 1)
        if fitted is None:
            continue
        rows.append(fitted)
        if len(rows) == batch_size:
            yield batch()
            rows = []
    if rows:
        yield batch()


def reply_bits(model: torch.nn.Module, tok: Tokenizer, conversations: Sequence[Any], *,
               batch_size: int = 8) -> dict[str, float]:
    """Bits per byte of the assistant replies of `conversations` under `model`, teacher-forced (`reply_batches`:
    the replies and their closing tags are the targets, as SFT's loss and its val_bpb take them). Runs in the
    caller's autocast, the model as it is (eval mode is the caller's). Returns {"bits", "tokens", "bytes",
    "bpb"} (bpb nan when no reply byte was scored)."""
    from contextlib import nullcontext
    device = next(model.parameters()).device
    token_bytes = torch.from_numpy(tok.token_byte_lengths().astype(np.float64))
    batches = (b.to(device) for b in reply_batches(tok, conversations, model.config.max_seq_len, batch_size))
    loss_sum, n_tokens, n_bytes = lm_scores(model, batches, nullcontext, token_bytes)
    bits = loss_sum / math.log(2)
    return {"bits": bits, "tokens": n_tokens, "bytes": int(n_bytes),
            "bpb": bits / n_bytes if n_bytes > 0 else float("nan")}
