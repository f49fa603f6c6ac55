"""A tokenizer that brings its own chat template (Qwen2.5's with tools, Llama 3's, SmolLM2's): nanolm renders
conversations through it exactly as transformers' `apply_chat_template` does, finds the assistant's tokens from
its `{% generation %}` markers or from prefixes of the conversation, refuses a template where neither holds,
and `nanolm prepare --format chat` writes the template's text with the mask on the replies only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from chat_helpers import write_jsonl
from conftest import EN
from nanolm import chat
from nanolm.chat import ChatError, Message, TemplateFormat, encode_chat, message_from_dict, tools_from_value
from nanolm.data.prepare import prepare
from nanolm.errors import UserError
from nanolm.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

NANOLM = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # what nanolm needs of every tokenizer

# Qwen2.5-Instruct's template, shortened (its default system prompt, tools in the system turn, tool calls and
# results in <tool_call> / <tool_response>).
QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object within <tool_call></tool_call> XML tags<|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- generation %}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Llama 3.1/3.2-Instruct's template, shortened (bos, the dated system header, a call as JSON, ipython results).
LLAMA3 = r"""{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {{- message.content }}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# SmolLM2-Instruct's template, as it ships (one line per tag, its default system prompt; no tools).
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
           "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# The last message is rendered unlike the others, so a conversation's prefixes are not prefixes of it.
NOT_NESTED = ("{% for m in messages %}{% if loop.last %}<|im_start|>{% endif %}{{ m.role + ': ' + m.content }}"
              "<|im_end|>{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")

FAMILIES = {
    "qwen2.5": (QWEN25, NANOLM + ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"], {}),
    # Llama 3's own special tokens only: none of nanolm's names (its roles are found by what plays them)
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>"],
               {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "smollm2": (SMOLLM2, NANOLM, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}),
    "not_nested": (NOT_NESTED, NANOLM, {}),
}

ADD = {"type": "function", "function": {"name": "add", "description": "add two numbers",
                                        "parameters": {"type": "object", "properties": {
                                            "a": {"type": "number"}, "b": {"type": "number"}}}}}
SYSTEM = {"role": "system", "content": "You are terse."}
CONVS = [
    [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi, how can I help?"}],
    [SYSTEM, {"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another one"}, {"role": "assistant", "content": "Green."}],
]
TOOL_CONV = [{"role": "user", "content": "What is 2 plus 3?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
             {"role": "tool", "content": "5"},
             {"role": "assistant", "content": "It is 5."}]


def family_tokenizer(out: Path, template: str, added: list[str], tokens: dict) -> Path:
    """A tiny byte-level BPE directory carrying the family's special tokens and its chat template."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=added, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(EN * 20, trainer=trainer)
    out.mkdir(parents=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096, "chat_template": template,
              **tokens}
    (out / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: family_tokenizer(root / name, *spec) for name, spec in FAMILIES.items()}


def hf(path: Path):
    return transformers.AutoTokenizer.from_pretrained(str(path))


def messages(conv: list[dict]) -> list:
    return [message_from_dict(f"m[{i}]", m) for i, m in enumerate(conv)]


@pytest.mark.parametrize("family", ["qwen2.5", "llama3", "smollm2"])
def test_rendering_equals_transformers(dirs, family):
    tok, ref = Tokenizer.load(dirs[family]), hf(dirs[family])
    assert isinstance(tok.chat_format, TemplateFormat)
    cases = [(c, None) for c in CONVS]
    if family != "smollm2":
        cases.append((TOOL_CONV, [ADD]))
    for conv, tools in cases:
        for gen in (False, True):
            prompt = conv[:-1] if gen else conv
            want = ref.apply_chat_template(prompt, tools=tools, tokenize=False, add_generation_prompt=gen)
            got = tok.chat_format.render(messages(prompt), tools_from_value("tools", tools),
                                         add_generation_prompt=gen)
            assert got == want, (family, gen)


def test_generation_markers_give_transformers_assistant_mask(dirs):
    tok, ref = Tokenizer.load(dirs["qwen2.5"]), hf(dirs["qwen2.5"])
    assert tok.chat_format.marked
    for conv, tools in [(CONVS[0], None), (CONVS[1], None), (TOOL_CONV, [ADD])]:
        out = ref.apply_chat_template(conv, tools=tools, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        spans = tok.chat_format.spans(messages(conv), tools_from_value("tools", tools))
        text = "".join(s.text for s in spans)
        ids, mask = encode_chat(spans, tok.encode(text), tok.spelled_lengths(), str(tok.path))
        assert ids.tolist() == list(out["input_ids"])
        assert (mask & chat.TARGET).tolist() == list(out["assistant_masks"])


def runs(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.diff(np.r_[0, (mask & chat.TARGET).astype(np.int8), 0])
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


@pytest.mark.parametrize("family, end", [("llama3", "<|eot_id|>"), ("smollm2", "<|im_end|>\n")])
def test_prefix_method_trains_exactly_the_assistant_turns(dirs, family, end):
    tok = Tokenizer.load(dirs[family])
    assert not tok.chat_format.marked
    conv = CONVS[1]
    spans = tok.chat_format.spans(messages(conv))
    text = "".join(s.text for s in spans)
    ids, mask = encode_chat(spans, tok.encode(text), tok.spelled_lengths(), str(tok.path))
    assert [tok.decode(ids[x:y].tolist()) for x, y in runs(mask)] == ["Blue." + end, "Green." + end]
    final = tok.chat_format.spans(messages(conv), final_only=True)
    assert [s.text for s in final if s.trains] == ["Green." + end]


def test_template_whose_prefixes_do_not_nest_is_refused(dirs):
    tok = Tokenizer.load(dirs["not_nested"])
    with pytest.raises(UserError, match=r"not_nested: the chat template has no \{% generation %\} markers.*"
                                        r"wrap each assistant reply in"):
        tok.chat_format.spans(messages(CONVS[0]))


def test_template_without_tools_renders_them_as_text_and_refuses_reasoning_in_one_line(dirs):
    tok = Tokenizer.load(dirs["smollm2"])
    fmt = tok.chat_format
    assert (fmt.tools, fmt.reads_tools, fmt.guided_calls, fmt.reasoning) == (True, False, True, False)
    fmt.check("the request", messages(TOOL_CONV), tools_from_value("tools", [ADD]), str(tok.path))  # no error
    thought = [Message("user", "hi"), Message("assistant", "Hello.", "I greet.")]
    with pytest.raises(ChatError, match=r"^the request has reasoning, but the chat template of .*smollm2/tokenizer.json has no "
                                        r"think block .*; leave reasoning and thinking out") as e:
        fmt.check("the request", thought, (), str(tok.path))
    assert "\n" not in str(e.value)
    with pytest.raises(ChatError, match=r"has thinking on, but the chat template of .*smollm2 has no think block"):
        fmt.render(thought[:1], add_generation_prompt=True, thinking=True)
    assert Tokenizer.load(dirs["llama3"]).chat_format.reads_tools


def test_generation_prompt_is_the_templates(dirs):
    assert Tokenizer.load(dirs["llama3"]).chat_format.generation_prompt() == \
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert Tokenizer.load(dirs["smollm2"]).chat_format.generation_prompt() == "<|im_start|>assistant\n"


def read_docs(out: Path, m) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, mask) of each conversation of the train split; each exchange begins on a user turn's first token."""
    docs = []
    for sh in m.splits["train"]["shards"]:
        ids = np.fromfile(out / sh["bin"], dtype=m.dtype).astype(np.int64)
        mask = np.fromfile(out / sh["mask"], dtype=np.uint8)
        offsets = np.fromfile(out / sh["idx"], dtype=np.uint64).astype(np.int64)
        docs += [(ids[x:y], mask[x:y]) for x, y in zip(offsets[:-1], offsets[1:])]
    return docs


@pytest.mark.parametrize("family", ["llama3", "qwen2.5"])
def test_prepare_chat_writes_the_templates_ids_and_masks_the_replies(tmp_path, dirs, family):
    tok, ref = Tokenizer.load(dirs[family]), hf(dirs[family])
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVS])
    m = prepare([src], dirs[family], tmp_path / "out", format="chat", val_fraction=0, workers=0, quiet=True)
    docs = read_docs(tmp_path / "out", m)
    assert len(docs) == len(CONVS)
    end = "<|eot_id|>" if family == "llama3" else "<|im_end|>"
    for conv, (ids, mask) in zip(CONVS, docs):
        text = ref.apply_chat_template(conv, tokenize=False)
        assert ids.tolist() == tok.encode(text) + [tok.eot_id]
        replies = [tok.decode(ids[x:y].tolist()) for x, y in runs(mask)]
        want = [msg["content"] + end for msg in conv if msg["role"] == "assistant"]
        if family == "qwen2.5":  # its generation block opens before the "\n" that starts a reply
            want = ["\n" + r for r in want]
        assert replies == want
        # Each user turn opens an exchange (where truncation may cut), at the template's turn header; but the
        # first when nothing comes before it (these templates cannot render an empty conversation).
        starts = ids[(mask & chat.EXCHANGE) > 0].tolist()
        head = "<|start_header_id|>" if family == "llama3" else "<|im_start|>"
        assert starts == [tok.encode(head)[0]] * (sum(msg["role"] == "user" for msg in conv)
                                                  - (conv[0]["role"] == "user"))


def test_nanolm_templates_keep_their_layouts_and_bad_jinja_is_named():
    assert chat.format_of(None) is chat.CHATML and chat.format_of(chat.CHATML.template) is chat.CHATML
    assert chat.format_of(chat.QWEN3.template) is chat.QWEN3
    assert isinstance(chat.format_of(SMOLLM2), TemplateFormat)
    with pytest.raises(UserError, match=r"^tok/: chat_template is not valid Jinja \(.*\); fix the template"):
        chat.format_of("{% for m in messages %}", "tok/")


def test_serve_renders_prompts_through_the_template_with_tools_as_text(dirs):
    httpx = pytest.importorskip("httpx")
    from server_helpers import ScriptedEngine, running  # skips without uvicorn

    from nanolm.config import ServeConfig
    from nanolm.infer.server import create_app
    tok, ref = Tokenizer.load(dirs["smollm2"]), hf(dirs["smollm2"])
    eng = ScriptedEngine(tok.encode("Hello."), max_seq_len=1024)
    with running(create_app(eng, tok, ServeConfig(model_name="smol"))) as url:
        conv = CONVS[1][:-1]
        r = httpx.post(url + "/v1/chat/completions", json={"messages": conv}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello."
        assert eng.prompts[-1] == tok.encode(ref.apply_chat_template(conv, tokenize=False,
                                                                      add_generation_prompt=True))
        r = httpx.post(url + "/v1/chat/completions", json={"messages": conv, "tools": [ADD]}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello."
        system = "You are terse.\n\n" + chat.templates._TOOLS_HEAD + "\n" + json.dumps(ADD) + chat.templates._TOOLS_TAIL
        want = ref.apply_chat_template([{"role": "system", "content": system}, *conv[1:]], tokenize=False,
                                       add_generation_prompt=True)
        assert eng.prompts[-1] == tok.encode(want)
        r = httpx.post(url + "/v1/chat/completions", json={"messages": conv, "chat_template_kwargs":
                                                           {"enable_thinking": True}}, timeout=30)
        assert (r.status_code, r.json()["error"]["param"]) == (400, "chat_template_kwargs")


def test_a_template_tokenizer_finds_its_own_control_tokens(dirs, tmp_path):
    """Llama 3 has none of nanolm's control tokens: its document end, turn end (the config's eos) and turn header
    play their parts; a template tokenizer with none of them is refused in one line naming what it looked for."""
    tok = Tokenizer.load(dirs["llama3"])
    names = {tok.decode([i]) for i in (tok.eot_id, tok.im_start_id, tok.im_end_id)}
    assert [tok.decode([i]) for i in (tok.eot_id, tok.im_start_id, tok.im_end_id)] == \
        ["<|end_of_text|>", "<|start_header_id|>", "<|eot_id|>"] and len(names) == 3
    bare = family_tokenizer(tmp_path / "bare", LLAMA3, ["<|begin_of_text|>"], {"bos_token": "<|begin_of_text|>"})
    with pytest.raises(UserError, match=r"^\S*tokenizer\.json: <\|endoftext\|> is not in its vocabulary \(nor "
                                        r"<\|end_of_text\|>, </s>, which play its part with the tokenizer's own chat "
                                        r"template\); nanolm needs") as e:
        Tokenizer.load(bare)
    assert "\n" not in str(e.value)


LLAMA_CALL = '{"name": "calculator", "parameters": {"expression": "12*(3+4)"}}'


def test_llama_calls_are_bare_json_and_read_back_however_the_reply_is_cut(dirs):
    """Llama 3's template writes a call as the whole reply, `{"name": ..., "parameters": ...}` with no tags: the
    format says so (found by rendering a probe call), and its replies are read back as calls."""
    assert Tokenizer.load(dirs["llama3"]).chat_format.bare_calls
    assert not Tokenizer.load(dirs["qwen2.5"]).chat_format.bare_calls  # <tool_call> tags
    assert not Tokenizer.load(dirs["smollm2"]).chat_format.bare_calls  # no tools at all
    want = chat.ToolCall("calculator", '{"expression": "12*(3+4)"}')
    two = LLAMA_CALL + '; {"name": "add", "arguments": {"a": 2, "b": 3}}'
    for text, calls, content in [(LLAMA_CALL, [want], ""), (" \n" + LLAMA_CALL + "\n", [want], ""),
                                 (two, [want, chat.ToolCall("add", '{"a": 2, "b": 3}')], ""),
                                 ("It is 84.", [], "It is 84."), ("{not json} at all", [], "{not json} at all"),
                                 ('{"name": "calculator", "parameters": 3}', [], '{"name": "calculator", '
                                                                               '"parameters": 3}')]:
        for cut in (1, 3, len(text)):
            parser = chat.ReplyParser(thinking=False, bare_calls=True)
            for i in range(0, len(text), cut):
                parser.push(text[i:i + cut])
            parser.finish()
            msg = parser.message()
            assert (list(msg.tool_calls), msg.content) == (calls, content), (text, cut)
    after_thought = chat.read_reply("I add.\n</think>\n\n" + LLAMA_CALL, thinking=True, bare_calls=True)
    assert (after_thought.reasoning, after_thought.tool_calls, after_thought.content) == ("I add.", (want,), "")
    assert chat.read_reply("Hm.</think>\n\n{oops", thinking=True, bare_calls=True).content == "{oops"
    assert chat.read_reply(LLAMA_CALL).tool_calls == ()  # without bare_calls it is text
    assert chat.read_reply(LLAMA_CALL, bare_calls=True).tool_calls == (want,)


def test_chat_runs_a_llama_call_and_feeds_the_result_back_through_the_template(dirs):
    from test_chat import BUILTIN, chat as scripted_chat
    tok, ref = Tokenizer.load(dirs["llama3"]), hf(dirs["llama3"])
    text, session, eng = scripted_chat(tok, [LLAMA_CALL, "It is 84."], ["What is 12*(3+4)?"], tools=BUILTIN)
    assert text == ("user: What is 12*(3+4)?\n"
                    'tool call: calculator({"expression": "12*(3+4)"})\n'
                    "tool result: 84\n"
                    "assistant: It is 84.\n")
    conv = [{"role": "user", "content": "What is 12*(3+4)?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*(3+4)"}}}]},
            {"role": "tool", "content": "84"}]
    tools = [json.loads(t) for t in BUILTIN.texts()]
    # the second prompt holds the call and its result as transformers renders them in Llama 3's layout
    assert eng.prompts[1] == tok.encode(ref.apply_chat_template(conv, tools=tools, tokenize=False,
                                                                add_generation_prompt=True))
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n84<|eot_id|>" in tok.decode(eng.prompts[1])


@pytest.mark.parametrize("family, guided", [("qwen2.5", True), ("llama3", False)])
def test_the_chat_guides_a_templates_tool_call_blocks_as_the_server_does(dirs, family, guided):
    """The chat session holds calls to the tools' schemas wherever the server does: a template's own
    <tool_call> blocks (Qwen's) as nanolm's layout, not Llama 3's bare JSON calls."""
    from test_chat import BUILTIN, Replies

    from nanolm.config import SamplingParams
    from nanolm.infer.session import ChatSession
    tok = Tokenizer.load(dirs[family])
    assert tok.chat_format.guided_calls == guided
    session = ChatSession(Replies(tok, []), tok, SamplingParams(), tools=BUILTIN)
    assert (session.guide is not None) == guided
    assert ChatSession(Replies(tok, []), tok, SamplingParams(), tools=BUILTIN, guide_calls=False).guide is None


def test_serve_returns_a_llama_call_as_tool_calls(dirs):
    httpx = pytest.importorskip("httpx")
    from server_helpers import ScriptedEngine, running  # skips without uvicorn

    from nanolm.config import ServeConfig
    from nanolm.infer.server import create_app
    tok = Tokenizer.load(dirs["llama3"])
    eng = ScriptedEngine(tok.encode('{"name": "add", "parameters": {"a": 2, "b": 3}}'), max_seq_len=1024)
    with running(create_app(eng, tok, ServeConfig(model_name="llama"))) as url:
        r = httpx.post(url + "/v1/chat/completions", json={"messages": TOOL_CONV[:1], "tools": [ADD]}, timeout=30)
        choice = r.json()["choices"][0]
        assert r.status_code == 200 and choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] is None
        assert [c["function"] for c in choice["message"]["tool_calls"]] == [{"name": "add",
                                                                              "arguments": '{"a": 2, "b": 3}'}]
