"""Structured output over HTTP with the official ``openai`` client and the embedded SmolLM2
(a weak model, which is the point): ``response_format`` JSON schemas at temperature 0.7
all parse and validate, json_object and vLLM's regex / choice / grammar extensions are
obeyed, bad schemas / regexes / grammars are 400s naming their field, and plain requests
batched with constrained ones get the tokens they get alone."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import numpy as np
import openai
import pytest

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.lifecycle.launch import BackgroundServer
from tests.ops_helpers import running_server
from tests.test_http_errors import assert_openai_error

ENGINE_CONFIG = EngineConfig(max_total_tokens=8192, max_running_requests=32)
PERSON = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def server(smollm: LoadedModel) -> Iterator[BackgroundServer]:
    with running_server(smollm, ENGINE_CONFIG) as srv:
        yield srv


def schemas(n: int) -> list[dict[str, Any]]:
    """``n`` different schemas (bounded strings and arrays, so an object fits the budget):
    flat and nested objects, enums, arrays, optional keys."""
    rng = np.random.default_rng(11)
    leaves = [
        {"type": "integer", "minimum": 0, "maximum": 999},
        {"type": "boolean"},
        {"type": "string", "maxLength": 8},
        {"enum": ["red", "green", "blue"]},
        {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        # NOTE: an unbounded "number" lets a weak model write digits until max_tokens.
        {"type": "number", "minimum": -10, "maximum": 10},
        {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"},
    ]
    names = ["name", "age", "city", "score", "tags", "ok", "color", "level"]
    out = []
    for i in range(n):
        keys = rng.choice(names, size=1 + i % 3, replace=False).tolist()
        props = {k: leaves[int(rng.integers(len(leaves)))] for k in keys}
        if i % 4 == 3:  # a nested object
            props["address"] = {
                "type": "object",
                "properties": {"zip": {"type": "string", "maxLength": 5}},
                "required": ["zip"],
                "additionalProperties": False,
            }
        required = keys if i % 5 else keys[:1]  # some keys optional
        out.append(
            {
                "type": "object",
                "properties": props,
                "required": required,
                "additionalProperties": False,
            }
        )
    return out


def create(client: openai.OpenAI, model: str, **kwargs: Any) -> Any:
    kwargs = {"messages": PERSON, "max_tokens": 160} | kwargs
    return client.chat.completions.create(model=model, **kwargs).choices[0]


def test_twenty_json_schemas_at_temperature_parse_and_validate(client, model: str) -> None:
    cases = schemas(20)

    def ask(i: int) -> Any:
        spec = {"name": f"person_{i}", "schema": cases[i]}
        if i % 3:
            spec["strict"] = i % 3 == 1
        fmt = {"type": "json_schema", "json_schema": spec}
        return create(client, model, response_format=fmt, temperature=0.7, seed=i)

    with ThreadPoolExecutor(len(cases)) as pool:
        choices = list(pool.map(ask, range(len(cases))))
    for i, (choice, schema) in enumerate(zip(choices, cases, strict=True)):
        assert choice.finish_reason == "stop", (i, choice)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_and_vllm_extensions(client, model: str) -> None:
    year = {"type": "object", "properties": {"year": {"type": "integer"}}, "required": ["year"]}
    extensions: dict[str, dict[str, Any]] = {
        "json_object": {"response_format": {"type": "json_object"}},
        "so_json": {"extra_body": {"structured_outputs": {"json": json.dumps(year)}}},
        "so_regex": {"extra_body": {"structured_outputs": {"regex": r"[A-Z][a-z]{2,6} \d{2}"}}},
        "so_choice": {"extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}},
        "so_grammar": {
            "extra_body": {"structured_outputs": {"grammar": 'start: "age " /[0-9]{1,2}/'}}
        },
        "guided_json": {"extra_body": {"guided_json": year}},
        "guided_regex": {"extra_body": {"guided_regex": r"\d{3}-\d{4}"}},
        "guided_choice": {"extra_body": {"guided_choice": ["red", "green", "blue"]}},
        "guided_grammar": {"extra_body": {"guided_grammar": 'start: ("ab" | "cd"){1,3} "!"'}},
    }

    def ask(kwargs: dict[str, Any]) -> str:
        choice = create(client, model, temperature=0.9, seed=3, max_tokens=60, **kwargs)
        assert choice.finish_reason == "stop", choice
        return choice.message.content

    with ThreadPoolExecutor(len(extensions)) as pool:
        out = dict(zip(extensions, pool.map(ask, extensions.values()), strict=True))
    assert isinstance(json.loads(out["json_object"]), dict)
    for name in ("so_json", "guided_json"):
        jsonschema.validate(json.loads(out[name]), year)
    assert re.fullmatch(r"[A-Z][a-z]{2,6} \d{2}", out["so_regex"]), out
    assert out["so_choice"] in {"yes", "no"} and out["guided_choice"] in {"red", "green", "blue"}
    assert re.fullmatch(r"age [0-9]{1,2}", out["so_grammar"]), out
    assert re.fullmatch(r"\d{3}-\d{4}", out["guided_regex"]), out
    assert re.fullmatch(r"(ab|cd){1,3}!", out["guided_grammar"]), out


def test_completions_take_constraints_too(client, model: str) -> None:
    choice = client.completions.create(
        model=model,
        prompt="My phone number is",
        max_tokens=20,
        temperature=0.8,
        seed=1,
        extra_body={"guided_regex": r" \d{3}-\d{4}"},
    ).choices[0]
    assert choice.finish_reason == "stop" and re.fullmatch(r" \d{3}-\d{4}", choice.text)


def test_streamed_json_equals_the_answer(client, model: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schemas(1)[0]}}
    kwargs = {"response_format": fmt, "temperature": 0.7, "seed": 5}
    whole = create(client, model, **kwargs).message.content
    stream = client.chat.completions.create(
        model=model, messages=PERSON, max_tokens=160, stream=True, **kwargs
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole


def test_plain_requests_batched_with_constrained_ones_are_unchanged(client, model) -> None:
    prompts = ["The capital of France is", "One, two, three,"]

    def plain(prompt: str) -> str:
        kwargs = {"max_tokens": 10, "temperature": 0, "extra_body": {"ignore_eos": True}}
        return client.completions.create(model=model, prompt=prompt, **kwargs).choices[0].text

    alone = [plain(p) for p in prompts]
    constrained = [
        {"response_format": {"type": "json_object"}, "temperature": 0.7, "seed": 1},
        {"extra_body": {"guided_regex": "[a-z ]{10,40}"}, "temperature": 0},
        {"response_format": {"type": "json_object"}, "temperature": 0},
    ]
    with ThreadPoolExecutor(len(prompts) + len(constrained)) as pool:
        jobs = [pool.submit(create, client, model, max_tokens=24, **kw) for kw in constrained]
        batched = list(pool.map(plain, prompts))
        for job in jobs:
            job.result()
    assert batched == alone


INVALID = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            }
        },
        "response_format.json_schema.schema",
        "nope",
    ),
    ({"guided_regex": "(unclosed"}, "guided_regex", "unclosed group"),
    ({"structured_outputs": {"regex": "a{2"}}, "structured_outputs.regex", "regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "undefined_rule"),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs.grammar", "lark"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    (
        {"structured_outputs": {"json": {"$ref": "#/$defs/missing"}}},
        "structured_outputs.json",
        "does not exist",
    ),
    ({"guided_choice": []}, "guided_choice", ""),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "Only one"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "Only one"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    (
        {"structured_outputs": {"whitespace_pattern": " "}},
        "structured_outputs.whitespace_pattern",
        "",
    ),
]


@pytest.mark.parametrize(("fields", "param", "says"), INVALID, ids=lambda v: str(v)[:40])
def test_invalid_constraints_are_400s_naming_the_field(http, model, fields, param, says) -> None:
    body = {"model": model, "messages": PERSON, "max_tokens": 4} | fields
    error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400, param=param)
    assert says in error["message"], error


def test_a_grammar_the_vocabulary_cannot_spell_is_a_400(http, model) -> None:
    # SmolLM2 has no token containing the byte 0x04: the grammar reaches a dead end at its
    # first token. That is the request's fault: a 400, and the server keeps serving.
    body = {"model": model, "messages": PERSON, "max_tokens": 4, "guided_regex": "\x04"}
    error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400)
    assert error["code"] == "grammar_unsatisfiable", error
    assert "vocabulary cannot spell" in error["message"], error
    ok = http.post("/v1/chat/completions", json=body | {"guided_regex": "ok"})
    assert ok.status_code == 200, ok.text


def test_a_grammar_is_compiled_once_per_request(client, model: str, monkeypatch) -> None:
    from mlxserve.scheduler.constraints import ConstraintCompiler

    compiled = []
    compile_once = ConstraintCompiler.compile

    def counting(self, spec):  # noqa: ANN001, ANN202
        compiled.append(spec.kind)
        return compile_once(self, spec)

    monkeypatch.setattr(ConstraintCompiler, "compile", counting)
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}
    response = client.chat.completions.create(
        model=model, messages=PERSON, max_tokens=30, n=3, response_format=fmt, seed=1
    )
    assert compiled == ["json_schema"], f"compiled {len(compiled)} times: {compiled}"
    for choice in response.choices:
        assert json.loads(choice.message.content)["ok"] in (True, False), choice


class TestJsonObjectWithSchema:
    """``{"type": "json_object", "schema": {...}}`` (llama.cpp / Together, instructor's
    JSON_SCHEMA mode) enforces the schema instead of any object."""

    SCHEMA = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer"}},
        "required": ["color", "n"],
        "additionalProperties": False,
    }

    def test_the_schema_is_enforced(self, client, model: str) -> None:
        fmt = {"type": "json_object", "schema": self.SCHEMA}
        choice = create(client, model, response_format=fmt, temperature=0.7, seed=3)
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), self.SCHEMA)

    def test_a_bad_schema_is_a_400_naming_it(self, http, model: str) -> None:
        fmt = {"type": "json_object", "schema": {"$ref": "#/$defs/missing"}}
        body = {"model": model, "messages": PERSON, "max_tokens": 4, "response_format": fmt}
        response = http.post("/v1/chat/completions", json=body)
        assert_openai_error(response, 400, param="response_format.schema")

    def test_schema_only_with_json_object(self, http, model: str) -> None:
        fmt = {"type": "text", "schema": self.SCHEMA}
        body = {"model": model, "messages": PERSON, "max_tokens": 4, "response_format": fmt}
        error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400)
        assert "json_object" in error["message"], error
