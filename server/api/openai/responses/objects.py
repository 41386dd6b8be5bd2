"""What the Responses routes send: the ``response`` object and its output items, from the
neutral pieces.

Output items from the answer's blocks (``server/serving/output_blocks.py``): ``reasoning``
(its text as one ``reasoning_text`` part), ``message`` (one ``output_text`` part), and
``function_call`` (``call_id``, ``name``, ``arguments``). Status: ``completed``;
``incomplete`` with ``incomplete_details.reason: "max_output_tokens"`` when the token budget
(or the context) ran out; ``failed`` with ``error`` when generation failed mid-stream.
Usage: ``input_tokens`` (the whole prompt), ``input_tokens_details.cached_tokens`` (served by
the prefix cache), ``output_tokens``, ``output_tokens_details.reasoning_tokens``.
"""

from __future__ import annotations

import time
from typing import Any

from mlxserve.server.api.openai.responses.items import new_item_id
from mlxserve.server.api.openai.responses.schemas import ResponsesRequest
from mlxserve.server.serving.output_blocks import Block
from mlxserve.server.serving.usage import UsageCounts

_PREFIXES = {"reasoning": "rs", "text": "msg", "tool_call": "fc"}


class ItemIds:
    """The output item ids of one answer's blocks, each given on first use."""

    def __init__(self) -> None:
        self.ids: dict[int, str] = {}

    def of(self, block: Block) -> str:
        if block.index not in self.ids:
            self.ids[block.index] = new_item_id(_PREFIXES[block.kind])
        return self.ids[block.index]


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def output_item(block: Block, item_id: str, status: str, started: bool = False) -> dict[str, Any]:
    """The block as an output item (``started``: as ``output_item.added`` opens it)."""
    if block.kind == "reasoning":
        content = [] if started else [{"type": "reasoning_text", "text": block.text}]
        return {
            "type": "reasoning",
            "id": item_id,
            "summary": [],
            "content": content,
            "status": status,
        }
    if block.kind == "text":
        return {
            "type": "message",
            "id": item_id,
            "role": "assistant",
            "status": status,
            "content": [] if started else [text_part(block.text)],
        }
    assert block.call is not None
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": block.call.id,
        "name": block.call.name,
        "arguments": "" if started else block.call.arguments,
        "status": status,
    }


def usage(counts: UsageCounts, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": counts.prompt_tokens,
        "input_tokens_details": {"cached_tokens": counts.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": counts.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": counts.total_tokens,
    }


class ResponseShape:
    """The request-dependent part of every response object of one request.

    Args:
        response_id: the response's id.
        model: the served model's name.
        body: the request.
    """

    def __init__(self, response_id: str, model: str, body: ResponsesRequest) -> None:
        self.id = response_id
        self.created_at = int(time.time())
        fmt = body.text_format.model_dump(by_alias=True, exclude_none=True)
        tool_choice = body.tool_choice or "auto"
        if not isinstance(tool_choice, str):
            tool_choice = tool_choice.model_dump()
        reasoning = body.reasoning
        self._echo: dict[str, Any] = {
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": None,
            "metadata": body.metadata or {},
            "model": model,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {
                "effort": reasoning.effort if reasoning else None,
                "summary": reasoning.summary if reasoning else None,
            },
            "store": body.store,
            "temperature": body.temperature if body.temperature is not None else 1.0,
            "text": {"format": fmt, "verbosity": (body.text and body.text.verbosity) or "medium"},
            "tool_choice": tool_choice,
            "tools": [t.echo() for t in body.tools or []],
            "top_p": body.top_p if body.top_p is not None else 1.0,
            "truncation": "disabled",
            "user": body.user,
            "background": False,
            "service_tier": "default",
        }

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The response object in ``status``."""
        done = status not in ("in_progress", "queued")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if status == "completed" else None,
            "status": status,
            "error": error,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "output": output,
            "usage": usage if done else None,
            **self._echo,
        }
