"""JSON Schemas of the request fields typed ``Any`` (``schemas.py`` checks them by hand, so
pydantic shows them as "anything"), for ``/openapi.json`` (``openapi.py``).

The not-implemented OpenAI parameters show the no-op values they accept. Schema fuzzing
(``bench/fuzz.py``) generates requests from these, so they describe what the validators
accept, no more.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any


def any_field_schemas(max_stop_strings: int, max_logit_bias: float) -> dict[str, dict[str, Any]]:
    """Field name -> its JSON Schema."""
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    return {
        "stop": {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {
                    "type": "array",
                    "items": {"type": "string", "minLength": 1},
                    "maxItems": max_stop_strings,
                },
                {"type": "null"},
            ]
        },
        "logit_bias": {
            "anyOf": [
                {
                    "type": "object",
                    "propertyNames": {"pattern": "^[0-9]+$"},
                    "additionalProperties": {
                        "type": "number",
                        "minimum": -max_logit_bias,
                        "maximum": max_logit_bias,
                    },
                },
                {"type": "null"},
            ],
            "description": "Token id (below the vocabulary size) -> bias added to its logit.",
        },
        "prompt": {
            "anyOf": [
                {"type": "string", "minLength": 1},
                ids,
                {
                    "type": "array",
                    "items": {"type": "string", "minLength": 1},
                    "minItems": 1,
                    "maxItems": 1,
                },
                {"type": "array", "items": ids, "minItems": 1, "maxItems": 1},
            ],
            "description": "Text, or token ids (below the vocabulary size); one prompt only.",
        },
        "guided_json": {
            "anyOf": [{"type": "object"}, {"type": "string"}, {"type": "null"}],
            "description": "A JSON schema, as an object or as JSON text.",
        },
        "tool_choice": {
            "anyOf": [
                {"enum": ["none", "auto", "required"]},
                {
                    "type": "object",
                    "properties": {
                        "type": {"const": "function"},
                        "function": {
                            "type": "object",
                            "properties": {"name": {"type": "string"}},
                            "required": ["name"],
                            "additionalProperties": False,
                        },
                    },
                    "required": ["type", "function"],
                    "additionalProperties": False,
                },
                {"type": "null"},
            ]
        },
    }


def describe_any_fields(
    noop_values: dict[str, tuple[Any, ...]], max_stop_strings: int, max_logit_bias: float
) -> Callable[[dict[str, Any]], None]:
    """A pydantic ``json_schema_extra`` hook filling in the schemas of a model's ``Any``
    fields (``noop_values``: not-implemented parameter -> the values accepted)."""
    schemas = any_field_schemas(max_stop_strings, max_logit_bias)

    def describe(schema: dict[str, Any]) -> None:
        for name, prop in schema.get("properties", {}).items():
            if name in schemas:
                prop.update(copy.deepcopy(schemas[name]))
            elif name in noop_values:
                accepted = [{"const": value} for value in noop_values[name]]
                prop["anyOf"] = [*accepted, {"type": "null"}]
                prop["description"] = "Not supported: only its no-op value (or null) is accepted."

    return describe
