"""`nanolm export web`: the folder, its pinned runtime, and its page chatting in a real headless Chromium.

In the browser (Debian's `chromium` and `chromium-driver`, Selenium from the test extra, and wllama's runtime
from the npm registry or nanolm's cache; each test that needs one skips, saying which, without it): the page
of a tiny model's f32 export writes, greedy, the same first 16 tokens for 3 prompts as `nanolm generate
--temperature 0`; the prompt it renders for a multi-turn chat, sent through the page's own form, is the one
nanolm renders; and the browser requests nothing from outside the folder (its network log).
"""

from __future__ import annotations

import json
import re
import shutil
import threading
from pathlib import Path

import pytest

from nanolm.chat import CHATML, QWEN3, Message
from nanolm.errors import UserError

gguf = pytest.importorskip("gguf")

from nanolm.export import web  # noqa: E402
from nanolm.export.web import (CONFIG_FILE, GGUF_FILE, RUNTIME, export_web, fetch_runtime, make_server,  # noqa: E402
                               runtime_files)

PROMPTS = ["To be, or not", "话说天下大势", "We hold these truths"]
# A multi-turn chat: a system prompt, a first exchange, then a second question (the reply is the model's).
CHAT = [("system", "You are brief."), ("user", "To be?"), ("user", "Or not to be?")]


@pytest.fixture(scope="module")
def runtime() -> Path:
    try:
        return fetch_runtime(quiet=True)
    except UserError as e:
        pytest.skip(f"wllama's runtime cannot be had here: {e}")


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_dir) -> Path:
    """A tiny model trained for a few seconds on the test corpus, so that its greedy text is text (a random
    model's is mostly lone bytes of broken UTF-8, which llama.cpp holds back)."""
    from nanolm.train.trainer import train
    from test_export_gguf import TRAINED
    from test_train import tiny_cfg
    out = tmp_path_factory.mktemp("web") / "run"
    train(tiny_cfg(data_dir, out, **{**TRAINED, "model.max_seq_len": 256}), quiet=True)  # room for a chat
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory, run, runtime) -> Path:
    return export_web(run, tmp_path_factory.mktemp("web-out") / "site", outtype="f32", quiet=True)


# ----------------------------------------------------------------------------- the folder

def test_the_folder_holds_the_page_model_and_verified_runtime(folder, run):
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert files == ["_headers", "chat.css", "chatui.js", CONFIG_FILE, "index.html", GGUF_FILE, "web.css",
                     "web.js", "wllama/LICENCE", "wllama/compat/wllama.js", "wllama/compat/wllama.wasm",
                     "wllama/index.js", "wllama/wllama.wasm"]
    for rel, sha in runtime_files().items():
        assert web._sha256(folder / "wllama" / rel) == sha
    config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    assert config["layout"] == "qwen3" and config["model"] == GGUF_FILE and config["context_length"] == 256
    assert config["sha256"] == web._sha256(folder / GGUF_FILE)
    assert config["stop"] == ["<|im_end|>", "<|endoftext|>"]
    assert config["sampling"] == {"temperature": 0.8, "top_k": 50, "top_p": 0.95, "max_tokens": 256,
                                  "repeat_penalty": 1.0, "seed": None}
    # the same file `nanolm export gguf --outtype f32` writes, byte for byte
    from nanolm.export.gguf import export_gguf
    assert (folder / GGUF_FILE).read_bytes() == export_gguf(run, folder.parent / "m.gguf", outtype="f32",
                                                            quiet=True).read_bytes()
    # nothing in the page names another origin
    for name in ("index.html", "web.js", "web.css", "chat.css", "chatui.js"):
        assert not re.search(r"https?://|//[a-z]|@import", (folder / name).read_text(encoding="utf-8")), name
    assert "MIT License" in (folder / "wllama" / "LICENCE").read_text(encoding="utf-8")


def test_a_damaged_cached_runtime_or_tarball_is_refused(run, tmp_path, monkeypatch, runtime):
    monkeypatch.setenv("NANOLM_CACHE", str(tmp_path / "cache"))
    cached = web.runtime_dir()
    shutil.copytree(runtime, cached)
    (cached / "index.js").write_text("tampered")
    with pytest.raises(UserError, match=r"index.js: missing, edited or damaged \(sha256 should be e5506753.*\); "
                                        r"delete .* and export again") as e:
        export_web(run, tmp_path / "site", quiet=True)
    assert "\n" not in str(e.value) and not (tmp_path / "site").exists()
    # A tarball put there by hand is checked against the pinned integrity before anything is read from it.
    shutil.rmtree(cached)
    (web.runtime_dir().parent / RUNTIME[0].tarball).write_bytes(b"not the tarball")
    with pytest.raises(UserError, match=r"wllama-3.8.1.tgz: integrity sha512-.* is not the pinned sha512-Pl7BEJhPU"):
        fetch_runtime(quiet=True)


def test_refusals_are_one_line_and_write_nothing(run, tmp_path, runtime):
    with pytest.raises(UserError, match=r"outtype='q4_k_m': must be one of f32, f16, q8_0, q4_0"):
        export_web(run, tmp_path / "o", outtype="q4_k_m", quiet=True)
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "mine.txt").write_text("x")
    with pytest.raises(UserError, match=r"o: already exists and is not an empty directory"):
        export_web(run, tmp_path / "o", quiet=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]
    with pytest.raises(UserError, match=r"not a folder written by `nanolm export web`"):
        make_server(tmp_path / "o")


def test_cli_export_web(run, tmp_path, capsys, runtime):
    from nanolm.cli import main
    assert main(["export", "web", str(run), str(tmp_path / "site"), "--temperature", "0.5", "--system",
                 "Be brief."]) == 0
    assert f"python -m http.server -d {tmp_path / 'site'}" in capsys.readouterr().out
    config = json.loads((tmp_path / "site" / CONFIG_FILE).read_text(encoding="utf-8"))
    assert config["sampling"]["temperature"] == 0.5 and config["system"] == "Be brief."
    assert gguf.GGUFReader(tmp_path / "site" / GGUF_FILE).fields["general.file_type"].contents() == 7  # q8_0


# ----------------------------------------------------------------------------- in the browser

class Outside:
    """Where the browser sends every request for another host: a listener that records each one's first line
    (a proxy that never answers). Chromium sends loopback requests directly, so the folder's server is not
    affected, and the page's worker's requests pass here too (the page's network log does not show those)."""

    def __init__(self) -> None:
        import socket
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requests: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            with conn:
                conn.settimeout(5)
                try:
                    self.requests.append(conn.recv(65536).decode("latin-1"))
                except OSError:
                    self.requests.append("(a connection that sent nothing)")

    def of(self, base: str) -> list[str]:
        """The first lines of the requests a page of `base` made (its Referer or Origin; Chromium's own
        background requests, to Google's update and time servers, carry neither)."""
        origin = base.rstrip("/")
        return [r.split("\r\n")[0] for r in self.requests
                if re.search(rf"^(Referer|Origin): {re.escape(origin)}(/|\r)", r, re.M | re.I)]


@pytest.fixture(scope="module")
def outside():
    o = Outside()
    yield o
    o.sock.close()


@pytest.fixture(scope="module")
def browser(outside):
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    missing = [name for name, path in (("chromium", chromium), ("chromedriver", driver)) if path is None]
    if missing:
        pytest.skip(f"the browser tests need Chromium and its driver ({', '.join(missing)} not found on PATH): "
                    "apt-get install chromium chromium-driver")
    webdriver = pytest.importorskip("selenium.webdriver", reason="the browser tests need Selenium: "
                                                                 "pip install 'nanolm[test]'")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=900,760",
                f"--proxy-server=http://127.0.0.1:{outside.port}", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--disable-default-apps"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})  # the network log
    d = webdriver.Chrome(service=webdriver.ChromeService(driver), options=options)
    try:
        yield d
    finally:
        d.quit()


@pytest.fixture(scope="module")
def page(folder, browser):
    """The browser on the served folder, the model loaded; yields (driver, base URL, the paths it asked for)."""
    import functools
    import http.server
    paths: list[str] = []

    class Recording(web.Handler):
        def log_request(self, code="-", size="-") -> None:
            paths.append(self.path.split("?")[0])

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Recording, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    browser.get(base)
    until(browser, lambda d: js(d, "window.nanolmWeb && (window.nanolmWeb.ready || window.nanolmWeb.failed)"), 120)
    assert js(browser, "window.nanolmWeb.failed") is None
    try:
        yield browser, base, paths
    finally:
        server.shutdown()
        server.server_close()


def until(d, condition, timeout: float = 60):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(d, timeout, poll_frequency=0.05).until(condition)


def js(d, code: str):
    return d.execute_script("return " + code)


def page_complete(d, prompt: str, **options) -> dict:
    """The page's raw completion of `prompt` (its text and token count), through its wllama."""
    return d.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "window.nanolmWeb.complete(arguments[0], arguments[1]).then(done, e => done({error: String(e)}));",
        prompt, options)


def nanolm_generate(run: Path, prompt: str, capsys) -> str:
    from nanolm.cli import main
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(prompt) and out.endswith("\n")
    return out[len(prompt):-1]


def test_greedy_tokens_are_nanolm_generate_s(page, run, tokenizer_dir, capsys):
    from nanolm.tokenizer import Tokenizer
    d, *_ = page
    tok = Tokenizer.load(tokenizer_dir)
    for prompt in PROMPTS:
        got = page_complete(d, prompt, temperature=0, max_tokens=16)
        assert "error" not in got, got
        want = nanolm_generate(run, prompt, capsys)
        assert got["text"] == want, prompt
        assert got["tokens"] == len(tok.encode(prompt + want)) - len(tok.encode(prompt)) == 16, prompt


def test_the_page_renders_the_prompt_nanolm_renders(page, capsys):
    d, *_ = page
    for fmt, layout in ((QWEN3, "qwen3"), (CHATML, "chatml")):
        for thinking in (False, True) if fmt is QWEN3 else (False,):
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"},
                        {"role": "assistant", "content": "\nHello.", "reasoning": "\nThey greet.\n"},
                        {"role": "user", "content": "话说天下大势？"}]
            for n in (2, 4):  # without and with an earlier exchange
                want = fmt.render([Message(m["role"], m["content"], m.get("reasoning", "")) for m in messages[:n]],
                                  add_generation_prompt=True, thinking=thinking)
                assert d.execute_script("return window.nanolmWeb.renderPrompt(...arguments)",
                                        messages[:n], thinking, layout) == want


def test_a_chat_through_the_form_sends_nanolm_s_prompt_and_nothing_leaves_the_folder(page, folder, outside):
    d, base, paths = page
    d.find_element("css selector", "#settings summary").click()
    for field, value in (("temperature", "0"), ("max_tokens", "8"), ("system", CHAT[0][1])):
        d.find_element("id", field).clear()
        d.find_element("id", field).send_keys(value)
    replies = []
    for n, (_, text) in enumerate(CHAT[1:], start=1):
        d.find_element("id", "input").send_keys(text)
        d.find_element("id", "send").click()
        until(d, lambda d: len(d.find_elements("css selector", "#log .assistant .stats")) == n
              or js(d, "document.getElementById('error').hidden") is False)
        assert js(d, "document.getElementById('error').textContent") == ""
        reply = d.find_elements("css selector", "#log .assistant")[-1]
        replies.append(reply.find_element("css selector", ".text").get_property("textContent"))
        stats = reply.find_element("css selector", ".stats").get_property("textContent")
        assert re.fullmatch(r"\d+ tokens( in \d+\.\d\d s from the first token to the end: \d+\.\d tokens/s)?", stats)
    messages = [Message("system", CHAT[0][1]), Message("user", CHAT[1][1]), Message("assistant", replies[0]),
                Message("user", CHAT[2][1])]
    assert js(d, "window.nanolmWeb.lastPrompt") == QWEN3.render(messages, add_generation_prompt=True)
    assert "runs entirely in your browser" in d.find_element("id", "where").text.lower()

    urls = set()
    for entry in d.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.add(message["params"]["request"]["url"])
    urls |= set(js(d, "performance.getEntriesByType('resource').map(e => e.name)"))
    assert {u for u in urls if not u.startswith((base, "blob:", "data:"))} == set()
    assert outside.of(base) == []  # the page's worker included
    # what the page and its worker asked the folder's server for: its own files
    assert {"/", "/web.js", "/chatui.js", "/chat.css", "/web.css", "/config.json", "/wllama/index.js",
            "/wllama/wllama.wasm", "/" + GGUF_FILE} <= set(paths)
    # (the browser asks for /favicon.ico of its own accord; the folder has none)
    assert [p for p in paths if not (folder / p.lstrip("/")).is_file() and p not in ("/", "/favicon.ico")] == []
    # and the check can fail: a request for another host does reach the recorder
    d.execute_script("fetch('http://example.com/elsewhere').catch(() => null)")
    until(d, lambda d: outside.of(base), 10)
    assert outside.of(base) == ["GET http://example.com/elsewhere HTTP/1.1"]


def test_screenshot(page, tmp_path):
    """The page after the chat above as a PNG (where $NANOLM_WEB_SCREENSHOT names a path: the docs' picture)."""
    import os
    d, *_ = page
    if d.find_element("id", "settings").get_property("open"):
        d.find_element("css selector", "#settings summary").click()
    shot = Path(os.environ.get("NANOLM_WEB_SCREENSHOT") or tmp_path / "page.png")
    assert d.save_screenshot(str(shot)) and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
