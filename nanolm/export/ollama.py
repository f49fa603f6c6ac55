"""ollama export: a directory that `ollama create NAME -f DIR/Modelfile` turns into a chat model.

The directory holds `model.gguf` (`nanolm.export.gguf`, q8_0 unless asked
otherwise) and a `Modelfile` that says how to talk to it:
- TEMPLATE: the chat layout of the model's tokenizer in Go's text/template
  (`ChatFormat.ollama_template`), so ollama renders every conversation of
  system, user and assistant turns (reasoning included) exactly as nanolm
  does, with the generation prompt (thinking as ollama's `think` option
  says); tools and calls are written in ollama's own JSON spelling (no
  spaces), which differs from nanolm's `json.dumps` by whitespace only. One
  difference is ollama's, before any template runs: it joins consecutive
  messages of one role with a blank line, which nanolm would render as
  separate turns;
- PARAMETER stop for `<|im_end|>` (the end of a turn) and `<|endoftext|>`;
- the sampling defaults of `nanolm.config.SamplingParams` (or the ones given)
  as ollama's options: temperature, top_k, top_p, num_predict (nanolm's
  max_new_tokens), seed when one is set, and the penalties: repeat_penalty
  (nanolm's repetition_penalty, 1 = off, written even then because older
  ollama versions default to 1.1), presence_penalty and frequency_penalty
  (llama.cpp counts the prompt's tokens for these too, where nanolm counts
  the reply's only); num_ctx is the model's context length, and
  repeat_last_n -1 makes the penalties look at the whole context, as
  nanolm's repetition penalty does;
- SYSTEM only when a system prompt is given.

Why q8_0 by default: nanolm's models are small (minimind-26m is 26 MiB at
q8_0, 16 MiB at q4_0), so the 40% that q4_0 saves is little, while q8_0 is
near-lossless (see bench/RESULTS.md, GGUF quantisation, for the measured perplexities).

The Modelfile is read by ollama's parser (parser/parser.go): a value in
three double quotes is taken verbatim up to the next three, and characters
that Go does not count as printable (other than newlines and tabs) are
dropped. A system prompt that holds either would not reach the model as
written, so it is refused.
"""

from __future__ import annotations

from pathlib import Path

from nanolm.chat import QWEN3, ChatFormat
from nanolm.config.sampling import SamplingParams
from nanolm.errors import UserError
from nanolm.io import atomic_directory, check_new_directory, write_text_atomic
from nanolm.progress import fmt_bytes
from nanolm.tokenizer import Tokenizer

GGUF_FILE = "model.gguf"
MODELFILE = "Modelfile"
DEFAULT_OUTTYPE = "q8_0"
# A SamplingParams field -> the ollama option of the same meaning (seed only when set).
OLLAMA_OPTIONS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                  "max_new_tokens": "num_predict", "seed": "seed", "repetition_penalty": "repeat_penalty",
                  "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
_TRIPLE_QUOTE = '"' * 3
_KEPT_UNPRINTABLE = "\n\r\t"  # what ollama's parser keeps of the characters Go does not count as printable


def check_system(system: str) -> None:
    """UserError unless `system` reaches the model unchanged as a Modelfile's triple-quoted SYSTEM."""
    if _TRIPLE_QUOTE in system:
        raise UserError(f"--system: holds {_TRIPLE_QUOTE}, which would end the Modelfile's quoted SYSTEM early; "
                        "remove it or use single or double quotes")
    # Python's printable (no Unicode "Other" or "Separator" but the space) is Go's unicode.IsPrint.
    bad = next((c for c in system if not c.isprintable() and c not in _KEPT_UNPRINTABLE), None)
    if bad is not None:
        raise UserError(f"--system: holds the unprintable character U+{ord(bad):04X}, which ollama's Modelfile "
                        "parser drops; remove it (newlines and tabs are kept)")


def _value(x: float | int) -> str:
    return repr(x) if isinstance(x, float) else str(x)


def modelfile_text(*, context_length: int, sampling: SamplingParams, system: str | None = None,
                   gguf_file: str = GGUF_FILE, name: str = "", fmt: ChatFormat = QWEN3) -> str:
    """The Modelfile for `gguf_file` beside it (see the module docstring); fmt: the chat layout of the model's
    tokenizer."""
    from nanolm.tokenizer import EOT_ID, IM_END_ID, SPECIAL_TOKENS

    if system is not None:
        check_system(system)
    lines = [f"# {name or 'a nanolm model'}, written by `nanolm export ollama`; "
             f"load it with: ollama create <name> -f Modelfile",
             f"FROM ./{gguf_file}",
             f"TEMPLATE {_TRIPLE_QUOTE}{fmt.ollama_template}{_TRIPLE_QUOTE}"]
    if system is not None:
        lines.append(f"SYSTEM {_TRIPLE_QUOTE}{system}{_TRIPLE_QUOTE}")
    lines += [f'PARAMETER stop "{SPECIAL_TOKENS[IM_END_ID]}"', f'PARAMETER stop "{SPECIAL_TOKENS[EOT_ID]}"']
    for field, option in OLLAMA_OPTIONS.items():
        value = getattr(sampling, field)
        if value is not None:
            lines.append(f"PARAMETER {option} {_value(value)}")
    # repeat_last_n -1: llama.cpp's penalties look at the whole context, as nanolm's repetition penalty does
    lines += [f"PARAMETER num_ctx {context_length}", "PARAMETER repeat_last_n -1"]
    return "\n".join(lines) + "\n"


def export_ollama(checkpoint: str | Path, out_dir: Path, *, which: str = "best", adapter: str | Path | None = None,
                  outtype: str = DEFAULT_OUTTYPE, sampling: SamplingParams | None = None, system: str | None = None,
                  quiet: bool = False) -> Path:
    """Write `checkpoint` as an ollama model directory at `out_dir` (created; must not hold files); returns it.

    checkpoint, which, adapter: as for `export_gguf`; outtype: the GGUF's type
    (f32, f16, q8_0, q4_0); sampling: the Modelfile's sampling PARAMETERs
    (default: SamplingParams()); system: a SYSTEM prompt, none if None. The
    directory is written beside out_dir and renamed into place whole.
    """
    from nanolm.checkpoint import load_model, require_causal, run_name
    from nanolm.export.gguf import check_outtype, write_gguf

    check_outtype(outtype)
    if system is not None:
        check_system(system)
    if sampling is None:
        sampling = SamplingParams()
    if sampling.seed is not None and sampling.seed >= 2**63:
        raise UserError(f"--seed {sampling.seed}: ollama's seed is a signed 64-bit integer; "
                        "give a seed below 2**63")
    out_dir = Path(out_dir)
    check_new_directory(out_dir)
    model, ckpt_dir = load_model(checkpoint, which, "cpu", adapter)
    require_causal(model.config, "ollama export", ckpt_dir)
    if not Tokenizer.load(ckpt_dir).chat_format.ollama_template:  # a tokenizer's own Jinja template
        raise UserError(f"{ckpt_dir}: the tokenizer carries its own chat template, which nanolm has no ollama "
                        "(Go) version of; export a GGUF with `nanolm export gguf` (it carries the template) and "
                        "write the Modelfile's TEMPLATE by hand")
    with atomic_directory(out_dir) as tmp:
        what = write_gguf(model, ckpt_dir, tmp / GGUF_FILE, outtype=outtype, quiet=quiet)
        write_text_atomic(tmp / MODELFILE, modelfile_text(context_length=model.config.max_seq_len,
                                                          sampling=sampling, system=system,
                                                          name=run_name(ckpt_dir),
                                                          fmt=Tokenizer.load(ckpt_dir).chat_format))
    if not quiet:
        print(f"wrote {out_dir / GGUF_FILE} ({what}, {fmt_bytes((out_dir / GGUF_FILE).stat().st_size)}) "
              f"and {out_dir / MODELFILE}")
    return out_dir
