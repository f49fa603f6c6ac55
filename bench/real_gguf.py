"""A real model handed back to llama.cpp: greedy tokens of the exported GGUF against nanolm's, f32 and f16.

For a checkpoint (default: the built-in SmolLM2-135M-Instruct, imported from its GGUF; or a run, its LoRA
adapters merged), each outtype is written with `nanolm export gguf` and loaded in llama.cpp
(llama-cpp-python); five chat prompts, rendered by the checkpoint's template, are answered greedily by both
for 32 tokens (`nanolm.quickstart_model.llama_cpp_agreement`), and the number of prompts whose tokens are
all equal is printed, with the first differing position of the others. Run from the repository root:

    PYTHONPATH=. python bench/real_gguf.py                                   # the built-in model
    PYTHONPATH=. python bench/real_gguf.py runs/quickstart-smollm2-135m-instruct/lora
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main() -> None:
    from nanolm.export.gguf import export_gguf
    from nanolm.quickstart_model import base_checkpoint, llama_cpp_agreement

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", nargs="?", default="smollm2-135m-instruct",
                   help="a built-in model, a checkpoint or a run directory")
    p.add_argument("--outtypes", nargs="+", default=["f32", "f16"])
    p.add_argument("--tokens", type=int, default=32)
    a = p.parse_args()
    ckpt = base_checkpoint(a.checkpoint)
    with tempfile.TemporaryDirectory() as tmp:
        for outtype in a.outtypes:
            t0 = time.perf_counter()
            gguf = export_gguf(ckpt, Path(tmp) / f"model-{outtype}.gguf", outtype=outtype, quiet=True)
            got = llama_cpp_agreement(gguf, ckpt, tokens=a.tokens)
            if got is None:
                raise SystemExit("llama-cpp-python is not installed (pip install llama-cpp-python)")
            print(f"{outtype}: llama.cpp's greedy tokens equal nanolm's for {got['same']} of {got['prompts']} "
                  f"prompts ({got['tokens']} tokens each; first difference at {got['first_difference']}) "
                  f"[{time.perf_counter() - t0:.0f} s]", flush=True)
            gguf.unlink()


if __name__ == "__main__":
    main()
