"""The `nanolm` command line, run as a user runs it (a subprocess), on real files."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


def nanolm(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanolm", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})}, timeout=600)


@pytest.mark.slow
def test_tokenizer_prepare_train_generate(tmp_path, corpus):
    tok = tmp_path / "tok"
    r = nanolm("tokenizer", "train", str(corpus), "--out", str(tok), "--vocab-size", "400")
    assert r.returncode == 0, r.stderr
    assert "compression: zh" in r.stdout and "en" in r.stdout
    assert (tok / "tokenizer.json").is_file() and (tok / "tokenizer_config.json").is_file()

    data = tmp_path / "data"
    r = nanolm("prepare", str(corpus), "--tokenizer", str(tok), "--out", str(data), "--workers", "2")
    assert r.returncode == 0, r.stderr
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["splits"]["train"]["n_tokens"] > 0

    run = tmp_path / "run"
    r = nanolm("train", "--preset", "tiny", "--data", str(data), "--out", str(run), "--model.vocab_size", "400",
               "--model.d_model", "32", "--model.n_layer", "1", "--train.max_steps", "6", "--train.seq_len", "32",
               "--train.batch_size", "2", "--train.eval_interval", "3", "--train.log_interval", "2")
    assert r.returncode == 0, r.stderr
    assert "model: " in r.stdout and "tokens/step" in r.stdout and "MFU" in r.stdout
    assert "step      6/6" in r.stdout
    saved = json.loads((run / "config.json").read_text())
    assert saved["model"]["n_layer"] == 1 and saved["train"]["max_steps"] == 6

    r = nanolm("generate", str(run), "--prompt", "To be", "--max-new-tokens", "10", "--seed", "1",
               "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("To be") and len(r.stdout) > len("To be\n")
    again = nanolm("generate", str(run), "--prompt", "To be", "--max-new-tokens", "10", "--temperature", "0")
    assert again.stdout == r.stdout  # greedy is deterministic
    assert "decoding in float32: auto: " in r.stderr  # a 32-wide model decodes in float32 on every CPU
    bf16 = nanolm("generate", str(run), "--prompt", "To be", "--max-new-tokens", "10", "--temperature", "0",
                  "--dtype", "bfloat16")
    assert bf16.returncode == 0 and "decoding in bfloat16: as asked" in bf16.stderr
    assert bf16.stdout.startswith("To be") and len(bf16.stdout) > len("To be\n")
    # --compile: the one-row step compiled before the first token, kept where it timed faster, the same reply
    compiled = nanolm("generate", str(run), "--prompt", "To be", "--max-new-tokens", "10", "--temperature", "0",
                      "--compile")
    assert compiled.returncode == 0, compiled.stderr
    assert re.search(r"; the decode step (compiled|left uncompiled) \(compiled in \d+ s\): a step of 1 row took "
                     r"[\d.]+ ms compiled, [\d.]+ ms as it is\]$", compiled.stderr, re.M), compiled.stderr
    assert compiled.stdout == r.stdout and "Graph break" not in compiled.stderr


def test_user_errors_are_one_line_with_exit_code_2(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": 3}\n', encoding="utf-8")
    r = nanolm("tokenizer", "train", str(bad), "--out", str(tmp_path / "t"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]  # one line, no traceback
    assert f"{bad}:2:" in r.stderr and "--skip-bad" in r.stderr

    r = nanolm("train", "--preset", "tiny", "--model.n_head", "5", "--data", str(tmp_path))
    assert r.returncode == 2 and "model.d_model (128) must be divisible by model.n_head (5)" in r.stderr

    r = nanolm("train", "--preset", "tiny", "--data", str(tmp_path / "nowhere"))
    assert r.returncode == 2 and "nanolm prepare" in r.stderr and "Traceback" not in r.stderr

    r = nanolm("generate", str(tmp_path), "--prompt", "x")
    assert r.returncode == 2 and "no checkpoint found" in r.stderr

    r = nanolm("data", "fetch", "no-such-corpus")
    assert r.returncode == 2 and "sanguo" in r.stderr


def test_help_lists_generated_config_overrides():
    r = nanolm("train", "--help")
    assert r.returncode == 0
    for name in ("--model.n_layer", "--model.n_kv_head", "--optim.lr", "--train.max_steps", "--train.dtype"):
        assert name in r.stdout


@pytest.mark.slow
def test_ecosystem_commands(tmp_path, data_dir, corpus):
    """export hf / import hf / export gguf / export ollama / eval / plot / serve, as a user runs them."""
    import socket
    import time
    import urllib.request

    from nanolm.train.trainer import train
    from test_train import tiny_cfg
    run = tmp_path / "run"
    train(tiny_cfg(data_dir, run, **{"train.max_steps": 4, "model.dropout": 0.0}), quiet=True)

    r = nanolm("export", "hf", str(run), str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama"
    r = nanolm("import", "hf", str(tmp_path / "hf"), str(tmp_path / "imported"))
    assert r.returncode == 0, r.stderr
    a = nanolm("generate", str(run), "--prompt", "To be", "--temperature", "0", "--max-new-tokens", "8")
    b = nanolm("generate", str(tmp_path / "imported"), "--prompt", "To be", "--temperature", "0",
               "--max-new-tokens", "8")
    assert a.returncode == b.returncode == 0 and a.stdout == b.stdout

    r = nanolm("export", "gguf", str(run), str(tmp_path / "m.gguf"), "--outtype", "q8_0")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "m.gguf").read_bytes()[:4] == b"GGUF"
    r = nanolm("export", "ollama", str(run), str(tmp_path / "ollama"), "--outtype", "q4_0", "--system", "Be brief.")
    assert r.returncode == 0, r.stderr
    assert f"ollama create <name> -f {tmp_path / 'ollama' / 'Modelfile'}" in r.stdout
    assert (tmp_path / "ollama" / "model.gguf").read_bytes()[:4] == b"GGUF"
    assert 'SYSTEM """Be brief."""' in (tmp_path / "ollama" / "Modelfile").read_text(encoding="utf-8")

    r = nanolm("eval", str(run), "--data", str(corpus), "--seq-len", "32")
    assert r.returncode == 0, r.stderr
    assert "ppl" in r.stdout and "bpb" in r.stdout

    r = nanolm("plot", str(run), "--out", str(tmp_path / "p.png"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "nanolm", "serve", str(run), "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as resp:
                    models = json.loads(resp.read())
                break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.5)
        assert models["object"] == "list" and len(models["data"]) == 1
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_sampling_options_are_generated_from_one_dataclass(tmp_path, capsys):
    """generate, chat and serve take --max-new-tokens/--temperature/--top-k/--top-p/--seed and the penalties from
    SamplingParams, with its defaults; a bad value is one line naming the option's field, before any model is
    loaded."""
    from nanolm.cli import from_fields, build_parser, main
    from nanolm.config import SamplingParams

    for command in ("generate", "chat", "serve"):
        args = build_parser().parse_args([command, "run"])
        assert from_fields(args, SamplingParams) == SamplingParams()
        args = build_parser().parse_args([command, "run", "--temperature", "0", "--top-k", "3", "--top-p", "0.5",
                                          "--seed", "7", "--max-new-tokens", "9", "--repetition-penalty", "1.2",
                                          "--presence-penalty", "0.5", "--frequency-penalty", "-0.25"])
        assert from_fields(args, SamplingParams) == SamplingParams(max_new_tokens=9, temperature=0, top_k=3,
                                                                    top_p=0.5, seed=7, repetition_penalty=1.2,
                                                                    presence_penalty=0.5, frequency_penalty=-0.25)
    # export ollama writes them into the Modelfile
    assert from_fields(build_parser().parse_args(["export", "ollama", "run", "out"]), SamplingParams) == \
        SamplingParams()
    args = build_parser().parse_args(["export", "ollama", "run", "out", "--top-k", "3", "--seed", "7"])
    assert from_fields(args, SamplingParams) == SamplingParams(top_k=3, seed=7)
    assert main(["generate", str(tmp_path / "nowhere"), "--temperature", "-1"]) == 2
    assert capsys.readouterr().err == "error: generate: temperature must be >= 0, got -1.0\n"
    assert main(["chat", str(tmp_path / "nowhere"), "--top-p", "1.5"]) == 2
    assert capsys.readouterr().err == "error: chat: top_p must be in (0, 1], got 1.5\n"
    assert main(["generate", str(tmp_path / "nowhere"), "--repetition-penalty", "0"]) == 2
    assert capsys.readouterr().err == ("error: generate: repetition_penalty must be in (0, 10] (1 = off, 1.1-1.3 is "
                                       "usual), got 0.0\n")


def test_serve_options_are_generated_from_its_settings(monkeypatch, capsys):
    """nanolm serve's --host/--port/--api-key/--model-name/--max-queue/--max-body-bytes/--body-timeout come from
    ServeConfig, with its defaults (loopback); the API key may come from NANOLM_API_KEY."""
    import nanolm.infer.server
    from nanolm.cli import build_parser, main
    from nanolm.config import SamplingParams, ServeConfig

    calls = []
    monkeypatch.setattr(nanolm.infer.server, "serve", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.delenv("NANOLM_API_KEY", raising=False)
    assert main(["serve", "run"]) == 0
    (checkpoint, config), kw = calls[-1]
    assert (checkpoint, config, kw["sampling"]) == ("run", ServeConfig(), SamplingParams())
    monkeypatch.setenv("NANOLM_API_KEY", "from-env")
    assert main(["serve", "run", "--host", "0.0.0.0", "--port", "0", "--model-name", "m", "--max-queue", "2",
                 "--max-body-bytes", "300", "--body-timeout", "1.5", "--temperature", "0", "--last"]) == 0
    (_, config), kw = calls[-1]
    assert config == ServeConfig(host="0.0.0.0", port=0, api_key="from-env", model_name="m", max_queue=2,
                                 max_body_bytes=300, body_timeout_s=1.5)
    assert kw["sampling"] == SamplingParams(temperature=0) and kw["which"] == "last"
    assert main(["serve", "run", "--api-key", "flag"]) == 0 and calls[-1][0][1].api_key == "flag"
    assert main(["serve", "run", "--max-queue", "0"]) == 2
    assert capsys.readouterr().err == "error: serve: max_queue=0: must be an integer >= 1 (requests admitted at once)\n"
    assert build_parser().parse_args(["serve", "run"]).body_timeout_s == 30.0
    assert main(["serve", "run", "--compile"]) == 0 and calls[-1][0][1].compile is True
    assert calls[-2][0][1].compile is False  # the default
    from nanolm.errors import UserError
    with pytest.raises(UserError, match=r"^compile='yes': must be true or false$"):
        ServeConfig(compile="yes")


def test_import_help_names_every_family_import_reads(capsys):
    """`nanolm import --help` names what import reads: each transformers model_type's families (SmolLM2 is a
    Llama, Qwen2.5 a Qwen2) and the GGUF architectures."""
    from nanolm.cli import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["import", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ("a transformers checkpoint (Llama, SmolLM2, Qwen2, Qwen2.5, Qwen3, Qwen2-MoE, Qwen3-MoE) or a GGUF file "
            "of a dense model (Llama, SmolLM2, Qwen2, Qwen2.5, Qwen3)") in text


def test_quickstart_options_are_generated_from_its_config():
    """`nanolm quickstart`'s options are QuickstartConfig's fields with its defaults; --model and --rl reach the
    real model's quickstart through it, and a bad budget is one line naming the option."""
    from nanolm.cli import build_parser
    from nanolm.config.options import from_fields
    from nanolm.errors import UserError
    from nanolm.quickstart import QuickstartConfig
    parser = build_parser()
    assert from_fields(parser.parse_args(["quickstart"]), QuickstartConfig) == QuickstartConfig()
    cfg = from_fields(parser.parse_args(["quickstart", "--model", "smollm2-135m-instruct", "--rl", "--bench-items",
                                         "7", "--chat-corpora"]), QuickstartConfig)
    assert (cfg.model, cfg.rl, cfg.bench_items, cfg.chat_corpora, cfg.out) == ("smollm2-135m-instruct", True, 7, (),
                                                                               None)
    with pytest.raises(UserError, match=r"^quickstart: --minutes must be > 0, got 0.0$"):
        from_fields(parser.parse_args(["quickstart", "--minutes", "0"]), QuickstartConfig)
