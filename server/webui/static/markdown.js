// Model answers as Markdown: marked turns them into HTML, with any raw HTML the model wrote
// escaped into text (it is shown, never parsed), then DOMPurify sanitizes the result (links,
// URLs, attributes) before it enters the document. This is the only place the page writes
// HTML; the CSP's Trusted Types rule makes every other HTML sink throw.

import { Marked } from "./vendor/marked.esm.js";
import DOMPurify from "./vendor/purify.es.mjs";

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

// breaks: a single newline is a line break, as models write poems, lists and addresses.
const markdown = new Marked({ gfm: true, breaks: true, async: false });
markdown.use({
  renderer: {
    // Block and inline HTML from the model: shown as the text it is.
    html({ text }) {
      return escapeHtml(text);
    },
  },
});

const PURIFY = {
  RETURN_TRUSTED_TYPE: true,
  ALLOW_DATA_ATTR: false,
  FORBID_TAGS: ["style", "form", "input", "button", "textarea", "select", "option"],
  FORBID_ATTR: ["style"],
};

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

/** Replace ``element``'s children with ``text`` rendered as sanitized Markdown. */
export function renderMarkdown(element, text) {
  element.innerHTML = DOMPurify.sanitize(markdown.parse(text), PURIFY);
}
