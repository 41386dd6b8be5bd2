"""Structured output: the OpenAI / vLLM request fields that constrain the output, each as a
``GrammarSpec`` with its field (``server/serving/output_constraint.py`` makes them one).

- OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type":
  "json_object"}`` (any JSON object), ``{"type": "json_schema", "json_schema": {"name",
  "schema", "strict", "description"}}`` (the schema is enforced, strict or not); and the
  llama.cpp / Together form ``{"type": "json_object", "schema": {...}}`` that older
  client libraries send (instructor's JSON_SCHEMA mode): the schema is enforced;
- vLLM's ``structured_outputs``: ``{"json": schema}``, ``{"regex": str}``, ``{"choice":
  [str, ...]}``, ``{"grammar": str}`` (Lark in llguidance's dialect), ``{"json_object":
  true}``; and its older ``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar``.

A request takes one of them (more is a 400). JSON is written in OpenAI's compact style
(``{"a": 1, "b": [2, 3]}``).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mlxserve.scheduler.constraints import GrammarSpec
from mlxserve.server.http.json_body import strict_json_text


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


def json_schema_value(value: Any) -> dict[str, Any] | None:
    """A JSON schema given as an object or as JSON text -> the object."""
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            value = strict_json_text(value)
        except ValueError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if isinstance(value, dict):
            return value
    raise ValueError("a JSON schema must be a JSON object.")


class JsonSchemaSpec(_Model):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None
    # llama.cpp / Together: {"type": "json_object", "schema": {...}}.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")

    _schema = field_validator("schema_", mode="before")(json_schema_value)

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("'json_schema' goes with (and only with) type 'json_schema'.")
        if self.schema_ is not None and self.type != "json_object":
            raise ValueError("'schema' goes with (and only with) type 'json_object'.")
        return self


class StructuredOutputs(_Model):
    """vLLM's ``structured_outputs`` (one key set)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None

    _schema = field_validator("json_", mode="before")(json_schema_value)


def output_constraints(body: Any) -> list[tuple[GrammarSpec, str]]:
    """Every constraint ``body`` asks for, with the field it came from."""
    found: list[tuple[GrammarSpec, str]] = []
    fmt: ResponseFormat | None = body.response_format
    if fmt is not None and fmt.schema_ is not None:
        found.append(
            (GrammarSpec("json_schema", json.dumps(fmt.schema_)), "response_format.schema")
        )
    elif fmt is not None and fmt.type == "json_object":
        found.append((GrammarSpec("json_object"), "response_format"))
    elif fmt is not None and fmt.json_schema is not None:
        schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {}
        found.append(
            (GrammarSpec("json_schema", json.dumps(schema)), "response_format.json_schema.schema")
        )
    so: StructuredOutputs | None = body.structured_outputs
    sources = [
        ("structured_outputs.json", so and so.json_, "json_schema"),
        ("structured_outputs.regex", so and so.regex, "regex"),
        ("structured_outputs.choice", so and so.choice, "choice"),
        ("structured_outputs.grammar", so and so.grammar, "lark"),
        ("structured_outputs.json_object", so and so.json_object, "json_object"),
        ("guided_json", body.guided_json, "json_schema"),
        ("guided_regex", body.guided_regex, "regex"),
        ("guided_choice", body.guided_choice, "choice"),
        ("guided_grammar", body.guided_grammar, "lark"),
    ]
    for param, value, kind in sources:
        if value is None or value is False:
            continue
        if kind == "json_object":
            found.append((GrammarSpec("json_object"), param))
        elif kind in ("json_schema", "choice"):
            found.append((GrammarSpec(kind, json.dumps(value)), param))
        else:
            found.append((GrammarSpec(kind, value), param))
    return found
