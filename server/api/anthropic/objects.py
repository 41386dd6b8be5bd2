"""What the Anthropic routes send: the ``message`` object and its parts, from neutral pieces.

- content blocks from the answer's blocks (``server/serving/output_blocks.py``):
  ``thinking`` (signature empty: a local model signs nothing), ``text``, ``tool_use``
  (``id`` ``toolu_...``, ``input`` the parsed arguments);
- ``stop_reason``: ``max_tokens`` (the budget or the context ran out), ``tool_use`` (a
  stop after a call), ``stop_sequence`` (with ``stop_sequence``), else ``end_turn``;
- ``usage`` as Anthropic counts it: ``input_tokens`` are the prompt tokens not read from
  the cache, ``cache_read_input_tokens`` those the prefix cache served (their sum is the
  prompt, what ``count_tokens`` returns), ``cache_creation_input_tokens`` 0 (caching is
  automatic and free).
"""

from __future__ import annotations

import json
from typing import Any

from mlxserve.server.serving.output_blocks import Block
from mlxserve.server.serving.tool_stream import ParsedCall
from mlxserve.server.serving.usage import UsageCounts


def tool_use_id(call: ParsedCall) -> str:
    """The call's id in Anthropic's style (``toolu_`` instead of ``call_``)."""
    return "toolu_" + call.id.removeprefix("call_")


def block_start(block: Block) -> dict[str, Any]:
    """The block as ``content_block_start`` opens it (empty text, input ``{}``)."""
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": "", "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": ""}
    assert block.call is not None
    return {"type": "tool_use", "id": tool_use_id(block.call), "name": block.call.name, "input": {}}


def content_block(block: Block) -> dict[str, Any]:
    """The whole block, as a non-streamed message holds it."""
    out = block_start(block)
    if block.kind == "reasoning":
        out["thinking"] = block.text
    elif block.kind == "text":
        out["text"] = block.text
    else:
        assert block.call is not None
        out["input"] = json.loads(block.call.arguments)
    return out


def stop_reason(finish_reason: str, made_calls: bool, stop_string: str | None) -> str:
    """Anthropic's stop reason of an answer that finished with ``finish_reason``."""
    if finish_reason == "length":
        return "max_tokens"
    if made_calls:
        return "tool_use"
    return "stop_sequence" if stop_string is not None else "end_turn"


def usage(counts: UsageCounts) -> dict[str, int]:
    """The ``usage`` object."""
    return {
        "input_tokens": counts.prompt_tokens - counts.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": counts.cached_tokens,
        "output_tokens": counts.completion_tokens,
    }


def message(
    message_id: str,
    model: str,
    content: list[dict[str, Any]],
    reason: str | None,
    stop_sequence: str | None,
    counts: UsageCounts,
) -> dict[str, Any]:
    """The ``message`` object (``reason`` None: still streaming)."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": stop_sequence if reason == "stop_sequence" else None,
        "usage": usage(counts),
    }
