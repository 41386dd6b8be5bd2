// The chat page: wires the toolbar, the conversation list, the composer and the dialogs to
// the API client (api.js), the browser's storage (store.js), the view (chat_view.js) and
// the dialogs (dialogs.js).

import { Client } from "./api.js";
import { renderConversation, updateAnswer } from "./chat_view.js";
import { KeyDialog, SettingsDialog } from "./dialogs.js";
import { Conversations, loadKey, loadSettings, saveSettings } from "./store.js";

const $ = (id) => document.getElementById(id);
const ui = {
  newChat: $("new-chat"),
  conversations: $("conversations"),
  model: $("model"),
  modelInfo: $("model-info"),
  openSettings: $("open-settings"),
  notice: $("notice"),
  messages: $("messages"),
  empty: $("empty"),
  prompt: $("prompt"),
  send: $("send"),
  stop: $("stop"),
};

const state = {
  settings: loadSettings(),
  conversations: new Conversations(),
  models: [],
  streaming: null, // {controller, conversation, message, article} while an answer streams
};
const client = new Client(loadKey);
const settingsDialog = new SettingsDialog(state);
const keyDialog = new KeyDialog(() => refreshModels());

// ------------------------------------------------------------------ notices and storage

function notice(text, kind = "info") {
  ui.notice.textContent = text;
  ui.notice.dataset.kind = kind;
  ui.notice.hidden = !text;
}

function persist() {
  try {
    state.conversations.save();
  } catch (error) {
    const text = `Could not save the conversation (${error.name}): delete old chats to make room.`;
    notice(text, "error");
  }
}

// ------------------------------------------------------------------------------- models

let modelsTimer = null;
// How often the list is read again: while a model loads, while several models are
// declared (they load and unload), and while the server cannot answer.
const POLL_LOADING_MS = 2000;
const POLL_SEVERAL_MS = 15000;
const POLL_DOWN_MS = 3000;

async function refreshModels() {
  clearTimeout(modelsTimer);
  let next = null;
  try {
    state.models = await client.models();
    if (ui.notice.dataset.kind === "models") notice("");
    renderModels();
    if (state.models.some((m) => m.status === "loading")) next = POLL_LOADING_MS;
    else if (state.models.length > 1) next = POLL_SEVERAL_MS;
  } catch (error) {
    if (error.needsKey) {
      keyDialog.open(error.message);
    } else if (error.status === 503) {
      notice(`The server is not ready: ${error.message} Retrying…`, "models");
      next = POLL_LOADING_MS;
    } else {
      // A network error (the server restarting) or an unexpected answer.
      notice(`Cannot list the models: ${error.message}. Retrying…`, "models");
      next = POLL_DOWN_MS;
    }
  }
  if (next !== null) modelsTimer = setTimeout(refreshWhenVisible, next);
}

function refreshWhenVisible() {
  if (document.visibilityState === "visible") refreshModels();
  else document.addEventListener("visibilitychange", refreshModels, { once: true });
}

function renderModels() {
  const several = state.models.length > 1;
  const labels = state.models.map((model) =>
    several && model.status ? `${model.id} (${model.status})` : model.id,
  );
  const shown = [...ui.model.options].map((option) => option.text);
  if (labels.join("\n") !== shown.join("\n")) {
    // Only when something changed: replacing the options closes an open list.
    const previous = ui.model.value || state.settings.model;
    ui.model.replaceChildren(...labels.map((label, i) => new Option(label, state.models[i].id)));
    const ids = state.models.map((m) => m.id);
    ui.model.value = ids.includes(previous) ? previous : (ids[0] ?? "");
  }
  renderModelInfo();
}

function selectedModel() {
  return state.models.find((m) => m.id === ui.model.value) || null;
}

function renderModelInfo() {
  const model = selectedModel();
  const parts = model ? [model.status, model.max_model_len && `context ${model.max_model_len}`] : [];
  ui.modelInfo.textContent = parts.filter(Boolean).join(" · ");
}

// ------------------------------------------------------------------------ conversations

function renderSidebar() {
  const current = state.conversations.currentId;
  ui.conversations.replaceChildren(
    ...state.conversations.sorted().map((conversation) => {
      const item = document.createElement("li");
      item.classList.toggle("current", conversation.id === current);
      const open = document.createElement("button");
      open.type = "button";
      open.className = "open";
      open.textContent = conversation.title;
      open.title = conversation.title;
      open.addEventListener("click", () => openConversation(conversation.id));
      const remove = document.createElement("button");
      remove.type = "button";
      remove.className = "delete";
      remove.textContent = "×";
      remove.setAttribute("aria-label", `Delete ${conversation.title}`);
      remove.addEventListener("click", () => deleteConversation(conversation.id));
      item.append(open, remove);
      return item;
    }),
  );
}

function renderMessages() {
  const conversation = state.conversations.current;
  const articles = renderConversation(ui.messages, conversation);
  ui.messages.prepend(ui.empty);
  ui.empty.hidden = articles.length > 0;
  if (state.streaming && state.streaming.conversation === conversation) {
    state.streaming.article = articles[articles.length - 1];
  }
  ui.messages.scrollTop = ui.messages.scrollHeight;
}

function openConversation(id) {
  state.conversations.open(id);
  persist();
  renderSidebar();
  renderMessages();
}

function deleteConversation(id) {
  if (state.streaming?.conversation.id === id) state.streaming.controller.abort();
  state.conversations.remove(id);
  persist();
  renderSidebar();
  renderMessages();
}

function newChat() {
  state.conversations.open(null);
  renderSidebar();
  renderMessages();
  ui.prompt.focus();
}

// ----------------------------------------------------------------------------- chatting

function requestBody(conversation, model) {
  const settings = state.settings;
  const messages = [];
  if (settings.systemPrompt.trim()) messages.push({ role: "system", content: settings.systemPrompt });
  for (const message of conversation.messages) {
    if (message.role === "user") messages.push({ role: "user", content: message.content });
    else if (message.state !== "streaming" && message.content) {
      messages.push({ role: "assistant", content: message.content });
    }
  }
  const body = { model, messages, stream: true, stream_options: { include_usage: true } };
  if (settings.temperature != null) body.temperature = settings.temperature;
  if (settings.maxTokens != null) body.max_tokens = settings.maxTokens;
  if (settings.ignoreEos) body.ignore_eos = true;
  if (settings.tools.trim()) body.tools = JSON.parse(settings.tools);
  return body;
}

function nearBottom() {
  const box = ui.messages;
  return box.scrollHeight - box.scrollTop - box.clientHeight < 80;
}

let frame = null;

function scheduleRender() {
  if (frame !== null) return;
  frame = requestAnimationFrame(() => {
    frame = null;
    const streaming = state.streaming;
    if (!streaming) return;
    const follow = nearBottom();
    updateAnswer(streaming.article, streaming.message);
    if (follow) ui.messages.scrollTop = ui.messages.scrollHeight;
  });
}

function mergeToolCalls(message, fragments) {
  for (const fragment of fragments) {
    let call = message.toolCalls[fragment.index];
    if (!call) {
      call = { id: fragment.id, type: "function", function: { name: "", arguments: "" } };
      message.toolCalls[fragment.index] = call;
    }
    if (fragment.function?.name) call.function.name = fragment.function.name;
    call.function.arguments += fragment.function?.arguments || "";
  }
}

async function send() {
  const text = ui.prompt.value;
  const model = ui.model.value;
  if (!text.trim() || state.streaming) return;
  if (!model) {
    notice("No model to send to: the server lists none yet.", "error");
    return;
  }
  const conversations = state.conversations;
  const conversation = conversations.current || conversations.create();
  conversation.messages.push({ role: "user", content: text });
  const message = {
    role: "assistant",
    model,
    content: "",
    reasoning: "",
    toolCalls: [],
    state: "streaming",
    error: null,
    stats: null,
  };
  conversation.messages.push(message);
  conversations.touch(conversation);
  persist();
  ui.prompt.value = "";
  renderSidebar();
  renderMessages();

  const controller = new AbortController();
  state.streaming = { controller, conversation, message, article: ui.messages.lastElementChild };
  setStreaming(true);
  const started = performance.now();
  let first = null;
  let last = null;
  let usage = null;
  let finishReason = null;
  try {
    for await (const chunk of client.chat(requestBody(conversation, model), controller.signal)) {
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        if (delta.reasoning_content) message.reasoning += delta.reasoning_content;
        if (delta.content) message.content += delta.content;
        if (delta.tool_calls) mergeToolCalls(message, delta.tool_calls);
        if (delta.content || delta.reasoning_content || delta.tool_calls) {
          last = performance.now();
          first ??= last;
        }
        if (choice.finish_reason) finishReason = choice.finish_reason;
      }
      scheduleRender();
    }
    message.state = "done";
  } catch (error) {
    if (error.name === "AbortError") {
      message.state = "stopped";
    } else {
      message.state = "error";
      message.error = error.message || String(error);
      if (error.needsKey) keyDialog.open(error.message);
    }
  }
  const ended = performance.now();
  const tokens = usage?.completion_tokens ?? null;
  message.stats = {
    completionTokens: tokens,
    promptTokens: usage?.prompt_tokens ?? null,
    ttftMs: first === null ? null : first - started,
    // Decode speed: the tokens after the first, over the time they took to arrive.
    tokensPerSecond: tokens > 1 && last > first ? ((tokens - 1) * 1000) / (last - first) : null,
    seconds: (ended - started) / 1000,
    finishReason,
  };
  state.streaming = null;
  setStreaming(false);
  conversations.touch(conversation);
  persist();
  if (conversations.current === conversation) renderMessages();
  refreshModels();
}

function setStreaming(on) {
  ui.send.hidden = on;
  ui.stop.hidden = !on;
  document.body.classList.toggle("streaming", on);
}

// ------------------------------------------------------------------------------- wiring

ui.send.addEventListener("click", send);
ui.stop.addEventListener("click", () => state.streaming?.controller.abort());
ui.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
ui.newChat.addEventListener("click", newChat);
ui.model.addEventListener("change", () => {
  state.settings.model = ui.model.value;
  saveSettings(state.settings);
  renderModelInfo();
});
ui.openSettings.addEventListener("click", () => settingsDialog.open());

renderSidebar();
renderMessages();
refreshModels();
