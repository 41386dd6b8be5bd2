"""An Anthropic request -> its rendered prompt and the neutral ``GenerationSpec``.

``count_tokens`` and a real call render through ``prompt_of``, so the count is the
prompt the call runs (chat template, tools and all).
"""

from __future__ import annotations

import json
import uuid

from mlxserve.scheduler.constraints import Constraint, GrammarSpec
from mlxserve.server.api.anthropic.conversation import conversation_of, tool_plan_of
from mlxserve.server.api.anthropic.schemas import CountTokensRequest, MessagesRequest
from mlxserve.server.config import ServerConfig
from mlxserve.server.models.served_model import ServedModel
from mlxserve.server.serving.cache_namespace import cache_namespace
from mlxserve.server.serving.chat_prompt import ChatPrompt, render_chat_prompt
from mlxserve.server.serving.reasoning_switch import reasoning_template_kwargs
from mlxserve.server.serving.spec import GenerationSpec, SamplingSpec


async def prompt_of(
    model: ServedModel, body: CountTokensRequest, config: ServerConfig | None = None
) -> ChatPrompt:
    """Render the request's conversation, tools and output format for ``model`` (its
    images checked against ``config``'s limits and encoded).

    Raises:
        APIError: 400 for a conversation, tools or format that do not go together.
    """
    conversation, prefill = conversation_of(body)
    tools = tool_plan_of(body, model.tool_format)
    constraints = []
    output = body.output_config
    if output is not None and output.format is not None:
        schema = json.dumps(output.format.schema_)
        constraints.append((GrammarSpec("json_schema", schema), "output_config.format.schema"))
    effort = output.effort if output is not None else None
    switch = reasoning_template_kwargs(model.tokenizer, body.thinking_enabled(), effort)
    return await render_chat_prompt(
        model,
        conversation,
        tools,
        constraints,
        continue_final_message=prefill,
        template_kwargs=switch,
        config=config,
    )


def new_message_id() -> str:
    """An Anthropic-style message id, ``msg_`` + 24 random characters."""
    return "msg_" + uuid.uuid4().hex[:24]


def generation_spec(
    body: MessagesRequest,
    prompt: ChatPrompt,
    constraint: Constraint | None,
    tenant: str | None = None,
) -> GenerationSpec:
    """The spec of a Messages request whose prompt is ``prompt``, sent by ``tenant``."""
    return GenerationSpec(
        kind="msg",
        prompt_ids=prompt.ids,
        prompt_param="messages",
        max_tokens=body.max_tokens,
        stop=list(body.stop_sequences or []),
        sampling=SamplingSpec(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k),
        constraint=constraint,
        response_id=new_message_id(),
        cache_namespace=cache_namespace(tenant, None),
        images=prompt.images,
    )
