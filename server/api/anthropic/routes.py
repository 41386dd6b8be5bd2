"""The Anthropic routes: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A Messages request is parsed (pydantic, ``schemas.py``), rendered into the neutral spec
(``request.py``: conversation, tools, output format, reasoning switch; the grammar of a
forced tool or an output format compiled once), submitted (``Admission.submit``), and
answered in Anthropic's shape, whole (``answer.py``) or streamed (``stream.py``). Errors on
these routes are in Anthropic's shape (``errors.py``, registered by ``server/app.py``).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from mlxserve.server.api.anthropic.answer import complete_message
from mlxserve.server.api.anthropic.request import generation_spec, prompt_of
from mlxserve.server.api.anthropic.schemas import CountTokensRequest, MessagesRequest
from mlxserve.server.api.anthropic.stream import stream_message
from mlxserve.server.http.auth import tenant_of
from mlxserve.server.models.registry import ModelRegistry
from mlxserve.server.serving.admission import Admission
from mlxserve.server.serving.output_constraint import compile_constraint
from mlxserve.server.serving.pieces import PieceSplitter


def add_anthropic_routes(app: FastAPI, models: ModelRegistry, admission: Admission) -> None:
    """Register the Anthropic routes on ``app``, serving ``models`` through ``admission``."""

    @app.post("/v1/messages", response_model=None)
    async def messages(body: MessagesRequest, request: Request) -> Any:
        async with models.use(body.model) as m:
            prompt = await prompt_of(m, body, admission.config)
            constraint = prompt.constraint
            compiled = (
                None if constraint is None else await compile_constraint(m.engine, constraint)
            )
            spec = generation_spec(body, prompt, compiled, tenant_of(request))
            choices = admission.submit(m, spec)
        splitter = PieceSplitter(m.reasoning, prompt.in_reasoning, prompt.tools)
        if body.stream:
            return stream_message(choices, m.name, splitter)
        return await complete_message(choices, m.name, request, splitter)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        async with models.use(body.model) as m:
            return {"input_tokens": len((await prompt_of(m, body, admission.config)).ids)}
