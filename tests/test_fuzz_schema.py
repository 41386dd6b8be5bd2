"""Schema fuzzing (CI-sized): ``/openapi.json`` describes every route's real inputs and
outputs, and schemathesis cases generated from it (valid and invalid) never get a 5xx, always
get OpenAI's error JSON for errors, and match the documented statuses, content types and
response schemas. The cases are derandomized: the same ones every run. ``bench/fuzz.py``
runs larger, seeded passes.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.routing import APIRoute

from bench.fuzz import fuzz, fuzz_server_configs
from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.server.app import create_app
from mlxserve.server.config import ServerConfig
from tests.ops_helpers import running_server

EXAMPLES = 20  # per operation and generation mode (the suite's time budget)
# Free-form by design: a JSON schema given by the client (vLLM's structured_outputs.json).
UNTYPED_ALLOWED = {("StructuredOutputs", "json")}
# POST routes that take no body: loading and unloading a model (server/api/admin.py).
BODYLESS_POSTS = {"/v1/models/{model}/load", "/v1/models/{model}/unload"}
_TYPE_KEYS = {"type", "anyOf", "oneOf", "allOf", "enum", "const", "$ref"}


@pytest.fixture(scope="module")
def openapi() -> dict[str, Any]:
    app = create_app(None, None, ServerConfig())  # the schema needs no model
    return app.openapi()


class TestOpenApiDocument:
    def test_every_route_is_documented(self, openapi: dict[str, Any]) -> None:
        app = create_app(None, None, ServerConfig())
        routes = {
            (method.lower(), route.path.replace(":path", ""))
            for route in app.routes
            if isinstance(route, APIRoute)
            for method in route.methods
        }
        documented = {(m, p) for p, ops in openapi["paths"].items() for m in ops}
        assert routes == documented
        expected = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model}"}
        expected |= {"/tokenize", "/detokenize", "/health", "/metrics", "/version"}
        expected |= {"/v1/messages", "/v1/messages/count_tokens", "/v1/responses"}
        expected |= {"/v1/responses/{response_id}", "/v1/responses/{response_id}/input_items"}
        assert expected <= set(openapi["paths"])

    def test_post_routes_declare_their_json_body(self, openapi: dict[str, Any]) -> None:
        components = openapi["components"]["schemas"]
        for path, operations in openapi["paths"].items():
            for method, operation in operations.items():
                if method != "post" or path in BODYLESS_POSTS:
                    continue
                body = operation.get("requestBody")
                assert body and body.get("required"), path
                ref = body["content"]["application/json"]["schema"]["$ref"]
                assert components[ref.rsplit("/", 1)[1]]["properties"], path

    def test_errors_are_documented_as_sent(self, openapi: dict[str, Any]) -> None:
        assert "HTTPValidationError" not in openapi["components"]["schemas"]
        for path, operations in openapi["paths"].items():
            for method, operation in operations.items():
                responses = operation["responses"]
                assert "422" not in responses, (method, path)
                shape = "AnthropicErrorResponse" if path.startswith("/v1/messages") else None
                for status, response in responses.items():
                    if int(status) < 400 or path == "/health":
                        continue
                    schema = response["content"]["application/json"]["schema"]
                    expected = f"#/components/schemas/{shape or 'ErrorResponse'}"
                    assert schema == {"$ref": expected}, path
        streaming = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
        for path in streaming:
            content = openapi["paths"][path]["post"]["responses"]["200"]["content"]
            assert set(content) == {"application/json", "text/event-stream"}, path
            assert "400" in openapi["paths"][path]["post"]["responses"]

    def test_request_fields_have_types(self, openapi: dict[str, Any]) -> None:
        untyped = {
            (name, field)
            for name, schema in openapi["components"]["schemas"].items()
            for field, prop in schema.get("properties", {}).items()
            if not _TYPE_KEYS & set(prop)
        }
        assert untyped <= UNTYPED_ALLOWED, sorted(untyped - UNTYPED_ALLOWED)


def test_fuzz_the_live_server(smollm: LoadedModel) -> None:
    engine_config, config = fuzz_server_configs()
    with running_server(smollm, engine_config, config) as srv:
        report = fuzz(srv.url, EXAMPLES)
    print(f"fuzz: {report.total} cases in {report.seconds:.1f} s, statuses {report.statuses}")
    assert not report.failures, "\n".join(report.failures)
    generation = [n for label, n in report.cases.items() if "completions" in label]
    assert sum(generation) >= 4 * EXAMPLES * 0.9, report.cases
    assert report.statuses.get(200, 0) >= 20, report.statuses
