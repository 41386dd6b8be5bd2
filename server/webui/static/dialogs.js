// The two dialogs: generation settings (system prompt, temperature, max tokens, tools) and
// the API key. Both read and write the browser's storage through store.js.

import { loadKey, saveKey, saveSettings } from "./store.js";

const $ = (id) => document.getElementById(id);

/** Check and convert the form's values; throws an Error whose message says what is wrong. */
export function parseSettings(previous, form) {
  const temperature = form.temperature.trim();
  const maxTokens = form.maxTokens.trim();
  const out = {
    ...previous,
    systemPrompt: form.systemPrompt,
    temperature: temperature === "" ? null : Number(temperature),
    maxTokens: maxTokens === "" ? null : Number(maxTokens),
    ignoreEos: form.ignoreEos,
    tools: form.tools,
  };
  if (out.temperature !== null && !(out.temperature >= 0 && out.temperature <= 2)) {
    throw new Error("Temperature must be a number from 0 to 2 (or empty for the default).");
  }
  if (out.maxTokens !== null && !(Number.isInteger(out.maxTokens) && out.maxTokens >= 1)) {
    throw new Error("Max tokens must be a whole number of at least 1 (or empty).");
  }
  if (out.tools.trim()) {
    let tools;
    try {
      tools = JSON.parse(out.tools);
    } catch (error) {
      throw new Error(`Tools are not valid JSON: ${error.message}`);
    }
    if (!Array.isArray(tools)) throw new Error("Tools must be a JSON array.");
  }
  return out;
}

export class SettingsDialog {
  /** @param {object} state the page's state (``state.settings`` is read and replaced) */
  constructor(state) {
    this.state = state;
    this.dialog = $("settings");
    this.fields = {
      systemPrompt: $("system-prompt"),
      temperature: $("temperature"),
      maxTokens: $("max-tokens"),
      ignoreEos: $("ignore-eos"),
      tools: $("tools"),
    };
    this.error = $("settings-error");
    $("save-settings").addEventListener("click", () => this.save());
    $("cancel-settings").addEventListener("click", () => this.dialog.close());
  }

  open() {
    const s = this.state.settings;
    const f = this.fields;
    f.systemPrompt.value = s.systemPrompt;
    f.temperature.value = s.temperature ?? "";
    f.maxTokens.value = s.maxTokens ?? "";
    f.ignoreEos.checked = s.ignoreEos;
    f.tools.value = s.tools;
    this.error.hidden = true;
    this.dialog.showModal();
  }

  save() {
    const f = this.fields;
    try {
      this.state.settings = parseSettings(this.state.settings, {
        systemPrompt: f.systemPrompt.value,
        temperature: f.temperature.value,
        maxTokens: f.maxTokens.value,
        ignoreEos: f.ignoreEos.checked,
        tools: f.tools.value,
      });
      saveSettings(this.state.settings);
      this.dialog.close();
    } catch (error) {
      this.error.textContent = error.message;
      this.error.hidden = false;
    }
  }
}

export class KeyDialog {
  /** @param {() => void} onChange called after the key was saved or forgotten */
  constructor(onChange) {
    this.onChange = onChange;
    this.dialog = $("key-dialog");
    this.reason = $("key-reason");
    this.input = $("api-key");
    this.button = $("open-key");
    this.button.hidden = !loadKey();
    this.button.addEventListener("click", () => this.open());
    $("save-key").addEventListener("click", () => this.use(this.input.value));
    $("forget-key").addEventListener("click", () => this.use(""));
    $("cancel-key").addEventListener("click", () => this.dialog.close());
    this.input.addEventListener("keydown", (event) => {
      if (event.key === "Enter") this.use(this.input.value);
    });
  }

  /** Open it; ``refusal`` is the server's message when it refused a request. */
  open(refusal = null) {
    this.button.hidden = false;
    if (refusal === null) this.reason.textContent = "The API key this page sends.";
    else if (loadKey()) this.reason.textContent = `The server refused the key: ${refusal}`;
    else this.reason.textContent = "This server needs an API key.";
    this.input.value = loadKey();
    if (!this.dialog.open) this.dialog.showModal();
    this.input.focus();
  }

  use(key) {
    saveKey(key.trim());
    this.dialog.close();
    this.onChange();
  }
}
