// The chat page of `nanolm serve`: a client of the server's own /v1 API, in plain JavaScript.
//
// Each turn sends the whole conversation (and the system prompt, if any) to /v1/chat/completions with
// stream: true and reads the server-sent events as they come. The model's output, like everything the
// user types, is only ever put on the page as text (text nodes, textContent), never parsed as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const SAMPLING = ["temperature", "top_p", "max_tokens", "seed", "repetition_penalty"];  // input ids, named as the request fields

let history = [];  // the conversation so far: {role, content}, without the system prompt
let controller = null;  // aborts the reply being streamed
let modelName = null;  // from GET /v1/models

class Shown extends Error {}  // a failure already worded for the user

function headers() {
  const h = {"Content-Type": "application/json"};
  const key = $("key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function showError(text) {
  $("error").textContent = text;
  $("error").hidden = false;
}

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
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
  } catch (e) {
    $("model").textContent = "model unknown";
    showError("Cannot reach the server: " + e.message);
  }
}

// One message on the page; returns its element and the text node that a streamed reply grows.
function addMessage(role, content) {
  const el = document.createElement("div");
  el.className = "msg " + role;
  const text = document.createElement("div");
  text.className = "text";
  const node = document.createTextNode(content);
  text.append(node);
  el.append(text);
  $("log").append(el);
  $("log").scrollTop = $("log").scrollHeight;
  return {el, node};
}

function addStats(reply, line) {
  const stats = document.createElement("div");
  stats.className = "stats";
  stats.textContent = line;
  reply.el.append(stats);
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
  if (modelName) body.model = modelName;
  for (const name of SAMPLING) {
    const value = $(name).value.trim();
    if (value !== "") body[name] = Number(value);
  }
  return body;
}

function speed(tokens, seconds) {
  let line = tokens + " tokens";
  if (tokens > 1 && seconds > 0) {  // one token has no time to be measured over
    line += " in " + seconds.toFixed(2) + " s from the first token to the end: " +
      (tokens / seconds).toFixed(1) + " tokens/s";
  }
  return line;
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

// A finished or stopped exchange joins the conversation sent next; one whose reply is empty (stopped before
// any text, or only whitespace) is left out, since the chat format has no empty reply to render.
function keep(conversation, content, text) {
  if (text.trim()) conversation.push({role: "user", content}, {role: "assistant", content: text});
}

async function send(event) {
  event.preventDefault();
  const content = $("input").value;
  if (!content.trim() || controller) return;
  const conversation = history;  // "New chat" replaces it: a reply still arriving then goes nowhere
  const body = request([...conversation, {role: "user", content}]);
  clearError();
  $("input").value = "";
  const user = addMessage("user", content);
  const reply = addMessage("assistant", "");
  controller = new AbortController();
  setBusy(true);
  let text = "", usage = null, first = null;
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) throw new Shown(await errorText(response));
    for await (const data of events(response)) {
      if (data.error) throw new Shown("Error: " + data.error.message);
      const piece = data.choices.length ? data.choices[0].delta.content : "";
      if (piece) {
        if (first === null) first = performance.now();
        text += piece;
        reply.node.appendData(piece);
        $("log").scrollTop = $("log").scrollHeight;
      }
      if (data.usage) usage = data.usage;
    }
    keep(conversation, content, text);
    const seconds = first === null ? 0 : (performance.now() - first) / 1000;
    addStats(reply, speed(usage ? usage.completion_tokens : 0, seconds));
  } catch (e) {
    if (e.name === "AbortError") {
      // Stopped: what came is kept as the reply, and the server has stopped generating it.
      keep(conversation, content, text);
      addStats(reply, "stopped");
    } else {
      // Nothing of this turn is kept: the message goes back into the box, to send again.
      user.el.remove();
      reply.el.remove();
      if (!$("input").value) $("input").value = content;
      showError(e instanceof Shown ? e.message : "The request failed: " + e.message);
    }
  } finally {
    controller = null;
    setBusy(false);
  }
}

function newChat() {
  if (controller) controller.abort();
  history = [];
  $("log").replaceChildren();
  clearError();
  $("input").focus();
}

$("composer").addEventListener("submit", send);
$("stop").addEventListener("click", () => controller && controller.abort());
$("new").addEventListener("click", newChat);
$("key").addEventListener("change", loadModel);
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    $("composer").requestSubmit();
  }
});
loadModel();
