"""Malformed Anthropic Messages bodies and what their 400 must say (the cases of
``tests/test_http_anthropic.py``): each a 400 ``invalid_request_error`` in Anthropic's
shape, naming what is wrong."""

from __future__ import annotations

from typing import Any

HELLO = [{"role": "user", "content": "Say hello."}]
WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}

# (body fields besides "model", a text the error message must contain)
BAD_BODIES: list[tuple[dict[str, Any], str]] = [
    ({"max_tokens": 4, "messages": [{"role": "user", "content": []}]}, "empty"),
    (
        {"max_tokens": 4, "messages": [{"role": "assistant", "content": []}, *HELLO]},
        "messages[0]",
    ),
    ({"max_tokens": 4}, "messages"),
    ({"messages": HELLO}, "max_tokens"),
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"max_tokens": -1, "messages": HELLO}, "max_tokens"),
    ({"max_tokens": True, "messages": HELLO}, "max_tokens"),
    ({"max_tokens": 4, "messages": HELLO, "n": 2}, "n"),
    ({"max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]}, "role"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": 5}]}, "content"),
    (
        {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
        "image",
    ),
    (
        {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
        "video",
    ),
    (
        {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "text",
    ),
    (
        {
            "max_tokens": 4,
            "messages": [
                {
                    "role": "assistant",
                    "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}],
                }
            ],
        },
        "tool_result",
    ),
    (
        {
            "max_tokens": 4,
            "messages": [
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                }
            ],
        },
        "tool_result",
    ),
    ({"max_tokens": 4, "messages": HELLO, "tools": [{"name": "f"}]}, "input_schema"),
    (
        {
            "max_tokens": 4,
            "messages": HELLO,
            "tools": [{"name": "f", "input_schema": {"type": "string"}}],
        },
        "object",
    ),
    (
        {
            "max_tokens": 4,
            "messages": HELLO,
            "tools": [{"type": "web_search_20250305", "name": "w"}],
        },
        "web_search_20250305",
    ),
    ({"max_tokens": 4, "messages": HELLO, "tools": [WEATHER, WEATHER]}, "unique"),
    ({"max_tokens": 4, "messages": HELLO, "tool_choice": {"type": "any"}}, "tools"),
    (
        {
            "max_tokens": 4,
            "messages": HELLO,
            "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "nope"},
        },
        "nope",
    ),
    ({"max_tokens": 4, "messages": HELLO, "tool_choice": {"type": "maybe"}}, "tool_choice"),
    (
        {"max_tokens": 8, "messages": HELLO, "thinking": {"type": "enabled", "budget_tokens": 8}},
        "budget_tokens",
    ),
    ({"max_tokens": 4, "messages": HELLO, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 4, "messages": HELLO, "stop_sequences": [""]}, "stop_sequences"),
    ({"max_tokens": 4, "messages": HELLO, "metadata": {"session": "x"}}, "session"),
    (
        {
            "max_tokens": 4,
            "messages": HELLO,
            "output_config": {"format": {"type": "json_schema", "schema": {"$ref": "#/nope"}}},
        },
        "output_config.format.schema",
    ),
    ({"max_tokens": 4, "messages": HELLO, "output_config": {"effort": "extreme"}}, "effort"),
]
