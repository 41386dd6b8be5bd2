"""Health and start-up: the server answers while the model loads (503 with the stage and
progress, then 200), reports a failed load, and logs what it serves."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import httpx
import pytest

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.mlx_backend.loading.loader import ModelLoadError
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.app import create_app
from mlxserve.server.config import ServerConfig
from mlxserve.server.lifecycle.launch import BackgroundServer, warn_if_exposed
from mlxserve.server.lifecycle.loading import BackgroundLoader, backend_name, blas_line, log_model
from mlxserve.server.lifecycle.state import ServerState
from tests.ops_helpers import completion, wait_for

ENGINE_CONFIG = EngineConfig(max_total_tokens=256, max_running_requests=2)


@pytest.fixture
def loading_server() -> Iterator[tuple[BackgroundServer, ServerState]]:
    """A server bound with no model yet (what the CLI runs while loading)."""
    app = create_app(None, None, ServerConfig(port=0))
    srv = BackgroundServer(app).start()
    try:
        yield srv, app.state.server
    finally:
        srv.stop()


class TestLoading:
    def test_503_while_loading_then_200(
        self, loading_server: tuple[BackgroundServer, ServerState], smollm: LoadedModel
    ) -> None:
        srv, state = loading_server
        release = threading.Event()

        def load() -> LoadedModel:
            assert release.wait(60), "the test never released the load"
            return smollm

        # convert=None: the shared model must not be changed in place by a conversion.
        loader = BackgroundLoader(load, ENGINE_CONFIG, state.progress, state.attach, convert=None)
        loader.start()
        try:
            wait_for(lambda: state.progress.stage == "weights", 10, "the weights stage")
            health = httpx.get(srv.url + "/health", timeout=10)
            assert health.status_code == 503, health.text
            assert health.json() == {"status": "loading", "stage": "weights", "progress": 0.0}
            models = httpx.get(srv.url + "/v1/models", timeout=10)
            assert models.status_code == 503 and models.headers["retry-after"], models.text
            assert models.json()["error"]["code"] == "model_loading", models.text
            assert httpx.get(srv.url + "/metrics", timeout=10).status_code == 503
            version = httpx.get(srv.url + "/version", timeout=10)
            assert version.status_code == 200 and version.json()["backend"] == backend_name()

            release.set()
            wait_for(
                lambda: httpx.get(srv.url + "/health", timeout=10).status_code == 200,
                120,
                "/health to turn 200 after loading and warm-up",
            )
            assert httpx.get(srv.url + "/health", timeout=10).json() == {"status": "ok"}
            [card] = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"]
            assert card["id"] == smollm.model_id and card["max_model_len"] == 256, card
            assert state.progress.snapshot()["progress"] == 1.0
            answer = httpx.post(
                srv.url + "/v1/completions", json=completion(smollm.model_id, "Hi", max_tokens=1)
            )
            assert answer.status_code == 200, answer.text
        finally:
            release.set()
            assert loader.join(120), "loading did not end"
            if loader.engine is not None:
                assert loader.engine.wait_idle(60), "engine still busy"
                loader.engine.check_integrity()
                loader.engine.shutdown()

    def test_failed_load_is_reported(
        self, loading_server: tuple[BackgroundServer, ServerState]
    ) -> None:
        srv, state = loading_server
        failures: list[BaseException] = []

        def load() -> LoadedModel:
            raise ModelLoadError("no such model: /nowhere")

        loader = BackgroundLoader(
            load, ENGINE_CONFIG, state.progress, state.attach, on_failed=failures.append
        ).start()
        assert loader.join(30) and isinstance(loader.error, ModelLoadError)
        assert len(failures) == 1, "on_failed stops the CLI's server"
        health = httpx.get(srv.url + "/health", timeout=10)
        assert health.status_code == 503, health.text
        body = health.json()
        assert body["status"] == "failed" and "/nowhere" in body["detail"], body
        models = httpx.get(srv.url + "/v1/models", timeout=10)
        assert models.status_code == 503, models.text
        assert models.json()["error"]["code"] == "model_load_failed", models.text


class TestStartupLog:
    def test_model_backend_and_blas_are_logged(
        self, smollm: LoadedModel, caplog: pytest.LogCaptureFixture
    ) -> None:
        with caplog.at_level(logging.INFO, logger="mlxserve.server.lifecycle.loading"):
            log_model(smollm, "dequantized 3 layers", 1.5)
        text = caplog.text
        assert smollm.model_id in text and "float32" in text, text
        assert "quantized" in text and "context" in text, text
        assert "dequantized 3 layers" in text, text
        assert backend_name() in ("cpu", "metal")
        assert "BLAS" in blas_line() or "Metal" in blas_line(), blas_line()

    def test_exposed_without_key_warns_and_keys_stay_secret(
        self, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.delenv("MLXSERVE_API_KEY", raising=False)
        with caplog.at_level(logging.WARNING, logger="mlxserve.server.lifecycle.launch"):
            warn_if_exposed(ServerConfig(host="127.0.0.1"))
            assert not caplog.records, "loopback without a key is fine"
            warn_if_exposed(ServerConfig(host="0.0.0.0"))
            assert "without an API key" in caplog.text, caplog.text
            caplog.clear()
            config = ServerConfig(host="0.0.0.0", api_key="s3cret-key")
            warn_if_exposed(config)
            assert not caplog.records, caplog.text
        assert "s3cret-key" not in repr(config), "keys must never reach a log line"
