"""What the server makes of chosen engine output, over HTTP: reasoning split (streamed and
not), models without a chat template, logprobs of partial characters, ``n`` choices.

The engine is ``tests/scripted_engine.ScriptedEngine`` (no model runs); the tokenizer is
SmolLM2's, with the chat template each test needs.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from tests.scripted_engine import scripted_client, tokenizer_with_template

EOS = 2  # SmolLM2's <|im_end|>
MESSAGES = [{"role": "user", "content": "Hi"}]
# Qwen3-style: the generation prompt opens the reasoning.
OPENING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
# Mentions <think> (a reasoning model) but lets the model open it.
PLAIN_TEMPLATE = (
    "{# the model reasons in <think> tags #}{% for m in messages %}<|im_start|>{{ m['role'] }}"
    "\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def answering(tokenizer: Any, text: str):
    """A script answering ``text`` then EOS."""
    ids = list(tokenizer.encode(text)) + [EOS]
    return lambda prompt, params: ids


def chat(client: TestClient, **fields: Any) -> dict[str, Any]:
    body = {"model": "scripted", "messages": MESSAGES, "max_tokens": 64} | fields
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def stream_payloads(client: TestClient, path: str, body: dict[str, Any]) -> list[dict]:
    with client.stream("POST", path, json=body | {"stream": True}) as response:
        assert response.status_code == 200, response.read()
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def streamed_fields(payloads: list[dict], index: int = 0) -> tuple[str, str, list[str]]:
    """Concatenated reasoning and content deltas of one choice, and its finish reasons."""
    reasoning = content = ""
    reasons = []
    for payload in payloads:
        for choice in payload["choices"]:
            if choice["index"] != index:
                continue
            reasoning += choice["delta"].get("reasoning_content") or ""
            content += choice["delta"].get("content") or ""
            if choice["finish_reason"]:
                reasons.append(choice["finish_reason"])
    return reasoning, content, reasons


class TestReasoning:
    @pytest.mark.parametrize(
        ("template", "output"),
        [
            (OPENING_TEMPLATE, "Let me think.\n</think>\n\nHello!"),
            (PLAIN_TEMPLATE, "<think>\nLet me think.\n</think>\n\nHello!"),
        ],
        ids=["template-opens-think", "model-opens-think"],
    )
    def test_split_streamed_and_not(self, smollm: LoadedModel, template: str, output: str):
        tokenizer = tokenizer_with_template(smollm.tokenizer, template)
        client, _ = scripted_client(tokenizer, answering(tokenizer, output))
        message = chat(client)["choices"][0]["message"]
        assert message["reasoning_content"] == "Let me think."
        assert message["content"] == "Hello!"
        payloads = stream_payloads(
            client,
            "/v1/chat/completions",
            {"model": "scripted"} | {"messages": MESSAGES, "max_tokens": 64},
        )
        reasoning, content, reasons = streamed_fields(payloads)
        assert (reasoning, content, reasons) == ("Let me think.", "Hello!", ["stop"])
        deltas = [c["delta"] for p in payloads for c in p["choices"]]
        assert not any("think>" in (d.get("content") or "") for d in deltas), "no tag leaks"
        assert not any("think>" in (d.get("reasoning_content") or "") for d in deltas)

    def test_cut_off_while_reasoning(self, smollm: LoadedModel) -> None:
        tokenizer = tokenizer_with_template(smollm.tokenizer, OPENING_TEMPLATE)
        client, _ = scripted_client(tokenizer, answering(tokenizer, "Hmm, a long thought"))
        choice = chat(client, max_tokens=3)["choices"][0]
        assert choice["finish_reason"] == "length"
        assert choice["message"]["content"] == ""
        assert choice["message"]["reasoning_content"], choice

    def test_no_reasoning_field_without_think(self, smollm: LoadedModel) -> None:
        tokenizer = tokenizer_with_template(smollm.tokenizer, PLAIN_TEMPLATE)
        client, _ = scripted_client(tokenizer, answering(tokenizer, "Hello!"))
        message = chat(client)["choices"][0]["message"]
        assert message == {"role": "assistant", "content": "Hello!"}

    def test_non_reasoning_model_keeps_tags_in_content(self, smollm: LoadedModel) -> None:
        client, _ = scripted_client(
            smollm.tokenizer, answering(smollm.tokenizer, "<think>a</think>b")
        )
        message = chat(client)["choices"][0]["message"]
        assert message == {"role": "assistant", "content": "<think>a</think>b"}


class TestNoChatTemplate:
    def test_chat_is_400_completions_work(self, smollm: LoadedModel) -> None:
        tokenizer = tokenizer_with_template(smollm.tokenizer, None)
        client, engine = scripted_client(tokenizer, answering(tokenizer, "ok"))
        body = {"model": "scripted", "messages": MESSAGES}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "no_chat_template" and "chat template" in error["message"]
        response = client.post("/tokenize", json={"messages": MESSAGES})
        assert response.status_code == 400, response.text
        assert not engine.requests, "nothing reached the engine"
        body = {"model": "scripted", "prompt": "Hi", "max_tokens": 4}
        assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == "ok"


class TestScriptedLogprobs:
    def test_partial_characters_have_exact_bytes(self, smollm: LoadedModel) -> None:
        """The emoji is two byte-level tokens, neither valid UTF-8 alone."""
        tokenizer = smollm.tokenizer
        client, _ = scripted_client(tokenizer, answering(tokenizer, " 😀"))
        choice = chat(client, logprobs=True, top_logprobs=1)["choices"][0]
        assert choice["message"]["content"] == " 😀"
        content = choice["logprobs"]["content"]
        assert len(content) == 2, "EOS has no logprobs entry (it is not part of the text)"
        assert bytes(content[0]["bytes"] + content[1]["bytes"]).decode() == " 😀"
        assert all(item["token"].startswith("bytes:\\x") for item in content), content
        assert [item["logprob"] for item in content] == pytest.approx([-0.1, -0.2])
        assert content[0]["top_logprobs"] == [
            {
                "token": content[0]["token"],
                "logprob": content[0]["logprob"],
                "bytes": content[0]["bytes"],
            }
        ]

    def test_n_choices_have_their_own_ids_seeds_and_indexes(self, smollm: LoadedModel):
        tokenizer = smollm.tokenizer
        client, engine = scripted_client(tokenizer, answering(tokenizer, "Hi there"))
        body = {"model": "scripted", "prompt": "Hello", "n": 3, "seed": 10, "max_tokens": 8}
        reply = client.post("/v1/completions", json=body).json()
        assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
        assert {c["text"] for c in reply["choices"]} == {"Hi there"}
        ids = [request_id for request_id, _, _ in engine.requests]
        assert len(set(ids)) == 3 and all(i.startswith(reply["id"]) for i in ids), ids
        assert [params.seed for _, _, params in engine.requests] == [10, 11, 12]
        per_choice = len(tokenizer.encode("Hi there")) + 1  # + EOS
        assert reply["usage"]["completion_tokens"] == 3 * per_choice, "all choices count"
        assert reply["usage"]["prompt_tokens"] == len(tokenizer.encode("Hello")), "prompt once"
        payloads = stream_payloads(client, "/v1/completions", body)
        for index in range(3):
            texts = [c["text"] for p in payloads for c in p["choices"] if c["index"] == index]
            assert "".join(texts) == "Hi there", (index, texts)
