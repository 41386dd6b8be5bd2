// The browser's storage: conversations, settings and the API key (localStorage, this
// origin only). Conversations are saved whole after every change; a failed write (storage
// full) is reported to the caller, never lost silently.

const CONVERSATIONS = "mlxserve.conversations";
const SETTINGS = "mlxserve.settings";
const API_KEY = "mlxserve.apiKey";

export const DEFAULT_SETTINGS = Object.freeze({
  systemPrompt: "",
  temperature: null, // null: the server's default
  maxTokens: null, // null: until the model stops or the context is full
  ignoreEos: false,
  tools: "", // a JSON array of OpenAI tools, as typed
  model: null, // the model last chosen
});

function read(key, fallback) {
  try {
    const text = localStorage.getItem(key);
    return text === null ? fallback : JSON.parse(text);
  } catch {
    return fallback; // unreadable (edited by hand): start over rather than break the page
  }
}

function write(key, value) {
  localStorage.setItem(key, JSON.stringify(value)); // throws QuotaExceededError when full
}

export function loadSettings() {
  return { ...DEFAULT_SETTINGS, ...read(SETTINGS, {}) };
}

export function saveSettings(settings) {
  write(SETTINGS, settings);
}

export function loadKey() {
  return localStorage.getItem(API_KEY) || "";
}

export function saveKey(key) {
  if (key) localStorage.setItem(API_KEY, key);
  else localStorage.removeItem(API_KEY);
}

function newId() {
  return crypto.randomUUID ? crypto.randomUUID() : `${Date.now()}-${Math.random()}`;
}

/** The conversations, most recently updated first, and which one is open. */
export class Conversations {
  constructor() {
    const saved = read(CONVERSATIONS, { items: [], current: null });
    this.items = Array.isArray(saved.items) ? saved.items : [];
    this.currentId = saved.current;
    for (const conversation of this.items) {
      for (const message of conversation.messages) {
        // An answer still streaming when the page went away will never finish.
        if (message.state === "streaming") message.state = "interrupted";
      }
    }
  }

  get current() {
    return this.items.find((c) => c.id === this.currentId) || null;
  }

  sorted() {
    return [...this.items].sort((a, b) => b.updated - a.updated);
  }

  create() {
    const conversation = { id: newId(), title: "New chat", messages: [], updated: Date.now() };
    this.items.push(conversation);
    this.currentId = conversation.id;
    return conversation;
  }

  open(id) {
    this.currentId = id;
  }

  remove(id) {
    this.items = this.items.filter((c) => c.id !== id);
    if (this.currentId === id) this.currentId = null;
  }

  touch(conversation) {
    conversation.updated = Date.now();
    if (conversation.title === "New chat") {
      const first = conversation.messages.find((m) => m.role === "user");
      if (first) conversation.title = first.content.trim().slice(0, 60) || "New chat";
    }
  }

  /** Save everything; throws (QuotaExceededError) when the storage is full. */
  save() {
    write(CONVERSATIONS, { items: this.items, current: this.currentId });
  }
}
