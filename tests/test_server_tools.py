"""Tools and reasoning in the chat API, through the official client against a running server whose engine replays
scripted replies: calls in messages and streams, tool_choice (the prefill read with the reply), reasoning_content
with enable_thinking, tool turns rendered into the prompt exactly as the chat format does, n choices each read
alone, logprobs of the content only, and a 400 with the chat format's message for what it cannot render."""

from __future__ import annotations

import json
import re

import pytest
from chat_helpers import old_chatml_tokenizer

from nanolm.chat import CHATML, ChatError, Message, ToolCall, message_from_dict, tools_from_value
from nanolm.config import ServeConfig
from nanolm.infer.tools import BUILTIN_TOOLS

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
from server_helpers import ScriptedEngine, running  # noqa: E402  (skips without uvicorn)

from nanolm.infer.server import create_app  # noqa: E402

CTX = 4096  # the tools' system turn alone is ~900 tokens of the test tokenizer
QUESTION = "What is 12*(3+4)?"
CALL = ToolCall("calculator", '{"expression": "12*(3+4)"}')
CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*(3+4)"}}\n</tool_call>'
TOOLS = list(BUILTIN_TOOLS)
ID = re.compile(r"call_[0-9a-f]{24}")
THINK_ON = {"chat_template_kwargs": {"enable_thinking": True}}


@pytest.fixture(scope="module")
def server(tok):
    eng = ScriptedEngine(tok.encode("(no reply scripted)"), max_seq_len=CTX)
    with running(create_app(eng, tok, ServeConfig(model_name="tools"))) as url:
        yield url, eng


def ask(server, tok, replies: list[str], **kw):
    """The response to one chat request (through the official client) whose rows replay `replies` in turn, and the
    prompt ids each row got."""
    url, eng = server
    eng.replies.extend(tok.encode(r) for r in replies)
    eng.prompts.clear()
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
    kw.setdefault("messages", [{"role": "user", "content": QUESTION}])
    r = c.chat.completions.create(model="tools", **kw)
    if kw.get("stream"):
        r = list(r)
    return r, list(eng.prompts)


def prompt(tok, messages: list[Message], tools=(), thinking: bool = False, prefill: str = "") -> list[int]:
    return tok.encode(tok.chat_format.render(messages, tools, add_generation_prompt=True, thinking=thinking) + prefill)


def test_a_tool_call_comes_back_as_message_tool_calls(server, tok):
    r, prompts = ask(server, tok, ["Let me compute.\n" + CALL_TEXT], tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me compute."
    (call,) = choice.message.tool_calls
    assert ID.fullmatch(call.id) and call.type == "function"
    assert (call.function.name, call.function.arguments) == ("calculator", '{"expression": "12*(3+4)"}')
    assert prompts == [prompt(tok, [Message("user", QUESTION)], tools_from_value("tools", TOOLS))]
    # A reply that only calls has no content: null, as OpenAI's.
    r, _ = ask(server, tok, [CALL_TEXT + "\n"], tools=TOOLS)
    assert r.choices[0].message.content is None and len(r.choices[0].message.tool_calls) == 1


def test_tool_calls_stream_as_openai_streams_them(server, tok):
    second = '<tool_call>\n{"name": "current_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'
    chunks, _ = ask(server, tok, ["On it.\n" + CALL_TEXT + "\n" + second], tools=TOOLS, stream=True)
    deltas = [ch.choices[0].delta for ch in chunks]
    assert "".join(d.content or "" for d in deltas) == "On it."
    calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert [(c.index, c.type, c.function.name, c.function.arguments) for c in calls] == [
        (0, "function", "calculator", ""), (0, None, None, '{"expression": "12*(3+4)"}'),
        (1, "function", "current_time", ""), (1, None, None, '{"timezone": "UTC"}')]
    assert ID.fullmatch(calls[0].id) and ID.fullmatch(calls[2].id) and calls[0].id != calls[2].id
    assert calls[1].id is None and calls[3].id is None
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [ch.choices[0].finish_reason for ch in chunks[:-1]] == [None] * (len(chunks) - 1)
    # The client's own accumulator makes of the stream what the non-streaming answer is.
    from openai.lib.streaming.chat import ChatCompletionStreamState
    state = ChatCompletionStreamState()
    for ch in chunks:
        state.handle_chunk(ch)
    msg = state.get_final_completion().choices[0].message
    assert msg.content == "On it." and [(c.id, c.function.name, c.function.arguments) for c in msg.tool_calls] == [
        (calls[0].id, "calculator", '{"expression": "12*(3+4)"}'), (calls[2].id, "current_time", '{"timezone": "UTC"}')]


def test_the_stream_wire_format_of_a_call(server, tok):
    url, eng = server
    eng.replies.append(tok.encode(CALL_TEXT))
    body = {"messages": [{"role": "user", "content": QUESTION}], "tools": TOOLS, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [e["choices"][0]["delta"] for e in events] == [
        {"role": "assistant", "content": ""},
        {"tool_calls": [{"index": 0, "id": events[1]["choices"][0]["delta"]["tool_calls"][0]["id"],
                         "type": "function", "function": {"name": "calculator", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"expression": "12*(3+4)"}'}}]},
        {}]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_reasoning_content_with_enable_thinking(server, tok):
    reply = "Seven times twelve.\n</think>\n\nIt is 84."
    r, prompts = ask(server, tok, [reply], extra_body=THINK_ON)
    msg = r.choices[0].message
    assert (msg.reasoning_content, msg.content, r.choices[0].finish_reason) == ("Seven times twelve.", "It is 84.",
                                                                                 "stop")
    assert prompts == [prompt(tok, [Message("user", QUESTION)], thinking=True)]
    assert tok.decode(prompts[0]).endswith("<|im_start|>assistant\n<think>\n")
    chunks, _ = ask(server, tok, [reply], extra_body=THINK_ON, stream=True)
    deltas = [ch.choices[0].delta for ch in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Seven times twelve."
    assert "".join(d.content or "" for d in deltas) == "It is 84."
    # Off by default, as in the template: the prompt closes an empty think block, and no reasoning_content.
    r, prompts = ask(server, tok, ["It is 84."])
    assert prompts == [prompt(tok, [Message("user", QUESTION)])]
    assert tok.decode(prompts[0]).endswith("<think>\n\n</think>\n\n")
    assert r.choices[0].message.content == "It is 84." and "reasoning_content" not in r.choices[0].message.model_extra


def test_tool_choice_named_and_required_prefill_the_call(server, tok):
    tools = tools_from_value("tools", TOOLS)
    user = [Message("user", QUESTION)]
    named = {"type": "function", "function": {"name": "calculator"}}
    r, prompts = ask(server, tok, ['{"expression": "12*(3+4)"}}\n</tool_call>'], tools=TOOLS, tool_choice=named)
    assert prompts == [prompt(tok, user, tools, prefill='<tool_call>\n{"name": "calculator", "arguments": ')]
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("calculator", '{"expression": "12*(3+4)"}')
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    r, prompts = ask(server, tok, ['{"name": "current_time", "arguments": {}}\n</tool_call>'], tools=TOOLS,
                     tool_choice="required", extra_body=THINK_ON)
    assert prompts == [prompt(tok, user, tools, prefill="<tool_call>\n")]  # a forced call: no think block
    assert r.choices[0].message.tool_calls[0].function.name == "current_time"
    # Streaming, the prefilled part is read with the reply.
    chunks, _ = ask(server, tok, ['{"expression": "1+1"}}\n</tool_call>'], tools=TOOLS, tool_choice=named,
                    stream=True)
    calls = [ch.choices[0].delta.tool_calls[0] for ch in chunks if ch.choices[0].delta.tool_calls]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("calculator", ""),
                                                                         (None, '{"expression": "1+1"}')]
    # "none": the tools are not offered, and a call the model writes anyway is text.
    r, prompts = ask(server, tok, [CALL_TEXT], tools=TOOLS, tool_choice="none")
    assert prompts == [prompt(tok, user)]
    assert r.choices[0].message.content == CALL_TEXT and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


def test_a_tool_round_trip_renders_the_call_and_result_into_the_prompt(server, tok):
    first, _ = ask(server, tok, [CALL_TEXT], tools=TOOLS)
    call = first.choices[0].message
    messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": QUESTION}, call,
                {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "84"}]
    r, prompts = ask(server, tok, ["It is 84."], messages=messages, tools=TOOLS)
    want = [Message("system", "Use tools."), Message("user", QUESTION), Message("assistant", "", "", (CALL,)),
            Message("tool", "84")]
    assert prompts == [prompt(tok, want, tools_from_value("tools", TOOLS))]
    assert "<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n" in tok.decode(prompts[0])
    assert r.choices[0].message.content == "It is 84." and r.choices[0].finish_reason == "stop"
    # Reasoning in an earlier assistant message, and two results of two calls.
    two = {"role": "assistant", "content": None, "reasoning_content": "Two sums.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+2"}}}]}
    messages = [{"role": "user", "content": "sums"}, two, {"role": "tool", "tool_call_id": "call_1", "content": "2"},
                {"role": "tool", "tool_call_id": "call_2", "content": "4"}]
    _, prompts = ask(server, tok, ["2 and 4."], messages=messages, tools=TOOLS)
    want = [Message("user", "sums"),
            Message("assistant", "", "Two sums.", (ToolCall("calculator", '{"expression": "1+1"}'),
                                                   ToolCall("calculator", '{"expression": "2+2"}'))),
            Message("tool", "2"), Message("tool", "4")]
    assert prompts == [prompt(tok, want, tools_from_value("tools", TOOLS))]


def test_n_choices_are_each_read_alone(server, tok):
    r, _ = ask(server, tok, [CALL_TEXT, "No tool needed."], tools=TOOLS, n=2)
    a, b = r.choices
    assert (a.finish_reason, a.message.content, a.message.tool_calls[0].function.name) == ("tool_calls", None,
                                                                                          "calculator")
    assert (b.finish_reason, b.message.content, b.message.tool_calls) == ("stop", "No tool needed.", None)
    chunks, _ = ask(server, tok, ["Thinking.\n</think>\n\nYes.", "Use it.\n</think>\n\n" + CALL_TEXT], tools=TOOLS, n=2,
                    stream=True,
                    extra_body=THINK_ON)
    by = {i: [ch.choices[0] for ch in chunks if ch.choices[0].index == i] for i in (0, 1)}
    assert "".join(getattr(c.delta, "reasoning_content", None) or "" for c in by[0]) == "Thinking."
    assert "".join(c.delta.content or "" for c in by[0]) == "Yes." and by[0][-1].finish_reason == "stop"
    assert [c.delta.tool_calls[0].function.name for c in by[1] if c.delta.tool_calls][:1] == ["calculator"]
    assert by[1][-1].finish_reason == "tool_calls"


def test_logprobs_are_the_contents_tokens(server, tok):
    """The scripted engine gives the k-th reply token logprob -(k + 1) / 100: the entries show which tokens came."""
    reply = "Hmm.\n</think>\n\nIt is 84."
    ids = tok.encode(reply)
    after = ids.index(tok.tag_ids["</think>"]) + 1
    want = [-(k + 1) / 100 for k in range(after, len(ids))]  # the tokens after </think>
    r, _ = ask(server, tok, [reply], extra_body=THINK_ON, logprobs=True)
    entries = r.choices[0].logprobs.content
    assert [e.logprob for e in entries] == pytest.approx(want)
    assert b"".join(bytes(e.bytes) for e in entries) == "\n\nIt is 84.".encode()
    chunks, _ = ask(server, tok, [reply], extra_body=THINK_ON, logprobs=True, stream=True)
    streamed = [e.logprob for ch in chunks if ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert streamed == pytest.approx(want)
    assert all(ch.choices[0].logprobs is None for ch in chunks if getattr(ch.choices[0].delta, "reasoning_content",
                                                                          None))
    reply = "Sure.\n" + CALL_TEXT
    ids = tok.encode(reply)
    r, _ = ask(server, tok, [reply], tools=TOOLS, logprobs=True)
    cut = ids.index(tok.tag_ids["<tool_call>"])
    assert [e.logprob for e in r.choices[0].logprobs.content] == pytest.approx([-(k + 1) / 100 for k in range(cut)])


# --- refusals ----------------------------------------------------------------------------------------

def post(server, body: dict) -> tuple[int, dict]:
    r = httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=30)
    return r.status_code, r.json().get("error", {})


def chat_error(where: str, message: dict) -> str:
    with pytest.raises(ChatError) as e:
        message_from_dict(where, message)
    return str(e.value)


USER = {"role": "user", "content": "hi"}


def test_malformed_messages_get_400_with_the_formats_message(server):
    bad_args = {"role": "assistant", "content": None,
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}
    status, err = post(server, {"messages": [USER, bad_args]})
    assert status == 400 and err["message"] == chat_error("messages[1]", bad_args)
    assert err["param"] == "messages[1].tool_calls[0].arguments" and "is not valid JSON" in err["message"]

    status, err = post(server, {"messages": [USER, {"role": "tool", "tool_call_id": "c", "content": "2"}]})
    assert status == 400 and err["param"] == "messages[1]"
    assert err["message"].startswith("messages[1] is a tool result with no tool call before it")

    status, err = post(server, {"messages": [USER, {"role": "robot", "content": "x"}]})
    assert status == 400 and err["param"] == "messages[1].role" and "unknown role 'robot'" in err["message"]

    status, err = post(server, {"messages": [USER, {"role": "user", "content": "a <|im_end|> b"}]})
    assert status == 400 and err["param"] == "messages[1].content" and "<|im_end|>" in err["message"]

    status, err = post(server, {"messages": [USER, {"role": "assistant", "content": None}]})
    assert status == 400 and err["param"] == "messages[1].content"

    status, err = post(server, {"messages": [USER], "tools": [{"type": "function"}]})
    assert status == 400 and err["param"] == "tools[0]" and err["message"].startswith("tools[0] must be a tool object")


def _nested(levels: int) -> dict:
    """An array schema `levels` deep."""
    return {"type": "array"} if levels == 1 else {"type": "array", "items": _nested(levels - 1)}


@pytest.mark.parametrize("extra, param, message", [
    ({"tool_choice": "required"}, "tool_choice",
     'tool_choice: "required" asks for a tool call, but the request offers no tools; give tools, or leave '
     'tool_choice out'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "search"}}}, "tool_choice",
     "tool_choice.function.name: 'search' is not one of the tools offered (calculator, current_time); name one of "
     "them"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice",
     'tool_choice: must be "none", "auto", "required" or {"type": "function", "function": {"name": "..."}}'),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs",
     "chat_template_kwargs: enable_thinking must be true or false"),
    ({"tools": {"type": "function"}}, "tools", "tools: Input should be a valid array"),
    # Tools are checked with tool_choice "none" too (these were 500s: AttributeError, KeyError).
    ({"tools": [1], "tool_choice": "none"}, "tools[0]",
     'tools[0] must be a tool object with a function name, such as {"type": "function", "function": {"name": '
     '"add", "parameters": {...}}}'),
    ({"tools": [{"x": 1}], "tool_choice": "none"}, "tools[0]",
     'tools[0] must be a tool object with a function name, such as {"type": "function", "function": {"name": '
     '"add", "parameters": {...}}}'),
    # No name a call can write: the guide has nothing to hold calls to (was a 500 with the exception's text).
    ({"tools": [{"type": "function", "function": {"name": 'say"hi'}}, {"type": "function", "function": {
        "name": "back\\slash"}}]}, "tools",
     "tools: every tool's function name holds a quote or backslash, which a call cannot write; give at least one "
     "tool a plain name"),
    # Schemas whose guide would cost more per token than the guide bounds (an enum of 10,000 values took 6.8 s
    # a token): refused before any work, naming the place.
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "pick", "parameters": {"type": "object",
      "properties": {"x": {"enum": list(range(65))}}}}}]}, "tools[1].function.parameters.properties.x.enum",
     "tools[1].function.parameters.properties.x.enum: 65 values; the tool-call guide follows at most 64 (each "
     "token's cost grows with them); give fewer, or a plain string"),
    ({"tools": [{"type": "function", "function": {"name": "wide", "parameters": {"type": "object", "properties": {
        f"p{i}": {"type": "string"} for i in range(65)}}}}]}, "tools[0].function.parameters.properties",
     "tools[0].function.parameters.properties: 65 properties; the tool-call guide follows at most 64"),
    ({"tools": [{"type": "function", "function": {"name": "deep", "parameters": {"type": "object", "properties": {
        "x": _nested(8)}}}}]}, "tools[0].function.parameters.properties.x.items.items.items.items.items.items.items",
     "tools[0].function.parameters.properties.x.items.items.items.items.items.items.items: nested more than 8 levels "
     "deep; the tool-call guide follows at most 8"),
])
def test_tool_choice_and_thinking_fields_are_checked(server, extra, param, message):
    status, err = post(server, {"messages": [USER], **extra})
    assert (status, err["param"], err["message"]) == (400, param, message)


def _tool(parameters) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def _prop(schema) -> dict:
    """A tool whose one property x has `schema`."""
    return _tool({"type": "object", "properties": {"x": schema}})


P = "tools[0].function.parameters"
ENUM_65 = {"enum": list(range(65))}
TOO_MANY = "65 values; the tool-call guide follows at most 64 (each token's cost grows with them); give fewer, or a " \
           "plain string"
NOT_FOLLOWED = ("the tool-call guide does not follow this keyword; write the schema without it (anyOf, enum, type, "
                "properties and items are followed)")


@pytest.mark.parametrize("tool, place, problem", [
    (_tool("str"), P, "must be a JSON schema object (the arguments' schema), not a string"),
    (_tool([1]), P, "must be a JSON schema object (the arguments' schema), not a list"),
    (_tool(5), P, "must be a JSON schema object (the arguments' schema), not a number"),
    (_tool(None), P, "must be a JSON schema object (the arguments' schema), not null"),
    (_tool({"type": "string"}), f"{P}.type",
     'the arguments are an object, so their schema\'s type is "object", not "string"'),
    (_tool({"type": "object", "properties": [{"x": {}}]}), f"{P}.properties",
     "must be an object of property schemas, not a list"),
    (_prop({"enum": "xyz"}), f"{P}.properties.x.enum", "must be a non-empty list of strings, numbers, booleans or null"),
    (_prop({"type": "bogus"}), f"{P}.properties.x.type",
     '"bogus" is not a JSON type or a list of distinct ones; use string, number, integer, boolean, null, object, array'),
    (_prop({"type": "array", "items": 1}), f"{P}.properties.x.items", "must be a JSON schema object, not a number"),
    (_prop({"$ref": "#/$defs/x"}), f"{P}.properties.x.$ref", NOT_FOLLOWED),
    (_prop({"oneOf": [{"type": "string"}]}), f"{P}.properties.x.oneOf", NOT_FOLLOWED),
    (_tool({"type": "object", "properties": {"a": {}}, "required": "a"}), f"{P}.required",
     "must be a list of property names"),
    (_tool({"type": "object", "properties": {"a": {}}, "required": ["b"]}), f"{P}.required",
     "names 'b', which properties does not list; the tool-call guide writes only listed properties"),
    (_prop({"type": "string", "maxLength": "9"}), f"{P}.properties.x.maxLength", 'must be a whole number >= 0, not "9"'),
    (_prop({"type": "string", "description": 5}), f"{P}.properties.x.description", "must be a string, not a number"),
    # the limits at every depth: inside anyOf, an items schema, additionalProperties
    (_prop({"anyOf": [{"type": "null"}, ENUM_65]}), f"{P}.properties.x.anyOf[1].enum", TOO_MANY),
    (_prop({"anyOf": [{"enum": list(range(40))}, {"enum": list(range(40))}]}), f"{P}.properties.x.anyOf",
     "80 alternatives in all (enum values and types counted); the tool-call guide follows at most 64"),
    (_prop({"type": "array", "items": [ENUM_65]}), f"{P}.properties.x.items",
     "a list of schemas (one per position) is not followed by the tool-call guide; give one schema for every item"),
    (_prop({"type": "array", "items": ENUM_65}), f"{P}.properties.x.items.enum", TOO_MANY),
    (_tool({"type": "object", "additionalProperties": ENUM_65}), f"{P}.additionalProperties.enum", TOO_MANY),
    (_prop({"type": "string", "anyOf": [{"type": "null"}]}), f"{P}.properties.x.anyOf",
     "given beside type, which the tool-call guide cannot combine with it; move type into each alternative"),
])
@pytest.mark.parametrize("choice", [None, "none", "required", {"type": "function", "function": {"name": "f"}}])
def test_a_tool_schema_is_checked_whole_and_refused_naming_the_place(server, tool, place, problem, choice):
    """Every keyword's type and every nested schema, whatever tool_choice says, before anything else is converted:
    the request's message here is also malformed (assistant first), and the schema is what the 400 names."""
    body = {"messages": [{"role": "assistant", "content": "x"}, USER], "tools": [tool]}
    if choice is not None:
        body["tool_choice"] = choice
    status, err = post(server, body)
    assert (status, err["param"], err["message"]) == (400, place, f"{place}: {problem}")


def test_schemas_in_the_guides_subset_are_served_and_guide_the_call(server, tok):
    """anyOf (a nullable value, as pydantic writes Optional), additionalProperties and annotations are accepted, and
    a forced call is held to them."""
    tool = _tool({"type": "object", "title": "F", "properties": {
        "x": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None, "title": "X", "minimum": 0},
        "tags": {"type": "object", "additionalProperties": {"type": "boolean"}}}, "required": ["x", "tags"],
        "additionalProperties": False})
    # The script writes a string where x must be an integer or null: the guide refuses it, so the engine's
    # scripted replay (which ignores masks) is not what is checked; the prompt accepted is.
    r, prompts = ask(server, tok, ['{"x": null, "tags": {"a": true}}}\n</tool_call>'], tools=[tool],
                     tool_choice={"type": "function", "function": {"name": "f"}})
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("f", {"x": None, "tags": {"a": True}})
    assert len(prompts) == 1


USER_2 = {"role": "user", "content": "and?"}
ASSISTANT = {"role": "assistant", "content": "ok"}
SYSTEM = {"role": "system", "content": "be brief"}
CALLING = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "2"}


@pytest.mark.parametrize("messages, message", [
    ([USER, USER_2], "messages[1] is user after user; user and assistant turns must alternate"),
    ([SYSTEM, USER, SYSTEM], "messages[2] is a system message, but a system message may only come first"),
    ([ASSISTANT, USER], "messages[0] is assistant, but the first turn (after an optional system message) must be "
                        "user"),
    ([SYSTEM, ASSISTANT, USER], "messages[1] is assistant, but the first turn (after an optional system message) "
                                "must be user"),
    ([USER, ASSISTANT, ASSISTANT, USER_2], "messages[2] is assistant after assistant; user and assistant turns must "
                                           "alternate"),
    # a last assistant message: the reply would follow it, assistant after assistant
    ([USER, ASSISTANT], "the reply is assistant after assistant; user and assistant turns must alternate"),
])
def test_the_docs_message_rules_are_enforced(server, messages, message):
    status, err = post(server, {"messages": messages})
    assert (status, err["message"], err["param"]) == (400, message, message.split(" ")[0] if
                                                      message.startswith("messages") else "messages")


@pytest.mark.parametrize("messages", [
    [SYSTEM, USER],
    [USER, ASSISTANT, USER_2],
    [USER, CALLING, RESULT],  # the reply answers the tool result
    [USER, CALLING, RESULT, {"role": "assistant", "content": "2"}, USER_2],
    [SYSTEM, USER, CALLING, RESULT, CALLING, RESULT],  # an assistant calling again after a result
])
def test_conversations_in_the_docs_order_are_served(server, tok, messages):
    r, _ = ask(server, tok, ["fine"], tools=TOOLS, messages=messages)
    assert r.choices[0].message.content == "fine"


def test_an_old_chatml_tokenizer_refuses_tools_and_thinking(tok, tmp_path):
    plain = old_chatml_tokenizer(tok.path.parent, tmp_path / "old")
    eng = ScriptedEngine(plain.encode("Hello."), max_seq_len=CTX)
    with running(create_app(eng, plain, ServeConfig(model_name="old"))) as url:
        status, err = post((url,), {"messages": [USER], "tools": TOOLS})
        with pytest.raises(ChatError) as e:
            CHATML.check("the request", [], tools_from_value("tools", TOOLS), str(plain.path))
        assert (status, err["param"], err["message"]) == (400, "tools", str(e.value))
        assert "carries the plain ChatML template" in err["message"]
        status, err = post((url,), {"messages": [USER], **THINK_ON})
        assert status == 400 and err["param"] == "chat_template_kwargs"
        assert err["message"].startswith(f"chat_template_kwargs.enable_thinking: the tokenizer {plain.path} carries "
                                         "the plain ChatML template")
        # Without tools (or with tool_choice "none") it answers in its own layout.
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [USER], "tools": TOOLS, "tool_choice": "none"},
                       timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello."
        assert eng.prompts[-1] == plain.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


# --- the built-in tools for the chat page: GET /v1/tools/builtin, POST /v1/tools/run --------------------

def run_tool(url: str, body, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/tools/run", json=body, timeout=30, **kw)


def test_the_builtin_tools_are_listed_and_run(server):
    url, _ = server
    r = httpx.get(url + "/v1/tools/builtin", timeout=30)
    assert r.status_code == 200 and r.json() == {"object": "list", "data": TOOLS}
    # Arguments as a reply's tool_calls give them (JSON text) or as an object, run as `nanolm chat` runs them.
    for arguments in ('{"expression": "12*(3+4)"}', {"expression": "12*(3+4)"}):
        r = run_tool(url, {"name": "calculator", "arguments": arguments})
        assert r.status_code == 200 and r.json() == {"name": "calculator", "content": "84"}
    r = run_tool(url, {"name": "calculator", "arguments": '{"expression": "__import__(\'os\')"}'})
    assert r.status_code == 200 and r.json()["content"].startswith("error: ")  # the model sees what went wrong
    assert run_tool(url, {"name": "calculator", "arguments": "{not json"}).json()["content"].startswith(
        "error: the arguments are not JSON")


@pytest.mark.parametrize("body, param", [
    ({"name": "shell", "arguments": {"cmd": "rm -rf /"}}, "name"),
    ({"name": "load_tools", "arguments": {}}, "name"),  # a function of the module, not a built-in tool
    ({"arguments": {}}, "name"),
    ({"name": "calculator", "arguments": [1]}, "arguments"),
])
def test_anything_but_a_builtin_tool_is_refused(server, body, param):
    r = run_tool(server[0], body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    if param == "name" and "name" in body:  # the refusal names the tool
        assert repr(body["name"]) in r.json()["error"]["message"]


def test_a_tool_call_body_is_bounded(server):
    from nanolm.infer.server.routes import MAX_TOOL_RUN_BYTES
    r = run_tool(server[0], {"name": "calculator", "arguments": {"expression": "1+" * MAX_TOOL_RUN_BYTES + "1"}})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(server[0] + "/v1/tools/run", content=b"[" * 100_000, timeout=30)  # nesting, under no limit
    assert r.status_code == 413
    assert f"limit of {MAX_TOOL_RUN_BYTES} bytes; send a shorter call" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: refused once it passes the limit while arriving
        for _ in range(64):
            yield b" " * 1024
    r = httpx.post(server[0] + "/v1/tools/run", content=chunked(), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_the_tool_routes_keep_the_apis_key_and_origin_rules(server, tok):
    url, _ = server
    foreign = {"Origin": "http://evil.example"}
    assert httpx.get(url + "/v1/tools/builtin", headers=foreign, timeout=30).status_code == 403
    r = run_tool(url, {"name": "calculator", "arguments": {"expression": "1+1"}}, headers=foreign)
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    same = {"Origin": url}  # the page's own POSTs carry its origin
    assert run_tool(url, {"name": "calculator", "arguments": {"expression": "1+1"}},
                    headers=same).json()["content"] == "2"
    eng = ScriptedEngine(tok.encode("hi"))
    with running(create_app(eng, tok, ServeConfig(model_name="keyed", api_key="s3cret"))) as keyed:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            assert httpx.get(keyed + "/v1/tools/builtin", headers=headers, timeout=30).status_code == 401
            r = run_tool(keyed, {"name": "calculator", "arguments": {"expression": "1+1"}}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = run_tool(keyed, {"name": "calculator", "arguments": {"expression": "1+1"}},
                     headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json()["content"] == "2"


# --- a reply sent back as the server gave it ---------------------------------------------------------------

def test_a_reply_holding_tags_goes_back_in_the_history_as_written(server, tok):
    """A model may write a tag where the reply has no place for one (a call with no tools offered, a think block
    mid-reply, a turn opener): the server returns it as content, and the next request, the reply in its
    history, is answered with the reply rendered as the model wrote it, not refused."""
    odd = "Sure. " + CALL_TEXT + " then <think> and <|im_start|>x"
    r, _ = ask(server, tok, [odd])
    said = r.choices[0].message.content
    assert said == odd and r.choices[0].finish_reason == "stop"
    history = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": said},
               {"role": "user", "content": "And then?"}]
    r, prompts = ask(server, tok, ["Done."], messages=history)
    assert r.choices[0].message.content == "Done."
    want = prompt(tok, [Message("user", QUESTION), Message("assistant", odd), Message("user", "And then?")])
    assert prompts == [want]
    # the reply's tags as the model wrote them: its call tag, and a fifth turn opener beside the four turns'
    assert tok.tag_ids["<tool_call>"] in want and want.count(tok.im_start_id) == 5
    # Only an assistant message is a reply: the same text from the user is refused, naming the field.
    status, err = post(server, {"messages": [{"role": "user", "content": odd}]})
    assert (status, err["param"]) == (400, "messages[0].content")
    assert err["message"] == ("messages[0].content contains the control token <tool_call>, which would change the "
                              "conversation's turns")
