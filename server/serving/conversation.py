"""A conversation -> the prompt the model's chat template makes of it.

A conversation is a list of messages as chat templates expect them (``{"role", "content",
"name"?, "tool_calls"?, "reasoning_content"?, "tool_call_id"?}``); each protocol adapter
builds it from its own message shapes. Rendering follows vLLM's extensions:
``add_generation_prompt`` (default true) opens the assistant's turn;
``continue_final_message`` (or ``add_generation_prompt: false`` after an assistant message)
leaves the final assistant message open so that the model continues it; template kwargs
are extra template variables (e.g. ``enable_thinking``). Text of the client's that spells a
special token stays plain text (``special_tokens.py``).
"""

from __future__ import annotations

from typing import Any

import jinja2

from mlxserve.server.http.errors import APIError, invalid_request
from mlxserve.server.serving.special_tokens import SpecialTokenGuard
from mlxserve.server.serving.tool_prompt import (
    hermes_messages,
    template_supports_tools,
    tool_results_as_user,
)

# Template variables a request may not set through chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "return_tensors",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
    }
)


def continuation_mode(
    last_role: str,
    add_generation_prompt: bool | None,
    continue_final_message: bool,
) -> tuple[bool, bool]:
    """Resolve ``(add_generation_prompt, continue_final_message)`` as vLLM does, with
    ``add_generation_prompt: false`` after a final assistant message meaning "continue it".

    Raises:
        APIError: 400 when both are asked, or a continuation without a final assistant
            message.
    """
    last_is_assistant = last_role == "assistant"
    if continue_final_message:
        if add_generation_prompt:
            raise invalid_request(
                "'continue_final_message' and 'add_generation_prompt' cannot both be true.",
                param="continue_final_message",
            )
        if not last_is_assistant:
            raise invalid_request(
                "'continue_final_message' needs the last message to be an assistant message.",
                param="continue_final_message",
            )
        return False, True
    if add_generation_prompt is None:
        return True, False
    return add_generation_prompt, (not add_generation_prompt and last_is_assistant)


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """Raises: APIError 400 for a ``chat_template_kwargs`` key the server sets itself."""
    kwargs = dict(kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise invalid_request(
            f"'chat_template_kwargs' may not set {reserved[0]!r}.", param="chat_template_kwargs"
        )
    return kwargs


def render_chat(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    add_special_tokens: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[str, list[int]]:
    """Render ``conversation`` with the model's chat template.

    ``tools`` (OpenAI tool dicts) go to a template that knows tools; for one that does not,
    the tools, the assistant's tool calls and the tool results are written into the
    messages in the default format (``server/serving/tool_prompt.py``), and a template refusing the
    ``tool`` role gets tool results as user messages.

    Returns:
        ``(prompt text, prompt token ids)``; the ids are the text encoded without added
        special tokens unless ``add_special_tokens`` (what HF's ``tokenize=True`` does).

    Raises:
        APIError: 400 if the model has no chat template or the template rejects the
            conversation (e.g. roles that do not alternate).
    """
    if not getattr(tokenizer, "has_chat_template", True):
        raise invalid_request(
            "This model has no chat template; use /v1/completions instead.",
            param="messages",
            code="no_chat_template",
        )
    kwargs = check_template_kwargs(template_kwargs)
    if continue_final_message:
        # Only when asked: custom renderers (mlx-lm's chat_template callables) may not take it.
        kwargs["continue_final_message"] = True
    attempts = [conversation]
    if template_supports_tools(tokenizer):
        if tools:
            kwargs["tools"] = tools
    else:
        conversation = hermes_messages(conversation, tools)
        attempts = [conversation, tool_results_as_user(conversation)]
        if attempts[1] == conversation:
            attempts.pop()
    # Special-token text of the client's becomes plain text (server/serving/special_tokens.py).
    guard = SpecialTokenGuard(tokenizer, [attempts, kwargs])
    for attempt, conversation in enumerate(attempts):
        try:
            text = tokenizer.apply_chat_template(
                guard.mask(conversation),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **guard.mask(kwargs),
            )
            break
        except APIError:
            raise
        except (
            jinja2.TemplateError,
            ValueError,
            TypeError,
            KeyError,
            IndexError,
            RecursionError,
        ) as e:
            if attempt + 1 < len(attempts):
                continue
            message = f"The chat template rejected the messages: {e}"
            raise invalid_request(message, "messages") from e
    if not isinstance(text, str):
        raise invalid_request("The chat template did not render one prompt.", "messages")
    ids = guard.encode(text, add_special_tokens=add_special_tokens)
    return guard.restore(text), ids
