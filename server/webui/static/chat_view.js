// The conversation on screen: one <article> per message, built with DOM calls (text goes
// in as text); only an answer's content goes through the Markdown renderer.

import { renderMarkdown } from "./markdown.js";

// The text each answer's content element shows, so a frame re-renders only what changed.
const rendered = new WeakMap();

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

/** "42 tokens · 31.5 tok/s · TTFT 180 ms · 1.6 s" for an answer's stats. */
export function statsText(message) {
  const stats = message.stats;
  const parts = [];
  if (message.state === "stopped") parts.push("stopped");
  if (message.state === "interrupted") parts.push("interrupted");
  if (stats) {
    if (stats.completionTokens != null) parts.push(`${stats.completionTokens} tokens`);
    if (stats.tokensPerSecond != null) parts.push(`${stats.tokensPerSecond.toFixed(1)} tok/s`);
    if (stats.ttftMs != null) parts.push(`TTFT ${Math.round(stats.ttftMs)} ms`);
    if (stats.seconds != null) parts.push(`${stats.seconds.toFixed(1)} s`);
    if (stats.finishReason && stats.finishReason !== "stop") parts.push(stats.finishReason);
  }
  return parts.join(" · ");
}

function addCopyButtons(container) {
  for (const pre of container.querySelectorAll("pre")) {
    const button = element("button", "copy", "Copy");
    button.type = "button";
    button.addEventListener("click", async () => {
      try {
        await navigator.clipboard.writeText(pre.querySelector("code")?.textContent ?? "");
        button.textContent = "Copied";
      } catch {
        button.textContent = "Copy failed";
      }
      setTimeout(() => (button.textContent = "Copy"), 1500);
    });
    pre.prepend(button);
  }
}

function userMessage(message) {
  const article = element("article", "message user");
  article.append(element("div", "role", "You"), element("div", "text", message.content));
  return article;
}

function assistantMessage(message) {
  const article = element("article", "message assistant");
  const reasoning = element("details", "reasoning");
  reasoning.append(element("summary", "", "Reasoning"), element("div", "reasoning-text"));
  article.append(
    element("div", "role", message.model || "Assistant"),
    reasoning,
    element("div", "content markdown"),
    element("div", "tool-calls"),
    element("div", "error"),
    element("div", "stats"),
  );
  updateAnswer(article, message);
  return article;
}

function toolCallElement(call) {
  const box = element("div", "tool-call");
  const name = call.function?.name || "(unnamed)";
  box.append(element("div", "tool-name", `Tool call: ${name}`));
  let args = call.function?.arguments || "";
  try {
    args = JSON.stringify(JSON.parse(args), null, 2);
  } catch {
    // still streaming, or not JSON: show it as it came
  }
  box.append(element("pre", "tool-arguments", args));
  return box;
}

/** Bring an answer's <article> up to date with ``message`` (cheap enough per frame). */
export function updateAnswer(article, message) {
  article.dataset.state = message.state;
  const reasoning = article.querySelector(".reasoning");
  reasoning.hidden = !message.reasoning;
  reasoning.querySelector("summary").textContent =
    message.state === "streaming" && !message.content ? "Reasoning…" : "Reasoning";
  const reasoningText = reasoning.querySelector(".reasoning-text");
  if (reasoningText.textContent !== message.reasoning) reasoningText.textContent = message.reasoning;

  const content = article.querySelector(".content");
  if (rendered.get(content) !== message.content) {
    renderMarkdown(content, message.content);
    rendered.set(content, message.content);
    if (message.state !== "streaming") addCopyButtons(content);
  } else if (message.state !== "streaming" && !content.querySelector("button.copy")) {
    addCopyButtons(content);
  }
  const calls = article.querySelector(".tool-calls");
  calls.replaceChildren(...(message.toolCalls || []).map(toolCallElement));
  const error = article.querySelector(".error");
  error.textContent = message.error || "";
  error.hidden = !message.error;
  const waiting = message.state === "streaming" && !message.content && !message.reasoning;
  article.querySelector(".stats").textContent = waiting ? "waiting for the first token…" : statsText(message);
}

/** Show ``conversation``'s messages in ``container``; returns the <article>s in order. */
export function renderConversation(container, conversation) {
  const articles = (conversation?.messages || []).map((message) =>
    message.role === "user" ? userMessage(message) : assistantMessage(message),
  );
  container.replaceChildren(...articles);
  return articles;
}

export function appendMessage(container, message) {
  const article = message.role === "user" ? userMessage(message) : assistantMessage(message);
  container.append(article);
  return article;
}
