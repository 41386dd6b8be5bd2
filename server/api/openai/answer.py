"""Non-streamed answers: wait for every choice, then one ``chat.completion`` or
``text_completion`` JSON body (streams: ``server/api/openai/sse.py``).

A client that drops the connection while waiting aborts all its choices in the engine
(``server/serving/collect.py``), so their slots are freed at once.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request
from fastapi.responses import Response

from mlxserve.server.api.openai.logprobs import ChatLogprobs
from mlxserve.server.api.openai.response_models import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    Completion,
    CompletionChoice,
    FunctionCall,
    ToolCall,
    Usage,
)
from mlxserve.server.api.openai.shapers import (
    ChatShaper,
    CompletionShaper,
    merge_completion_logprobs,
)
from mlxserve.server.serving.choices import Choices
from mlxserve.server.serving.collect import CLIENT_CLOSED, collect_unless_disconnected


async def complete_chat(
    choices: Choices, model: str, request: Request, make_shaper: Callable[[], ChatShaper]
) -> Response | ChatCompletion:
    """Wait for the whole chat completion (``stream=false``)."""
    results = await collect_unless_disconnected(choices, request)
    if results is None:
        return Response(status_code=CLIENT_CLOSED)
    out = []
    for index, result in enumerate(results):
        assert result.finish_reason in ("stop", "length"), result.finish_reason
        shaper = make_shaper()
        pieces = [shaper.piece(chunk) for chunk in result.chunks]
        content: str | None = "".join(p.content for p in pieces)
        reasoning = "".join(p.reasoning for p in pieces) if shaper.saw_reasoning else None
        logprobs = None
        if any(p.logprobs is not None for p in pieces):
            logprobs = ChatLogprobs(content=[lp for p in pieces for lp in p.logprobs or []])
        calls = [
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for p in pieces
            for c in p.tool_calls
        ]
        if calls and not content:
            content = None  # OpenAI: a message of tool calls only has null content
        message = AssistantMessage(
            content=content, reasoning_content=reasoning, tool_calls=calls or None
        )
        out.append(
            ChatChoice(
                index=index,
                message=message,
                logprobs=logprobs,
                finish_reason=shaper.finish_reason(result.finish_reason),
            )
        )
    return ChatCompletion(id=choices.id, model=model, choices=out, usage=Usage.of(choices.usage()))


async def complete_text(
    choices: Choices, model: str, request: Request, make_shaper: Callable[[], CompletionShaper]
) -> Response | Completion:
    """Wait for the whole text completion (``stream=false``)."""
    results = await collect_unless_disconnected(choices, request)
    if results is None:
        return Response(status_code=CLIENT_CLOSED)
    out = []
    for index, (gen, result) in enumerate(zip(choices.generations, results, strict=True)):
        assert result.finish_reason in ("stop", "length"), result.finish_reason
        shaper = make_shaper()
        pieces = [shaper.piece(gen, chunk) for chunk in result.chunks]
        out.append(
            CompletionChoice(
                index=index,
                text="".join(text for text, _ in pieces),
                logprobs=merge_completion_logprobs([lp for _, lp in pieces]),
                finish_reason=result.finish_reason,
            )
        )
    return Completion(id=choices.id, model=model, choices=out, usage=Usage.of(choices.usage()))
