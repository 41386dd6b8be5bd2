"""A Responses request -> its conversation, rendered prompt and neutral ``GenerationSpec``.

The conversation is the stored conversation of ``previous_response_id`` (if any) followed
by the request's input items; an ``item_reference`` stands for an item of that stored
conversation.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from mlxserve.scheduler.constraints import Constraint, GrammarSpec
from mlxserve.server.api.openai.responses.conversation import conversation_of, tool_plan_of
from mlxserve.server.api.openai.responses.items import input_items
from mlxserve.server.api.openai.responses.schemas import (
    ResponsesRequest,
    TextFormatJsonObject,
    TextFormatJsonSchema,
)
from mlxserve.server.api.openai.responses.store import StoredResponse
from mlxserve.server.config import ServerConfig
from mlxserve.server.http.errors import invalid_request
from mlxserve.server.models.served_model import ServedModel
from mlxserve.server.serving.cache_namespace import cache_namespace
from mlxserve.server.serving.chat_prompt import ChatPrompt, render_chat_prompt
from mlxserve.server.serving.reasoning_switch import reasoning_template_kwargs
from mlxserve.server.serving.spec import GenerationSpec, SamplingSpec


@dataclass(frozen=True)
class ResponseInput:
    """A request's input, resolved.

    Attributes:
        items: its own input items (references resolved), as the store lists them.
        conversation: the earlier conversation it continues, then ``items``.
    """

    items: tuple[dict[str, Any], ...]
    conversation: tuple[dict[str, Any], ...]


def new_response_id() -> str:
    """A response id, ``resp_`` + 32 random hex digits."""
    return "resp_" + uuid.uuid4().hex


def resolve_input(value: str | list[Any], previous: StoredResponse | None) -> ResponseInput:
    """The request's items after ``previous``'s conversation.

    Raises:
        APIError: 400 for a bad item, or a reference to an item not in that conversation.
    """
    earlier = previous.conversation if previous is not None else ()
    by_id = {item["id"]: item for item in earlier if "id" in item}
    items = []
    for i, item in enumerate(input_items(value)):
        if item["type"] == "item_reference":
            found = by_id.get(item["id"])
            if found is None:
                raise invalid_request(
                    f"input[{i}] refers to the item '{item['id']}', which is not in the "
                    "conversation of 'previous_response_id'.",
                    f"input[{i}].id",
                )
            item = found
        items.append(item)
    return ResponseInput(tuple(items), earlier + tuple(items))


def _constraints(body: ResponsesRequest) -> list[tuple[GrammarSpec, str]]:
    fmt = body.text_format
    if isinstance(fmt, TextFormatJsonSchema):
        return [(GrammarSpec("json_schema", json.dumps(fmt.schema_)), "text.format.schema")]
    if isinstance(fmt, TextFormatJsonObject):
        return [(GrammarSpec("json_object"), "text.format")]
    return []


async def prompt_of(
    model: ServedModel,
    body: ResponsesRequest,
    given: ResponseInput,
    config: ServerConfig | None = None,
) -> ChatPrompt:
    """Render the request's conversation, tools and text format for ``model`` (its images
    checked against ``config``'s limits and encoded).

    Raises:
        APIError: 400 for a conversation, tools or format that do not go together.
    """
    conversation = conversation_of(body.instructions, list(given.conversation))
    if not conversation:
        raise invalid_request("'input' must hold at least one item.", "input")
    tools = tool_plan_of(body, model.tool_format)
    effort = body.reasoning.effort if body.reasoning is not None else None
    switch = reasoning_template_kwargs(model.tokenizer, None, effort)
    return await render_chat_prompt(
        model, conversation, tools, _constraints(body), template_kwargs=switch, config=config
    )


def generation_spec(
    body: ResponsesRequest,
    prompt: ChatPrompt,
    constraint: Constraint | None,
    response_id: str,
    tenant: str | None = None,
) -> GenerationSpec:
    """The spec of a Responses request whose prompt is ``prompt``, sent by ``tenant``."""
    return GenerationSpec(
        kind="resp",
        prompt_ids=prompt.ids,
        prompt_param="input",
        max_tokens=body.max_output_tokens,
        sampling=SamplingSpec(temperature=body.temperature, top_p=body.top_p),
        constraint=constraint,
        response_id=response_id,
        cache_namespace=cache_namespace(tenant, None),
        images=prompt.images,
    )
