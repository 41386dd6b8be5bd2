"""A request's output constraint: one grammar from the fields that ask for one, combined
with its tools, compiled once before the response starts.

Adapters find the constraints their request asks for (a JSON schema, any JSON object, a
regex, a Lark grammar, a choice of strings), each with the field it came from; here they
become the request's one ``OutputConstraint`` (more than one is a 400). With tools offered
(``tool_choice: "auto"``) a JSON or choice constraint becomes "a tool call or an answer in
the format"; a ``required`` / named tool choice is itself a constraint, so it does not
combine with these. The grammar is compiled off the event loop before anything is sent, so
a bad schema, regex or grammar is a 400 that names its field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from mlxserve.scheduler.client import EngineClient
from mlxserve.scheduler.constraints import (
    JSON_STYLE,
    Constraint,
    GrammarSpec,
    GrammarUnsatisfiable,
)
from mlxserve.server.http.errors import invalid_request
from mlxserve.server.serving.offload import offload
from mlxserve.server.serving.tool_parsers import hermes_format
from mlxserve.server.serving.tool_plan import ToolPlan


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


def request_constraint(
    found: list[tuple[GrammarSpec, str]], plan: ToolPlan
) -> tuple[OutputConstraint | None, ToolPlan]:
    """The one constraint of a request (None: none), and the tool plan (which parses the
    default format when calls are constrained together with an answer format).

    Args:
        found: the constraints the request's fields ask for, each with its field.
        plan: the request's tool plan.

    Raises:
        APIError: 400 for more than one constraint, or one that cannot go with tools.
    """
    found = list(found)
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


async def compile_constraint(engine: EngineClient, constraint: OutputConstraint) -> Constraint:
    """Compile the constraint, once, off the event loop (the first use builds the model's
    grammar compiler); when it fails, its parts alone, so that the error names the one at
    fault.

    Returns:
        the compiled matcher of the request's first choice (``copy()`` it for the others).

    Raises:
        APIError: 400 naming the field at fault, with llguidance's reason (code
            ``grammar_unsatisfiable`` for a grammar that matches no text).
    """
    spec, param, suspects = constraint.spec, constraint.param, constraint.suspects

    def compile_all() -> Constraint | tuple[ValueError, str]:
        try:
            return engine.compile_grammar(spec)
        except ValueError as e:
            failure = (e, param)
        for part, part_param in suspects:
            try:
                engine.compile_grammar(part)
            except ValueError as e:
                return e, part_param
        return failure

    compiled = await offload(compile_all)
    if isinstance(compiled, tuple):
        error, at = compiled
        code = "grammar_unsatisfiable" if isinstance(error, GrammarUnsatisfiable) else None
        raise invalid_request(f"Invalid '{at}': {error}", param=at, code=code)
    return compiled
