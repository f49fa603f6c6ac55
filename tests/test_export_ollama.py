"""ollama export: the directory, the Modelfile as ollama's parser reads it, and its TEMPLATE rendered by Go.

ollama renders a chat with Go's text/template (template/template.go, Execute): when the template uses
`.Messages`, it is executed once with System (the system messages joined by a blank line), Messages
(each with Role, Content and the tool and thinking fields), Tools, Response (""), Think, ThinkLevel and
IsThinkSet, and a Modelfile SYSTEM arrives as a first system message (server/routes.go) unless the
conversation opens with one. The Go program below executes the TEMPLATE with that data, so the rendering
is Go's own; it needs `go` (Debian: apt-get install golang-go) and those tests skip without it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from nanolm.chat import CHATML, QWEN3, Message
from nanolm.config import SamplingParams

OLLAMA_TEMPLATE = QWEN3.ollama_template


def render_chat(messages, add_generation_prompt=False, fmt=QWEN3, thinking=False):
    """nanolm's text of (role, content, thinking) messages, unvalidated (an empty reply is kept)."""
    return fmt.render([Message(m["role"], m["content"], m.get("thinking", "")) for m in messages],
                      add_generation_prompt=add_generation_prompt, thinking=thinking)
from nanolm.errors import UserError

gguf = pytest.importorskip("gguf")

from nanolm.export.gguf import export_gguf  # noqa: E402
from nanolm.export.ollama import GGUF_FILE, MODELFILE, export_ollama, modelfile_text  # noqa: E402
from test_export_gguf import make_run, read  # noqa: E402

# The data ollama's Execute passes a template that uses .Messages; the fields of its templateMessage.
RENDER_GO = r"""
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"text/template"
)

type message struct {
	Role       string
	Content    string
	Thinking   string
	Images     []string
	ToolCalls  []any
	ToolName   string
	ToolCallID string
}

func main() {
	var req struct {
		Template string
		Messages []message
	}
	if err := json.NewDecoder(os.Stdin).Decode(&req); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	tmpl, err := template.New("").Option("missingkey=zero").Parse(req.Template)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	var system []string
	messages := make([]*message, len(req.Messages))
	for i := range req.Messages {
		if req.Messages[i].Role == "system" {
			system = append(system, req.Messages[i].Content)
		}
		messages[i] = &req.Messages[i]
	}
	data := map[string]any{"System": strings.Join(system, "\n\n"), "Messages": messages, "Tools": nil,
		"Response": "", "Think": false, "ThinkLevel": "", "IsThinkSet": false}
	if err := tmpl.Execute(os.Stdout, data); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
"""


@pytest.fixture(scope="module")
def go_render(tmp_path_factory):
    """render(template, messages) -> the text Go's text/template makes of them as ollama executes it."""
    go = shutil.which("go")
    if go is None:
        pytest.skip("Go is not installed (apt-get install golang-go): the TEMPLATE is rendered with Go itself")
    d = tmp_path_factory.mktemp("go")
    (d / "render.go").write_text(RENDER_GO, encoding="utf-8")
    subprocess.run([go, "build", "-o", str(d / "render"), str(d / "render.go")], check=True, cwd=d, timeout=300)

    def render(template: str, messages: list[dict]) -> str:
        data = {"Template": template, "Messages": [{"Role": m["role"], "Content": m["content"],
                                                    "Thinking": m.get("thinking", "")} for m in messages]}
        r = subprocess.run([str(d / "render")], input=json.dumps(data), capture_output=True, text=True,
                           encoding="utf-8", timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout
    return render


def parse_modelfile(text: str) -> list[tuple[str, str]]:
    """(command, value) pairs as ollama's parser (parser/parser.go, ParseFile) reads a Modelfile.

    Its rules: `#` starts a comment line; a command is a word, then one space; PARAMETER's is the word
    after it. The value runs to a line end at which it is complete: trimmed of white space, a value opened
    by three double quotes (or one) is complete once it also ends with them, and they are removed; an
    unquoted one is complete at its line's end. Characters Go does not count as printable, other than
    white space and newlines, are dropped. Values are returned with PARAMETER's as "name value".
    """
    out: list[tuple[str, str]] = []
    i, n = 0, len(text)
    while i < n:
        if text[i] in " \t\r\n":
            i += 1
            continue
        if text[i] == "#":
            i = text.find("\n", i) + 1 or n
            continue
        name = re.match(r"[A-Za-z]+", text[i:]).group()
        i += len(name)
        if name.lower() == "parameter":
            assert text[i] == " "
            param = re.match(r"[A-Za-z0-9_]+", text[i + 1:]).group()
            i += 1 + len(param)
        assert text[i] == " ", f"no space after {name}"
        i += 1
        buf = ""
        while True:
            ch = text[i] if i < n else None
            if ch is None or ch in "\r\n":
                v = buf.strip()
                quote = '"""' if v.startswith('"""') else '"' if v.startswith('"') else ""
                if not quote or (len(v) >= 2 * len(quote) and v.endswith(quote)):
                    value = v[len(quote):len(v) - len(quote)]
                    out.append((name.upper(), f"{param} {value}" if name.lower() == "parameter" else value))
                    i += 1
                    break
                assert ch is not None, "unexpected end of file inside a quoted value"
                buf += ch
            elif ch.isprintable() or ch in " \t":
                buf += ch
            i += 1
    return out


def ollama_messages(modelfile: list[tuple[str, str]], messages: list[dict]) -> list[dict]:
    """The messages ollama's chat handler hands the template: the Modelfile's SYSTEM first, unless the
    conversation opens with a system message."""
    system = [v for k, v in modelfile if k == "SYSTEM"]
    if system and messages[0]["role"] != "system":
        return [{"role": "system", "content": system[-1]}, *messages]
    return messages


def template_of(modelfile: list[tuple[str, str]]) -> str:
    (template,) = [v for k, v in modelfile if k == "TEMPLATE"]
    return template


CONVERSATIONS = {
    "system and several turns": [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": "To be, or not to be?"}, {"role": "assistant", "content": "That is the question."},
        {"role": "user", "content": "话说天下大势"}, {"role": "assistant", "content": "分久必合，合久必分。"},
        {"role": "user", "content": "And then?"}],
    "no system": [
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there!"},
        {"role": "user", "content": "How are you?"}],
    "one user message": [{"role": "user", "content": "你好"}],
    "awkward contents": [  # newlines, white space at the ends, template syntax, markup, quotes, an empty reply
        {"role": "system", "content": "  line one\nline two\n\n"},
        {"role": "user", "content": "{{ .System }} <b>&amp;</b> \"\"\" \\n {{- end }}"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "\tlast\t"}],
    "ending with a reply": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
}


@pytest.mark.parametrize("case", list(CONVERSATIONS))
def test_template_renders_what_render_chat_renders(go_render, case):
    messages = CONVERSATIONS[case]
    want = render_chat(messages, add_generation_prompt=True)
    assert go_render(OLLAMA_TEMPLATE, messages) == want
    # through the Modelfile as ollama parses it, with and without a SYSTEM
    system = "Be kind.\nAnswer in one line."
    for modelfile_system in (None, system):
        modelfile = parse_modelfile(modelfile_text(context_length=64, sampling=SamplingParams(),
                                                   system=modelfile_system))
        msgs = ollama_messages(modelfile, messages)
        assert go_render(template_of(modelfile), msgs) == render_chat(msgs, add_generation_prompt=True)
    if messages[0]["role"] != "system":  # the SYSTEM arrives as nanolm's system turn, before the conversation
        assert msgs == [{"role": "system", "content": system}, *messages]


def test_the_template_is_exactly_the_chat_layout_and_can_fail(go_render):
    messages = CONVERSATIONS["system and several turns"]
    assert go_render(OLLAMA_TEMPLATE, messages).startswith(
        "<|im_start|>system\nYou are brief.<|im_end|>\n<|im_start|>user\nTo be, or not to be?<|im_end|>\n")
    assert go_render(OLLAMA_TEMPLATE, [{"role": "user", "content": "x"}]) == \
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    # a reply's reasoning, as ollama hands it (.Thinking)
    reasoned = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "thinking": "hm"},
                {"role": "user", "content": "q2"}]
    assert go_render(OLLAMA_TEMPLATE, reasoned) == render_chat(reasoned, add_generation_prompt=True)
    # a template without the newline after <|im_end|> renders something else, and the comparison sees it
    wrong = OLLAMA_TEMPLATE.replace("<|im_end|>\n{{ else", "<|im_end|>{{ else")
    assert wrong != OLLAMA_TEMPLATE
    assert go_render(wrong, messages) != render_chat(messages, add_generation_prompt=True)
    # the plain ChatML of old tokenizers
    assert go_render(CHATML.ollama_template, messages) == render_chat(messages, True, fmt=CHATML)


def test_modelfile_text_exactly():
    assert modelfile_text(context_length=512, sampling=SamplingParams(), name="mm26") == (
        "# mm26, written by `nanolm export ollama`; load it with: ollama create <name> -f Modelfile\n"
        "FROM ./model.gguf\n"
        f'TEMPLATE """{OLLAMA_TEMPLATE}"""\n'
        'PARAMETER stop "<|im_end|>"\n'
        'PARAMETER stop "<|endoftext|>"\n'
        "PARAMETER temperature 0.8\n"
        "PARAMETER top_k 50\n"
        "PARAMETER top_p 0.95\n"
        "PARAMETER num_predict 256\n"
        "PARAMETER repeat_penalty 1.0\n"
        "PARAMETER presence_penalty 0.0\n"
        "PARAMETER frequency_penalty 0.0\n"
        "PARAMETER num_ctx 512\n"
        "PARAMETER repeat_last_n -1\n")


def test_modelfile_parses_to_every_setting():
    system = 'Say "hi".\n\t多行的 system\n'  # quotes, a tab, Chinese, a newline at the end
    text = modelfile_text(context_length=64, system=system,
                          sampling=SamplingParams(temperature=0.0, top_k=0, top_p=1.0, max_new_tokens=12, seed=7,
                                                  repetition_penalty=1.2, presence_penalty=0.5,
                                                  frequency_penalty=-0.25))
    assert parse_modelfile(text) == [
        ("FROM", "./model.gguf"), ("TEMPLATE", OLLAMA_TEMPLATE), ("SYSTEM", system),
        ("PARAMETER", "stop <|im_end|>"), ("PARAMETER", "stop <|endoftext|>"), ("PARAMETER", "temperature 0.0"),
        ("PARAMETER", "top_k 0"), ("PARAMETER", "top_p 1.0"), ("PARAMETER", "num_predict 12"),
        ("PARAMETER", "seed 7"), ("PARAMETER", "repeat_penalty 1.2"), ("PARAMETER", "presence_penalty 0.5"),
        ("PARAMETER", "frequency_penalty -0.25"), ("PARAMETER", "num_ctx 64"), ("PARAMETER", "repeat_last_n -1")]


# ----------------------------------------------------------------------------- the directory

@pytest.fixture(scope="module")
def run(tmp_path_factory, tokenizer_dir) -> Path:
    return make_run(tmp_path_factory.mktemp("ollama") / "run", tokenizer_dir)


@pytest.mark.parametrize("outtype,file_type", [(None, 7), ("q4_0", 2)])  # default q8_0
def test_export_writes_the_gguf_and_modelfile(run, tmp_path, outtype, file_type):
    kw = {} if outtype is None else {"outtype": outtype}
    out = export_ollama(run, tmp_path / "ollama", quiet=True, **kw)
    assert sorted(p.name for p in out.iterdir()) == [MODELFILE, GGUF_FILE]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ollama"]  # no temporary directory left
    modelfile = parse_modelfile((out / MODELFILE).read_text(encoding="utf-8"))
    (source,) = [v for k, v in modelfile if k == "FROM"]
    assert (out / source).resolve() == (out / GGUF_FILE).resolve()
    assert template_of(modelfile) == OLLAMA_TEMPLATE and not [v for k, v in modelfile if k == "SYSTEM"]
    params = [v for k, v in modelfile if k == "PARAMETER"]
    assert "num_ctx 64" in params and "temperature 0.8" in params and "num_predict 256" in params
    # the same file `nanolm export gguf` writes, byte for byte
    gguf_file = export_gguf(run, tmp_path / "m.gguf", outtype=outtype or "q8_0", quiet=True)
    assert (out / GGUF_FILE).read_bytes() == gguf_file.read_bytes()
    assert read(out / GGUF_FILE)[0]["general.file_type"] == file_type


def test_export_takes_system_and_sampling(run, tmp_path):
    out = export_ollama(run, tmp_path / "o", system="You are brief.", quiet=True,
                        sampling=SamplingParams(temperature=0.3, top_k=5, top_p=0.5, max_new_tokens=9, seed=1))
    modelfile = parse_modelfile((out / MODELFILE).read_text(encoding="utf-8"))
    assert ("SYSTEM", "You are brief.") in modelfile
    assert [v for k, v in modelfile if k == "PARAMETER"][2:7] == [
        "temperature 0.3", "top_k 5", "top_p 0.5", "num_predict 9", "seed 1"]


def test_refusals_are_one_line_and_write_nothing(run, tmp_path):
    target = tmp_path / "o"
    for kw, match in [
        ({"outtype": "q4_k_m"}, r"outtype='q4_k_m': must be one of f32, f16, q8_0, q4_0 \(K-quants: .*llama-quantize"),
        ({"system": 'a """ b'}, r'--system: holds """.*remove it'),
        ({"system": "a\x00b"}, r"--system: holds the unprintable character U\+0000.*remove it"),
        ({"sampling": SamplingParams(seed=2**63)}, r"--seed 9223372036854775808: .*below 2\*\*63"),
    ]:
        with pytest.raises(UserError, match=match) as e:
            export_ollama(run, target, quiet=True, **kw)
        assert "\n" not in str(e.value)
    assert not target.exists()
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"o: already exists and is not an empty directory; choose a new output "
                                        r"directory or remove it"):
        export_ollama(run, target, quiet=True)
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_failed_export_leaves_nothing(run, tmp_path, monkeypatch):
    import nanolm.export.ollama as ollama

    def failing(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ollama, "write_text_atomic", failing)
    with pytest.raises(OSError, match="No space left"):
        export_ollama(run, tmp_path / "o", quiet=True)
    assert list(tmp_path.iterdir()) == []  # neither the directory nor its temporary twin with the GGUF


def test_cli_export_ollama(run, tmp_path, capsys):
    from nanolm.cli import main
    assert main(["export", "ollama", str(run), str(tmp_path / "o"), "--system", "Be brief.", "--temperature", "0",
                 "--seed", "3"]) == 0
    assert f"ollama create <name> -f {tmp_path / 'o' / MODELFILE}" in capsys.readouterr().out
    modelfile = parse_modelfile((tmp_path / "o" / MODELFILE).read_text(encoding="utf-8"))
    assert ("SYSTEM", "Be brief.") in modelfile and ("PARAMETER", "temperature 0.0") in modelfile
    assert ("PARAMETER", "seed 3") in modelfile
    for args, fix in [(["--outtype", "q4_k"], "must be one of f32, f16, q8_0, q4_0"),
                      ([], "choose a new output directory or remove it")]:
        assert main(["export", "ollama", str(run), str(tmp_path / "o"), *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and fix in err
