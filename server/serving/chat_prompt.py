"""A conversation request's prompt: the conversation, its tools and its output constraint,
rendered the one way every chat-like protocol shares.

The Anthropic Messages and OpenAI Responses adapters build a conversation
(``server/serving/conversation.py``), a ``ToolPlan`` and the constraints their fields ask
for, and get back the prompt text and tokens, the tool plan as the constraint leaves it,
and the constraint to compile. Counting a request's tokens (Anthropic's ``count_tokens``)
goes through the same function, so the count is the prompt a real call would run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from mlxserve.scheduler.constraints import GrammarSpec
from mlxserve.scheduler.multimodal import MultimodalPrompt
from mlxserve.server.config import ServerConfig
from mlxserve.server.serving.conversation import render_chat
from mlxserve.server.serving.images import prepare_images, take_images
from mlxserve.server.serving.offload import offload
from mlxserve.server.serving.output_constraint import OutputConstraint, request_constraint
from mlxserve.server.serving.reasoning import prompt_opens_reasoning
from mlxserve.server.serving.tool_plan import ToolPlan


class ChatTarget(Protocol):
    """The model a conversation is rendered for (``ServedModel`` is one)."""

    reasoning: bool

    @property
    def tokenizer(self) -> Any: ...

    @property
    def vision(self) -> Any: ...

    def check_text_fits(self, text: Any, param: str) -> None: ...


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation request.

    Attributes:
        text: the prompt text.
        ids: its tokens.
        tools: the tool plan (parsing the default format when calls are constrained).
        constraint: the one output constraint to compile (None: unconstrained).
        in_reasoning: the prompt opened the model's reasoning (the output starts in it).
        images: the prompt's images, encoded, with ``ids`` expanded over their
            placeholders (None: no images).
    """

    text: str
    ids: list[int]
    tools: ToolPlan
    constraint: OutputConstraint | None
    in_reasoning: bool
    images: MultimodalPrompt | None = None


async def render_chat_prompt(
    target: ChatTarget,
    conversation: list[dict[str, Any]],
    tools: ToolPlan,
    constraints: list[tuple[GrammarSpec, str]],
    *,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    config: ServerConfig | None = None,
) -> ChatPrompt:
    """Render ``conversation`` for ``target`` with its tools and constraints, on a worker
    thread (``offload.py``), after refusing text that cannot fit the context.

    Args:
        target: the model.
        conversation: the messages as chat templates take them.
        tools: the request's tool plan.
        constraints: the constraints its fields ask for, each with its field.
        continue_final_message: leave the final assistant message open (prefill) instead
            of opening a new assistant turn.
        template_kwargs: extra template variables (e.g. the reasoning switch).
        config: the server's image limits (``serving/images.py``; None: the defaults).

    Raises:
        APIError: 400 for a template that rejects the conversation, constraints that do
            not go together, or images the model or the limits refuse.
    """
    constraint, tools = request_constraint(constraints, tools)
    conversation, sources = take_images(conversation)
    target.check_text_fits([conversation, tools.prompt_tools], "messages")
    text, ids = await offload(
        render_chat,
        target.tokenizer,
        conversation,
        add_generation_prompt=not continue_final_message,
        continue_final_message=continue_final_message,
        template_kwargs=template_kwargs,
        tools=tools.prompt_tools,
    )
    ids, images = await prepare_images(target.vision, ids, sources, config or ServerConfig())
    in_reasoning = target.reasoning and prompt_opens_reasoning(text)
    return ChatPrompt(text, ids, tools, constraint, in_reasoning, images)
