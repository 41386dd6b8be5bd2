"""Loading and unloading models on request: ``POST /v1/models/{model}/load`` and
``POST /v1/models/{model}/unload`` (``?force=true`` ends the model's running requests with
an error instead of waiting for them). Both answer the model's card with its status; like
every ``/v1`` route they need the API key when one is set."""

from __future__ import annotations

from fastapi import FastAPI

from mlxserve.server.api.openai.response_models import ModelCard
from mlxserve.server.api.openai.routes import entry_card
from mlxserve.server.http.errors import invalid_request
from mlxserve.server.models.entry import ModelEntry
from mlxserve.server.models.registry import ModelRegistry
from mlxserve.server.models.served_model import ServedModel
from mlxserve.server.serving.admission import Admission


def add_admin_routes(app: FastAPI, models: ModelRegistry, admission: Admission) -> None:
    """Register the model load/unload routes on ``app``."""

    def managed(model: str) -> ModelEntry:
        entry = models.entry(model)
        if models.loader is None:
            raise invalid_request(
                "This server serves one model, loaded at start-up; declare several models "
                "(--model ... --model ..., --models-config, --models-dir) to load and "
                "unload them.",
                code="model_management_disabled",
            )
        return entry

    @app.post("/v1/models/{model:path}/load")
    async def load_model(model: str) -> ModelCard:
        entry = managed(model)
        served = await models.acquire(model)
        models.release(served)
        return entry_card(entry, model)

    @app.post("/v1/models/{model:path}/unload")
    async def unload_model(model: str, force: bool = False) -> ModelCard:
        entry = managed(model)

        def abort(served: ServedModel) -> None:
            admission.fail_all(served.engine, f"The model '{entry.name}' was unloaded.")

        await models.unload_when_idle(entry, abort if force else None)
        return entry_card(entry, model)
