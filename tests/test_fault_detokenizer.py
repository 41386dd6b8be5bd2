"""Fault injection on the server side: a detokenizer that raises while serving one request
fails only that request (an OpenAI-style 5xx error, or an error chunk when streaming); the
requests beside it finish normally, the engine frees the failed request's slots
(``running_server`` checks on exit), and the server goes on serving."""

from __future__ import annotations

import threading

import httpx
import pytest

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.serving.detokenizer import IncrementalDetokenizer
from tests.ops_helpers import COUNTING, completion, running_server, sse_payloads

DOOMED = "Doomed: 1, 2, 3,"


@pytest.fixture
def faulty_detokenizer(smollm: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Detokenizers of prompts starting with DOOMED raise on their third token."""
    marker = list(smollm.tokenizer.encode(DOOMED))[:3]
    init, add = IncrementalDetokenizer.__init__, IncrementalDetokenizer.add

    def patched_init(self, tokenizer, prompt_ids):  # noqa: ANN001
        init(self, tokenizer, prompt_ids)
        self.doomed = list(prompt_ids[:3]) == marker
        self.seen = 0

    def patched_add(self, token: int) -> str:
        self.seen += 1
        if self.doomed and self.seen == 3:
            raise RuntimeError("injected detokenizer fault")
        return add(self, token)

    monkeypatch.setattr(IncrementalDetokenizer, "__init__", patched_init)
    monkeypatch.setattr(IncrementalDetokenizer, "add", patched_add)


def test_a_failing_detokenizer_fails_only_its_request(smollm: LoadedModel, faulty_detokenizer):
    config = EngineConfig(max_total_tokens=1024, max_running_requests=8)
    with running_server(smollm, config) as srv:
        model = smollm.model_id
        results: dict[str, object] = {}

        def plain(i: int) -> None:
            body = completion(model, COUNTING, max_tokens=12)
            results[f"plain{i}"] = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)

        def doomed_streamed() -> None:
            body = completion(model, DOOMED, max_tokens=12, stream=True)
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
                results["streamed"] = list(sse_payloads(r.iter_lines()))

        threads = [threading.Thread(target=plain, args=(i,)) for i in range(2)]
        threads.append(threading.Thread(target=doomed_streamed))
        for t in threads:
            t.start()
        doomed = httpx.post(
            srv.url + "/v1/completions", json=completion(model, DOOMED, max_tokens=12), timeout=120
        )
        for t in threads:
            t.join(120)
        assert doomed.status_code >= 500, doomed.text
        assert set(doomed.json()["error"]) == {"message", "type", "param", "code"}, doomed.text
        streamed = results["streamed"]
        assert any(isinstance(p, dict) and "error" in p for p in streamed), streamed
        for i in range(2):
            ok = results[f"plain{i}"]
            assert ok.status_code == 200, ok.text
            assert ok.json()["choices"][0]["finish_reason"] == "length"
        assert srv.engine.wait_idle(30) and srv.engine.is_alive
        again = httpx.post(
            srv.url + "/v1/completions", json=completion(model, max_tokens=8), timeout=60
        )
        assert again.status_code == 200, again.text
