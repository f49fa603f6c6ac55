// The chat page of `nanolm serve`: a client of the server's own /v1 API, in plain JavaScript.
//
// Each turn sends the whole conversation (and the system prompt, if any) to /v1/chat/completions with
// stream: true and reads the server-sent events as they come. The built-in tools ticked under Settings go with
// it; when a reply calls them, the server runs the calls (/v1/tools/run: its own built-ins only, never anything
// the model wrote as code), and the results go back as `tool` messages for the model to continue, up to
// MAX_ROUNDS times a turn. With Thinking on, the reasoning streams into a folded <details> apart from the
// answer. The model's output, like everything the user types, is only ever put on the page as text (text
// nodes, textContent), never parsed as HTML. What it shares with `nanolm export web`'s page is in chatui.js.
import {$, Shown, addMessage, addStats, clearError, dropTurn, reasoningOf, setBusy, showError, speed, state,
  wireComposer} from "./chatui.js";

const SAMPLING = ["temperature", "top_p", "max_tokens", "seed", "repetition_penalty"];  // input ids, named as the request fields

const MAX_ROUNDS = 5;  // continuations after tool results in one turn, as `nanolm chat --max-tool-rounds`

// state.history holds OpenAI messages (tool calls and results too).
let builtins = [];  // OpenAI tool objects, from GET /v1/tools/builtin
let modelName = null;  // from GET /v1/models

function headers() {
  const h = {"Content-Type": "application/json"};
  const key = $("key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

// A failed response as one readable line: the message of OpenAI's error body when there is one.
async function errorText(response) {
  let message = response.statusText;
  try {
    message = (await response.json()).error.message;
  } catch (e) {
    // not OpenAI's error body: the status text says what there is to say
  }
  if (response.status === 401) {
    return "This server needs an API key: enter it under Settings, API key. (" + message + ")";
  }
  return "Error " + response.status + ": " + message;
}

async function loadModel() {
  try {
    const response = await fetch("v1/models", {headers: headers()});
    if (!response.ok) {
      modelName = null;
      $("model").textContent = "model unknown";
      showError(await errorText(response));
      return;
    }
    modelName = (await response.json()).data[0].id;
    $("model").textContent = modelName;
    clearError();
    await loadTools();
  } catch (e) {
    $("model").textContent = "model unknown";
    showError("Cannot reach the server: " + e.message);
  }
}

// One checkbox per built-in tool, unticked: a model not trained on tools does better without them.
async function loadTools() {
  if (builtins.length) return;  // loaded already: the boxes keep their ticks when the key changes
  const response = await fetch("v1/tools/builtin", {headers: headers()});
  if (!response.ok) return;
  builtins = (await response.json()).data;
  const boxes = builtins.map((tool) => {
    const label = document.createElement("label");
    label.className = "check";
    const box = document.createElement("input");
    box.type = "checkbox";
    box.name = "tool";
    box.value = tool.function.name;
    label.append(box, " " + tool.function.name + ": " + (tool.function.description || ""));
    return label;
  });
  $("tools").replaceChildren(...boxes);
}

function offered() {
  const names = [...document.querySelectorAll("#tools input:checked")].map((box) => box.value);
  return builtins.filter((tool) => names.includes(tool.function.name));
}

// The `data:` payloads of a server-sent event stream, parsed, up to [DONE].
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) throw new Shown("The reply stream ended before it was complete.");
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const payload = line.slice("data: ".length);
        if (payload === "[DONE]") return;
        yield JSON.parse(payload);
      }
    }
  }
}

function request(messages) {
  const system = $("system").value;
  const body = {
    messages: system ? [{role: "system", content: system}, ...messages] : messages,
    stream: true,
    stream_options: {include_usage: true},
  };
  const tools = offered();
  if (tools.length) body.tools = tools;
  if ($("thinking").checked) body.chat_template_kwargs = {enable_thinking: true};
  if (modelName) body.model = modelName;
  for (const name of SAMPLING) {
    const value = $(name).value.trim();
    if (value !== "") body[name] = Number(value);
  }
  return body;
}

// One reply streamed into the page: {content, reasoning, calls (OpenAI tool_calls), usage, first}.
async function stream(messages, reply) {
  const response = await fetch("v1/chat/completions", {
    method: "POST", headers: headers(), body: JSON.stringify(request(messages)), signal: state.controller.signal,
  });
  if (!response.ok) throw new Shown(await errorText(response));
  const out = {content: "", reasoning: "", calls: [], usage: null, first: null};
  for await (const data of events(response)) {
    if (data.error) throw new Shown("Error: " + data.error.message);
    if (data.usage) out.usage = data.usage;
    if (!data.choices.length) continue;
    const delta = data.choices[0].delta;
    if (out.first === null && (delta.content || delta.reasoning_content || delta.tool_calls)) {
      out.first = performance.now();
    }
    if (delta.reasoning_content) {
      out.reasoning += delta.reasoning_content;
      reasoningOf(reply).appendData(delta.reasoning_content);
    }
    if (delta.content) {
      out.content += delta.content;
      reply.node.appendData(delta.content);
    }
    for (const part of delta.tool_calls || []) {  // OpenAI's pieces: id and name first, then the arguments
      const call = out.calls[part.index] ||= {id: "", type: "function", function: {name: "", arguments: ""}};
      if (part.id) call.id = part.id;
      if (part.function && part.function.name) call.function.name += part.function.name;
      if (part.function && part.function.arguments) call.function.arguments += part.function.arguments;
    }
    $("log").scrollTop = $("log").scrollHeight;
  }
  return out;
}

// A call of a built-in tool, run by the server; its result text.
async function runTool(call) {
  const response = await fetch("v1/tools/run", {
    method: "POST", headers: headers(), signal: state.controller.signal,
    body: JSON.stringify({name: call.function.name, arguments: call.function.arguments}),
  });
  if (!response.ok) throw new Shown(await errorText(response));
  return (await response.json()).content;
}

function assistantMessage(out) {
  const message = {role: "assistant", content: out.content};
  if (out.calls.length) message.tool_calls = out.calls;
  return message;
}

// What of a stopped turn joins the conversation: its finished rounds and the text that came, without a call
// whose results are missing; nothing when no reply has text, since the chat format has no empty reply.
function kept(turn) {
  while (turn.length > 1 && (turn.at(-1).role === "tool" || turn.at(-1).tool_calls)) turn.pop();
  return turn.length > 1 && turn.at(-1).content.trim() ? turn : [];
}

async function ask(content) {
  const conversation = state.history;  // "New chat" replaces it: a reply still arriving then goes nowhere
  clearError();
  const elements = [addMessage("user", content).el];
  const turn = [{role: "user", content}];
  const names = new Set(offered().map((tool) => tool.function.name));
  state.controller = new AbortController();
  setBusy(true);
  let out = null;
  try {
    for (let round = 0; ; round++) {
      const reply = addMessage("assistant", "");
      elements.push(reply.el);
      out = null;
      out = await stream([...conversation, ...turn], reply);
      const seconds = out.first === null ? 0 : (performance.now() - out.first) / 1000;
      addStats(reply, speed(out.usage ? out.usage.completion_tokens : 0, seconds));
      turn.push(assistantMessage(out));
      if (!out.calls.length) break;
      for (const call of out.calls) {  // each call gets a result, as in `nanolm chat`: the format needs one
        const shown = addMessage("tool", call.function.name + "(" + call.function.arguments + ")\n→ ");
        elements.push(shown.el);
        const result = names.has(call.function.name) ? await runTool(call)
          : "error: no tool named " + JSON.stringify(call.function.name) + " here; the tools are " +
            ([...names].join(", ") || "none");
        shown.node.appendData(result);
        turn.push({role: "tool", tool_call_id: call.id, content: result});
      }
      if (round >= MAX_ROUNDS) {
        addStats({el: elements.at(-1)}, "stopped after " + (round + 1) + " replies with tool calls (the limit is " +
          MAX_ROUNDS + " continuations per turn); the results are kept for the next turn");
        break;
      }
    }
    conversation.push(...turn);
    state.last = {start: conversation.length - turn.length, content, elements};
  } catch (e) {
    if (e.name === "AbortError") {
      // Stopped: what came is kept, and the server has stopped generating it.
      const partial = elements.at(-1).querySelector(".text").textContent;
      if (out === null && partial.trim()) turn.push({role: "assistant", content: partial});
      const keep = kept(turn);
      conversation.push(...keep);
      state.last = keep.length ? {start: conversation.length - keep.length, content, elements} : null;
      addStats({el: elements.at(-1)}, "stopped");
    } else {
      dropTurn(e, elements, content, "The request failed: ");
    }
  } finally {
    state.controller = null;
    setBusy(false);
  }
}

wireComposer(ask);
$("key").addEventListener("change", loadModel);
loadModel();
