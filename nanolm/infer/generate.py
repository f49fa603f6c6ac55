"""Text in, streamed text out: the glue between a tokenizer and the engine (and the output block of a model
trained on input and output blocks)."""

from __future__ import annotations

import re
import sys
from typing import Iterable, Iterator, Sequence, TextIO

import torch

from nanolm.config.sampling import SamplingParams
from nanolm.errors import UserError
from nanolm.infer.engine import Engine, Guide
from nanolm.infer.text import TextStream
from nanolm.tokenizer import Tokenizer


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: str, what: str) -> str:
    """`text`, or UserError when it holds a lone surrogate: what Python makes of bytes that are not UTF-8 (in
    command-line arguments, or stdin under a C locale), and what the tokenizer cannot take."""
    m = _SURROGATE.search(text)
    if m:
        c = ord(m.group())
        bad = f"the byte 0x{c - 0xDC00:02x}, which is not UTF-8" if c >= 0xDC80 else f"a lone surrogate \\u{c:04x}"
        raise UserError(f"{what}: holds {bad}, at character {m.start() + 1}; give UTF-8 text")
    return text


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """UserError when the tokenizer has ids the model has no embedding for (a tokenizer.json that does not
    belong to the checkpoint): encoding a prompt would index past the embedding."""
    if tokenizer.vocab_size > model_vocab_size:
        raise UserError(f"{tokenizer.path}: the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                        f"{model_vocab_size} (model.vocab_size); use the tokenizer the checkpoint was trained with")


def stream_text(engine: Engine, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams,
                stop_ids: Iterable[int], stops: Sequence[str] = (), guide: Guide | None = None) -> Iterator[str]:
    """Generate and yield text pieces as soon as they form whole characters, up to the first stop string.
    guide: which ids may come next (`infer/guide.py`), or None."""
    check_vocab(tokenizer, engine.model.config.vocab_size)
    text = TextStream(tokenizer, stops)
    gen = engine.generate(prompt_ids, params, stop_ids=list(stop_ids), guide=guide)
    try:
        for tid in gen:
            piece = text.push(tid)
            if piece:
                yield piece
            if text.stopped:
                return
    finally:
        gen.close()  # frees the KV cache now, also when the caller or a stop string ends the reply early
    tail = text.finish()
    if tail:
        yield tail


def complete(engine: Engine, tokenizer: Tokenizer, prompt: str, params: SamplingParams,
             out: TextIO | None = None) -> str:
    """Continue `prompt`, printing the continuation as it is generated; returns it."""
    out = out if out is not None else sys.stdout
    ids = tokenizer.encode(check_text(prompt, "the prompt")) or [tokenizer.eot_id]
    pieces = []
    for piece in stream_text(engine, tokenizer, ids, params, (tokenizer.eot_id, tokenizer.im_end_id)):
        pieces.append(piece)
        out.write(piece)
        out.flush()
    return "".join(pieces)


@torch.no_grad()
def write_block(model: torch.nn.Module, tokenizer: Tokenizer, text: str, block_len: int) -> str:
    """The output block a model trained with --stage blocks (nanolm/data/kinds/blocks.py) writes for the input `text`,
    up to its first end-of-text, greedily: a non-causal model in one pass over the input block; a causal one
    token by token after it (at most block_len forwards, no cache: blocks are short)."""
    check_vocab(tokenizer, model.config.vocab_size)
    ids = tokenizer.encode(check_text(text, "the prompt"))
    if not 0 < len(ids) <= block_len:
        raise UserError(f"the prompt is {len(ids)} tokens; this model reads input blocks of 1 to {block_len} tokens "
                        "(its run's train.seq_len)")
    device = next(model.parameters()).device
    x = torch.full((1, block_len), tokenizer.eot_id, dtype=torch.long, device=device)
    x[0, :len(ids)] = torch.tensor(ids, device=device)
    if not model.config.causal:
        out = model(x)[0].argmax(-1).tolist()
    else:
        out = []
        for _ in range(block_len):
            out.append(int(model(x)[0, -1].argmax()))
            if out[-1] == tokenizer.eot_id:
                break
            x = torch.cat([x, x.new_tensor([[out[-1]]])], dim=1)
    end = out.index(tokenizer.eot_id) if tokenizer.eot_id in out else len(out)
    return tokenizer.decode(out[:end])
