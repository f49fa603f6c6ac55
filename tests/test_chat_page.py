"""The chat page that `nanolm serve` answers `GET /` with, driven in a real headless Chromium.

What the page shows must be what the API answers: a seeded reply streamed into the page equals the
non-streaming answer to the same request, turn after turn (the whole conversation is sent). Stop ends a
reply and frees the server's worker; the API key, error bodies, model output that looks like HTML (shown
as text, never run) and a phone-sized screen are checked too. The browser tests need Debian's `chromium`
and `chromium-driver` and Selenium (the test extra) and skip, saying which is missing, without them; the
route's headers and files are checked without a browser.
"""

from __future__ import annotations

import re
import shutil
import time

import pytest

from nanolm.chat import Message, control_in
from nanolm.config import ServeConfig

httpx = pytest.importorskip("httpx")
from server_helpers import ScriptedEngine, running  # noqa: E402  (skips without uvicorn)

from nanolm.infer.server import create_app  # noqa: E402

CSP = "default-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
SENTENCE = "To be, or not to be, that is the question."
KEY_HINT = "This server needs an API key: enter it under Settings, API key. "
# What a reply's speed line says: its completion_tokens, and the rate over the time from its first token.
SPEED = re.compile(r"(\d+) tokens in \d+\.\d\d s from the first token to the end: \d+\.\d tokens/s")


def test_the_page_and_its_files_are_public_plain_and_under_a_strict_csp(engine, tok):
    with running(create_app(engine, tok, ServeConfig(model_name="tiny", api_key="s3cret"))) as url:
        assert httpx.get(url + "/v1/models", timeout=30).status_code == 401  # the API keeps its key
        page = httpx.get(url + "/", timeout=30)
        assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
        assert page.headers["content-security-policy"] == CSP
        assert page.headers["x-content-type-options"] == "nosniff"
        # Everything the page loads is one of the server's own files, named relative to the page.
        assert re.findall(r'(?:src|href)="([^"]*)"', page.text) == ["static/chat.css", "static/chat.js"]
        assert '<meta name="viewport" content="width=device-width, initial-scale=1">' in page.text
        for name, kind in (("chat.js", "text/javascript"), ("chatui.js", "text/javascript"),
                           ("chat.css", "text/css")):
            r = httpx.get(f"{url}/static/{name}", timeout=30)
            assert r.status_code == 200 and r.headers["content-type"] == f"{kind}; charset=utf-8"
            assert r.headers["content-security-policy"] == CSP
            assert not re.search(r"https?:|//[a-z]|url\(|@import", r.text), name  # nothing from elsewhere
        for name in ("chat.js", "chatui.js"):
            script = httpx.get(f"{url}/static/{name}", timeout=30).text
            assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(", script), name
        for name in ("chat.html", "nothing.js", "..%2Fpage.py"):
            r = httpx.get(f"{url}/static/{name}", timeout=30)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", name


# --- in the browser ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    missing = [name for name, path in (("chromium", chromium), ("chromedriver", driver)) if path is None]
    if missing:
        pytest.skip(f"the browser tests need Chromium and its driver ({', '.join(missing)} not found on PATH): "
                    "apt-get install chromium chromium-driver")
    webdriver = pytest.importorskip("selenium.webdriver", reason="the browser tests need Selenium: "
                                                                 "pip install 'nanolm[test]'")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    # Given the driver's path, Selenium skips its Selenium Manager, which would try to download one.
    d = webdriver.Chrome(service=webdriver.ChromeService(driver), options=options)
    try:
        yield d
    finally:
        d.quit()


def until(d, condition, timeout: float = 30):
    """condition(d)'s first truthy value, polled; fails the test after `timeout` s."""
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(d, timeout, poll_frequency=0.05).until(condition)


def el(d, id: str):
    return d.find_element("id", id)


def js(d, code: str):
    return d.execute_script("return " + code)


def text_of(d, id: str) -> str:
    return el(d, id).get_property("textContent")


def open_page(d, url: str, model: str | None) -> None:
    d.get(url + "/")
    until(d, lambda d: text_of(d, "model") != "loading…")
    if model is not None:
        assert text_of(d, "model") == model  # from GET /v1/models


def settings(d, **fields) -> None:
    if not el(d, "settings").get_property("open"):
        d.find_element("css selector", "#settings summary").click()
    for name, value in fields.items():
        el(d, name).clear()
        el(d, name).send_keys(str(value))


def say(d, text: str, enter: bool = False) -> None:
    """Type `text` and send it with the Send button (or the Enter key)."""
    el(d, "input").send_keys(text)
    if enter:
        el(d, "input").send_keys("\n")
    else:
        el(d, "send").click()


def messages(d) -> list[tuple[str, str, str | None]]:
    """What the page shows: (role, text, stats line or None) per message."""
    return [tuple(m) for m in js(d, "[...document.querySelectorAll('#log .msg')].map(m => [m.classList[1], "
                                    "m.querySelector('.text').textContent, m.querySelector('.stats')?.textContent "
                                    "?? null])")]


def reply(d, n: int) -> tuple[str, str]:
    """The n-th reply's text and stats line, once it has ended."""
    def ended(d):
        replies = [m for m in messages(d) if m[0] == "assistant"]
        return len(replies) >= n and replies[n - 1][2] is not None and replies[n - 1][1:]
    return until(d, ended)


def idle(d) -> bool:
    return el(d, "send").is_displayed() and not el(d, "stop").is_displayed()


def error(d) -> str | None:
    return text_of(d, "error") if el(d, "error").is_displayed() else None


def api(url: str, msgs: list[dict], key: str | None = None, **sampling) -> dict:
    """The API's non-streaming answer to the same request."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(url + "/v1/chat/completions", json={"messages": msgs, **sampling}, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def check_speed(stats: str, answer: dict) -> None:
    m = SPEED.fullmatch(stats)
    assert m, stats
    assert int(m.group(1)) == answer["usage"]["completion_tokens"]


@pytest.fixture(scope="module")
def roomy(tok):
    """A server of the tiny model with room for a two-turn conversation: the Qwen3 layout's think blocks take
    more of the context than plain ChatML's turns, and 96 tokens no longer hold it."""
    from server_helpers import tiny_model

    from nanolm.infer.engine import Engine
    with running(create_app(Engine(tiny_model(max_seq_len=192)), tok, ServeConfig(model_name="tiny"))) as url:
        yield url


def test_a_seeded_conversation_shows_the_apis_answers(browser, roomy):
    d = browser
    base = roomy
    open_page(d, base, "tiny")
    system = {"role": "system", "content": "Be brief."}
    first = {"role": "user", "content": "To be"}
    sampling = {"temperature": 0.9, "top_p": 0.9, "max_tokens": 8, "repetition_penalty": 4.0}
    # The first seed whose reply holds a tag or control token the random model wrote: sent back in the history,
    # the reply renders as written and the conversation goes on.
    sampling["seed"] = next(seed for seed in range(3, 40) if control_in(
        api(base, [system, first], **sampling, seed=seed)["choices"][0]["message"]["content"]))
    settings(d, system=system["content"], **sampling)
    want = api(base, [system, first], **sampling)
    text = want["choices"][0]["message"]["content"]
    # The seed and the penalty decide the reply, so equal replies mean the page sent these fields.
    for other in ({"seed": sampling["seed"] + 1}, {"repetition_penalty": 1.0}):
        assert text.strip() and text != api(base, [system, first], **{**sampling, **other})["choices"][0][
            "message"]["content"], other
    say(d, first["content"])
    shown, stats = reply(d, 1)
    assert shown == text
    check_speed(stats, want)
    assert idle(d) and error(d) is None

    # The second turn sends the whole conversation: the API's answer to the three messages (and the system
    # prompt), not to the last one alone.
    second = {"role": "user", "content": "你好"}
    want2 = api(base, [system, first, {"role": "assistant", "content": text}, second], **sampling)
    text2 = want2["choices"][0]["message"]["content"]
    assert text2.strip() and text2 != api(base, [system, second], **sampling)["choices"][0]["message"]["content"]
    say(d, second["content"], enter=True)
    shown2, stats2 = reply(d, 2)
    assert shown2 == text2
    check_speed(stats2, want2)
    assert [m[:2] for m in messages(d)] == [("user", first["content"]), ("assistant", text),
                                            ("user", second["content"]), ("assistant", text2)]

    # New chat forgets the conversation: the same first message gets the first answer again.
    el(d, "new").click()
    assert messages(d) == []
    say(d, first["content"])
    assert reply(d, 1)[0] == text


def test_an_error_body_is_shown_and_the_message_kept(browser, base):
    d = browser
    open_page(d, base, "tiny")
    settings(d, temperature=5)
    r = httpx.post(base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "temperature": 5, "stream": True}, timeout=30)
    assert r.status_code == 400
    say(d, "hi")
    until(d, lambda d: idle(d) and error(d) == "Error 400: " + r.json()["error"]["message"] and messages(d) == [])
    assert el(d, "input").get_property("value") == "hi"  # to send again once fixed
    settings(d, temperature=0)
    el(d, "send").click()
    assert reply(d, 1)[0] == api(base, [{"role": "user", "content": "hi"}], temperature=0)["choices"][0][
        "message"]["content"]
    assert error(d) is None


def test_the_api_key_is_asked_for_and_sent(browser, engine, tok):
    d = browser
    with running(create_app(engine, tok, ServeConfig(model_name="tiny", api_key="s3cret"))) as url:
        def refusal(key: str | None) -> str:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = httpx.get(url + "/v1/models", headers=headers, timeout=30)
            assert r.status_code == 401
            return KEY_HINT + "(" + r.json()["error"]["message"] + ")"

        open_page(d, url, "model unknown")
        assert error(d) == refusal(None)  # said as soon as the page loads
        say(d, "hi")
        for key in (None, "wrong"):
            if key:
                settings(d, key=key)
                el(d, "send").click()
            want = refusal(key)
            until(d, lambda d: idle(d) and error(d) == want and messages(d) == [])
            assert el(d, "input").get_property("value") == "hi"  # to send again with the key
        settings(d, key="s3cret", temperature=0, max_tokens=8)
        el(d, "send").click()
        want = api(url, [{"role": "user", "content": "hi"}], "s3cret", temperature=0, max_tokens=8)
        assert reply(d, 1)[0] == want["choices"][0]["message"]["content"]
        until(d, lambda d: text_of(d, "model") == "tiny")  # asked for again with the key
        assert error(d) is None


def test_stop_ends_a_long_reply_and_frees_the_server(browser, tok):
    d = browser
    script = tok.encode(SENTENCE * 4)
    eng = ScriptedEngine(script, delay=0.2)  # the whole reply would take 11 s
    with running(create_app(eng, tok, ServeConfig(model_name="slow"))) as url:
        open_page(d, url, "slow")
        say(d, "go")
        until(d, lambda d: len(messages(d)) == 2 and messages(d)[1][1])
        el(d, "stop").click()
        shown, stats = reply(d, 1)
        assert stats == "stopped" and idle(d) and error(d) is None
        full = tok.decode(script)
        assert 0 < len(shown) < len(full) and full.startswith(shown)
        assert eng.closed.wait(5) and eng.tokens < len(script)
        deadline = time.monotonic() + 5
        while httpx.get(url + "/health", timeout=30).json()["admitted"] != 0:
            assert time.monotonic() < deadline, "the stopped request still holds its place"
            time.sleep(0.05)


def test_a_reply_stopped_before_any_text_is_left_out_of_the_conversation(browser, tok):
    """The chat format has no empty reply to render (the server refuses one), so the next turn is sent without
    the stopped exchange and is answered."""
    d = browser
    eng = ScriptedEngine(tok.encode(SENTENCE))
    with running(create_app(eng, tok, ServeConfig(model_name="gated"))) as url:
        open_page(d, url, "gated")
        eng.gate.clear()  # no token comes until the test opens the gate
        try:
            say(d, "go")
            until(d, lambda d: len(messages(d)) == 2 and el(d, "stop").is_displayed())
            el(d, "stop").click()
            assert reply(d, 1) == ("", "stopped")
        finally:
            eng.gate.set()
        eng.prompts.clear()
        say(d, "again")
        assert reply(d, 2)[0] == SENTENCE and error(d) is None
        assert eng.prompts[-1] == tok.encode(tok.chat_format.render([Message("user", "again")],
                                                                    add_generation_prompt=True))


def test_model_output_is_shown_as_text_and_never_runs(browser, tok):
    d = browser
    html = '<img src=x onerror="pwned=1"><script>pwned=2</script>'
    with running(create_app(ScriptedEngine(tok.encode(html)), tok, ServeConfig(model_name="html"))) as url:
        open_page(d, url, "html")
        say(d, '<img src=y onerror="pwned=3">')
        assert reply(d, 1)[0] == html
        assert [m[:2] for m in messages(d)] == [("user", '<img src=y onerror="pwned=3">'), ("assistant", html)]
        assert js(d, "document.querySelectorAll('#log img, #log script').length") == 0
        assert js(d, "typeof window.pwned") == "undefined"


def test_the_page_fits_a_phone_screen(browser, tok):
    d = browser
    long_word = "question" * 8  # one 64-letter word: wider than the screen unless it wraps
    eng = ScriptedEngine(tok.encode(long_word + " " + SENTENCE))
    # A phone's screen: as a mobile browser does, the page is laid out 980 px wide unless its viewport meta
    # says otherwise.
    d.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {"width": 360, "height": 740, "deviceScaleFactor": 3,
                                                             "mobile": True})
    try:
        with running(create_app(eng, tok, ServeConfig(model_name="phone"))) as url:
            open_page(d, url, "phone")
            settings(d)
            say(d, long_word)
            assert reply(d, 1)[0] == long_word + " " + SENTENCE
            assert js(d, "window.innerWidth") == 360
            assert js(d, "document.documentElement.scrollWidth") <= 360
            assert js(d, "document.getElementById('log').scrollWidth <= document.getElementById('log').clientWidth")
            for id in ("new", "send", "input", "system", "seed", "key"):
                left, right = js(d, f"(r => [r.left, r.right])(document.getElementById('{id}')"
                                    ".getBoundingClientRect())")
                assert 0 <= left and right <= 360, id
    finally:
        d.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


# --- tools, thinking and regenerate ------------------------------------------------------------------

QUESTION = "What is 12*(3+4)?"
CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*(3+4)"}}\n</tool_call>'


def scripted(tok, replies: list[str], name: str):
    """A server whose rows replay `replies` in turn, with room for the tools' system turn (~900 tokens)."""
    eng = ScriptedEngine(tok.encode("(no reply scripted)"), replies=[tok.encode(r) for r in replies],
                         max_seq_len=4096)
    return eng, running(create_app(eng, tok, ServeConfig(model_name=name)))


def tick(d, css: str) -> None:
    settings(d)
    box = d.find_element("css selector", css)
    if not box.is_selected():
        box.click()


def test_a_call_of_a_builtin_tool_is_run_shown_and_answered(browser, tok):
    from nanolm.chat import ToolCall, tools_from_value
    from nanolm.infer.tools import BUILTIN_TOOLS, CALCULATOR
    d = browser
    eng, server = scripted(tok, ["Let me compute.\n" + CALL_TEXT, "It is 84."], "tools")
    with server as url:
        open_page(d, url, "tools")
        boxes = js(d, "[...document.querySelectorAll('#tools input[type=checkbox]')].map(b => [b.value, b.checked])")
        assert boxes == [[t["function"]["name"], False] for t in BUILTIN_TOOLS]  # offered, none ticked
        tick(d, "#tools input[value=calculator]")
        say(d, QUESTION)
        until(d, lambda d: idle(d) and len(messages(d)) == 4)
        shown = messages(d)
        assert [m[:2] for m in shown] == [
            ("user", QUESTION), ("assistant", "Let me compute."),
            ("tool", 'calculator({"expression": "12*(3+4)"})\n→ 84'), ("assistant", "It is 84.")]
        assert shown[1][2] is not None and shown[3][2] is not None and error(d) is None
        # The second request carried the call and its result, as a tool message, with only the calculator offered.
        tools = tools_from_value("tools", [CALCULATOR.schema()])
        want = [Message("user", QUESTION),
                Message("assistant", "Let me compute.", "", (ToolCall("calculator", '{"expression": "12*(3+4)"}'),)),
                Message("tool", "84")]
        assert eng.prompts[-1] == tok.encode(tok.chat_format.render(want, tools, add_generation_prompt=True))


def test_thinking_shows_the_reasoning_folded_apart(browser, tok):
    d = browser
    eng, server = scripted(tok, ["Seven times twelve.\n</think>\n\nIt is 84."], "think")
    with server as url:
        open_page(d, url, "think")
        tick(d, "#thinking")
        say(d, QUESTION)
        assert reply(d, 1)[0] == "It is 84."
        folded = js(d, "(r => [r.tagName, r.open, r.querySelector('summary').textContent, "
                       "r.querySelector('.thought').textContent])"
                       "(document.querySelector('#log .assistant .reasoning'))")
        assert folded == ["DETAILS", False, "Reasoning", "Seven times twelve."]
        assert tok.decode(eng.prompts[-1]).endswith("<|im_start|>assistant\n<think>\n")


def test_regenerate_replaces_the_last_reply(browser, tok):
    d = browser
    eng, server = scripted(tok, ["First answer.", "Second answer."], "again")
    with server as url:
        open_page(d, url, "again")
        assert not el(d, "regenerate").is_enabled()  # nothing to regenerate yet
        say(d, "hi")
        assert reply(d, 1)[0] == "First answer."
        until(d, lambda d: el(d, "regenerate").is_enabled())
        el(d, "regenerate").click()
        want = [("user", "hi"), ("assistant", "Second answer.")]
        until(d, lambda d: idle(d) and [m[:2] for m in messages(d)] == want)
        assert len(eng.prompts) == 2 and eng.prompts[0] == eng.prompts[1]  # the same conversation asked again


def test_stop_during_a_tool_round_keeps_the_call_and_sends_nothing_more(browser, tok):
    """Stop while the reply to a tool's result streams: the call and its result stay shown, the reply keeps what
    came, no further request is made, the server's slot is freed, and the conversation goes on."""
    d = browser
    eng, server = scripted(tok, ["Let me compute.\n" + CALL_TEXT, SENTENCE * 8, "Fine."], "toolstop")
    eng.delay = 0.05  # the reply after the tool would take about 6 s
    with server as url:
        open_page(d, url, "toolstop")
        tick(d, "#tools input[value=calculator]")
        say(d, QUESTION)
        until(d, lambda d: len(messages(d)) == 4 and messages(d)[3][1])
        el(d, "stop").click()
        shown = messages(d)
        assert [m[:2] for m in shown[:3]] == [("user", QUESTION), ("assistant", "Let me compute."),
                                             ("tool", 'calculator({"expression": "12*(3+4)"})\n→ 84')]
        text, stats = reply(d, 2)
        assert stats == "stopped" and 0 < len(text) < len(SENTENCE * 8) and (SENTENCE * 8).startswith(text)
        assert idle(d) and error(d) is None
        deadline = time.monotonic() + 5
        while httpx.get(url + "/health", timeout=30).json()["admitted"] != 0:
            assert time.monotonic() < deadline, "the stopped request still holds its place"
            time.sleep(0.05)
        assert len(eng.prompts) == 2  # the call's request and the one after its result; nothing after Stop
        say(d, "thanks")
        until(d, lambda d: idle(d) and len(messages(d)) == 6)
        assert messages(d)[5][:2] == ("assistant", "Fine.") and error(d) is None
