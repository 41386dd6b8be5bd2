"""Hostile values in well-formed requests, over loopback HTTP: numbers out of every range,
``n`` / ``max_tokens`` / ``top_k`` far past their limits, ``logit_bias`` ids outside the
vocabulary, 10,000 stop strings, control characters, empty inputs, and prompts at and one
token past the context limit. Each gets a 4xx with OpenAI's error JSON or a correct answer,
never a 5xx or a dead engine; ``/health`` is checked after each test and ``running_server``
checks every slot on exit.

Context limit semantics (vLLM's): a request is refused with 400 ``context_length_exceeded``
when prompt + ``max_tokens`` exceeds the context; without ``max_tokens`` the completion gets
what the prompt leaves, and a prompt that fills the context leaves nothing: 400 too.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.sampling_params import MAX_TOP_K, SamplingParams
from mlxserve.server.api.openai.schemas import MAX_N
from mlxserve.server.http.errors import APIError
from mlxserve.server.serving.limits import check_prompt_tokens
from tests.hostile_helpers import (
    CONTEXT,
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


@pytest.fixture(scope="module")
def vocab(http: httpx.Client) -> int:
    # /detokenize names the vocabulary in its refusal of an out-of-range id.
    message = http.post("/detokenize", json={"tokens": [10**9]}).json()["error"]["message"]
    return int(message.rsplit(", ", 1)[1].rstrip(")."))


@pytest.fixture(autouse=True)
def _still_healthy(http: httpx.Client) -> Iterator[None]:
    yield
    assert http.get("/health").status_code == 200, "the engine died"


NUMERIC_FIELDS = [
    "max_tokens", "n", "temperature", "top_p", "seed", "presence_penalty",
    "frequency_penalty", "top_k", "min_p", "repetition_penalty", "min_tokens", "logprobs",
]  # fmt: skip
EXTREMES = ["-1", "-0.0", "0", "1e-320", "-1e308", "1e308", "1e400", str(2**31), str(2**63)]
EXTREMES += [str(10**30), str(-(10**30)), "1" + "0" * 5000]


class TestNumbers:
    def test_every_numeric_field_at_every_extreme(self, http: httpx.Client, model) -> None:
        cases = [(field, raw) for field in NUMERIC_FIELDS for raw in EXTREMES]
        body = completion_body(model, max_tokens=2)
        bodies = [with_raw_value(body, field, raw) for field, raw in cases]
        for case, response in zip(cases, post_all(http, "/v1/completions", bodies), strict=True):
            assert response.status_code < 500, (case, response.text)
            assert_error_or_answer(response)

    @pytest.mark.parametrize("top_k", [2**31, 2**63, 10**30, MAX_TOP_K])
    def test_top_k_past_int32_is_off(self, http: httpx.Client, model: str, top_k: int) -> None:
        # top_k of 2**31 or more used to kill the engine thread (int32 overflow while
        # building the batch): every later request got a 503.
        body = completion_body(model, top_k=top_k, temperature=0.7, seed=1, max_tokens=3)
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        same = completion_body(model, top_k=0, temperature=0.7, seed=1, max_tokens=3)
        reference = http.post("/v1/completions", json=same).json()["choices"][0]["text"]
        assert response.json()["choices"][0]["text"] == reference, "past the vocab = off"

    def test_engine_refuses_top_k_it_cannot_hold(self) -> None:
        SamplingParams(top_k=MAX_TOP_K)
        with pytest.raises(ValueError, match="top_k"):
            SamplingParams(top_k=MAX_TOP_K + 1)

    def test_tiny_temperature_is_served(self, http: httpx.Client, model: str) -> None:
        # 1e-30 and subnormals overflow float32 logits / t: the sampler must still pick a
        # token inside the vocabulary (an id outside it would crash MLX).
        for raw in ("1e-30", "5e-324", "1e-45"):
            body = with_raw_value(completion_body(model, max_tokens=3), "temperature", raw)
            response = post_raw(http, "/v1/completions", body)
            assert response.status_code == 200, response.text


class TestLimits:
    @pytest.mark.parametrize("n", [MAX_N + 1, 10**6, 10**30])
    def test_n_past_the_limit(self, http: httpx.Client, model: str, n: int) -> None:
        error = assert_openai_error(http.post("/v1/completions", json=completion_body(model, n=n)))
        assert error["param"] == "n", error

    def test_many_choices_at_once(self, http: httpx.Client, model: str) -> None:
        body = completion_body(model, n=32, temperature=1.0, seed=3)
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert sorted(c["index"] for c in response.json()["choices"]) == list(range(32))

    @pytest.mark.parametrize("max_tokens", [CONTEXT, 10**6, 2**63, 10**30])
    def test_max_tokens_past_the_context(self, http, model: str, max_tokens: int) -> None:
        for path, body in (
            ("/v1/completions", completion_body(model, max_tokens=max_tokens)),
            ("/v1/chat/completions", chat_body(model, max_tokens=max_tokens)),
            ("/v1/chat/completions", chat_body(model, max_completion_tokens=max_tokens)),
        ):
            error = assert_openai_error(http.post(path, json=body), 400)
            assert error["code"] == "context_length_exceeded", error

    def test_min_tokens_past_max_tokens(self, http: httpx.Client, model: str) -> None:
        body = completion_body(model, max_tokens=2, min_tokens=10**30)
        assert assert_openai_error(http.post("/v1/completions", json=body))["param"]


class TestLogitBias:
    def test_ids_outside_the_vocabulary(self, http: httpx.Client, model: str, vocab) -> None:
        for key in ("-1", str(vocab), str(vocab + 1), str(2**63), "9" * 400):
            body = completion_body(model, logit_bias={key: 1})
            error = assert_openai_error(http.post("/v1/completions", json=body), 400)
            assert error["param"] == "logit_bias", error

    def test_keys_that_are_not_token_ids(self, http: httpx.Client, model: str) -> None:
        # " 5", "1_0" and "٥" (an Arabic-Indic five) used to pass: int() takes them.
        for key in (" 5", "5 ", "1_0", "\u0665", "+5", "0x10", "1e3", "", "five"):
            body = completion_body(model, logit_bias={key: 1})
            error = assert_openai_error(http.post("/v1/completions", json=body), 400)
            assert error["param"] == "logit_bias", error

    def test_the_last_id_and_a_full_dictionary(self, http, model: str, vocab: int) -> None:
        bias = {str(t): -1.0 for t in range(0, vocab, 7)} | {str(vocab - 1): 100}
        response = http.post("/v1/completions", json=completion_body(model, logit_bias=bias))
        assert response.status_code == 200, response.text


class TestStopStrings:
    def test_ten_thousand_stop_strings(self, http: httpx.Client, model: str) -> None:
        stops = [f"s{i}" for i in range(10_000)]
        for path, body in (
            ("/v1/completions", completion_body(model, stop=stops)),
            ("/v1/chat/completions", chat_body(model, stop=stops)),
        ):
            error = assert_openai_error(http.post(path, json=body), 400)
            assert error["param"] == "stop", error

    def test_long_and_odd_stop_strings(self, http: httpx.Client, model: str) -> None:
        for stop in (["x" * 100_000], ["\x00"], ["\n", "\r\n", "\t", "\u2028"], "\U0001f600"):
            response = http.post("/v1/completions", json=completion_body(model, stop=stop))
            assert response.status_code == 200, response.text


CONTROL = "".join(chr(c) for c in range(32)) + "\x7f\u0085\u200b\u200e\u202e\u2028\ufeff\ufffd"


class TestControlCharacters:
    def test_in_prompts_and_messages(self, http: httpx.Client, model: str) -> None:
        for text in ("\x00" * 50, CONTROL, "a\x00b\x1b[31mred\x1b[0m\u202eevil"):
            for path, body in (
                ("/v1/completions", completion_body(model, prompt=text)),
                ("/v1/chat/completions", chat_body(model, messages=[_user(text)])),
                ("/v1/chat/completions", chat_body(model, messages=[_user("Hi", name=text)])),
                ("/tokenize", {"prompt": text}),
                ("/tokenize", {"messages": [_user(text)]}),
            ):
                response = http.post(path, json=body)
                assert response.status_code == 200, (path, response.text)

    def test_in_names_the_server_echoes(self, http: httpx.Client, model: str) -> None:
        # An unknown model name is quoted in the 404: it must come back intact, as JSON.
        response = http.post("/v1/completions", json=completion_body(model) | {"model": CONTROL})
        error = assert_openai_error(response, 404)
        assert CONTROL in error["message"]
        assert http.get("/v1/models/%00%1b").status_code == 404


def _user(content: str, **fields: str) -> dict[str, str]:
    return {"role": "user", "content": content, **fields}


class TestEmptyInputs:
    def test_refused(self, http: httpx.Client, model: str) -> None:
        for path, body in (
            ("/v1/chat/completions", chat_body(model, messages=[])),
            ("/v1/completions", completion_body(model, prompt="")),
            ("/v1/completions", completion_body(model, prompt=[])),
            ("/v1/completions", completion_body(model, prompt=[[]])),
            ("/v1/completions", completion_body(model, prompt=[""])),
            ("/detokenize", {"tokens": None}),
        ):
            assert_openai_error(http.post(path, json=body), 400)

    def test_answered(self, http: httpx.Client, model: str) -> None:
        for path, body in (
            ("/v1/chat/completions", chat_body(model, messages=[_user("")])),
            ("/v1/chat/completions", chat_body(model, messages=[_user("")] * 3)),
            (
                "/v1/chat/completions",
                chat_body(model, messages=[{"role": "system", "content": ""}]),
            ),
            ("/v1/completions", completion_body(model, prompt=" ")),
            ("/tokenize", {"prompt": ""}),
            ("/detokenize", {"tokens": []}),
        ):
            response = http.post(path, json=body)
            assert response.status_code == 200, (path, body, response.text)


class TestContextLimit:
    """The context is CONTEXT (256) tokens: the engine's pool caps the model's 8192."""

    def test_context_is_small(self, http: httpx.Client) -> None:
        assert http.get("/v1/models").json()["data"][0]["max_model_len"] == CONTEXT

    def test_prompt_plus_max_tokens_exactly_at_the_limit(self, http, model: str) -> None:
        prompt = [42] * (CONTEXT - 1)
        body = completion_body(model, prompt=prompt, max_tokens=1)
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["total_tokens"] == CONTEXT, response.text
        # Without max_tokens the completion gets the one token the prompt leaves.
        del body["max_tokens"]
        response = http.post("/v1/completions", json=body | {"ignore_eos": True})
        assert response.json()["usage"]["completion_tokens"] == 1, response.text

    def test_one_token_past_the_limit(self, http: httpx.Client, model: str) -> None:
        for prompt_len, max_tokens in ((CONTEXT - 1, 2), (CONTEXT, 1), (CONTEXT, None)):
            body = completion_body(model, prompt=[42] * prompt_len, max_tokens=max_tokens)
            error = assert_openai_error(http.post("/v1/completions", json=body), 400)
            assert error["code"] == "context_length_exceeded", error
        body = completion_body(model, prompt=[42] * (CONTEXT + 1))
        assert_openai_error(http.post("/v1/completions", json=body), 400)

    def test_chat_at_the_limit(self, http: httpx.Client, model: str) -> None:
        messages = [_user("Hi " * 500)]
        count = http.post("/tokenize", json={"messages": messages}).json()["count"]
        assert count > CONTEXT
        error = assert_openai_error(
            http.post("/v1/chat/completions", json=chat_body(model, messages=messages)), 400
        )
        assert error["code"] == "context_length_exceeded" and error["param"] == "messages"


class TestPromptTokenLimit:
    def test_exactly_at_max_prompt_tokens_passes(self) -> None:
        check_prompt_tokens(8, 8, "prompt")
        with pytest.raises(APIError) as info:
            check_prompt_tokens(9, 8, "prompt")
        assert info.value.status_code == 400 and info.value.code == "prompt_too_long"
