// The server's API as the page uses it: /v1/models and streamed /v1/chat/completions.
// The API key (if any) goes in the Authorization header, never in a URL.

/** An error the server answered (status and its OpenAI-shaped message). */
export class APIError extends Error {
  constructor(status, message, code = null) {
    super(message);
    this.name = "APIError";
    this.status = status;
    this.code = code;
  }

  get needsKey() {
    return this.status === 401;
  }
}

export class Client {
  /** @param {() => string} getKey the API key to send ("" for none) */
  constructor(getKey) {
    this.getKey = getKey;
  }

  headers(extra = {}) {
    const key = this.getKey();
    return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
  }

  async fetch(path, options = {}) {
    const response = await fetch(path, {
      ...options,
      headers: this.headers(options.headers),
      cache: "no-store",
      credentials: "omit",
    });
    if (!response.ok) throw await errorOf(response);
    return response;
  }

  /** Every declared model: {id, status ("loaded", "loading", "unloaded"), max_model_len}. */
  async models() {
    const response = await this.fetch("/v1/models");
    const body = await response.json();
    return body.data || [];
  }

  /**
   * Stream a chat completion: yields each parsed chunk (``choices`` deltas, then one with
   * ``usage``). Aborting ``signal`` closes the connection, which makes the server abort
   * the request and free its memory.
   */
  async *chat(body, signal) {
    const response = await this.fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
      body: JSON.stringify(body),
      signal,
    });
    yield* serverSentEvents(response.body, signal);
  }
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  let code = null;
  try {
    const body = await response.json();
    const error = body.error || body;
    if (error && typeof error.message === "string") message = error.message;
    if (error && error.code) code = error.code;
  } catch {
    // not JSON: keep the status line
  }
  return new APIError(response.status, message, code);
}

/** The JSON payloads of an SSE body until ``[DONE]``; an in-band error is thrown. */
async function* serverSentEvents(stream, signal) {
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  const onAbort = () => reader.cancel().catch(() => {});
  signal?.addEventListener("abort", onAbort);
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (signal?.aborted) throw new DOMException("stopped", "AbortError");
      if (done) return;
      buffer += value;
      let end;
      while ((end = eventEnd(buffer)) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end).replace(/^(\r?\n){2}/, "");
        const data = event
          .split(/\r?\n/)
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (!data) continue; // a comment (keep-alive) or an event without data
        if (data === "[DONE]") return;
        const payload = JSON.parse(data);
        if (payload.error) {
          throw new APIError(500, payload.error.message || "generation failed", payload.error.code);
        }
        yield payload;
      }
    }
  } finally {
    signal?.removeEventListener("abort", onAbort);
    reader.cancel().catch(() => {}); // a no-op after the end; closes an unfinished stream
  }
}

function eventEnd(buffer) {
  const lf = buffer.indexOf("\n\n");
  const crlf = buffer.indexOf("\r\n\r\n");
  if (lf < 0) return crlf;
  return crlf < 0 ? lf : Math.min(lf, crlf);
}
