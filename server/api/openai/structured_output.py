"""Structured output: the request fields that constrain the output, as one ``GrammarSpec``.

- OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type":
  "json_object"}`` (any JSON object), ``{"type": "json_schema", "json_schema": {"name",
  "schema", "strict", "description"}}`` (the schema is enforced, strict or not);
- vLLM's ``structured_outputs``: ``{"json": schema}``, ``{"regex": str}``, ``{"choice":
  [str, ...]}``, ``{"grammar": str}`` (Lark in llguidance's dialect), ``{"json_object":
  true}``; and its older ``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar``.

A request takes one of them (more is a 400). JSON is written in OpenAI's compact style
(``{"a": 1, "b": [2, 3]}``). With tools offered (``tool_choice: "auto"``) a JSON or choice
constraint becomes "a tool call or an answer in the format"; a ``required`` / named
``tool_choice`` is itself a constraint, so it does not combine with these. Grammars are
compiled in the request handler before anything is sent, so a bad schema, regex or grammar
is a 400 that names its field.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mlxserve.scheduler.constraints import JSON_STYLE, GrammarSpec
from mlxserve.server.api.openai.tools import ToolPlan
from mlxserve.server.http.errors import invalid_request
from mlxserve.server.serving.tool_parsers import hermes_format


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


def json_schema_value(value: Any) -> dict[str, Any] | None:
    """A JSON schema given as an object or as JSON text -> the object."""
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
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

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("'json_schema' goes with (and only with) type 'json_schema'.")
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
    if fmt is not None and fmt.type == "json_object":
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


def _answer_rule(spec: GrammarSpec) -> str | None:
    """The Lark rule ``answer`` matching what ``spec`` matches (None: not expressible)."""
    if spec.kind in ("json_schema", "json_object"):
        schema = json.loads(spec.value) if spec.kind == "json_schema" else {"type": "object"}
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": schema.get("x-guidance", JSON_STYLE)}
        return f"answer: %json {json.dumps(schema)}\n"
    if spec.kind == "choice":
        return "answer: " + " | ".join(json.dumps(str(c)) for c in json.loads(spec.value)) + "\n"
    return None


@dataclass(frozen=True)
class OutputConstraint:
    """A request's one constraint.

    Attributes:
        spec: the grammar the output follows.
        param: the request field it comes from (named by errors).
        suspects: its parts, each with its field, when it combines several.
    """

    spec: GrammarSpec
    param: str
    suspects: tuple[tuple[GrammarSpec, str], ...] = ()


def request_constraint(body: Any, plan: ToolPlan) -> tuple[OutputConstraint | None, ToolPlan]:
    """The one constraint of a request (None: none), and the tool plan (which parses the
    default format when calls are constrained together with an answer format).

    Raises:
        APIError: 400 for more than one constraint, or one that cannot go with tools.
    """
    found = output_constraints(body)
    tool_grammar = plan.grammar()
    if tool_grammar is not None:
        found.insert(0, (tool_grammar, "tool_choice"))
    if len(found) > 1:
        raise invalid_request(
            f"Only one output constraint per request: '{found[0][1]}' and '{found[1][1]}' "
            "were both given.",
            param=found[1][1],
        )
    if not found:
        return None, plan
    spec, param = found[0]
    if tool_grammar is not None:
        return OutputConstraint(spec, "tools", plan.schemas), plan
    if plan.parse is None:
        return OutputConstraint(spec, param), plan
    # Tools offered (tool_choice auto): a call or an answer in the requested format.
    answer = _answer_rule(spec)
    if answer is None:
        raise invalid_request(
            f"'{param}' cannot be combined with tools unless 'tool_choice' is \"none\" "
            "(only JSON and choice constraints can).",
            param=param,
        )
    assert plan.call_rules is not None
    combined = GrammarSpec("lark", "start: calls | answer\n" + answer + plan.call_rules)
    suspects = ((spec, param), *plan.schemas)
    return OutputConstraint(combined, param, suspects), replace(plan, parse=hermes_format())


async def check_constraint(engine: Any, constraint: OutputConstraint) -> None:
    """Compile the constraint once, off the event loop (the first use builds the
    compiler); when it fails, its parts alone, so that the error names the one at fault.

    Raises:
        APIError: 400 naming the field at fault, with llguidance's reason.
    """
    spec, param, suspects = constraint.spec, constraint.param, constraint.suspects
    compiler_of = getattr(engine, "constraint_compiler", None)
    if compiler_of is None:
        return  # an engine without grammars (test doubles): add_request checks

    def compile_all() -> tuple[str, str] | None:
        compiler = compiler_of()
        try:
            compiler.compile(spec)
            return None
        except ValueError as e:
            failure = (str(e), param)
        for part, part_param in suspects:
            try:
                compiler.compile(part)
            except ValueError as e:
                return str(e), part_param
        return failure

    failure = await asyncio.to_thread(compile_all)
    if failure is not None:
        message, at = failure
        raise invalid_request(f"Invalid '{at}': {message}", param=at)
