// What the two chat pages share: `nanolm serve`'s (chat.js, a client of the server's /v1 API) and
// `nanolm export web`'s (web.js, the model in the browser, which gets this file copied beside it). Both keep
// the conversation in `state`, show messages the same way and wire the composer's buttons the same way; each
// brings its own ask(content), which streams one turn. The model's output, like everything the user types, is
// only ever put on the page as text (text nodes, textContent), never parsed as HTML.

export const $ = (id) => document.getElementById(id);

export class Shown extends Error {}  // a failure already worded for the user

export const state = {
  history: [],  // the conversation so far, without the system prompt, in the page's own message shape
  last: null,  // the last exchange: {start: its index in history, content: the user's message, elements}
  controller: null,  // aborts the reply being streamed
};

export function showError(text) {
  $("error").textContent = text;
  $("error").hidden = false;
}

export function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

// One message on the page; returns its element and the text node that a streamed reply grows.
export function addMessage(role, content) {
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

// The folded reasoning of a reply, made at its first piece: a <details> above the answer's text.
export function reasoningOf(reply) {
  if (!reply.thought) {
    const details = document.createElement("details");
    details.className = "reasoning";
    const summary = document.createElement("summary");
    summary.textContent = "Reasoning";
    const text = document.createElement("div");
    text.className = "thought";
    reply.thought = document.createTextNode("");
    text.append(reply.thought);
    details.append(summary, text);
    reply.el.prepend(details);
  }
  return reply.thought;
}

export function addStats(reply, line) {
  const stats = document.createElement("div");
  stats.className = "stats";
  stats.textContent = line;
  reply.el.append(stats);
}

export function speed(tokens, seconds) {
  let line = tokens + " tokens";
  if (tokens > 1 && seconds > 0) {  // one token has no time to be measured over
    line += " in " + seconds.toFixed(2) + " s from the first token to the end: " +
      (tokens / seconds).toFixed(1) + " tokens/s";
  }
  return line;
}

// A turn that failed: nothing of it is kept, the message goes back into the box, to send again.
export function dropTurn(error, elements, content, failed) {
  for (const element of elements) element.remove();
  if (!$("input").value) $("input").value = content;
  showError(error instanceof Shown ? error.message : failed + error.message);
}

export function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("regenerate").disabled = busy || state.last === null;
}

// The composer (Enter sends, Shift+Enter starts a new line), Stop, New chat and Regenerate, each acting through
// ask(content), the page's one turn; ready() says whether the page can send at all yet.
export function wireComposer(ask, ready = () => true) {
  async function send(event) {
    event.preventDefault();
    const content = $("input").value;
    if (!content.trim() || state.controller || !ready()) return;
    $("input").value = "";
    await ask(content);
  }

  // The last reply asked for again: its turn (its assistant and tool messages) dropped, the same user message sent.
  async function regenerate() {
    if (state.controller || state.last === null || state.history.length === 0) return;
    const {start, content, elements} = state.last;
    state.history.length = start;
    for (const element of elements) element.remove();
    state.last = null;
    await ask(content);
  }

  function newChat() {
    if (state.controller) state.controller.abort();
    state.history = [];
    state.last = null;
    $("regenerate").disabled = true;
    $("log").replaceChildren();
    clearError();
    $("input").focus();
  }

  $("composer").addEventListener("submit", send);
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("new").addEventListener("click", newChat);
  $("regenerate").addEventListener("click", regenerate);
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
}
