"""Backpressure and limits over real HTTP: a full queue (429), request timeouts that free
their slots, body size (413) and prompt length (400) limits; and a stalled stream reader,
whose request is aborted instead of holding the engine."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import httpx

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.scheduler.engine import Engine
from mlxserve.scheduler.sampling_params import SamplingParams
from mlxserve.server.config import ServerConfig
from mlxserve.server.serving.generation import Generation, GenerationError
from tests.ops_helpers import completion, metric, running_server, scrape, sse_payloads, wait_for

SMALL_ENGINE = EngineConfig(max_total_tokens=256, max_running_requests=2)


def assert_error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert error["code"] == code and error["message"], error
    return error


class TestQueueFull:
    def test_429_with_retry_after_beyond_max_queue(self, smollm: LoadedModel) -> None:
        engine_config = EngineConfig(max_total_tokens=256, max_running_requests=1)
        config = ServerConfig(port=0, max_queue=1)
        model = smollm.model_id
        with running_server(smollm, engine_config, config) as srv:
            engine = srv.engine
            # 200 tokens: the running request must outlast the queued and the refused
            # requests' round trips (20 tokens, ~0.6 s on a fast machine, did not once).
            with httpx.stream(
                "POST", srv.url + "/v1/completions",
                json=completion(model, max_tokens=200, stream=True), timeout=120,
            ) as running:  # fmt: skip
                # NOTE: keep the iterator: a collected one closes the connection (an abort).
                events = sse_payloads(running.iter_lines())
                next(events)  # its first token: it runs
                queued: list[httpx.Response] = []
                waiter = threading.Thread(
                    target=lambda: queued.append(
                        httpx.post(
                            srv.url + "/v1/completions",
                            json=completion(model, "Hi", max_tokens=1),
                            timeout=120,
                        )
                    )
                )
                waiter.start()
                wait_for(lambda: engine.stats().num_waiting == 1, 30, "a queued request")
                refused = httpx.post(
                    srv.url + "/v1/completions", json=completion(model, max_tokens=1), timeout=30
                )
                assert_error(refused, 429, "queue_full")
                assert int(refused.headers["retry-after"]) >= 1, refused.headers
                assert engine.stats().num_running == 1, "the running stream was not disturbed"
            # Leaving the stream aborts the running request, so the queued one runs now.
            waiter.join(120)
            assert queued and queued[0].status_code == 200, queued and queued[0].text


class TestRequestTimeout:
    def test_timeout_aborts_and_frees_slots(self, smollm: LoadedModel) -> None:
        config = ServerConfig(port=0, request_timeout=1.0)
        model = smollm.model_id
        body = completion(model, max_tokens=200)
        with running_server(smollm, SMALL_ENGINE, config) as srv:
            started = time.monotonic()
            with httpx.stream(
                "POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=120
            ) as response:
                payloads = list(sse_payloads(response.iter_lines()))
            assert time.monotonic() - started < 30, "the stream outlived its timeout"
            assert payloads[-1] == "[DONE]", payloads[-3:]
            error = payloads[-2]["error"]
            assert error["code"] == "request_timeout", error

            assert_error(
                httpx.post(srv.url + "/v1/completions", json=body, timeout=120),
                408,
                "request_timeout",
            )
            assert srv.engine.wait_idle(30), "timed-out requests must leave the engine"
            srv.engine.check_integrity()
            samples = scrape(srv.url)
            assert metric(samples, "mlxserve:request_success_total", finished_reason="abort") == 2


class TestBodyAndPromptLimits:
    def test_limits(self, smollm: LoadedModel) -> None:
        config = ServerConfig(port=0, max_body_bytes=1024, max_prompt_tokens=8)
        model = smollm.model_id
        with running_server(smollm, SMALL_ENGINE, config) as srv:
            url = srv.url + "/v1/completions"
            big = completion(model, "x" * 2000, max_tokens=1)
            # Announced by Content-Length: refused before reading.
            assert_error(httpx.post(url, json=big, timeout=30), 413, "request_too_large")

            # Chunked, no Content-Length: counted as it arrives.
            def chunks():
                for _ in range(4):
                    yield b" " * 512

            chunked = httpx.post(
                url, content=chunks(), headers={"Content-Type": "application/json"}, timeout=30
            )
            assert "content-length" not in chunked.request.headers
            assert_error(chunked, 413, "request_too_large")

            # Under the body limit but over max_prompt_tokens (11 > 8).
            long_prompt = httpx.post(url, json=completion(model, max_tokens=1), timeout=30)
            error = assert_error(long_prompt, 400, "prompt_too_long")
            assert error["param"] == "prompt", error

            fine = httpx.post(url, json=completion(model, "Hi", max_tokens=1), timeout=120)
            assert fine.status_code == 200, fine.text


class TestStalledReader:
    """A consumer that stops reading: its request is aborted once ``max_buffered_tokens``
    are waiting, and the engine never waits for it.

    NOTE: over HTTP the same happens only after uvicorn's write buffer and the kernel's
    socket buffers (hundreds of KiB) fill, far more tokens than a test can afford on the
    CPU; so this drives ``Generation`` (what the HTTP stream consumes) directly.
    """

    def test_overflow_aborts_the_request(
        self, smollm: LoadedModel, make_engine: Callable[..., Engine]
    ) -> None:
        engine = make_engine(smollm, max_total_tokens=256, max_running_requests=2)
        prompt = list(smollm.tokenizer.encode("1, 2, 3, 4,"))

        async def scenario() -> tuple[str, GenerationError | None]:
            gen = Generation(
                engine,
                smollm.tokenizer,
                "stalled",
                prompt,
                SamplingParams(max_tokens=50, temperature=0.0),
                [],
                max_buffered_tokens=2,
            )
            gen.start()
            # Not reading: the engine must finish with the request on its own (aborted).
            idle = await asyncio.get_running_loop().run_in_executor(None, engine.wait_idle, 60)
            assert idle, "the engine kept generating for a reader that does not read"
            text, error = "", None
            try:
                async for chunk in gen.chunks():
                    text += chunk.text
            except GenerationError as e:
                error = e
            return text, error

        text, error = asyncio.run(scenario())
        assert error is not None and error.code == "stream_buffer_overflow", error
        assert text.strip().startswith("5"), f"the buffered text still arrives first: {text!r}"
