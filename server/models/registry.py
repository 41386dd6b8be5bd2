"""The model registry: served names -> ``ServedModel``.

A request's ``model`` only ever selects a model registered here; it is never a path or a
repo id to load. One model is served today; the lookup is the same for several.
"""

from __future__ import annotations

from mlxserve.server.http.errors import APIError
from mlxserve.server.models.served_model import ServedModel


class ModelRegistry:
    """The models being served, by served name (thread-safe for readers: models are added
    whole, on the loading thread)."""

    def __init__(self) -> None:
        self._models: dict[str, ServedModel] = {}

    def add(self, model: ServedModel) -> None:
        """Serve ``model`` under its name.

        Raises:
            ValueError: a model is already served under that name.
        """
        if model.name in self._models:
            raise ValueError(f"a model named {model.name!r} is already served")
        self._models = {**self._models, model.name: model}

    def get(self, name: str) -> ServedModel:
        """The model served as ``name``.

        Raises:
            APIError: 404 ``model_not_found`` for any other name.
        """
        model = self._models.get(name)
        if model is None:
            served = ", ".join(f"'{n}'" for n in self._models) or "no model"
            raise APIError(
                404,
                f"The model '{name}' does not exist. This server serves {served}.",
                param="model",
                code="model_not_found",
            )
        return model

    def default(self) -> ServedModel:
        """The model a request that names none is served by (the first one served)."""
        return next(iter(self._models.values()))

    def all(self) -> list[ServedModel]:
        """Every served model, in the order they were added."""
        return list(self._models.values())

    def __len__(self) -> int:
        return len(self._models)
