"""Hostile request bodies over loopback HTTP: bytes that are not UTF-8, JSON that is not
JSON (NaN, lone surrogates), nesting 10,000 deep, a 100 MB body, and wrong types in every
field. Each gets a 4xx with OpenAI's error JSON or a correct answer; never a 5xx, a hang
(client timeouts), a dropped connection, or a leaked slot (``running_server`` checks the
engine's slots on exit; ``/health`` is checked after each test).

Value-level hostility (numbers, limits, stop strings, control characters, the context
limit) is in ``test_hostile_values.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.server.api.openai.messages import ChatMessage
from mlxserve.server.api.openai.schemas import ChatCompletionRequest, CompletionRequest
from mlxserve.server.api.openai.tokenize import DetokenizeRequest, TokenizeRequest
from mlxserve.server.http.json_body import MAX_JSON_DEPTH
from tests.hostile_helpers import (
    assert_error_or_answer,
    assert_openai_error,
    chat_body,
    completion_body,
    hostile_server_client,
    post_all,
    post_raw,
    with_raw_value,
)


@pytest.fixture(scope="module")
def http(smollm: LoadedModel) -> Iterator[httpx.Client]:
    yield from hostile_server_client(smollm)


@pytest.fixture(autouse=True)
def _still_healthy(http: httpx.Client) -> Iterator[None]:
    yield
    health = http.get("/health")
    assert health.status_code == 200, health.text


def invalid_json(response: httpx.Response) -> str:
    error = assert_openai_error(response, 400)
    assert error["code"] == "invalid_json", error
    return error["message"]


class TestEncoding:
    @pytest.mark.parametrize(
        "raw",
        [b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf4\x90\x80\x80"],
        ids=["ff", "truncated", "encoded-surrogate", "overlong", "past-unicode"],
    )
    def test_invalid_utf8(self, http: httpx.Client, model: str, raw: bytes) -> None:
        body = json.dumps(completion_body(model, prompt="@@")).encode()
        assert "UTF-8" in invalid_json(post_raw(http, "/v1/completions", body.replace(b"@@", raw)))

    @pytest.mark.parametrize(
        ("path", "field"),
        [
            ("/v1/completions", "prompt"),
            ("/v1/completions", "stop"),
            ("/v1/completions", "user"),
            ("/v1/chat/completions", "model"),
            ("/tokenize", "prompt"),
        ],
    )
    def test_lone_surrogate_escapes(self, http: httpx.Client, model: str, path, field) -> None:
        # Used to be a 500 (the tokenizer cannot take the string), or a dropped connection
        # when the error message quoted it and could not be encoded.
        body = chat_body(model) if "chat" in path else completion_body(model)
        if path == "/tokenize":
            body = {"prompt": "Hi"}
        for escape in ('"\\ud800"', '"a\\udfffb"', '"\\udc00\\ud800"'):
            message = invalid_json(post_raw(http, path, with_raw_value(body, field, escape)))
            assert "surrogate" in message

    def test_paired_surrogate_escape_is_a_character(self, http: httpx.Client, model) -> None:
        body = with_raw_value(completion_body(model), "prompt", '"smile \\ud83d\\ude00"')
        assert post_raw(http, "/v1/completions", body).status_code == 200

    def test_byte_order_mark_and_utf16(self, http: httpx.Client, model: str) -> None:
        text = json.dumps(completion_body(model))
        assert post_raw(http, "/v1/completions", "\ufeff" + text).status_code == 200
        invalid_json(post_raw(http, "/v1/completions", text.encode("utf-16")))


class TestNonJsonNumbers:
    @pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
    @pytest.mark.parametrize(
        "field", ["temperature", "max_tokens", "seed", "repetition_penalty", "metadata"]
    )
    def test_literals_are_not_json(self, http: httpx.Client, model, literal, field) -> None:
        body = with_raw_value(completion_body(model), field, literal)
        assert literal.lstrip("-") in invalid_json(post_raw(http, "/v1/completions", body))

    def test_nan_where_no_range_check_would_catch_it(self, http: httpx.Client, model) -> None:
        # chat_template_kwargs and logit_bias values are free-form: only the parser stops it.
        body = with_raw_value(chat_body(model), "chat_template_kwargs", '{"x": NaN}')
        invalid_json(post_raw(http, "/v1/chat/completions", body))
        body = with_raw_value(completion_body(model), "logit_bias", '{"5": -Infinity}')
        invalid_json(post_raw(http, "/v1/completions", body))

    def test_huge_exponents_are_numbers(self, http: httpx.Client, model: str) -> None:
        # 1e400 is valid JSON; as a float it is inf, which the ranges refuse by name.
        body = with_raw_value(completion_body(model), "temperature", "1e400")
        assert_openai_error(post_raw(http, "/v1/completions", body), 400)


class TestNesting:
    @pytest.mark.parametrize("depth", [10_000, 100_000])
    def test_deep_arrays_and_objects(self, http: httpx.Client, model: str, depth: int) -> None:
        arrays = "[" * depth + "]" * depth
        objects = '{"a":' * depth + "1" + "}" * depth
        for value in (arrays, objects):
            for field in ("prompt", "metadata", "logit_bias"):
                body = with_raw_value(completion_body(model), field, value)
                assert "nested" in invalid_json(post_raw(http, "/v1/completions", body))

    @pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 500, 900])
    def test_deep_template_kwargs(self, http: httpx.Client, model: str, depth: int) -> None:
        # Under the parser's own limit this used to reach the chat template, whose
        # recursive walk over the kwargs ran out of stack: a 500.
        nested = "[" * depth + "]" * depth
        body = with_raw_value(chat_body(model), "chat_template_kwargs", f'{{"x": {nested}}}')
        assert "nested" in invalid_json(post_raw(http, "/v1/chat/completions", body))
        messages = {"messages": [{"role": "user", "content": "Hi"}]}
        body = with_raw_value(messages, "chat_template_kwargs", f'{{"x": {nested}}}')
        assert "nested" in invalid_json(post_raw(http, "/tokenize", body))

    def test_nesting_at_the_limit_is_served(self, http: httpx.Client, model: str) -> None:
        depth = MAX_JSON_DEPTH - 2  # the body object and chat_template_kwargs are two levels
        nested = "[" * depth + "]" * depth
        body = with_raw_value(chat_body(model), "chat_template_kwargs", f'{{"x": {nested}}}')
        assert post_raw(http, "/v1/chat/completions", body).status_code == 200


class TestHugeBody:
    MB = 1 << 20

    def _body(self, counter: list[int]) -> Iterator[bytes]:
        for _ in range(100):
            counter[0] += 1
            yield b" " * self.MB

    def test_100_mb_refused_without_being_held(self, http: httpx.Client) -> None:
        before = _rss_mb()
        for announced in (True, False):  # Content-Length given, or chunked
            sent = [0]
            headers = {"content-type": "application/json"}
            if announced:
                headers["content-length"] = str(100 * self.MB)
            response = http.post("/v1/completions", content=self._body(sent), headers=headers)
            error = assert_openai_error(response, 413)
            assert error["code"] == "request_too_large", error
        # The client streamed 200 MB; the server kept none of it.
        assert _rss_mb() - before < 64, f"RSS grew from {before:.0f} to {_rss_mb():.0f} MB"


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


# Values of every JSON type; each field gets the ones that are not its own type.
WRONG_VALUES = ['"x"', "2.5", "true", '[1, "a"]', '{"a": 1}']


def _fields(model_class) -> list[str]:
    return sorted(name for name in model_class.model_fields if name != "model")


def _sweep(http: httpx.Client, path: str, base: dict, fields: list[str]) -> set[int]:
    """Each field set to each wrong value (four requests at a time); the statuses seen."""
    cases = [(field, raw) for field in fields for raw in WRONG_VALUES]
    bodies = [with_raw_value(base, field, raw) for field, raw in cases]
    statuses = set()
    for case, response in zip(cases, post_all(http, path, bodies), strict=True):
        assert response.status_code < 500, (case, response.text)
        assert_error_or_answer(response)
        statuses.add(response.status_code)
    return statuses


class TestWrongTypesEverywhere:
    def test_completion_fields(self, http: httpx.Client, model: str) -> None:
        statuses = _sweep(
            http, "/v1/completions", completion_body(model), _fields(CompletionRequest)
        )
        assert statuses == {200, 400}, statuses

    def test_chat_fields(self, http: httpx.Client, model: str) -> None:
        base = chat_body(model)
        statuses = _sweep(http, "/v1/chat/completions", base, _fields(ChatCompletionRequest))
        assert 400 in statuses, statuses

    def test_message_fields(self, http: httpx.Client, model: str) -> None:
        for field in sorted(ChatMessage.model_fields):
            for raw in WRONG_VALUES:
                message = with_raw_value({"role": "user", "content": "Hi"}, field, raw)
                body = json.dumps(chat_body(model, messages=["@@"])).replace('"@@"', message)
                response = post_raw(http, "/v1/chat/completions", body)
                assert_error_or_answer(response)

    def test_tokenize_fields(self, http: httpx.Client) -> None:
        _sweep(http, "/tokenize", {"prompt": "Hi"}, _fields(TokenizeRequest))
        _sweep(http, "/detokenize", {"tokens": [1, 2]}, _fields(DetokenizeRequest))
        for raw in WRONG_VALUES:
            assert_error_or_answer(post_raw(http, "/tokenize", raw))

    def test_not_an_object_anywhere(self, http: httpx.Client) -> None:
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
            for raw in WRONG_VALUES + ["null", '"', "{", "}", "\x00", ""]:
                assert_openai_error(post_raw(http, path, raw), 400)
