"""Schema fuzzing: schemathesis generates requests from the server's own ``/openapi.json``
(valid ones, and ones that break the schema) and sends them over loopback HTTP.

Every answer must be: not a 5xx; JSON (or SSE / Prometheus text where documented); for an
error, exactly OpenAI's ``{"error": {"message", "type", "param", "code"}}`` (Anthropic's
``{"type": "error", "error": {"type", "message"}}`` on ``/v1/messages``); and conform to
the status codes, content types and response schemas that ``/openapi.json`` documents
(schemathesis's own checks). Afterwards ``/health`` must still be 200.

Generation is kept cheap by bounding the fuzzed schema (the server's stays as is): ``model``
is the served one, ``max_tokens`` (Responses: ``max_output_tokens``) is required and at most
``--max-tokens``, ``n`` at most 2;
the server runs with a small context, ``--max-prompt-tokens`` and a request timeout.
``tests/test_fuzz_schema.py`` runs a CI-sized pass; this runs a larger one::

    .venv/bin/python -m bench.fuzz --examples 200
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MAX_TOKENS = 4
MAX_N = 2
REQUEST_TIMEOUT_S = 60
ERROR_KEYS = {"message", "type", "param", "code"}
GENERATION_BODIES = ("ChatCompletionRequest", "CompletionRequest")
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
# Request bodies -> their token budget field (bounded like max_tokens above).
AGENT_BODIES = {"MessagesRequest": "max_tokens", "ResponsesRequest": "max_output_tokens"}
MODEL_BODIES = ("TokenizeRequest", "DetokenizeRequest", "CountTokensRequest")
ANTHROPIC_PREFIX = "/v1/messages"
# Streams whose events are named (``event: <type>``) and end without ``[DONE]``.
NAMED_EVENT_PATHS = ("/v1/messages", "/v1/responses")


@dataclass
class FuzzReport:
    """Cases sent per operation and mode, and every failure found."""

    cases: dict[str, int] = field(default_factory=dict)
    statuses: dict[int, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.cases.values())


def bounded_schema(schema: dict[str, Any], model: str, max_tokens: int) -> dict[str, Any]:
    """A copy of ``schema`` whose generation requests stay cheap (see the module doc)."""
    schema = copy.deepcopy(schema)
    components = schema["components"]["schemas"]
    for name in GENERATION_BODIES:
        body = components[name]
        props = body["properties"]
        props["model"] = {"type": "string", "enum": [model]}
        props["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": max_tokens}
        body["required"] = sorted({*body.get("required", []), "max_tokens"})
        if "max_completion_tokens" in props:
            props["max_completion_tokens"] = {
                "type": "integer",
                "minimum": 1,
                "maximum": max_tokens,
            }
        props["min_tokens"] = {"type": "integer", "minimum": 0, "maximum": max_tokens}
        props["n"] = {"type": "integer", "minimum": 1, "maximum": MAX_N}
        if "best_of" in props:
            props["best_of"] = {"type": "integer", "minimum": 1, "maximum": MAX_N}
    for name, budget in AGENT_BODIES.items():
        body = components[name]
        body["properties"]["model"] = {"type": "string", "enum": [model]}
        body["properties"][budget] = {"type": "integer", "minimum": 1, "maximum": max_tokens}
        body["required"] = sorted({*body.get("required", []), budget})
    for name in MODEL_BODIES:
        components[name]["properties"]["model"] = {"type": "string", "enum": [model]}
    return schema


def _check_error_body(body: Any) -> str | None:
    if not isinstance(body, dict) or set(body) != {"error"}:
        return f"error body is not {{'error': ...}}: {str(body)[:200]}"
    error = body["error"]
    if not isinstance(error, dict) or set(error) != ERROR_KEYS:
        return f"error object keys are not {sorted(ERROR_KEYS)}: {str(error)[:200]}"
    if not isinstance(error["message"], str) or not error["message"]:
        return "error message is empty"
    if not isinstance(error["type"], str):
        return "error type is not a string"
    if any(error[k] is not None and not isinstance(error[k], str) for k in ("param", "code")):
        return "error param/code is neither a string nor null"
    return None


def _check_anthropic_error_body(body: Any) -> str | None:
    if not isinstance(body, dict) or set(body) != {"type", "error"} or body["type"] != "error":
        return f"error body is not {{'type': 'error', 'error': ...}}: {str(body)[:200]}"
    error = body["error"]
    if not isinstance(error, dict) or set(error) != {"type", "message"}:
        return f"error object keys are not ['message', 'type']: {str(error)[:200]}"
    if not isinstance(error["message"], str) or not error["message"]:
        return "error message is empty"
    return None


def _check_named_stream(text: str) -> str | None:
    events = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
    payloads = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    if not payloads or len(events) != len(payloads):
        return f"stream events are not named pairs: {text[-200:]!r}"
    for name, payload in zip(events, payloads, strict=True):
        if payload.get("type") != name:
            return f"event {name!r} carries {str(payload)[:200]}"
        if name in ("error", "response.failed"):
            return f"stream carried an error: {str(payload)[:300]}"
    if events[-1] not in ("message_stop", "response.completed", "response.incomplete"):
        return f"stream ends with {events[-1]!r}"
    return None


def _check_stream(text: str) -> str | None:
    payloads = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    if not payloads or payloads[-1] != "[DONE]":
        return f"stream does not end with [DONE]: {text[-200:]!r}"
    for data in payloads[:-1]:
        chunk = json.loads(data)
        if "error" in chunk:
            return f"stream carried an error: {data[:300]}"
    return None


def check_response(path: str, response: httpx.Response) -> str | None:
    """The first problem with ``response``, or None."""
    status = response.status_code
    content_type = response.headers.get("content-type", "")
    if status >= 500 and path != "/health":
        return f"server error {status}: {response.text[:300]}"
    if path == "/metrics" and status == 200:
        return None if content_type.startswith("text/plain") else f"metrics as {content_type}"
    if content_type.startswith("text/event-stream"):
        if status != 200:
            return f"{status} as an SSE stream"
        if path in NAMED_EVENT_PATHS:
            return _check_named_stream(response.text)
        return _check_stream(response.text)
    if not content_type.startswith("application/json"):
        return f"content-type {content_type!r} for {status}"
    try:
        body = response.json()
    except ValueError:
        return f"body is not JSON: {response.text[:200]!r}"
    if status >= 400 and path.startswith(ANTHROPIC_PREFIX):
        return _check_anthropic_error_body(body)
    if status >= 400 and path != "/health":
        return _check_error_body(body)
    return None


def _schemathesis_checks() -> list[Any]:
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    return [status_code_conformance, content_type_conformance, response_schema_conformance]


def fuzz(
    base_url: str,
    examples: int,
    *,
    modes: tuple[str, ...] = ("positive", "negative"),
    max_tokens: int = MAX_TOKENS,
    seed: int | None = None,
    body_bytes: int = 1024 * 1024,
) -> FuzzReport:
    """Fuzz every operation of the server at ``base_url`` with ``examples`` cases per mode,
    then the hostile strings of ``hostile_string_cases`` (huge texts up to ``body_bytes``).

    Args:
        base_url: e.g. ``http://127.0.0.1:8000``.
        examples: hypothesis ``max_examples`` per operation and mode.
        modes: schemathesis generation modes ("positive", "negative").
        max_tokens: the bound on ``max_tokens`` in the fuzzed schema.
        seed: None: derandomized (the same cases every run); else hypothesis's seed.
    """
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis.errors import Unsatisfiable

    started = time.monotonic()
    model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    raw = httpx.get(base_url + "/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(bounded_schema(raw, model, max_tokens))
    report = FuzzReport()
    strategy_settings = settings(
        max_examples=examples,
        derandomize=seed is None,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: failures are collected
        suppress_health_check=list(HealthCheck),
    )
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in modes:
            label = f"{operation.label} [{mode}]"
            strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))
            run = strategy_settings(
                given(case=strategy)(_case_runner(base_url, label, report, max_tokens))
            )
            if seed is not None:
                run = hypothesis_seed(seed)(run)
            try:
                run()
            except Unsatisfiable:
                pass  # e.g. no invalid request exists for a route without inputs
    check_hostile_strings(base_url, model, body_bytes, report)
    health = httpx.get(base_url + "/health", timeout=30)
    if health.status_code != 200:
        report.failures.append(f"/health is {health.status_code} after fuzzing: {health.text}")
    report.seconds = time.monotonic() - started
    return report


def _case_runner(base_url: str, label: str, report: FuzzReport, max_tokens: int) -> Any:
    """The hypothesis test body of one operation and mode: send, check, record."""
    from schemathesis.core.failures import FailureGroup

    checks = _schemathesis_checks()

    def run(case: Any) -> None:
        report.cases[label] = report.cases.get(label, 0) + 1
        body = case.body
        budgets = {"max_tokens", "max_completion_tokens", "max_output_tokens"}
        generates = case.operation.path in (*GENERATION_PATHS, "/v1/responses")
        if generates and case.method.lower() == "post" and isinstance(body, dict):
            if not (budgets & set(body)):
                # A negative case may drop the (fuzz-required) budget; put it back so that
                # the request cannot generate to the end of the context.
                budget = "max_output_tokens" if case.operation.path == "/v1/responses" else None
                body[budget or "max_tokens"] = max_tokens
        try:
            response = case.call(base_url=base_url, timeout=REQUEST_TIMEOUT_S)
        except Exception as e:  # a hang or a dropped connection is a failure too
            report.failures.append(f"{label}: {type(e).__name__}: {e}")
            return
        status = response.status_code
        report.statuses[status] = report.statuses.get(status, 0) + 1
        problem = None
        if not getattr(response, "stream_cut_short", False):
            problem = check_response(case.operation.path, _as_httpx(response))
        if problem is None:
            try:
                case.validate_response(response, checks=checks)
            except FailureGroup as e:
                problem = str(e).strip().splitlines()[0] + ": " + _titles(e)
        if problem is not None:
            curl = case.as_curl_command(base_url=base_url)
            report.failures.append(f"{label}: {problem}\n    {curl[:600]}")

    return run


def _titles(group: Exception) -> str:
    return "; ".join(getattr(f, "title", str(f)) for f in getattr(group, "exceptions", []))


def _as_httpx(response: Any) -> httpx.Response:
    """schemathesis answers with its own ``Response``; the checks above read httpx's."""
    headers = [(k, v) for k, values in response.headers.items() for v in values]
    return httpx.Response(response.status_code, headers=headers, content=response.content)


def hostile_string_cases(model: str, body_bytes: int) -> list[tuple[str, str, dict[str, Any]]]:
    """``(label, path, body)`` cases schemathesis does not generate: JSON hidden inside
    strings (where the body's depth and surrogate checks never look) and text that is huge
    but within ``body_bytes``. Each must get a 4xx, never a 5xx."""
    deep = "[" * 50_000 + "]" * 50_000
    surrogate = '{"a": "\\ud800"}'  # a lone surrogate once the string is parsed as JSON
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}

    def with_arguments(arguments: str) -> dict[str, Any]:
        tool_call = {**call, "function": {"name": "f", "arguments": arguments}}
        return {
            "model": model,
            "max_tokens": 1,
            "messages": [
                {"role": "assistant", "content": None, "tool_calls": [tool_call]},
                {"role": "tool", "content": "ok", "tool_call_id": "c"},
            ],
        }

    chat = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    completion = {"model": model, "max_tokens": 1, "prompt": "Hi"}
    huge = "x " * (body_bytes // 2 - 4096)
    cases = [
        ("deep arguments", "/v1/chat/completions", with_arguments(deep)),
        ("surrogate arguments", "/v1/chat/completions", with_arguments(surrogate)),
        ("deep arguments (tokenize)", "/tokenize", with_arguments(deep)),
        (
            "huge message",
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "user", "content": huge}]},
        ),
        ("huge prompt", "/v1/completions", {**completion, "prompt": huge}),
    ]
    for key in ("guided_json", "structured_outputs"):
        for name, text in (("deep", deep), ("surrogate", surrogate)):
            value: Any = {"json": text} if key == "structured_outputs" else text
            for path, base in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
                cases.append((f"{name} {key} ({path})", path, {**base, key: value}))
    return cases


def check_hostile_strings(base_url: str, model: str, body_bytes: int, report: FuzzReport) -> None:
    """Send ``hostile_string_cases``; anything but a 4xx in OpenAI's shape is a failure."""
    with httpx.Client(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as client:
        for label, path, body in hostile_string_cases(model, body_bytes):
            report.cases["hostile strings"] = report.cases.get("hostile strings", 0) + 1
            response = client.post(path, json=body)
            report.statuses[response.status_code] = report.statuses.get(response.status_code, 0) + 1
            problem = check_response(path, response)
            if problem is None and not 400 <= response.status_code < 500:
                problem = f"status {response.status_code}, expected a 4xx"
            if problem is not None:
                report.failures.append(f"hostile strings, {label}: {problem}")


def fuzz_server_configs():
    """The engine and server settings of a fuzz run: small context, bounded prompts."""
    from mlxserve.scheduler.config import EngineConfig
    from mlxserve.server.config import ServerConfig

    engine = EngineConfig(max_total_tokens=512, max_running_requests=4)
    server = ServerConfig(
        port=0, max_prompt_tokens=64, request_timeout=15, max_body_bytes=1024 * 1024
    )
    return engine, server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=200, help="cases per operation and mode")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: fixed)")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--url", default=None, help="fuzz this server instead of starting one")
    args = parser.parse_args(argv)
    from bench._env import enable_blas

    print(enable_blas())
    if args.url:
        report = fuzz(args.url, args.examples, max_tokens=args.max_tokens, seed=args.seed)
    else:
        from mlxserve.mlx_backend.loading.dequantize import dequantize_for_cpu
        from mlxserve.mlx_backend.loading.loader import load_model
        from mlxserve.server.lifecycle.launch import serve_in_background

        loaded = load_model(None)
        dequantize_for_cpu(loaded.model)
        srv = serve_in_background(loaded, *fuzz_server_configs())
        try:
            report = fuzz(srv.url, args.examples, max_tokens=args.max_tokens, seed=args.seed)
            assert srv.engine is not None
            if not srv.engine.wait_idle(60):
                report.failures.append("the engine is still busy after the run")
            srv.engine.check_integrity()  # raises on a leaked slot
        finally:
            srv.stop()
    for label, count in report.cases.items():
        print(f"{count:6d}  {label}")
    print(f"cases tried: {report.total} in {report.seconds:.1f} s; statuses {report.statuses}")
    print(f"failures: {len(report.failures)}")
    for failure in report.failures:
        print(" -", failure)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
