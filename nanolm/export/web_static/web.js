// The page of `nanolm export web`: the model chats in the browser through llama.cpp's WebAssembly build
// (wllama), loaded from this folder; nothing is fetched from anywhere else.
//
// config.json names the model file and its chat layout. For nanolm's layouts (qwen3, chatml) the page
// renders the prompt itself, exactly as nanolm's ChatFormat.render does (renderPrompt; the tests compare the
// two), and asks llama.cpp for a raw completion of it, streamed. A tokenizer's own Jinja template
// ("template") is rendered by llama.cpp's Jinja engine through its chat completion. Each turn sends the
// whole conversation; llama.cpp reuses the cached prefix. The model's output, like everything the user types,
// is only ever put on the page as text, never parsed as HTML. What it shares with `nanolm serve`'s chat page is
// in chatui.js, copied from there.
import {Wllama} from "./wllama/index.js";
import {$, Shown, addMessage, addStats, clearError, dropTurn, reasoningOf, setBusy, showError, speed, state,
  wireComposer} from "./chatui.js";

const SAMPLING = ["temperature", "top_k", "top_p", "max_tokens", "seed", "repeat_penalty"];  // config.sampling's
const IM_START = "<|im_start|>", IM_END = "<|im_end|>", THINK = "<think>", THINK_END = "</think>";

let config = null;  // config.json
let wllama = null;
// state.history holds {role, content, reasoning?} messages.

const here = (path) => new URL(path, location.href).href;

// The text of a conversation in nanolm's layout, then the generation prompt: what ChatFormat.render gives with
// add_generation_prompt (nanolm/chat/templates.py). Messages: {role, content, reasoning?}.
function renderPrompt(messages, thinking = false, layout = config.layout) {
  let text = "";
  for (const m of messages) {
    if (layout === "qwen3" && m.role === "assistant") {
      // The reasoning (none: empty) in its think block, then the reply.
      const reasoning = (m.reasoning || "").replace(/^\n+|\n+$/g, "");
      text += IM_START + "assistant\n" + THINK + "\n" + reasoning + "\n" + THINK_END + "\n\n" +
        m.content.replace(/^\n+/, "") + IM_END + "\n";
    } else {
      text += IM_START + m.role + "\n" + m.content + IM_END + "\n";
    }
  }
  text += IM_START + "assistant\n";
  if (layout === "qwen3") text += THINK + "\n" + (thinking ? "" : "\n" + THINK_END + "\n\n");
  return text;
}

// The request's sampling fields: those filled in, as llama.cpp names them (a field left empty: llama.cpp's
// default). repeat_penalty looks back over the whole context (penalty_last_n -1), as nanolm's does.
function sampling() {
  const out = {};
  for (const name of SAMPLING) {
    const value = $(name).value.trim();
    if (value !== "") out[name] = Number(value);
  }
  if (out.repeat_penalty !== undefined) out.penalty_last_n = -1;
  return out;
}

// A streamed completion's pieces, each given to onText as it comes (pieceOf(choice): its text); returns
// {text, tokens, first}.
async function drain(stream, pieceOf, onText) {
  const out = {text: "", tokens: 0, first: null};
  for await (const chunk of stream) {
    const piece = chunk.choices && chunk.choices.length ? pieceOf(chunk.choices[0]) : "";
    if (chunk.timings) out.tokens = chunk.timings.predicted_n;
    if (chunk.usage) out.tokens = chunk.usage.completion_tokens;
    if (!piece) continue;
    if (out.first === null) out.first = performance.now();
    out.text += piece;
    onText(piece);
  }
  return out;
}

// A raw completion of `prompt`, streamed: onText(piece) for each piece; returns {text, tokens, first}.
async function complete(prompt, options, onText, signal) {
  const stream = await wllama.createCompletion({
    prompt, stream: true, stop: config.stop, cache_prompt: true, abortSignal: signal, ...options,
  });
  return drain(stream, (choice) => choice.text, onText);
}

// A chat completion rendered by llama.cpp's Jinja engine from the GGUF's own template, streamed.
async function chatComplete(messages, options, onText, signal) {
  const stream = await wllama.createChatCompletion({messages, stream: true, abortSignal: signal, ...options});
  return drain(stream, (choice) => choice.delta.content, onText);
}

// Splits a reply written after an open think block into its reasoning and answer as they stream.
class ThinkSplitter {
  constructor(reply, thinking) {
    this.reply = reply;
    this.thinking = thinking;  // still inside the think block
    this.raw = "";
  }

  push(piece) {
    this.raw += piece;
    if (!this.thinking) {
      this.reply.node.appendData(piece);
      return;
    }
    const end = this.raw.indexOf(THINK_END);
    const shown = this.reply.thought ? this.reply.thought.length : 0;
    if (end < 0) {
      // Hold back what could be the start of </think>.
      const safe = this.raw.length - (THINK_END.length - 1);
      if (safe > shown) reasoningOf(this.reply).appendData(this.raw.slice(shown, safe));
      return;
    }
    if (end > shown) reasoningOf(this.reply).appendData(this.raw.slice(shown, end));
    this.thinking = false;
    const rest = this.raw.slice(end + THINK_END.length).replace(/^\n+/, "");
    this.raw = rest;
    this.reply.node.appendData(rest);
  }

  // The reply as history keeps it: {content, reasoning}.
  message(thinkingAsked) {
    if (!thinkingAsked) return {content: this.raw, reasoning: ""};
    if (this.thinking) return {content: "", reasoning: this.raw};  // stopped inside the think block
    return {content: this.raw, reasoning: this.reply.thought ? this.reply.thought.data : ""};
  }
}

async function ask(content) {
  const conversation = state.history;  // "New chat" replaces it: a reply still arriving then goes nowhere
  clearError();
  const user = addMessage("user", content);
  const reply = addMessage("assistant", "");
  const elements = [user.el, reply.el];
  const system = $("system").value;
  const messages = [...(system ? [{role: "system", content: system}] : []), ...conversation,
    {role: "user", content}];
  const thinking = config.layout === "qwen3" && $("thinking").checked;
  const splitter = new ThinkSplitter(reply, thinking);
  state.controller = new AbortController();
  setBusy(true);
  try {
    let out;
    if (config.layout === "template") {
      out = await chatComplete(messages.map(({role, content}) => ({role, content})), sampling(),
        (piece) => splitter.push(piece), state.controller.signal);
    } else {
      const prompt = renderPrompt(messages, thinking);
      window.nanolmWeb.lastPrompt = prompt;
      out = await complete(prompt, sampling(), (piece) => splitter.push(piece), state.controller.signal);
    }
    const seconds = out.first === null ? 0 : (performance.now() - out.first) / 1000;
    addStats(reply, speed(out.tokens, seconds));
    const {content: answer, reasoning} = splitter.message(thinking);
    conversation.push({role: "user", content}, {role: "assistant", content: answer, reasoning});
    state.last = {start: conversation.length - 2, content, elements};
  } catch (e) {
    if (e.name === "AbortError") {
      // Stopped: what came is kept; the chat format has no empty reply, so nothing is kept without text.
      const {content: answer, reasoning} = splitter.message(thinking);
      if (answer.trim() || reasoning.trim()) {
        conversation.push({role: "user", content}, {role: "assistant", content: answer, reasoning});
        state.last = {start: conversation.length - 2, content, elements};
      } else {
        state.last = null;
      }
      addStats(reply, "stopped");
    } else {
      dropTurn(e, elements, content, "The model failed: ");
    }
  } finally {
    state.controller = null;
    setBusy(false);
  }
}

// The model file, downloaded once: kept in wllama's cache (the origin's private file system) where the
// browser allows it (https or localhost), keyed by the file's sha256 so that a new export is fetched anew.
async function loadModel() {
  const url = here(config.model + "?sha256=" + config.sha256);
  const params = {
    n_ctx: config.context_length,
    n_gpu_layers: 0,  // llama.cpp's CPU kernels: WebGPU is not in every browser, and tiny models gain nothing
    progressCallback: ({loaded, total}) => { if (total) $("progress").value = loaded / total; },
  };
  if (window.isSecureContext && navigator.storage && navigator.storage.getDirectory) {
    await wllama.loadModelFromUrl(url, {...params, useCache: true});
  } else {
    const response = await fetch(url);
    if (!response.ok) throw new Shown("Cannot load " + config.model + ": error " + response.status);
    await wllama.loadModel([await response.blob()], params);
  }
  $("progress").value = 1;
}

async function start() {
  try {
    const response = await fetch("config.json");
    if (!response.ok) throw new Shown("Cannot read config.json: error " + response.status);
    config = await response.json();
    $("model").textContent = config.name + " (loading " + config.model + "…)";
    $("system").value = config.system || "";
    for (const name of SAMPLING) {
      const value = config.sampling[name];
      if (value !== null && value !== undefined) $(name).value = value;
    }
    $("thinking").disabled = config.layout !== "qwen3";
    wllama = new Wllama({default: here("wllama/wllama.wasm")}, {
      allowOffline: true,
      logger: {debug: () => {}, log: () => {}, warn: console.warn, error: console.error},
    });
    // Browsers without JSPI or Memory64 (Safari) run wllama's compat build: from this folder, not its CDN.
    wllama.setCompat({worker: here("wllama/compat/wllama.js"), wasm: here("wllama/compat/wllama.wasm")});
    await loadModel();
    const threads = wllama.getNumThreads();
    $("engine").textContent = "llama.cpp " + Wllama.getLibllamaVersion() + " (wllama " + config.runtime.version +
      "), " + threads + (threads === 1 ? " thread" : " threads") +
      (window.crossOriginIsolated ? "" : " (the server sends no cross-origin isolation headers)") + ".";
    $("model").textContent = config.name;
    $("input").disabled = false;
    $("send").disabled = false;
    $("input").focus();
    window.nanolmWeb.ready = true;
  } catch (e) {
    $("model").textContent = config ? config.name + " (not loaded)" : "model unknown";
    showError(e instanceof Shown ? e.message : "The model could not be loaded: " + e.message);
    window.nanolmWeb.failed = String(e && e.message);
  }
}

// For tests and the curious: the prompt renderer, the last prompt sent, a raw completion.
window.nanolmWeb = {
  renderPrompt, lastPrompt: null, ready: false, failed: null,
  complete: async (prompt, options) => complete(prompt, options, () => {}),
};

wireComposer(ask, () => wllama !== null);
start();
