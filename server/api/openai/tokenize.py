"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes.

Tokenize a completion prompt::

    {"model"?: str, "prompt": str, "add_special_tokens": true, "return_token_strs": false}

or a chat conversation as the chat route renders it (the same template and options)::

    {"model"?: str, "messages": [...], "add_generation_prompt"?: bool,
     "continue_final_message": false, "chat_template_kwargs"?: {...}, "tools"?: [...],
     "add_special_tokens": false, "return_token_strs": false}

-> ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs``: the tokenizer's
pieces, when asked; otherwise null).

Detokenize ``{"model"?: str, "tokens": [int, ...]}`` -> ``{"prompt": str}`` (special tokens
kept, so a rendered chat prompt comes back as its template text). Ids outside the
vocabulary are refused with 400 before they reach the tokenizer.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, field_validator

from mlxserve.server.api.openai.messages import ChatMessage, conversation_of
from mlxserve.server.api.openai.tools import ToolDefinition
from mlxserve.server.http.errors import invalid_request
from mlxserve.server.models.registry import ModelRegistry
from mlxserve.server.models.served_model import ServedModel
from mlxserve.server.serving.conversation import continuation_mode, render_chat
from mlxserve.server.serving.images import take_images
from mlxserve.server.serving.offload import offload


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizeRequest(_Model):
    """Either ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]

    @field_validator("tokens", mode="before")
    @classmethod
    def _ints(cls, value: Any) -> Any:
        if isinstance(value, list) and any(isinstance(t, bool) for t in value):
            raise ValueError("token ids must be integers.")
        return value


class DetokenizeResponse(BaseModel):
    prompt: str


def _tokenize(ctx: ServedModel, body: TokenizeRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise invalid_request("Send exactly one of 'prompt' and 'messages'.", param="prompt")
    if body.prompt is not None:
        for name in ("add_generation_prompt", "chat_template_kwargs", "tools"):
            if getattr(body, name) is not None:
                raise invalid_request(f"'{name}' applies to 'messages' only.", param=name)
        if body.continue_final_message:
            raise invalid_request(
                "'continue_final_message' applies to 'messages' only.",
                param="continue_final_message",
            )
        special = True if body.add_special_tokens is None else body.add_special_tokens
        return [int(t) for t in ctx.tokenizer.encode(body.prompt, add_special_tokens=special)]
    assert body.messages is not None
    add_generation_prompt, continue_final = continuation_mode(
        body.messages[-1].role, body.add_generation_prompt, body.continue_final_message
    )
    conversation, images = take_images(conversation_of(body.messages))
    if images:
        raise invalid_request(
            "/tokenize does not take images: their token counts come from the vision "
            "encoder; see the usage of a chat request.",
            images[0].param,
        )
    _, ids = render_chat(
        ctx.tokenizer,
        conversation,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final,
        template_kwargs=body.chat_template_kwargs,
        add_special_tokens=bool(body.add_special_tokens),
        tools=[t.template_dict() for t in body.tools] if body.tools else None,
    )
    return ids


def add_tokenize_routes(app: FastAPI, models: ModelRegistry) -> None:
    """Register ``/tokenize`` and ``/detokenize`` on ``app`` (``model`` names one of
    ``models``; without it, the default model)."""

    def name_of(requested: str | None) -> str:
        return models.default().name if requested is None else requested

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        async with models.use(name_of(body.model), task=None) as c:
            ids = await offload(_tokenize, c, body)
        strs = None
        if body.return_token_strs:
            strs = [str(s) for s in c.tokenizer.convert_ids_to_tokens(ids)]
        return TokenizeResponse(
            count=len(ids), max_model_len=c.context_length, tokens=ids, token_strs=strs
        )

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        c = await models.acquire(name_of(body.model))
        models.release(c)  # only its tokenizer is used, right now
        bad = [t for t in body.tokens if not 0 <= t < c.vocab_size]
        if bad:
            raise invalid_request(
                f"Token id {bad[0]} in 'tokens' is outside the vocabulary [0, {c.vocab_size}).",
                param="tokens",
            )
        return DetokenizeResponse(prompt=c.tokenizer.decode(body.tokens))
