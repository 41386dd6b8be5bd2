"""The chat page at ``/`` in a real browser (headless Chromium, tests/browser.py).

Three servers: the embedded SmolLM2 (a real engine: streaming, stop, speed, conversations
kept), a scripted engine (``tests/scripted_engine.py``: answers chosen to the character,
for Markdown, raw HTML, reasoning, tool calls and the API key) and two tiny random models
(the load status of several declared models). Every test saves a screenshot of the page
in its ``tmp_path``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.app import create_app
from mlxserve.server.config import ServerConfig
from mlxserve.server.lifecycle.launch import BackgroundServer
from mlxserve.server.lifecycle.loading import LoadProgress
from mlxserve.server.lifecycle.multi_model import serve_models_in_background
from mlxserve.server.models.declarations import ModelDeclaration
from tests.browser import STATS, ChatPage, chromium
from tests.ops_helpers import metric, running_server, scrape
from tests.scripted_engine import ScriptedEngine, tokenizer_with_template
from tests.test_http_scripted import EOS, PLAIN_TEMPLATE
from tests.test_http_tools_scripted import CALL, WEATHER
from tests.tiny_models import build_tiny_model_dir

KEY = "sk-webui-test-key"
XSS = (
    'Look: <img src=x onerror="window.__pwned = 1"> and <script>window.__pwned = 2</script>'
    " [a link](javascript:window.__pwned=3)!"
)
MARKDOWN = (
    "Here is **bold** and code:\n\n```python\nprint('hi')\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |"
)
REASONING = "<think>\nLet me think.\n</think>\n\nHello!"
# What the scripted engine answers, by a word of the last user message.
ANSWERS = {"xss": XSS, "markdown": MARKDOWN, "think": REASONING, "tool": f"Let me look.\n{CALL}"}


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as b:
        yield b


@pytest.fixture
def open_page(browser: Browser, tmp_path: Path) -> Iterator[Any]:
    """``open_page(url, models=1)``: the chat page loaded in a fresh context."""
    pages: list[ChatPage] = []

    def make(url: str, models: int = 1) -> ChatPage:
        page = ChatPage(browser, url, tmp_path)
        pages.append(page)
        page.open(models)
        return page

    yield make
    for page in pages:
        page.screenshot("final")
        page.close()


# ------------------------------------------------------------------------- SmolLM2, real


@pytest.fixture(scope="module")
def smol(smollm: LoadedModel) -> Iterator[BackgroundServer]:
    config = EngineConfig(max_total_tokens=4096, max_running_requests=4)
    with running_server(smollm, config) as server:
        yield server


def greedy_answer(url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


class TestStreamedAnswer:
    def test_the_answer_streams_in_with_its_speed(self, smol, open_page, smollm) -> None:
        page = open_page(smol.url)
        assert page.page.input_value("#model") == smollm.model_id
        assert "loaded" in page.page.inner_text("#model-info")
        page.configure(system_prompt="You are brief.", temperature="0", max_tokens="12")
        page.send("Say hello.")
        answer = page.answer("done")

        [request] = page.chat_requests()
        body = request.post_data_json
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert (body["temperature"], body["max_tokens"]) == (0, 12), body
        assert body["messages"] == [
            {"role": "system", "content": "You are brief."},
            {"role": "user", "content": "Say hello."},
        ], body
        assert "Authorization" not in request.headers, "no key configured, none sent"

        recorded = page.recorded_answers()
        final = recorded[-1][1]
        assert final > 0, recorded
        partial = [n for state, n in recorded if state == "streaming" and 0 < n < final]
        assert partial, f"the answer never showed partly: {recorded}"

        reference = greedy_answer(smol.url, smollm.model_id, body["messages"], 12)
        [conversation] = page.stored()["items"]
        stored = conversation["messages"][1]
        expected = reference["choices"][0]["message"]["content"]
        assert stored["content"] == expected, (stored, expected)
        shown = " ".join(answer.locator(".content").inner_text().split())
        assert shown.split()[:2] == expected.split()[:2], (shown, expected)

        stats = STATS.search(answer.locator(".stats").inner_text())
        assert stats, answer.locator(".stats").inner_text()
        tokens, speed, ttft, seconds = stats.groups()
        assert int(tokens) == reference["usage"]["completion_tokens"], (tokens, reference)
        assert float(speed) > 0 and 0 < int(ttft) <= float(seconds) * 1000 + 1, stats.groups()
        assert not page.errors, page.errors
        page.screenshot("streamed")


class TestStop:
    def test_stop_aborts_the_request_and_frees_its_slots(self, smol, open_page) -> None:
        before = scrape(smol.url)
        page = open_page(smol.url)
        page.configure(max_tokens="2000", ignore_eos=True, temperature="0")
        page.send("Count to one thousand.")
        page.wait_until(
            "document.querySelector('article.assistant:last-of-type .content')"
            ".textContent.length > 10"
        )
        page.page.click("#stop")
        answer = page.answer("stopped")
        assert page.page.is_visible("#send") and not page.page.is_visible("#stop")
        assert answer.locator(".content").inner_text().strip(), "the partial answer stays"
        assert "stopped" in answer.locator(".stats").inner_text()

        engine = smol.engine
        assert engine.wait_idle(15), "the engine still runs the stopped request"
        engine.check_integrity()
        after = scrape(smol.url)
        name = "mlxserve:request_success_total"
        aborted = metric(after, name, finished_reason="abort") - metric(
            before, name, finished_reason="abort"
        )
        assert aborted == 1, "the server aborted the request"
        generated = metric(after, "mlxserve:generation_tokens_total") - metric(
            before, "mlxserve:generation_tokens_total"
        )
        assert generated < 1000, f"{generated} tokens: the stop did not end the generation"
        assert page.stored()["items"][0]["messages"][1]["state"] == "stopped"
        assert not page.errors, page.errors
        page.screenshot("stopped")


class TestConversationsKept:
    def test_a_reload_shows_the_conversation(self, smol, open_page) -> None:
        page = open_page(smol.url)
        page.configure(max_tokens="8", temperature="0")
        page.send("Name a color.")
        answer = page.answer("done").locator(".content").inner_text()
        stats = page.page.inner_text("article.assistant .stats")
        page.page.click("#new-chat")
        assert page.page.locator("article").count() == 0, "a new chat starts empty"

        page.page.reload()
        page.wait_models(1)
        titles = page.page.locator("#conversations .open").all_inner_texts()
        assert titles == ["Name a color."], titles
        page.page.click("#conversations .open")
        assert page.page.inner_text("article.user .text") == "Name a color."
        assert page.page.inner_text("article.assistant .content") == answer
        assert page.page.inner_text("article.assistant .stats") == stats
        settings = page.page.evaluate("JSON.parse(localStorage.getItem('mlxserve.settings'))")
        assert (settings["maxTokens"], settings["temperature"]) == (8, 0), settings

        page.page.click("#conversations .delete")
        page.page.reload()
        page.wait_models(1)
        assert page.page.locator("#conversations li").count() == 0
        assert not page.errors, page.errors


# --------------------------------------------------------------------- scripted answers


def scripted_answers(tokenizer: Any):
    """The engine's script: the answer of ANSWERS whose word the last user turn has."""

    def script(prompt: list[int], params: Any) -> list[int]:
        last_turn = tokenizer.decode(prompt).rsplit("<|im_start|>user", 1)[-1]
        text = next((a for word, a in ANSWERS.items() if word in last_turn), "Hi.")
        return list(tokenizer.encode(text)) + [EOS]

    return script


def serve_scripted(loaded: LoadedModel, config: ServerConfig) -> BackgroundServer:
    tokenizer = tokenizer_with_template(loaded.tokenizer, PLAIN_TEMPLATE)
    vocab = {"vocab_size": len(tokenizer)}
    model = LoadedModel(None, tokenizer, "scripted", vocab, context_length=4096)
    app = create_app(model, ScriptedEngine(scripted_answers(tokenizer)), config)
    return BackgroundServer(app).start()


@pytest.fixture(scope="module")
def scripted(smollm: LoadedModel) -> Iterator[BackgroundServer]:
    server = serve_scripted(smollm, ServerConfig(port=0))
    yield server
    server.stop()


class TestRendering:
    def test_raw_html_from_the_model_shows_as_text(self, scripted, open_page) -> None:
        page = open_page(scripted.url)
        page.send("xss please")
        content = page.answer("done").locator(".content")
        shown = XSS.replace(" [a link](javascript:window.__pwned=3)", " a link")
        assert content.inner_text() == shown, content.inner_text()
        assert content.locator("img, script").count() == 0, content.inner_html()
        assert content.locator("a").get_attribute("href") is None, content.inner_html()
        content.locator("a").click()
        assert page.page.evaluate("window.__pwned") is None, "the model's HTML ran"
        assert page.page.locator("img").count() == 0
        assert not page.errors, page.errors

    def test_the_csp_holds_in_the_browser(self, scripted, open_page) -> None:
        page = open_page(scripted.url)
        attempt = "(() => { try { %s; return 'allowed'; } catch (error) { return error.name; } })()"
        sink = attempt % "document.body.insertAdjacentHTML('beforeend', '<b>x</b>')"
        assert page.page.evaluate(sink) == "TypeError", "HTML sinks need a Trusted Type"
        inline = (
            "const s = document.createElement('script'); s.text = 'window.__inline = 1';"
            " document.head.append(s)"
        )
        page.page.evaluate(attempt % inline)
        assert page.page.evaluate("window.__inline") is None, "an inline script ran"

    def test_markdown_renders_code_and_tables(self, scripted, open_page) -> None:
        page = open_page(scripted.url)
        page.send("markdown please")
        content = page.answer("done").locator(".content")
        assert content.locator("strong").inner_text() == "bold"
        assert content.locator("pre code.language-python").inner_text().strip() == "print('hi')"
        assert content.locator("pre button.copy").count() == 1, "code blocks get a copy button"
        assert content.locator("table td").all_inner_texts() == ["1", "2"]
        assert not page.errors, page.errors

    def test_reasoning_is_shown_collapsed(self, scripted, open_page) -> None:
        page = open_page(scripted.url)
        page.send("think first")
        answer = page.answer("done")
        details = answer.locator("details.reasoning")
        assert details.is_visible() and details.get_attribute("open") is None, "collapsed"
        assert answer.locator(".reasoning-text").text_content() == "Let me think."
        assert answer.locator(".content").inner_text() == "Hello!"
        details.locator("summary").click()
        assert answer.locator(".reasoning-text").is_visible()

    def test_tool_calls_are_shown_as_calls(self, scripted, open_page) -> None:
        page = open_page(scripted.url)
        page.configure(tools=json.dumps([WEATHER]))
        page.send("use the tool")
        answer = page.answer("done")
        [request] = page.chat_requests()
        assert request.post_data_json["tools"] == [WEATHER]
        call = answer.locator(".tool-call")
        assert call.locator(".tool-name").inner_text() == "Tool call: get_weather"
        assert '"city": "Paris"' in call.locator("pre").inner_text()
        assert answer.locator(".content").inner_text() == "Let me look."
        assert "<tool_call>" not in answer.inner_text()
        assert "tool_calls" in answer.locator(".stats").inner_text(), "the finish reason"

    def test_bad_settings_are_refused_in_the_dialog(self, scripted, open_page) -> None:
        page = open_page(scripted.url)
        page.page.click("#open-settings")
        page.page.fill("#tools", "{not json")
        page.page.click("#save-settings")
        assert page.page.is_visible("#settings-error")
        assert "not valid JSON" in page.page.inner_text("#settings-error")
        page.page.click("#cancel-settings")
        stored = page.page.evaluate("localStorage.getItem('mlxserve.settings')")
        assert stored is None, "nothing saved"


class TestWhileLoading:
    def test_the_page_waits_for_the_model(self, smollm, browser, tmp_path) -> None:
        tokenizer = smollm.tokenizer
        app = create_app(None, None, ServerConfig(port=0), LoadProgress())
        server = BackgroundServer(app).start()
        page = ChatPage(browser, server.url, tmp_path)
        try:
            page.page.goto(server.url + "/")
            page.wait_until("!document.querySelector('#notice').hidden")
            assert "not ready" in page.page.inner_text("#notice"), page.page.inner_text("#notice")
            vocab = {"vocab_size": len(tokenizer)}
            loaded = LoadedModel(None, tokenizer, "late", vocab, context_length=4096)
            app.state.server.attach(loaded, ScriptedEngine(scripted_answers(tokenizer)))
            page.wait_models(1)
            assert page.page.is_hidden("#notice"), "the notice goes once the model is there"
            page.send("hello")
            assert page.answer("done").locator(".content").inner_text() == "Hi."
            unexpected = [e for e in page.errors if "503" not in e]
            assert not unexpected, unexpected
            page.screenshot("loaded")
        finally:
            page.close()
            server.stop()


@pytest.fixture(scope="module")
def keyed(smollm: LoadedModel) -> Iterator[BackgroundServer]:
    server = serve_scripted(smollm, ServerConfig(port=0, api_key=KEY))
    yield server
    server.stop()


class TestAPIKey:
    def test_the_page_asks_for_the_key_and_sends_it_as_a_header(self, keyed, browser, tmp_path):
        page = ChatPage(browser, keyed.url, tmp_path)
        try:
            page.page.goto(keyed.url + "/")
            page.page.wait_for_selector("#key-dialog[open]")
            assert "needs an API key" in page.page.inner_text("#key-reason")
            page.page.fill("#api-key", "wrong")
            page.page.click("#save-key")
            page.wait_until("document.querySelector('#key-reason').textContent.includes('refused')")
            page.page.fill("#api-key", KEY)
            page.page.click("#save-key")
            page.wait_models(1)
            page.send("hello")
            assert page.answer("done").locator(".content").inner_text() == "Hi."
            [chat] = page.chat_requests()
            assert chat.headers["authorization"] == f"Bearer {KEY}"
            assert all(KEY not in r.url for r in page.requests), [r.url for r in page.requests]
            assert page.page.evaluate("localStorage.getItem('mlxserve.apiKey')") == KEY
            unexpected = [e for e in page.errors if "401" not in e]
            assert not unexpected, unexpected
            page.screenshot("key")
        finally:
            page.close()


# ----------------------------------------------------------- several models, by status


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    root = tmp_path_factory.mktemp("webui-models")
    declarations = [
        ModelDeclaration(str(build_tiny_model_dir("llama", root / "a")), names=("tiny-a",)),
        ModelDeclaration(str(build_tiny_model_dir("llama", root / "b", seed=1)), names=("tiny-b",)),
    ]
    config = EngineConfig(max_total_tokens=512, max_running_requests=4)
    server = serve_models_in_background(declarations, config, ServerConfig(port=0))
    try:
        yield server
        for model in server.app.state.server.models.all():
            assert model.engine.wait_idle(30), f"{model.name} still busy"
            model.engine.check_integrity()
    finally:
        server.stop()


class TestSeveralModels:
    def test_models_are_listed_with_their_status(self, two_models, open_page) -> None:
        page = open_page(two_models.url, models=2)
        options = page.page.locator("#model option").all_inner_texts()
        assert options == ["tiny-a (loaded)", "tiny-b (unloaded)"], options
        page.page.select_option("#model", "tiny-b")
        assert page.page.inner_text("#model-info") == "unloaded"
        page.configure(max_tokens="3")
        page.send("hello")
        page.answer("done")
        page.wait_until(
            "[...document.querySelectorAll('#model option')].map(o => o.text).join()"
            " === 'tiny-a (loaded),tiny-b (loaded)'"
        )
        assert re.fullmatch(r"loaded · context \d+", page.page.inner_text("#model-info"))
        assert page.stored()["items"][0]["messages"][1]["model"] == "tiny-b"
        assert not page.errors, page.errors
