"""Tool-call formats: the markers around a call in the model's output and the parser of what
is between them.

The parsers are mlx-lm's (``mlx_lm/tool_parsers/<name>.py``: ``json_tools``, ``mistral``,
``pythonic``, ``qwen3_coder``, ``glm47``, ...), each a module with ``tool_call_start``,
``tool_call_end`` and ``parse_tool_call(text, tools)``. ``hermes`` is our name for the
default format (mlx-lm's ``json_tools``)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``--tool-parser auto`` (the default) takes the parser mlx-lm attaches to the model's
tokenizer (from its ``tokenizer_config.json`` or inferred from its chat template), else
``hermes``. Names are checked at start-up (``ServerConfig``) without importing mlx-lm.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

AUTO = "auto"
HERMES = "hermes"
# Our name -> mlx-lm's module name.
_ALIASES = {HERMES: "json_tools"}

ParseFn = Callable[[str, Any], Any]


@dataclass(frozen=True)
class ToolFormat:
    """How tool calls look in the output.

    Attributes:
        name: the parser's name (``hermes``, ``mistral``, ...).
        start: the text that opens a call (or a block of calls).
        end: the text that closes it; "" when the call runs to the end of the output.
        parse: ``parse(text between the markers, tools)`` -> a call ``{"name",
            "arguments"}`` or a list of them; raises ValueError if the text is no call.
    """

    name: str
    start: str
    end: str
    parse: ParseFn


def _mlx_lm_parser_dir() -> str | None:
    # find_spec of a top-level package locates it without importing it (no mlx.core yet).
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], "tool_parsers")


def tool_parser_names() -> list[str]:
    """Every name ``--tool-parser`` accepts: auto, hermes, and mlx-lm's parsers."""
    names = {AUTO, HERMES}
    folder = _mlx_lm_parser_dir()
    if folder and os.path.isdir(folder):
        names.update(
            f[:-3] for f in os.listdir(folder) if f.endswith(".py") and not f.startswith("_")
        )
    return sorted(names)


def check_tool_parser_name(name: str) -> None:
    """Raises: ValueError naming the known parsers when ``name`` is not one of them."""
    names = tool_parser_names()
    if name not in names:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(names)}")


def _from_module(name: str) -> ToolFormat:
    module = importlib.import_module(f"mlx_lm.tool_parsers.{_ALIASES.get(name, name)}")
    return ToolFormat(name, module.tool_call_start, module.tool_call_end, module.parse_tool_call)


def hermes_format() -> ToolFormat:
    """The default format (``<tool_call>`` JSON ``</tool_call>``)."""
    return _from_module(HERMES)


def resolve_tool_format(name: str, tokenizer: Any) -> ToolFormat:
    """The format of ``--tool-parser name`` for a model served with ``tokenizer``.

    Raises:
        ValueError: the name is unknown.
    """
    check_tool_parser_name(name)
    if name != AUTO:
        return _from_module(name)
    parse = getattr(tokenizer, "tool_parser", None)
    start = getattr(tokenizer, "tool_call_start", None)
    if parse is not None and start:
        own = str(getattr(parse, "__module__", "model")).rsplit(".", 1)[-1]
        own = HERMES if own == _ALIASES[HERMES] else own
        return ToolFormat(own, start, getattr(tokenizer, "tool_call_end", None) or "", parse)
    return hermes_format()
