"""Anthropic's message content blocks, as pydantic models.

Served: ``text``, ``image`` (user messages; a ``base64`` source, or a ``url`` one that
the server fetches only with ``--allow-image-urls``), ``tool_use``, ``tool_result``
(content a string or text blocks, ``is_error``), ``thinking`` and ``redacted_thinking``
(replayed from earlier answers). The other block types the SDK defines (``document``,
``search_result``, server tool blocks, ...) are a 400 naming the block; unknown types
too. Fields the SDK defines that mean nothing here (``cache_control``, ``citations``,
``caller``, ``toolset_name``) are accepted and ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(_Model):
    """Prompt-cache breakpoints: the prefix cache is automatic here, so they change nothing."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Model):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None


class ToolUseBlock(_Model):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class Base64ImageSource(_Model):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class URLImageSource(_Model):
    type: Literal["url"]
    url: str


class ImageBlock(_Model):
    type: Literal["image"]
    source: Annotated[Base64ImageSource | URLImageSource, Field(discriminator="type")]
    cache_control: CacheControl | None = None


def text_blocks(value: Any) -> Any:
    """A string given where text blocks go, as one text block (so that errors in blocks
    are located at the block, not at a union branch)."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


class ToolResultBlock(_Model):
    type: Literal["tool_result"]
    tool_use_id: str
    content: list[TextBlock] = []
    is_error: bool = False
    cache_control: CacheControl | None = None
    toolset_name: str | None = None

    _content = field_validator("content", mode="before")(text_blocks)

    def text(self) -> str:
        """The result as text (text blocks joined with newlines), marked when an error."""
        text = "\n".join(block.text for block in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(_Model):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(_Model):
    """Encrypted reasoning of Anthropic's models: nothing a local model can read."""

    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]

_SERVED = frozenset({"text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"})
# Defined by Anthropic, not served (yet): named in the error.
_UNSERVED = {
    "document": "document blocks are not supported",
    "search_result": "search_result blocks are not supported",
    "container_upload": "container_upload blocks need Anthropic's code execution",
}


def check_block_types(value: Any) -> Any:
    """A message's ``content`` as blocks (a string is one text block), their types checked
    before pydantic parses them, so that an unsupported block gets a sentence naming it
    (not a list of the expected tags)."""
    value = text_blocks(value)
    if not isinstance(value, list):
        raise ValueError("'content' must be a string or a list of content blocks.")
    for i, block in enumerate(value):
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str):
            raise ValueError(f"content[{i}] must be an object with a 'type'.")
        if kind in _SERVED:
            continue
        if kind in _UNSERVED:
            raise ValueError(f"content[{i}] is a '{kind}' block: {_UNSERVED[kind]}.")
        if kind.endswith("_tool_result") or kind == "server_tool_use":
            raise ValueError(
                f"content[{i}] is a '{kind}' block: server tools run on Anthropic's servers; "
                "this server has client tools only."
            )
        raise ValueError(f"content[{i}] has the unknown block type '{kind}'.")
    return value
