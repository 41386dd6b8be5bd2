"""The OpenAI routes: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models`` and ``GET /v1/models/{model}``.

Each generation route does three things: parse (pydantic, in the signature) into the
neutral ``GenerationSpec`` (rendering and tokenizing the prompt, compiling the output
constraint), submit it (``Admission.submit``), and stream or return the result in OpenAI's
shape (``sse.py`` / ``answer.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request

from mlxserve.server.api.openai.answer import complete_chat, complete_text
from mlxserve.server.api.openai.messages import conversation_of
from mlxserve.server.api.openai.response_models import ModelCard, ModelList
from mlxserve.server.api.openai.schemas import ChatCompletionRequest, CompletionRequest
from mlxserve.server.api.openai.shapers import ChatShaper, CompletionShaper
from mlxserve.server.api.openai.spec import generation_spec
from mlxserve.server.api.openai.sse import stream_chat, stream_completion
from mlxserve.server.api.openai.structured_output import output_constraints
from mlxserve.server.api.openai.tools import plan_tools
from mlxserve.server.http.auth import tenant_of
from mlxserve.server.models.entry import ModelEntry
from mlxserve.server.models.registry import ModelRegistry
from mlxserve.server.models.served_model import ServedModel
from mlxserve.server.serving.admission import Admission
from mlxserve.server.serving.choices import Choices
from mlxserve.server.serving.conversation import continuation_mode, render_chat
from mlxserve.server.serving.images import prepare_images, take_images
from mlxserve.server.serving.offload import offload
from mlxserve.server.serving.output_constraint import compile_constraint, request_constraint
from mlxserve.server.serving.prompts import completion_prompt_ids
from mlxserve.server.serving.reasoning import prompt_opens_reasoning
from mlxserve.server.serving.tool_plan import ToolPlan


def add_openai_routes(app: FastAPI, models: ModelRegistry, admission: Admission) -> None:
    """Register the OpenAI routes on ``app``, serving ``models`` through ``admission``.

    A generation route holds its model (``models.use``: loaded on demand, never unloaded
    meanwhile) while it prepares and submits the request; the engine's own count of the
    requests it runs keeps the model busy after that.
    """

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[entry_card(e) for e in models.entries()])

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> ModelCard:
        return entry_card(models.entry(model), model)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        async with models.use(body.model) as m:
            choices, shaper = await submit_chat(m, body, request, admission)
        if body.stream:
            return stream_chat(choices, m.name, body.include_usage, shaper)
        return await complete_chat(choices, m.name, request, shaper)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        async with models.use(body.model) as m:
            choices, shaper = await submit_completion(m, body, request, admission)
        if body.stream:
            return stream_completion(choices, m.name, body.include_usage, shaper)
        return await complete_text(choices, m.name, request, shaper)


async def submit_chat(
    m: ServedModel, body: ChatCompletionRequest, request: Request, admission: Admission
) -> tuple[Choices, Callable[[], ChatShaper]]:
    """Render, constrain and submit a chat request; its choices and their shaper."""
    add_generation_prompt, continue_final = continuation_mode(
        body.messages[-1].role, body.add_generation_prompt, body.continue_final_message
    )
    tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, m.tool_format)
    constraint, tools = request_constraint(output_constraints(body), tools)
    conversation, images = take_images(conversation_of(body.messages))
    m.check_text_fits([conversation, tools.prompt_tools], "messages")
    prompt_text, prompt_ids = await offload(
        render_chat,
        m.tokenizer,
        conversation,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final,
        template_kwargs=body.chat_template_kwargs,
        tools=tools.prompt_tools,
    )
    prompt_ids, mm = await prepare_images(m.vision, prompt_ids, images, admission.config)
    in_reasoning = m.reasoning and prompt_opens_reasoning(prompt_text)
    texts = m.token_texts if body.logprobs else None

    def shaper() -> ChatShaper:
        return ChatShaper(texts, body.top_logprobs or 0, m.reasoning, in_reasoning, tools)

    compiled = None if constraint is None else await compile_constraint(m.engine, constraint)
    spec = generation_spec(body, "chatcmpl", prompt_ids, "messages", compiled, tenant_of(request))
    return admission.submit(m, replace(spec, images=mm)), shaper


async def submit_completion(
    m: ServedModel, body: CompletionRequest, request: Request, admission: Admission
) -> tuple[Choices, Callable[[], CompletionShaper]]:
    """Tokenize, constrain and submit a completion request; its choices and their shaper."""
    if isinstance(body.prompt, str):
        m.check_text_fits(body.prompt, "prompt")
    prompt_ids = await offload(completion_prompt_ids, m.tokenizer, body.prompt, m.vocab_size)
    echo_text = None
    if body.echo:
        prompt = body.prompt
        echo_text = prompt if isinstance(prompt, str) else m.tokenizer.decode(prompt_ids)
    texts = m.token_texts if body.logprobs is not None else None

    def shaper() -> CompletionShaper:
        return CompletionShaper(m.tokenizer, texts, body.logprobs or 0, echo_text)

    constraint, _ = request_constraint(output_constraints(body), ToolPlan())
    compiled = None if constraint is None else await compile_constraint(m.engine, constraint)
    spec = generation_spec(body, "cmpl", prompt_ids, "prompt", compiled, tenant_of(request))
    return admission.submit(m, spec), shaper


def entry_card(entry: ModelEntry, name: str | None = None) -> ModelCard:
    """A declared model as ``/v1/models`` lists it (its context length once loaded)."""
    served = entry.served
    return ModelCard(
        id=name or entry.name,
        max_model_len=served.context_length if served is not None else None,
        status=entry.status.value,
    )
