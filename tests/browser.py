"""Headless Chromium for the chat page's tests (tests/test_webui_browser.py).

The browser is Debian's ``chromium`` package (``/usr/bin/chromium``; ``.ci/run`` installs
it), driven by Playwright's Python package: Playwright never downloads a browser here.
Playwright starts it with a fresh temporary profile (its own ``--user-data-dir``, removed
when the browser closes), and each test gets a new context: its own storage and cookies.

Without Chromium the tests fail, saying how to install it; ``MLXSERVE_SKIP_BROWSER=1``
skips them (a machine that cannot have a browser), never silently.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, Request, sync_playwright

CHROMIUM = os.environ.get("MLXSERVE_CHROMIUM", "/usr/bin/chromium")
SKIP_ENV = "MLXSERVE_SKIP_BROWSER"
LAUNCH_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Records, at every change of the page, the last answer's state and content length: what
# the page showed while it streamed (a poll could miss a short stream).
RECORD_ANSWERS = """
window.__answers = [];
new MutationObserver(() => {
  const answer = document.querySelector("article.assistant:last-of-type");
  if (!answer) return;
  const length = answer.querySelector(".content").textContent.length;
  const last = window.__answers[window.__answers.length - 1];
  if (!last || last[0] !== answer.dataset.state || last[1] !== length) {
    window.__answers.push([answer.dataset.state, length]);
  }
}).observe(document, { subtree: true, childList: true, characterData: true, attributes: true });
"""
STATS = re.compile(r"(\d+) tokens · ([\d.]+) tok/s · TTFT (\d+) ms · ([\d.]+) s")


def chromium_path() -> str:
    """The browser to drive; skips with ``MLXSERVE_SKIP_BROWSER=1``, fails without one."""
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: the chat page's browser tests are skipped")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(
            f"no Chromium at {CHROMIUM}: install Debian's package (apt-get install -y "
            f"chromium; .ci/run does it) or set {SKIP_ENV}=1 to skip the browser tests"
        )
    return CHROMIUM


@contextmanager
def chromium() -> Iterator[Browser]:
    """Headless Chromium, closed on exit."""
    path = chromium_path()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=path, headless=True, args=LAUNCH_FLAGS, timeout=60_000
        )
        try:
            yield browser
        finally:
            browser.close()


class ChatPage:
    """The chat page in a fresh browser context, with what it logged and requested.

    Attributes:
        page: the Playwright page.
        errors: uncaught page errors, console errors and CSP violations.
        requests: every request the page made.
    """

    def __init__(self, browser: Browser, url: str, artifacts: Path) -> None:
        self.url = url
        self.artifacts = artifacts
        self.context = browser.new_context(viewport={"width": 1200, "height": 760})
        self.context.set_default_timeout(60_000)
        self.page: Page = self.context.new_page()
        self.page.add_init_script(RECORD_ANSWERS)
        self.errors: list[str] = []
        self.requests: list[Request] = []
        self.page.on("pageerror", lambda error: self.errors.append(f"page error: {error}"))
        self.page.on(
            "console",
            lambda m: self.errors.append(f"console: {m.text}") if m.type == "error" else None,
        )
        self.page.on("request", lambda request: self.requests.append(request))

    def open(self, models: int = 1) -> None:
        """Load the page and wait for its model list."""
        self.page.goto(self.url + "/")
        self.wait_models(models)

    def wait_until(self, expression: str, timeout: float = 60.0) -> Any:
        """Poll a JavaScript expression until it is truthy; returns its value.

        (Playwright's ``wait_for_function`` evaluates its predicate with ``eval`` in the
        page, which the page's CSP rightly refuses; ``evaluate`` goes through DevTools.)
        """
        deadline = time.monotonic() + timeout
        while not (value := self.page.evaluate(expression)):
            assert time.monotonic() < deadline, f"timed out after {timeout}s: {expression}"
            time.sleep(0.02)
        return value

    def wait_models(self, count: int) -> None:
        self.wait_until(f"document.querySelector('#model').options.length === {count}")

    def configure(self, **fields: str | bool) -> None:
        """Fill the settings dialog (system_prompt, temperature, max_tokens, ignore_eos,
        tools) and save it."""
        self.page.click("#open-settings")
        for name, value in fields.items():
            selector = "#" + name.replace("_", "-")
            if isinstance(value, bool):
                self.page.set_checked(selector, value)
            else:
                self.page.fill(selector, value)
        self.page.click("#save-settings")
        assert not self.page.is_visible("#settings"), self.page.inner_text("#settings-error")

    def send(self, text: str) -> None:
        self.page.fill("#prompt", text)
        self.page.press("#prompt", "Enter")

    def answer(self, state: str = "done") -> Any:
        """The last answer's <article> once its state is ``state``."""
        selector = f"article.assistant:last-of-type[data-state={state}]"
        self.page.wait_for_selector(selector)
        return self.page.locator(selector)

    def recorded_answers(self) -> list[tuple[str, int]]:
        return [tuple(x) for x in self.page.evaluate("window.__answers")]

    def stored(self) -> dict[str, Any]:
        """The conversations as the page saved them in localStorage."""
        return json.loads(self.page.evaluate("localStorage.getItem('mlxserve.conversations')"))

    def chat_requests(self) -> list[Request]:
        return [r for r in self.requests if r.url.endswith("/v1/chat/completions")]

    def screenshot(self, name: str) -> Path:
        path = self.artifacts / f"{name}.png"
        self.page.screenshot(path=str(path))
        return path

    def close(self) -> None:
        self.context.close()
