"""The HTTP side of `nanolm serve`: the FastAPI app, and its routes as plain functions over one ServerState.

`ServerState` is what every route shares (the engine and tokenizer, the
worker, the limits, the served model's name); `build_app` puts it on the app
and registers the routes, the error handlers and the API-key and same-origin
middleware (middleware.py). A route reads the state from its request,
validates the body (`schemas`),
bounds its cost, submits a `worker.Job` and answers from the job's events:
one JSON body, or server-sent events in OpenAI's chunk shapes. A chat
request's messages and tools go through the chat format
(`ServerState.chat_prompt`: a message or conversation it cannot render is a
400 with its message), and each choice's reply is read by `choices.Choice`.

Every failure a client causes is a 4xx with OpenAI's error body, never a 500.
Imported only when a server is built: FastAPI comes with the `serve` extra.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from typing import Any, AsyncIterator, Callable

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask

from nanolm.chat import ChatError, Message, ToolCall, check_conversation, message_from_dict, tools_from_value
from nanolm.config.sampling import SamplingParams
from nanolm.config.serve import ServeConfig
from nanolm.errors import UserError
from nanolm.infer.engine import Engine
from nanolm.infer.bans import ReplyGuides
from nanolm.infer.guide import SchemaError, check_schema
from nanolm.infer.generate import check_vocab
from nanolm.infer.server.choices import ChatPlan, Choice
from nanolm.infer.server.middleware import ERROR_HANDLERS, ApiError, BearerAuth, SameOrigin
from nanolm.infer.server.page import chat_page, static_file
from nanolm.infer.server.schemas import (ChatRequest, CompletionLogprobs, CompletionRequest, Usage, chat_logprobs,
                                         error_body, sse, validation_error)
from nanolm.infer.server.worker import Job, Worker, events
from nanolm.infer.tools import BUILTIN_TOOLS, BUILTINS, run_builtin, tool_name
from nanolm.special_tokens import TOOL_CALL
from nanolm.tokenizer import SPECIAL_TOKENS, Tokenizer

# A completion without max_tokens stops after this many tokens, as OpenAI's /v1/completions does; a chat
# reply without it gets the server's max_new_tokens (its SamplingParams), at most the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# The request fields that are SamplingParams fields of the same name.
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty")
# Rows decoded together when the server's config leaves max_batch unset: on a CPU, a small model's products
# stop being bound by reading the weights at about 16 rows; a GPU has room for many more.
DEFAULT_MAX_BATCH_CPU, DEFAULT_MAX_BATCH_GPU = 16, 64


def max_batch(config: ServeConfig, device: torch.device) -> int:
    """The most rows the server decodes together: config.max_batch, or the device's default."""
    return config.max_batch or (DEFAULT_MAX_BATCH_CPU if device.type == "cpu" else DEFAULT_MAX_BATCH_GPU)


def max_token_bytes(tokenizer: Tokenizer) -> int:
    """The most UTF-8 bytes of text one token can stand for: a special token's name or the longest BPE token."""
    return max(int(tokenizer.token_byte_lengths().max()), *(len(s.encode("utf-8")) for s in SPECIAL_TOKENS))


class ServerState:
    """What the routes share: the engine and tokenizer, the generation worker, the server's settings and limits,
    and the sampling defaults for what a request leaves out."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, config: ServeConfig, sampling: SamplingParams) -> None:
        if not config.model_name:
            raise UserError("model_name is empty: name the model the server serves (serve() names it after the run)")
        # Refused at start, not as a failure inside the first request.
        check_vocab(tokenizer, engine.model.config.vocab_size)
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.sampling = sampling
        # A text of n UTF-8 bytes is at least n / max_token_bytes tokens long. Tokenizing is linear but not
        # cheap (1 MiB of text took 1.1 s of the event loop and 230 MiB that stayed resident), so a prompt
        # sure to overflow the context is refused by its length. The factor 4 leaves room for a tokenizer
        # whose normalizer shrinks text (NFKC maps a 4-byte letter to 1 byte); nanolm's have none.
        self.max_prompt_bytes = 4 * max_token_bytes(tokenizer) * engine.max_seq_len
        self.max_batch = max_batch(config, engine.device)
        self.worker = Worker(engine, config.max_queue, self.max_batch)
        self._guides = ReplyGuides(tokenizer, engine.model.config.vocab_size, engine.device)  # the replies' guides
        self.created = int(time.time())

    def model_card(self) -> dict[str, Any]:
        return {"id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "nanolm"}

    def _too_large(self, size: int | None, limit: int | None = None,
                   fix: str = "shorten the prompt or the conversation") -> ApiError:
        what = f"is {size} bytes, over" if size is not None else "passes"
        limit = self.config.max_body_bytes if limit is None else limit
        return ApiError(413, f"the request body {what} this server's limit of {limit} bytes; {fix}", None,
                        "request_too_large")

    async def _read_body(self, request: Request, chat: bool = False,
                         most_bytes: int | None = None) -> tuple[bytes, int]:
        """The body and the `{` bytes it holds (at least one per JSON object, however its keys are spelt:
        `\u0072ole` is `role`); refused as soon as it is known to pass max_body_bytes (or `most_bytes`, a
        route's own smaller limit): by its declared length, before reading any of it, else while it arrives.
        uvicorn discards the unread rest after the response. A chat body is also refused as soon as it holds
        twice as many `"role"` keys as the context can hold messages: a body of thousands of messages so spelt
        is not read to its end, nor parsed."""
        limit = min(self.config.max_body_bytes, most_bytes or self.config.max_body_bytes)
        timeout = self.config.body_timeout_s
        fix = "shorten the prompt or the conversation" if most_bytes is None else "send a shorter call"
        declared = request.headers.get("content-length", "")
        if declared.isascii() and declared.isdigit() and int(declared) > limit:
            raise self._too_large(int(declared), limit, fix)
        body = bytearray()
        roles, braces, most = 0, 0, 2 * (self.engine.max_seq_len // 3)

        async def receive() -> None:
            nonlocal roles, braces
            async for part in request.stream():
                braces += part.count(b"{")
                if chat:  # a key cut between two parts is counted with the part it ends in
                    tail = bytes(body[-5:])
                    roles += (tail + part).count(b'"role"') - tail.count(b'"role"')
                    if roles > most:
                        raise ApiError(400, f"the conversation holds more than {most} \"role\" keys, more messages "
                                            f"than the model's context of {self.engine.max_seq_len} tokens can hold "
                                            "(each takes at least 3); shorten the conversation", "messages",
                                       "context_length_exceeded", unread=True)
                body.extend(part)
                if len(body) > limit:
                    raise self._too_large(None, limit, fix)

        try:
            await asyncio.wait_for(receive(), timeout)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {timeout:g} s of its headers "
                                f"({len(body)} bytes came); send the whole request at once", None,
                           "request_timeout") from None
        return bytes(body), braces

    async def parse(self, request: Request, schema: type[BaseModel]) -> Any:
        """The request body, read within the limits and validated; 400 naming the field otherwise."""
        body, braces = await self._read_body(request, chat=schema is ChatRequest)
        if schema is ChatRequest:
            self._count_messages(body, braces)
        try:
            req = schema.model_validate_json(body)
        except ValidationError as e:
            message, param = validation_error(e.errors(include_url=False))
            raise ApiError(400, message, param) from None
        self._check_logit_bias(req.logit_bias)
        return req

    def _check_logit_bias(self, bias: dict[str, float] | None) -> None:
        """400 for a logit_bias OpenAI would refuse (a key that is not a token id of the model, a bias outside
        [-100, 100]), and for any other non-empty one: the sampler has no per-token bias, and a bias ignored
        would change the reply the client asked for without a word."""
        if not bias:
            return
        size = self.engine.model.config.vocab_size
        for key, value in bias.items():
            if not (key.isascii() and key.isdigit() and int(key) < size):
                raise ApiError(400, f"logit_bias: {key[:40]!r} is not a token id of this model; its ids are 0 to "
                                    f"{size - 1}", "logit_bias")
            if not -100 <= value <= 100:
                raise ApiError(400, f"logit_bias[{key!r}]: {value:g} is outside -100 to 100", "logit_bias")
        raise ApiError(400, "logit_bias: not supported by this server (its sampler has no per-token bias); leave "
                            "it out", "logit_bias")

    def too_many_messages(self, n: int) -> ApiError:
        limit = self.engine.max_seq_len
        return ApiError(400, f"the conversation has {n} messages, more than the model's context of {limit} tokens "
                             "can hold (each takes at least 3); shorten the conversation", "messages",
                        "context_length_exceeded")

    def _count_messages(self, body: bytes, braces: int) -> None:
        """A chat body of more messages than the context can hold, refused before it is validated: validating
        20,000 messages took 140 ms, where the `{` bytes are counted as the body arrives (each message is an
        object, so there are at least as many, whatever its keys' spelling) and, when there are more than the
        limit, parsing the JSON to count the messages as the parser produces them takes 7 ms."""
        limit = self.engine.max_seq_len // 3
        if braces <= limit:
            return
        try:
            messages = json.loads(body).get("messages")
        except (ValueError, AttributeError, RecursionError):
            return  # malformed: validation says what is wrong
        if isinstance(messages, list) and len(messages) > limit:
            raise self.too_many_messages(len(messages))

    def encode_prompt(self, text: str, param: str) -> list[int]:
        """The prompt's token ids; a prompt too long by its byte count alone is refused before tokenizing."""
        size = len(text.encode("utf-8"))
        if size > self.max_prompt_bytes:
            raise ApiError(400, f"the prompt is {size} bytes long, more tokens than the model's context of "
                                f"{self.engine.max_seq_len} tokens can hold; shorten the prompt or the conversation",
                           param, "context_length_exceeded")
        return self.tokenizer.encode(text)

    def chat_prompt(self, req: ChatRequest) -> tuple[str, ChatPlan]:
        """The prompt text of a chat request, in the tokenizer's chat format with the tools it offers, and how
        its replies are read; 400 with the chat format's message for a conversation it cannot render.

        tool_choice "none" leaves the tools out; "required" and a named function prefill the reply with the
        opening of a call (`<tool_call>\n`, or up to the named function's arguments), which the reply is read
        from. A forced call is written without reasoning: its prompt closes the think block.
        """
        fmt = self.tokenizer.chat_format
        forced = req.forced_call()
        # The tools' schemas, whole, before anything else is converted or rendered, whatever tool_choice says:
        # the guide follows a schema only in the subset check_schema accepts, at a bounded cost per token.
        for i, tool in enumerate(req.tools or ()):
            try:
                check_schema(tool, f"tools[{i}]")
            except SchemaError as e:
                raise ApiError(400, str(e), e.place) from None
        # Before any message is converted or rendered: a conversation too long for the context by its count of
        # messages (each takes at least 3 tokens: the turn's opening, its role and its end) or by the bytes of
        # its texts alone is refused at once, so a body of thousands of tiny messages costs no rendering.
        limit = self.engine.max_seq_len
        if len(req.messages) > limit // 3:
            raise self.too_many_messages(len(req.messages))
        size = sum(len(m.content.encode("utf-8")) for m in req.messages if isinstance(m.content, str))
        if size > self.max_prompt_bytes:
            raise ApiError(400, f"the messages hold {size} bytes of text, more tokens than the model's context of "
                                f"{limit} tokens can hold; shorten the conversation", "messages",
                           "context_length_exceeded")
        try:
            # The replies in the history are the model's, sent back as the server gave them: a tag it wrote
            # where the reply has no place for one (`<tool_call>` with no tools) renders back as it was written.
            messages = [message_from_dict(f"messages[{i}]", m.as_dict(), replies_as_written=True)
                        for i, m in enumerate(req.messages)]
            check_conversation("messages", messages, complete=False)
            # The order the docs promise (an optional system message first, user and assistant turns
            # alternating, tool results after calls), as the conversation stands once the reply completes it.
            check_conversation("messages", [*messages, Message("assistant", "reply")], complete=True,
                               names=[f"messages[{i}]" for i in range(len(messages))] + ["the reply"])
            offered = tools_from_value("tools", req.tools) if req.tools else ()  # checked whatever tool_choice says
            tools = offered if req.tool_choice != "none" else ()
            fmt.check("the request", messages, tools, str(self.tokenizer.path))
        except ChatError as e:
            message = str(e)
            param = _CHAT_PARAM.match(message)
            raise ApiError(400, message, "tools" if message.startswith("the request has tools")
                           else param.group() if param else "messages") from None
        if forced is not None and not tools:
            raise ApiError(400, f"tool_choice: {json.dumps(req.tool_choice)} asks for a tool call, but the request "
                                "offers no tools; give tools, or leave tool_choice out", "tool_choice")
        if forced is not None and not fmt.nanolm_layout:  # the prefill below is nanolm's <tool_call> opening
            raise ApiError(400, f"tool_choice: {json.dumps(req.tool_choice)} forces a call in nanolm's <tool_call> "
                                f"layout, but the tokenizer {self.tokenizer.path} renders its own chat template; "
                                'leave tool_choice out or "auto"', "tool_choice")
        names = [tool_name(t) for t in req.tools or ()]
        if forced and forced not in names:
            raise ApiError(400, f"tool_choice.function.name: {forced!r} is not one of the tools offered "
                                f"({', '.join(names)}); name one of them", "tool_choice")
        if forced and ('"' in forced or "\\" in forced):
            raise ApiError(400, f"tool_choice.function.name: {forced!r} holds a quote or backslash; use a plain "
                                "name", "tool_choice")
        if tools and self.config.guide_calls and all('"' in n or "\\" in n for n in names):
            raise ApiError(400, "tools: every tool's function name holds a quote or backslash, which a call cannot "
                                "write; give at least one tool a plain name", "tools")
        thinking = req.thinking()
        if thinking and not fmt.reasoning:
            raise ApiError(400, f"chat_template_kwargs.enable_thinking: the tokenizer {self.tokenizer.path} carries "
                                "the plain ChatML template of nanolm before tools and reasoning, which has no think "
                                "block; leave thinking off, or serve a model whose tokenizer has <think>",
                           "chat_template_kwargs")
        prefill = "" if forced is None else f"{TOOL_CALL}\n" + (f'{{"name": "{forced}", "arguments": ' if forced
                                                                  else "")
        thinking = thinking and not prefill
        text = fmt.render(messages, tools, add_generation_prompt=True, thinking=thinking) + prefill
        return text, ChatPlan(thinking=thinking, calls=bool(tools), prefill=prefill,
                              tools=tuple(req.tools or ()) if tools else (), bare_calls=fmt.bare_calls)

    def guide(self, plan: ChatPlan) -> Any:
        """The reply's guide (`infer/bans.py`): its tool calls held to the tools offered (ServeConfig.guide_calls),
        started on the prefilled opening of a forced call; with no tools rendered (absent, empty, tool_choice
        "none"), no call tag; with thinking off, no <think>. None when there is nothing to guide."""
        guide = self._guides.reply(plan.tools if plan.calls else (), thinking=plan.thinking,
                                   guide_calls=self.config.guide_calls)
        if guide is not None:
            guide.feed(plan.prefill.encode("utf-8"))
        return guide

    def sampling_params(self, req: BaseModel, max_tokens: int | None) -> SamplingParams:
        """The request's sampling fields, and the server's defaults for those it leaves out; a reply without
        max_tokens gets the server's max_new_tokens, both at most the rest of the context (the engine's cut)."""
        given = {name: getattr(req, name) for name in SAMPLING_FIELDS if name in req.model_fields_set}
        return dataclasses.replace(self.sampling, **given,
                                   max_new_tokens=self.sampling.max_new_tokens if max_tokens is None else max_tokens)

    def start(self, prompt_ids: list[int], req: Any, max_tokens: int | None, param: str,
              guide: Any = None) -> Job:
        """Submit the request's generation to the worker: 400 if the prompt leaves no room or it asks for more
        choices than decode together, 429 if the queue is full."""
        max_seq_len = self.engine.max_seq_len
        if len(prompt_ids) >= max_seq_len:
            raise ApiError(400, f"the prompt is {len(prompt_ids)} tokens long and the model's context is "
                                f"{max_seq_len} tokens, which leaves no room for a reply; "
                                "shorten the prompt or the conversation", param, "context_length_exceeded")
        if req.n > self.max_batch:
            raise ApiError(400, f"n: {req.n} choices asked for, and this server decodes at most {self.max_batch} "
                                "rows together (nanolm serve --max-batch); ask for fewer", "n")
        job = Job(self.tokenizer, prompt_ids, self.sampling_params(req, max_tokens), req.stop, n=req.n,
                  logprobs=req.logprobs_wanted(), guide=guide, stream=bool(req.stream))
        if not self.worker.submit(job):
            raise ApiError(429, f"the server is busy: {self.worker.max_queue} requests are already queued; "
                                "retry shortly", None, "queue_full", "rate_limit_error")
        return job


def _state(request: Request) -> ServerState:
    return request.app.state.nanolm


# The field a chat format error names at its start: "messages[2].tool_calls[0].arguments is not valid JSON ..."
_CHAT_PARAM = re.compile(r"(messages|tools)(\[\d+\]|\.[A-Za-z_]+)*")


# --- answering from a job's events -------------------------------------------------------------------

# (choice index, text or None, finish_reason or None, the token log-probabilities that came with it) -> the
# chunks of the stream it makes (a chat reply's text may make none yet, or several)
Chunks = Callable[..., list[dict[str, Any]]]


async def _collect(request: Request, job: Job, usage: Usage) -> list[tuple[str, str, list]] | None:
    """Per choice, (text, finish_reason, token log-probabilities) of a whole generation; None when the client
    went away."""
    pieces: list[list[str]] = [[] for _ in range(job.n)]
    lps: list[list] = [[] for _ in range(job.n)]
    done: list[tuple[str, str, list] | None] = [None] * job.n
    async with aclosing(events(request, job)) as stream:
        async for event in stream:
            if event[0] == "text":
                pieces[event[1]].append(event[2])
                lps[event[1]] += event[3]
            elif event[0] == "end":
                _, i, finish, tokens, last = event
                usage.completion_tokens += tokens
                done[i] = ("".join(pieces[i]), finish, lps[i] + last)
            else:
                raise ApiError(500, event[1], type_="server_error")
    return None if any(d is None for d in done) else done  # type: ignore[return-value]


def _stream(request: Request, job: Job, usage: Usage, first: list[dict[str, Any]], chunks: Chunks,
            include_usage: bool, head: dict[str, Any]) -> StreamingResponse:
    """Server-sent events: the `first` chunks, the chunks of each text piece of any choice, those of each
    choice's end (the last with its finish reason), a usage chunk (`head`'s fields, no choices) if asked for,
    then [DONE]. With include_usage every chunk carries "usage": null."""
    def shaped(c: dict[str, Any]) -> bytes:
        if include_usage:
            c["usage"] = None
        return sse(c)

    async def body() -> AsyncIterator[bytes]:
        for c in first:
            yield shaped(c)
        open_choices = job.n
        async with aclosing(events(request, job)) as stream:
            async for event in stream:
                if event[0] == "text":
                    for c in chunks(event[1], event[2], None, event[3]):
                        yield shaped(c)
                elif event[0] == "end":
                    _, i, finish, tokens, last = event
                    usage.completion_tokens += tokens
                    for c in chunks(i, None, finish, last):
                        yield shaped(c)
                    open_choices -= 1
                    if open_choices:
                        continue
                    if include_usage:
                        yield sse({**head, "choices": [], "usage": usage.as_dict()})
                    yield b"data: [DONE]\n\n"
                else:
                    yield sse(error_body(event[1], "server_error"))

    # The background task runs once the response is over, however it ended: a client that left before the
    # stream began never starts body(), whose own `finally` would otherwise be the one to cancel the job.
    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                             background=BackgroundTask(job.cancel.set))


async def _respond(request: Request, job: Job, usage: Usage, req: Any, head: dict[str, Any],
                   first: list[dict[str, Any]], chunks: Chunks,
                   whole: Callable[[list[tuple[str, str, list]]], dict[str, Any]]) -> Response:
    """The answer to a generation request: a stream of chunks, or `whole(choices)` once every choice is done.
    head: the fields every chunk starts with (id, object, created, model)."""
    if req.stream:
        return _stream(request, job, usage, first, chunks,
                       bool(req.stream_options and req.stream_options.include_usage), head)
    done = await _collect(request, job, usage)
    if done is None:
        return Response(status_code=499)  # nobody is there to read it
    return JSONResponse(whole(done))


# --- the routes --------------------------------------------------------------------------------------

async def health(request: Request) -> dict[str, Any]:
    # Outside /v1, so no API key: for load balancers and monitors. `admitted` counts requests
    # decoding or waiting; it returns to 0 when the server is idle.
    state = _state(request)
    return {"status": "ok", "model": state.config.model_name, "admitted": state.worker.admitted,
            "max_queue": state.worker.max_queue, "max_batch": state.max_batch}


async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_state(request).model_card()]}


async def get_model(request: Request, model: str) -> dict[str, Any]:
    state = _state(request)
    if model != state.config.model_name:
        raise ApiError(404, f"model {model!r} not found; this server serves {state.config.model_name!r}", "model",
                       "model_not_found")
    return state.model_card()


async def chat_completions(request: Request) -> Response:
    state = _state(request)
    req = await state.parse(request, ChatRequest)
    text, plan = state.chat_prompt(req)
    prompt_ids = state.encode_prompt(text, "messages")
    usage = Usage(len(prompt_ids))
    job = state.start(prompt_ids, req, req.max_completion_tokens or req.max_tokens, "messages", state.guide(plan))
    try:
        rid, now, name = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), state.config.model_name
        head = {"id": rid, "object": "chat.completion.chunk", "created": now, "model": name}
        token_bytes = state.tokenizer.token_bytes()
        wants_lp = job.logprobs is not None
        streamed = [Choice(state.tokenizer, plan) for _ in range(job.n)]

        def chunk(i: int, delta: dict[str, Any], finish: str | None, lps: list) -> dict[str, Any]:
            return {**head, "choices": [{"index": i, "delta": delta,
                                         "logprobs": chat_logprobs(token_bytes, lps) if wants_lp and lps else None,
                                         "finish_reason": finish}]}

        def chunks(i: int, text: str | None, finish: str | None, lps: list) -> list[dict[str, Any]]:
            choice = streamed[i]
            out = [chunk(i, delta, None, tokens) for delta, tokens in choice.deltas(text, lps, end=finish is not None)]
            if finish is not None:
                out.append(chunk(i, {}, choice.finish_reason(finish), choice.last_tokens()))
            return out

        def whole(choices: list[tuple[str, str, list]]) -> dict[str, Any]:
            out = []
            for i, (text, finish, lps) in enumerate(choices):
                choice = Choice(state.tokenizer, plan)
                choice.read(text, lps)
                out.append({"index": i, "message": choice.message(),
                            "logprobs": chat_logprobs(token_bytes, choice.content_tokens) if wants_lp else None,
                            "finish_reason": choice.finish_reason(finish)})
            return {"id": rid, "object": "chat.completion", "created": now, "model": name, "choices": out,
                    "usage": usage.as_dict()}

        first = [chunk(i, {"role": "assistant", "content": ""}, None, []) for i in range(job.n)]
        return await _respond(request, job, usage, req, head, first, chunks, whole)
    except BaseException:  # what fails before the answer is under way must not leave the job running
        job.cancel.set()
        raise


async def completions(request: Request) -> Response:
    state = _state(request)
    req = await state.parse(request, CompletionRequest)
    # An empty prompt starts a fresh document, as after an end-of-text token.
    prompt_ids = state.encode_prompt(req.prompt, "prompt") or [state.tokenizer.eot_id]
    usage = Usage(len(prompt_ids))
    job = state.start(prompt_ids, req, COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens,
                      "prompt")
    try:
        rid, now, name = f"cmpl-{uuid.uuid4().hex}", int(time.time()), state.config.model_name
        token_bytes = state.tokenizer.token_bytes()
        offsets = [CompletionLogprobs(token_bytes) for _ in range(job.n)]
        wants_lp = job.logprobs is not None

        head = {"id": rid, "object": "text_completion", "created": now, "model": name}

        def chunks(i: int, text: str | None, finish: str | None, lps: list) -> list[dict[str, Any]]:
            return [{**head, "choices": [{"index": i, "text": text or "",
                                          "logprobs": offsets[i].block(lps) if wants_lp and lps else None,
                                          "finish_reason": finish}]}]

        def whole(choices: list[tuple[str, str, list]]) -> dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": now, "model": name,
                    "choices": [{"index": i, "text": text, "logprobs": offsets[i].block(lps) if wants_lp else None,
                                 "finish_reason": finish} for i, (text, finish, lps) in enumerate(choices)],
                    "usage": usage.as_dict()}

        return await _respond(request, job, usage, req, head, [], chunks, whole)
    except BaseException:  # what fails before the answer is under way must not leave the job running
        job.cancel.set()
        raise


# --- the built-in tools, for the chat page ----------------------------------------------------------

# A call's body is a name and a few arguments: a calculator expression is at most MAX_EXPRESSION_CHARS.
MAX_TOOL_RUN_BYTES = 16 * 1024


async def builtin_tools(request: Request) -> dict[str, Any]:
    """The built-in tools as OpenAI tool objects: what the chat page offers, and `run_tool` runs."""
    return {"object": "list", "data": list(BUILTIN_TOOLS)}


async def run_tool(request: Request) -> dict[str, Any]:
    """Run one call of a built-in tool, `{"name", "arguments"}` (arguments: a JSON object or its text, as in
    a reply's `tool_calls`), as `nanolm chat --tools builtin` runs it: `{"name", "content"}`, the result text
    (`error: ...` for arguments the tool cannot use). Anything but a built-in is refused with 400: the
    server runs no tool a client names, only its own."""
    body, _ = await _state(request)._read_body(request, most_bytes=MAX_TOOL_RUN_BYTES)
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):
        raise ApiError(400, 'the body is not JSON; send {"name": "<built-in tool>", "arguments": {...}}') from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ApiError(400, 'name: missing; send {"name": "<built-in tool>", "arguments": {...}}', "name")
    name, arguments = call["name"], call.get("arguments", {})
    if name not in BUILTINS:
        raise ApiError(400, f"name: {name[:64]!r} is not a built-in tool; this server runs only "
                            f"{', '.join(BUILTINS)}", "name", "unknown_tool")
    if not isinstance(arguments, (str, dict)):
        raise ApiError(400, "arguments: give a JSON object or its text", "arguments")
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"name": name, "content": await asyncio.to_thread(run_builtin, ToolCall(name, text))}


ROUTES: list[tuple[str, str, Callable[..., Any]]] = [
    ("GET", "/", chat_page),  # the chat web page (page.py): public, as /health; it calls /v1 with the key
    ("GET", "/static/{name}", static_file),
    ("GET", "/health", health),
    ("GET", "/v1/models", list_models),
    ("GET", "/v1/models/{model}", get_model),
    ("POST", "/v1/chat/completions", chat_completions),
    ("POST", "/v1/completions", completions),
    ("GET", "/v1/tools/builtin", builtin_tools),  # under /v1: the same key and same-origin rules as the API
    ("POST", "/v1/tools/run", run_tool),
]


# --- the app -----------------------------------------------------------------------------------------

@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    app.state.nanolm.worker.close()


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI app over `state`; with an API key in its config, /v1 needs `Authorization: Bearer <key>`."""
    summary = f"OpenAI-compatible API serving {state.config.model_name}"
    app = FastAPI(title="nanolm", summary=summary, lifespan=_lifespan)
    app.state.nanolm = state
    if state.config.api_key is not None:
        app.add_middleware(BearerAuth, api_key=state.config.api_key)
    # Added last, so it runs first: a foreign page learns nothing, not even whether a key is needed.
    app.add_middleware(SameOrigin, loopback=state.config.loopback)
    for exc_type, handler in ERROR_HANDLERS:
        app.add_exception_handler(exc_type, handler)
    for method, path, route in ROUTES:
        app.add_api_route(path, route, methods=[method])
    return app
