"""Tools offered to a model, and what they mean for one request (``ToolPlan``).

Every protocol adapter converts its tool fields into ``ToolSpec``s and a ``ToolChoice``:

- ``"auto"`` (the default with tools): the tools are offered in the prompt and the output
  is parsed for calls in the server's format (``--tool-parser``).
- ``"none"``: the tools are not offered and nothing is parsed (the model cannot call).
- ``"required"`` / ``NamedTool(name)``: constrained decoding. A Lark grammar (llguidance's
  dialect, ``%json`` rules holding each tool's parameters schema) lets the model write
  only calls in the default ``<tool_call>`` format, to one of the tools (required) or to
  the named one, so a call always parses and its arguments validate. ``parallel`` (default
  true) allows several calls for ``required``; a named tool is called once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from mlxserve.scheduler.constraints import JSON_STYLE, GrammarSpec
from mlxserve.server.http.errors import invalid_request
from mlxserve.server.serving.tool_parsers import ToolFormat, hermes_format
from mlxserve.server.serving.tool_prompt import TOOL_CALL_END, TOOL_CALL_START

# A function without ``parameters`` takes none (OpenAI).
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolSpec:
    """One function tool.

    Attributes:
        name: the function's name.
        description: what it does (shown to the model).
        parameters: the JSON schema of its arguments (None: it takes none).
        strict: the client asked for strict schema adherence.
        param: the request field holding the schema, named when it does not compile.
    """

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    param: str = "tools"

    def template_dict(self) -> dict[str, Any]:
        """The tool as chat templates (and OpenAI) write it."""
        function: dict[str, Any] = {"name": self.name}
        for key in ("description", "parameters", "strict"):
            if getattr(self, key) is not None:
                function[key] = getattr(self, key)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class NamedTool:
    """``tool_choice`` naming the one tool to call."""

    name: str


ToolChoice = Literal["none", "auto", "required"] | NamedTool


@dataclass(frozen=True)
class ToolPlan:
    """What the tools of one request do.

    Attributes:
        prompt_tools: the tools to render into the prompt (None: none offered).
        parse: parse the output for calls in this format (None: no parsing).
        parallel: keep several calls of one answer.
        call_rules: Lark rules whose ``calls`` matches calls to the tools (None: no tools).
        constrained: the output must be ``calls`` (``required`` or a named function).
        schemas: each tool's parameters schema and its field, to name the one at fault
            when a grammar does not compile.
    """

    prompt_tools: list[dict[str, Any]] | None = None
    parse: ToolFormat | None = None
    parallel: bool = True
    call_rules: str | None = None
    constrained: bool = False
    schemas: tuple[tuple[GrammarSpec, str], ...] = ()

    def grammar(self) -> GrammarSpec | None:
        """The constraint for ``required`` / a named function (None: unconstrained)."""
        if not self.constrained or self.call_rules is None:
            return None
        return GrammarSpec("lark", "start: calls\n" + self.call_rules)


def plan_tools(
    tools: list[ToolSpec] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
    default_format: ToolFormat,
) -> ToolPlan:
    """Resolve a request's tool fields.

    Args:
        tools: the tools offered.
        tool_choice: which may be called (None: "auto" with tools, "none" without).
        parallel_tool_calls: several calls per answer (None: yes).
        default_format: the server's format for unconstrained calls (``--tool-parser``).

    Raises:
        APIError: 400 for duplicate tool names, or a ``tool_choice`` that needs tools
            which are not there.
    """
    tools = tools or []
    names = [t.name for t in tools]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise invalid_request(f"'tools' must have unique names; '{duplicate}' repeats.", "tools")
    choice = tool_choice or ("auto" if tools else "none")
    if not tools:
        if choice in ("auto", "none"):
            return ToolPlan()
        raise invalid_request("'tool_choice' needs 'tools' to choose from.", "tool_choice")
    if choice == "none":
        return ToolPlan()
    dicts = [t.template_dict() for t in tools]
    parallel = parallel_tool_calls is not False
    schemas = tuple(
        (GrammarSpec("json_schema", json.dumps(parameters_schema(t))), t.param) for t in tools
    )
    if choice == "auto":
        rules = tool_calls_rules(tools, parallel)
        return ToolPlan(dicts, default_format, parallel, rules, schemas=schemas)
    if isinstance(choice, NamedTool):
        chosen = [t for t in tools if t.name == choice.name]
        if not chosen:
            raise invalid_request(
                f"'tool_choice' names the function '{choice.name}', which is not in 'tools'.",
                "tool_choice",
            )
        rules, parallel = tool_calls_rules(chosen, parallel=False), False
    else:
        rules = tool_calls_rules(tools, parallel)
    # Constrained calls are written in the default format, whatever the model's own.
    return ToolPlan(dicts, hermes_format(), parallel, rules, True, schemas)


def _lark_literal(text: str) -> str:
    return json.dumps(text)


def parameters_schema(tool: ToolSpec) -> dict[str, Any]:
    """The schema the call's arguments follow, in OpenAI's compact JSON style."""
    schema = dict(tool.parameters or NO_PARAMETERS)
    schema.setdefault("x-guidance", JSON_STYLE)
    return schema


def tool_calls_rules(tools: list[ToolSpec], parallel: bool) -> str:
    """Lark rules (llguidance's dialect) whose ``calls`` is one call (or, ``parallel``, one
    or more separated by newlines) to one of ``tools``, in the ``<tool_call>`` format."""
    rules = []
    tail = _lark_literal("}\n" + TOOL_CALL_END)
    for i, tool in enumerate(tools):
        head = TOOL_CALL_START + '\n{"name": ' + json.dumps(tool.name) + ', "arguments": '
        schema = json.dumps(parameters_schema(tool))
        rules.append(f"call_{i}: {_lark_literal(head)} %json {schema} {tail}")
    alternatives = " | ".join(f"call_{i}" for i in range(len(tools)))
    calls = 'calls: call ("\\n" call)*' if parallel else "calls: call"
    return "\n".join([calls, f"call: {alternatives}", *rules]) + "\n"
