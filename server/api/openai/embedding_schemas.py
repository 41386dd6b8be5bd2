"""Pydantic models of ``POST /v1/embeddings``: the request body and the answer (OpenAI's
shapes; ``cache_salt`` is vLLM's extension, as on the generation routes)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

# One input: a string, or its token ids.
EmbeddingInput = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class EmbeddingRequest(BaseModel):
    """``input`` is a string, a list of strings, a list of token ids, or a list of lists of
    token ids (each list one input)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    # floats, or with encoding_format "base64" the little-endian float32 bytes in base64.
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
