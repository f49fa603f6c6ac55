"""The lm-evaluation-harness model `nanolm`: any lm-eval task on a native checkpoint, nothing exported.

lm-eval (0.4.x) finds models in its own registry and has no plugin hook for
packages outside it, so its command is run through this module, which
registers `nanolm` first and then hands the command line to lm-eval
unchanged:

    python -m nanolm.eval.harness --model nanolm --model_args path=runs/x \\
        --tasks ceval-valid,cmmlu --batch_size 16

(`--model_args` keys: path, which=best|last, adapter, max_gen_toks; lm-eval's
own --batch_size and --device are taken too, a CUDA device falling back to
the CPU where there is none, as lm-eval's hf model does). From Python,
`import nanolm.eval.harness` registers it for `lm_eval.simple_evaluate(model="nanolm", ...)`.

The requests are scored by the same functions as `nanolm eval --task`
(`scoring.py`): loglikelihood pairs are cut as lm-eval's own models cut them
(`encode_pair`), so on the same items the two give the same accuracy;
loglikelihood_rolling scores every token of a text once, in windows of the
model's context; generate_until decodes greedy (or sampled, do_sample with a
temperature) replies in the batched engine, cut at the `until` strings.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from nanolm.chat import render_chat
from nanolm.eval.scoring import continuation_logprobs, encode_pair, generate_texts, rolling_requests


@register_model("nanolm")
class NanoLM(LM):
    """A nanolm checkpoint (run or checkpoint directory) as an lm-eval model."""

    def __init__(self, path: str, which: str = "best", adapter: str | None = None, device: str = "auto",
                 batch_size: int | str = 16, max_batch_size: int | None = None, max_gen_toks: int | str = 256,
                 **unknown: Any) -> None:
        super().__init__()
        from nanolm.checkpoint import load_model, require_causal
        from nanolm.errors import UserError
        from nanolm.infer.generate import check_vocab
        from nanolm.runtime import resolve_device
        from nanolm.tokenizer import Tokenizer

        if unknown:
            raise UserError(f"--model_args: unknown key(s) {', '.join(sorted(unknown))} for the nanolm model; use "
                            "path, which, adapter, max_gen_toks (and lm-eval's --device, --batch_size)")
        device = str(device) if device else "auto"
        if device.startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's default --device is cuda:0; like its own hf model, run on the CPU where there is no GPU.
            print(f"nanolm: --device {device} but no CUDA GPU is visible; running on the CPU", file=sys.stderr)
            device = "auto"
        self._device = resolve_device(device)
        self.model, self.ckpt = load_model(path, which, self._device, adapter=adapter)
        require_causal(self.model.config, "lm-evaluation-harness", self.ckpt)
        self.tok = Tokenizer.load(self.ckpt)
        check_vocab(self.tok, self.model.config.vocab_size)
        # "auto" (lm-eval's batch-size search) has nothing to search on a CPU-sized model: its default is used.
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 16
        self.max_gen_toks = int(max_gen_toks)
        self._engine = None

    @property
    def engine(self):
        if self._engine is None:
            from nanolm.infer.engine import Engine
            self._engine = Engine(self.model, self._device)
        return self._engine

    @property
    def tokenizer_name(self) -> str:
        return f"nanolm-{self.tok.fingerprint[:16]}"

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return render_chat(chat_history, add_generation_prompt, fmt=self.tok.chat_format)

    def loglikelihood(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = []
        for req in requests:
            context, continuation = req.args
            pairs.append(([self.tok.eot_id], self.tok.encode(continuation)) if context == ""
                         else encode_pair(self.tok, context, continuation))
        out = continuation_logprobs(self.model, pairs, batch_size=self.batch_size, device=self._device)
        for req, res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return out

    def loglikelihood_rolling(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[float]:
        max_len = self.model.config.max_seq_len
        windows, owner = [], []
        for i, req in enumerate(requests):
            for w in rolling_requests(self.tok.encode(req.args[0]), max_len, self.tok.eot_id):
                windows.append(w)
                owner.append(i)
        scores = continuation_logprobs(self.model, windows, batch_size=self.batch_size, device=self._device)
        out = [0.0] * len(requests)
        for i, (lp, _) in zip(owner, scores):
            out[i] += lp
        for req, res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, res)
        return out

    def generate_until(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[str]:
        from nanolm.config.sampling import SamplingParams
        groups: dict[tuple, list[int]] = {}  # requests of the same settings are decoded together
        for i, req in enumerate(requests):
            kwargs = dict(req.args[1] or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 0.0)) if sample else 0.0
            key = (tuple(until), max_new, temperature)
            groups.setdefault(key, []).append(i)
        out = [""] * len(requests)
        for (until, max_new, temperature), idx in groups.items():
            params = SamplingParams(max_new_tokens=max_new, temperature=temperature,
                                    seed=0 if temperature > 0 else None)
            prompts = [self.tok.encode(requests[i].args[0]) or [self.tok.eot_id] for i in idx]
            texts = generate_texts(self.engine, self.tok, prompts, params, stops=until,
                                   stop_ids=(self.tok.eot_id, self.tok.im_end_id), rows=self.batch_size)
            for i, text in zip(idx, texts):
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out


def main(argv: Sequence[str] | None = None) -> None:
    """lm-eval's command line, with the `nanolm` model registered."""
    from lm_eval.__main__ import cli_evaluate

    from nanolm.errors import UserError
    sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    try:
        cli_evaluate()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
