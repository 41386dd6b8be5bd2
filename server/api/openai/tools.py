"""OpenAI's tool fields: ``tools`` (function tools), ``tool_choice`` and
``parallel_tool_calls``, as pydantic models, converted into the neutral ``ToolSpec`` and
``ToolChoice`` (``server/serving/tool_plan.py``) that decide what the tools do.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mlxserve.server.serving.tool_parsers import ToolFormat
from mlxserve.server.serving.tool_plan import NamedTool, ToolPlan, ToolSpec
from mlxserve.server.serving.tool_plan import ToolChoice as NeutralToolChoice
from mlxserve.server.serving.tool_plan import plan_tools as plan_neutral_tools

# OpenAI's pattern, with dots allowed too (namespaced tools).
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_.-]{1,64}$"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDefinition(_Model):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Model):
    type: Literal["function"]
    function: FunctionDefinition

    def spec(self, index: int = 0) -> ToolSpec:
        """The neutral tool (``index``: its place in ``tools``, named in errors)."""
        f = self.function
        param = f"tools[{index}].function.parameters"
        return ToolSpec(f.name, f.description, f.parameters, f.strict, param)

    def template_dict(self) -> dict[str, Any]:
        """The tool as chat templates (and OpenAI) write it."""
        return self.spec().template_dict()


class ToolChoiceFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def plan_tools(
    tools: list[ToolDefinition] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
    default_format: ToolFormat,
) -> ToolPlan:
    """The tool plan of an OpenAI chat request (``server/serving/tool_plan.py``).

    Raises:
        APIError: 400 for duplicate tool names, or a ``tool_choice`` that needs tools
            which are not there.
    """
    specs = [t.spec(i) for i, t in enumerate(tools or [])]
    choice: NeutralToolChoice | None
    if isinstance(tool_choice, NamedToolChoice):
        choice = NamedTool(tool_choice.function.name)
    else:
        choice = tool_choice
    return plan_neutral_tools(specs, choice, parallel_tool_calls, default_format)
