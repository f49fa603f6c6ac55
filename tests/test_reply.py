"""Reading a reply (nanolm/chat/replies.py): whole replies read as their messages, exact events for exact chunks,
tags split anywhere held until decided, the same message however the text is cut, the inverse of the chat
format's rendering, and a reading of the whole text at once (`whole_reading`) but for the whitespace at the
content's ends."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanolm.chat import (QWEN3, Call, ChatError, Content, Message, Reasoning, ReplyParser, TokenKinds, ToolCall,
                         parse_call, parse_tool_call)
from nanolm.special_tokens import THINK, THINK_END, TOOL_CALL, TOOL_CALL_END

CALC = ToolCall("calculator", '{"expression": "2+2"}')
CALC_TEXT = f'{TOOL_CALL}\n{{"name": "calculator", "arguments": {{"expression": "2+2"}}}}\n{TOOL_CALL_END}'


def run(chunks: list[str], **kw) -> tuple[list[list], list, ReplyParser]:
    """(the events of each push, the events of finish, the parser)."""
    p = ReplyParser(**kw)
    per_push = [p.push(c) for c in chunks]
    return per_push, p.finish(), p


_CALL = re.compile(re.escape(TOOL_CALL) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_END), re.S)


def whole_reading(text: str, *, thinking: bool = False) -> tuple[Message, list[str]]:
    """The message of a whole reply and the calls that did not parse, read at once by a regular expression: the
    reading the stream is held to (it differs only where a stream cannot take text back, see the property test).
    A call that does not parse stays in the content; the content is stripped at both ends."""
    reasoning = ""
    if thinking or text.lstrip().startswith(THINK):
        if THINK_END in text:
            head, _, text = text.partition(THINK_END)
            reasoning = head.split(THINK)[-1].strip("\n")
        elif thinking:
            return Message("assistant", "", text.strip("\n")), []
    calls, problems, kept = [], [], []
    at = 0
    for m in _CALL.finditer(text):
        try:
            calls.append(parse_tool_call(m.group(1)))
        except ChatError as e:
            problems.append(str(e))
            continue
        kept.append(text[at:m.start()])
        at = m.end()
    kept.append(text[at:])
    return Message("assistant", "".join(kept).strip(), reasoning, tuple(calls)), problems


@pytest.mark.parametrize("text, thinking, want", [
    ("The answer is 5.", False, Message("assistant", "The answer is 5.")),
    ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>', False,
     Message("assistant", "", "", (ToolCall("calculator", '{"expression": "2+3"}'),))),
    ("let me think\n</think>\n\nIt is 5.", True, Message("assistant", "It is 5.", "let me think")),
    ("still thinking", True, Message("assistant", "", "still thinking")),
    ('ok\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "g", '
     '"arguments": {"a": [1]}}\n</tool_call>', False,
     Message("assistant", "ok", "", (ToolCall("f", "{}"), ToolCall("g", '{"a": [1]}')))),
])
def test_a_whole_reply_reads_as_its_message(text, thinking, want):
    _, _, p = run([text], thinking=thinking)
    assert (p.message(), p.problems) == (want, [])


def test_a_broken_call_is_kept_as_text_and_says_why():
    _, _, p = run(["<tool_call>\n{\"name\": calc}\n</tool_call>"], thinking=False)
    reply, problems = p.message(), p.problems
    assert reply.tool_calls == () and "calc" in reply.content
    assert len(problems) == 1 and problems[0].startswith("a tool call the model wrote is not a JSON call")


def test_reasoning_then_content_with_the_end_tag_split():
    pushes, end, p = run(["Let me", " think.\n</th", "ink>\n\nThe answer", " is 4."], thinking=True)
    assert pushes == [[Reasoning("Let me")], [Reasoning(" think.")], [Content("The answer")], [Content(" is 4.")]]
    assert end == []
    assert p.message() == Message("assistant", "The answer is 4.", "Let me think.")


def test_a_call_split_across_chunks_is_held_and_comes_out_whole():
    chunks = ["Sure.\n<too", 'l_call>\n{"name": "calculator", "argu', 'ments": {"expression": "2+2"}}\n</tool_call>']
    pushes, end, p = run(chunks, thinking=False)
    assert pushes == [[Content("Sure.")], [], [Call(CALC)]]
    assert end == [] and p.problems == []
    assert p.message() == Message("assistant", "Sure.", "", (CALC,))


def test_a_partial_tag_is_held_until_the_next_chunk_decides_it():
    # "<too" that turns out not to be <tool_call>: released with what follows.
    assert run(["a <too", "k b"], thinking=False)[0] == [[Content("a")], [Content(" <took b")]]
    # </thi that is not </think>: reasoning.
    assert run(["x</thi", "s"], thinking=True)[0] == [[Reasoning("x")], [Reasoning("</this")]]
    # At the end nothing can complete: the held text comes out as what it is.
    assert run(["a <tool_ca"], thinking=False)[1] == [Content(" <tool_ca")]
    assert run(["hmm </thin"], thinking=True)[1:2] == ([Reasoning("</thin")],)  # only newlines wait in reasoning


def test_thinking_off_a_reply_that_opens_its_own_think_block():
    chunks = [" <", "thi", "nk>\n", "plan</think>\n\nok"]
    pushes, end, p = run(chunks, thinking=False)
    assert pushes == [[], [], [], [Reasoning("plan"), Content("ok")]]
    assert p.message() == Message("assistant", "ok", "plan")
    # "<" that is not the start of <think>: content, leading space and all.
    assert run([" <", "b>"], thinking=False)[0] == [[], [Content(" <b>")]]
    assert run(["  "], thinking=False)[1] == [Content("  ")]


def test_two_calls_and_whitespace_beside_them():
    text = f"x \n{CALC_TEXT}\n{CALC_TEXT}\n y \n"
    _, _, p = run([text], thinking=False)
    assert p.message() == Message("assistant", "x \n\n\n y \n", "", (CALC, CALC))
    _, _, p = run([f"\n {CALC_TEXT}\n"], thinking=False)  # whitespace beside a call alone is the template's
    assert p.message() == Message("assistant", "", "", (CALC,))
    _, _, p = run(["Thinking\n\n</think>\n\n" + CALC_TEXT + "  Done."], thinking=True)
    assert p.message() == Message("assistant", "Done.", "Thinking", (CALC,))


def test_a_call_that_is_not_json_stays_in_the_content_and_is_reported():
    bad = f"{TOOL_CALL}\n{{name: calculator}}\n{TOOL_CALL_END}"
    pushes, end, p = run(["See ", bad], thinking=False)
    assert pushes == [[Content("See")], [Content(" " + bad)]]
    assert p.tool_calls == [] and len(p.problems) == 1 and "not a JSON call" in p.problems[0]
    assert p.message().content == whole_reading("See " + bad)[0].content == "See " + bad  # as written


def test_a_reply_that_ends_inside_a_call():
    pushes, end, p = run(['ok\n<tool_call>\n{"name": "calc'], thinking=False)
    assert pushes == [[Content("ok")]] and end == [Content('\n<tool_call>\n{"name": "calc')]
    assert p.problems == ["the reply ended inside a tool call (no </tool_call>)"]


def test_without_tools_the_tags_are_content_and_nothing_waits():
    pushes, end, p = run(["a <tool", "_call>{}</tool_call> "], thinking=False, calls=False)
    assert pushes == [[Content("a <tool")], [Content("_call>{}</tool_call> ")]] and end == []


def test_a_prefill_is_read_as_the_replys_start():
    prefill = f'{TOOL_CALL}\n{{"name": "calculator", "arguments": '
    p = ReplyParser(thinking=False, prefill=prefill)
    assert p.prefill_events == []
    assert p.push('{"expression": "2+2"}}\n') == []
    assert p.push(TOOL_CALL_END) == [Call(CALC)]
    assert p.finish() == [] and p.message() == Message("assistant", "", "", (CALC,))


def test_parse_call_is_the_formats_reading():
    assert parse_call('\n{"name": "f", "arguments": {"a": [1, 2]}}\n') == ToolCall("f", '{"a": [1, 2]}')
    assert parse_call('{"name": "f", "arguments": "{\\"a\\": 1}"}') == ToolCall("f", '{"a": 1}')
    assert "not a JSON call" in parse_call('{"arguments": {}}')
    assert "not a JSON call" in parse_call("[1]")


def test_push_after_finish_is_refused():
    p = ReplyParser(thinking=False)
    p.finish()
    with pytest.raises(ValueError, match="finish was called"):
        p.push("x")


# --- properties --------------------------------------------------------------------------------------

# Fragments that make tags, their starts, JSON calls and whitespace likely where they matter.
FRAGMENTS = ["a", "b ", " ", "\n", "\n\n", "<", "<t", "</", "think", ">", "<too", "tool_call>", THINK, THINK_END,
             TOOL_CALL, TOOL_CALL_END, CALC_TEXT, '{"name": "f", "arguments": {}}', "{bad", "好", "。"]
texts = st.lists(st.sampled_from(FRAGMENTS), max_size=14).map("".join)


def cuts(text: str, data) -> list[str]:
    points = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=8)))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def streamed(chunks: list[str], **kw) -> tuple[Message, list, list[str]]:
    p = ReplyParser(**kw)
    events = [e for c in chunks for e in p.push(c)] + p.finish()
    return p.message(), events, p.problems


def joined(events: list) -> tuple[str, str, list[ToolCall]]:
    return ("".join(e.text for e in events if isinstance(e, Reasoning)),
            "".join(e.text for e in events if isinstance(e, Content)),
            [e.call for e in events if isinstance(e, Call)])


@settings(max_examples=400, deadline=None)
@given(text=texts, thinking=st.booleans(), calls=st.booleans(), data=st.data())
def test_the_message_does_not_depend_on_how_the_text_is_cut(text, thinking, calls, data):
    whole, whole_events, problems = streamed([text], thinking=thinking, calls=calls)
    msg, events, problems2 = streamed(cuts(text, data), thinking=thinking, calls=calls)
    assert msg == whole and problems2 == problems
    m = msg
    assert joined(events) == (m.reasoning, m.content, list(m.tool_calls))
    assert all(e.text for e in events if not isinstance(e, Call))  # no empty deltas


@settings(max_examples=400, deadline=None)
@given(text=texts, thinking=st.booleans(), data=st.data())
def test_the_message_is_the_whole_readings_but_for_the_contents_end_whitespace(text, thinking, data):
    opens_itself = not thinking and text.lstrip().startswith(THINK)
    reasoning_part = text.split(THINK_END)[0] if thinking or opens_itself else ""
    if reasoning_part.count(THINK) > (1 if opens_itself else 0):
        return  # a <think> inside the reasoning: kept as text here, cut off by the whole reading
    if opens_itself and THINK_END not in text:
        return  # an unclosed think block of its own: reasoning here, content for the whole reading
    want, want_problems = whole_reading(text, thinking=thinking)
    msg, _, problems = streamed(cuts(text, data), thinking=thinking)
    assert (msg.reasoning, msg.content.strip(), msg.tool_calls) == (want.reasoning, want.content, want.tool_calls)
    assert [p for p in problems if "ended inside" not in p] == want_problems


# Texts the template may hold: no tags, but their starts and whitespace everywhere.
plain = st.lists(st.sampled_from(["a", "b c", " ", "\n", "<", "<too", "</thi", "好", "{", "}"]), max_size=8).map(
    "".join)
calls = st.lists(st.sampled_from([CALC, ToolCall("f", "{}"), ToolCall("g_2", '{"x": [1, {"y": null}]}')]),
                 max_size=3).map(tuple)


@settings(max_examples=400, deadline=None)
@given(content=plain, reasoning=plain, tool_calls=calls, thinking=st.booleans(), data=st.data())
def test_parsing_the_formats_rendering_of_a_reply_gives_the_reply_back(content, reasoning, tool_calls, thinking,
                                                                       data):
    """The reply part of an assistant turn as QWEN3 renders it (after the generation prompt, without <|im_end|>)
    reads back as the message, its whitespace normalised as the template and the parser treat it."""
    if not thinking:
        reasoning = ""  # thinking off, the prompt closed the (empty) think block
    reasoning = reasoning.strip("\n")
    content = content.lstrip() if thinking else content.lstrip("\n")
    if tool_calls:
        content = content.rstrip()
    turn = QWEN3.render([Message("user", "q"), Message("assistant", content, reasoning, tool_calls)])
    prompt = QWEN3.render([Message("user", "q")], add_generation_prompt=True, thinking=thinking)
    assert turn.startswith(prompt) and turn.endswith("<|im_end|>\n")
    reply = turn[len(prompt):-len("<|im_end|>\n")]
    msg, events, problems = streamed(cuts(reply, data), thinking=thinking)
    assert msg == Message("assistant", content, reasoning, tool_calls) and problems == []
    assert [e.call for e in events if isinstance(e, Call)] == list(tool_calls)


# --- token kinds -------------------------------------------------------------------------------------

def test_token_kinds_follow_the_tags(tok):
    ids = tok.tag_ids
    hello, world = tok.encode("Hello"), tok.encode(" world")
    kinds = TokenKinds(tok.tag_ids, thinking=True)
    seq = [*hello, ids[THINK_END], *tok.encode("\n\n"), *world, ids[TOOL_CALL], *tok.encode("{}"),
           ids[TOOL_CALL_END], *hello]
    got = [kinds.kind(t) for t in seq]
    assert got == (["reasoning"] * (len(hello) + 1) + ["content"] * (len(tok.encode("\n\n")) + len(world))
                   + ["call"] * (len(tok.encode("{}")) + 2) + ["content"] * len(hello))
    k = TokenKinds(tok.tag_ids, thinking=False)
    assert [k.kind(t) for t in [ids[THINK], *hello, ids[THINK_END], *world]] == (
        ["reasoning"] * (len(hello) + 2) + ["content"] * len(world))
    k = TokenKinds(tok.tag_ids, thinking=False, calls=False)
    assert [k.kind(t) for t in [*hello, ids[TOOL_CALL], *world]] == ["content"] * (len(hello) + 1 + len(world))
    k = TokenKinds(tok.tag_ids, thinking=False, in_call=True)
    assert [k.kind(t) for t in [*hello, ids[TOOL_CALL_END], *world]] == ["call"] * (len(hello) + 1) + [
        "content"] * len(world)
