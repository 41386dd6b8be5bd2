"""One served model: its engine, tokenizer and what the server derives from them.

Everything the routes need per model lives here, looked up by served name in the
``ModelRegistry``; the server holds no model state of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlxserve.scheduler.client import EngineClient
from mlxserve.server.config import ModelConfig
from mlxserve.server.models.declarations import Task
from mlxserve.server.serving.prompt_size import check_text_fits, max_token_chars, text_chars
from mlxserve.server.serving.reasoning import is_reasoning_model
from mlxserve.server.serving.token_logprobs import TokenTexts
from mlxserve.server.serving.tool_parsers import ToolFormat, resolve_tool_format


@dataclass(frozen=True)
class ModelInfo:
    """What loading told about a model (the backend-free part of a loaded model).

    Attributes:
        model_id: the loaded model's own id.
        tokenizer: mlx-lm's ``TokenizerWrapper`` (``encode``, ``decode``,
            ``apply_chat_template``, ``eos_token_ids``).
        context_length: the longest prompt + completion the model allows.
        vocab_size: the model config's vocabulary size (0: unknown).
        task: "generate" (chat, completions, messages, responses) or "embed"
            (``/v1/embeddings`` only).
        embedding_dims: the length of its embeddings (its hidden size; 0: not known).
        matryoshka_dims: the shorter lengths its embeddings may be cut to (Matryoshka
            representations): None for none, ``()`` for any, else those only.
        vision: a vision model's encoder (``submit(prompt_ids, images)`` -> a future of
            the prepared prompt); None: the model takes no images.
    """

    model_id: str
    tokenizer: Any
    context_length: int
    vocab_size: int = 0
    task: Task = "generate"
    embedding_dims: int = 0
    matryoshka_dims: tuple[int, ...] | None = None
    vision: Any = None


@dataclass(eq=False)
class ServedModel:
    """A loaded model as the routes use it.

    Attributes:
        name: the served name clients send as ``model``.
        info: the loaded model's tokenizer, id and context.
        engine: the engine serving it.
        config: its per-model configuration.
        vocab_size: token ids a client may send (the tokenizer's and the model's, whichever
            is smaller: ids past the tokenizer could not be decoded, past the model not run).
        reasoning: the model's output may open with ``<think>`` reasoning.
        token_texts: token id -> text for logprobs (cached across requests).
        tool_format: how the model writes tool calls (``--tool-parser``).
        max_token_chars: the most characters one token stands for (0: unknown), the bound
            that refuses text too long for the context before it is encoded.
    """

    info: ModelInfo
    engine: EngineClient
    config: ModelConfig = field(default_factory=ModelConfig)
    name: str = ""
    vocab_size: int = 0
    reasoning: bool = False
    token_texts: TokenTexts = field(init=False)
    tool_format: ToolFormat = field(init=False)
    max_token_chars: int = field(init=False)

    def __post_init__(self) -> None:
        tokenizer = self.info.tokenizer
        self.name = self.name or self.config.served_model_name or self.info.model_id
        vocab = self.info.vocab_size or len(tokenizer)
        self.vocab_size = min(int(vocab), len(tokenizer))
        self.reasoning = is_reasoning_model(tokenizer)
        self.token_texts = TokenTexts(tokenizer)
        self.tool_format = resolve_tool_format(self.config.tool_parser, tokenizer)
        self.max_token_chars = max_token_chars(tokenizer)

    def check_text_fits(self, text: Any, param: str) -> None:
        """Raises: APIError 400 when the client text in ``text`` (strings, nested) cannot
        fit the context, before anything is rendered or encoded."""
        chars = text_chars(text)
        check_text_fits(chars, self.context_length, self.max_token_chars, param)

    @property
    def tokenizer(self) -> Any:
        return self.info.tokenizer

    @property
    def task(self) -> Task:
        return self.info.task

    @property
    def embedding_dims(self) -> int:
        return self.info.embedding_dims

    @property
    def matryoshka_dims(self) -> tuple[int, ...] | None:
        return self.info.matryoshka_dims

    @property
    def vision(self) -> Any:
        """The model's vision encoder (None: it takes no images)."""
        return self.info.vision

    @property
    def context_length(self) -> int:
        """Longest prompt + completion: the model's, capped by the engine's KV pool."""
        return getattr(self.engine, "max_context_len", 0) or self.info.context_length
