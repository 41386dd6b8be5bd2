"""API keys and CORS over real HTTP: 401 in OpenAI's shape without a valid Bearer key on the
API routes, open health/metrics unless --protect-metrics, CORS only for allowed origins."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import pytest

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.config import ServerConfig
from mlxserve.server.http.auth import key_is_valid
from mlxserve.server.lifecycle.launch import BackgroundServer
from tests.ops_helpers import completion, running_server

ENGINE_CONFIG = EngineConfig(max_total_tokens=128, max_running_requests=1)
KEYS = ("key-one", "key-two")
ORIGIN = "https://app.example"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_401(response: httpx.Response) -> None:
    assert response.status_code == 401, (response.status_code, response.text)
    assert response.json()["error"]["code"] == "invalid_api_key", response.text
    assert response.headers["www-authenticate"] == "Bearer", response.headers


@pytest.fixture(scope="module")
def server(smollm: LoadedModel) -> Iterator[BackgroundServer]:
    config = ServerConfig(port=0, api_key=",".join(KEYS), allowed_origins=ORIGIN)
    with running_server(smollm, ENGINE_CONFIG, config) as srv:
        yield srv


class TestApiKeys:
    def test_missing_or_wrong_key_is_401(self, server: BackgroundServer, smollm) -> None:
        assert_401(httpx.get(server.url + "/v1/models"))
        assert_401(httpx.get(server.url + "/v1/models", headers=bearer("key-three")))
        assert_401(httpx.get(server.url + "/v1/models", headers={"Authorization": "key-one"}))
        assert_401(httpx.post(server.url + "/v1/completions", json=completion(smollm.model_id)))

    def test_every_key_is_accepted(self, server: BackgroundServer) -> None:
        for key in KEYS:
            response = httpx.get(server.url + "/v1/models", headers=bearer(key))
            assert response.status_code == 200, response.text

    def test_tokenize_routes_are_protected(self, server: BackgroundServer) -> None:
        for path in ("/tokenize", "/detokenize"):
            assert_401(httpx.post(server.url + path, json={}))
            # With a key the request gets through (to a 404 until those routes exist).
            response = httpx.post(server.url + path, json={}, headers=bearer(KEYS[0]))
            assert response.status_code != 401, response.text

    def test_health_and_metrics_stay_open(self, server: BackgroundServer) -> None:
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.get(server.url + "/metrics").status_code == 200

    def test_keys_are_not_logged(
        self, server: BackgroundServer, caplog: pytest.LogCaptureFixture
    ) -> None:
        with caplog.at_level(logging.DEBUG):
            httpx.get(server.url + "/v1/models", headers=bearer("key-three"))
            httpx.get(server.url + "/v1/models", headers=bearer(KEYS[0]))
        assert not any(key in caplog.text for key in (*KEYS, "key-three")), caplog.text

    def test_compare(self) -> None:
        keys = [k.encode() for k in KEYS]
        assert key_is_valid("Bearer key-two", keys) and key_is_valid("bearer key-one", keys)
        for header in (None, "", "Bearer", "Bearer key", "Basic key-one", "Bearer key-one2"):
            assert not key_is_valid(header, keys), header

    def test_environment_variable(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("MLXSERVE_API_KEY", "a, b")
        assert ServerConfig().api_keys() == ("a", "b")
        assert ServerConfig(api_key="c").api_keys() == ("c",), "the option wins"
        monkeypatch.delenv("MLXSERVE_API_KEY")
        assert ServerConfig().api_keys() == (), "no key: no authentication"


class TestCors:
    def test_preflight_from_allowed_origin(self, server: BackgroundServer) -> None:
        response = httpx.options(
            server.url + "/v1/chat/completions",
            headers={
                "Origin": ORIGIN,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert response.status_code == 200, response.text
        assert response.headers["access-control-allow-origin"] == ORIGIN, response.headers
        allowed = response.headers["access-control-allow-headers"].lower()
        assert "authorization" in allowed, allowed

    def test_other_origins_get_no_cors(self, server: BackgroundServer) -> None:
        response = httpx.options(
            server.url + "/v1/chat/completions",
            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
        )
        assert response.status_code == 400, response.text
        assert "access-control-allow-origin" not in response.headers, response.headers

    def test_errors_carry_cors_headers(self, server: BackgroundServer) -> None:
        # A browser can only read the 401 if it carries the CORS header.
        response = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN})
        assert_401(response)
        assert response.headers["access-control-allow-origin"] == ORIGIN, response.headers


class TestProtectMetrics:
    def test_ops_routes_need_the_key(self, smollm: LoadedModel) -> None:
        config = ServerConfig(port=0, api_key="k", protect_metrics=True)
        with running_server(smollm, ENGINE_CONFIG, config) as srv:
            for path in ("/metrics", "/health", "/version"):
                assert_401(httpx.get(srv.url + path))
                response = httpx.get(srv.url + path, headers=bearer("k"))
                assert response.status_code == 200, (path, response.text)

    def test_no_cors_by_default(self, smollm: LoadedModel) -> None:
        with running_server(smollm, ENGINE_CONFIG) as srv:
            response = httpx.options(
                srv.url + "/v1/models",
                headers={"Origin": ORIGIN, "Access-Control-Request-Method": "GET"},
            )
            assert "access-control-allow-origin" not in response.headers, response.headers
