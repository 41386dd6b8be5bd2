"""Strict JSON request bodies: what reaches pydantic is RFC 8259 JSON of bounded depth.

Python's ``json`` module is lenient where a server must not be:

- it takes ``NaN``, ``Infinity`` and ``-Infinity``, which are not JSON;
- it decodes lone UTF-16 surrogates (``"\\ud800"``, or the bytes ``ED A0 80``) into
  strings that cannot be encoded again, so the tokenizer (and any error message that
  quotes them) fails later with a 500;
- it parses nesting as deep as the interpreter's stack allows (~1,000 levels here), and the
  chat template's own recursive walk over ``chat_template_kwargs`` then runs out of stack.

``StrictJSONRoute`` makes FastAPI parse bodies with ``strict_json_loads``, which refuses
all three; FastAPI turns its ``JSONDecodeError`` into a 400 ``invalid_json``
(``errors.py``). The body limit (``limits.py``) has already bounded the size. JSON that
clients send inside strings (a tool call's ``arguments``, a schema given as text) is parsed
with ``strict_json_text``, the same rules: it skipped the body's checks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

# Deepest nesting of arrays and objects accepted (serde_json's default limit is 128 too).
MAX_JSON_DEPTH = 128

# A \u escape of a UTF-16 surrogate (paired ones are fine: they decode to one character).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class JSONHazard(json.JSONDecodeError):
    """JSON that parses but must not be used: too deep, a lone surrogate, ``NaN``."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _depth_or_surrogate_error(value: Any, check_strings: bool) -> str | None:
    """Walk ``value`` iteratively (no recursion): the first problem found, or None."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
            if check_strings:
                children = [*item.keys(), *children]
        elif isinstance(item, list):
            children = item
        else:
            if check_strings and isinstance(item, str) and not _encodable(item):
                return "a string contains a lone UTF-16 surrogate"
            continue
        if depth > MAX_JSON_DEPTH:
            return f"arrays and objects are nested deeper than {MAX_JSON_DEPTH} levels"
        stack.extend((child, depth + 1) for child in children)
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def strict_json_loads(body: bytes) -> Any:
    """Parse a request body as strict JSON.

    Raises:
        json.JSONDecodeError: invalid UTF-8, invalid JSON, ``NaN``/``Infinity``, a lone
            surrogate, or nesting deeper than ``MAX_JSON_DEPTH``.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise json.JSONDecodeError("the body is not valid UTF-8", "", e.start) from None
    text = text.removeprefix("\ufeff")  # RFC 8259 lets a parser ignore a byte order mark
    return strict_json_text(text)


def strict_json_text(text: str) -> Any:
    """Parse JSON text with the body's rules (no ``NaN``/``Infinity``, no lone surrogates,
    nesting at most ``MAX_JSON_DEPTH`` deep).

    Raises:
        JSONHazard: it parses, but breaks one of those rules.
        json.JSONDecodeError: it is not JSON.
    """
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise JSONHazard(
            f"arrays and objects are nested deeper than {MAX_JSON_DEPTH} levels", "", 0
        ) from None
    except json.JSONDecodeError:
        raise
    except ValueError as e:  # from _reject_constant
        raise JSONHazard(str(e), "", 0) from None
    # Cheap pre-checks: fewer brackets than the limit cannot nest past it, and a surrogate
    # can only come from a \u escape (strict UTF-8 decoding refused encoded ones).
    deep = text.count("[") + text.count("{") > MAX_JSON_DEPTH
    surrogates = _SURROGATE_ESCAPE.search(text) is not None
    if deep or surrogates:
        problem = _depth_or_surrogate_error(value, surrogates)
        if problem is not None:
            raise JSONHazard(problem, "", 0)
    return value


class StrictJSONRequest(Request):
    """A request whose ``json()`` is ``strict_json_loads``."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = strict_json_loads(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """An ``APIRoute`` whose body parsing is strict (set as ``app.router.route_class``)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict_handler
