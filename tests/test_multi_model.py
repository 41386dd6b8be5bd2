"""Several models behind one server: declared by name, loaded on demand (once, however many
requests ask), unloaded least recently used first, by an idle time-out or on request
(waiting for running requests, or ending them with ``force``), each model with its own
engine whose slots are all accounted for when it is unloaded; names that are not declared
(paths, URLs, hub ids) are 404s that load nothing."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from mlxserve.mlx_backend.loading.loader import load_model
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.config import ServerConfig
from mlxserve.server.lifecycle.launch import BackgroundServer
from mlxserve.server.lifecycle.model_loader import EngineModelLoader
from mlxserve.server.lifecycle.multi_model import serve_models_in_background
from mlxserve.server.models.declarations import ModelDeclaration
from mlxserve.server.models.served_model import ServedModel
from tests.conftest import greedy_reference
from tests.ops_helpers import cli_server, scrape, sse_payloads
from tests.tiny_models import build_tiny_model_dir

ENGINE_CONFIG = EngineConfig(max_total_tokens=512, max_running_requests=8)
PROMPT = "hello there"
MAX_TOKENS = 6


class AuditingLoader(EngineModelLoader):
    """Checks, at every unload, that the engine accounts for every slot, and counts loads."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.unloaded: list[str] = []

    def unload(self, model: ServedModel) -> None:
        engine = model.engine
        assert engine.wait_idle(30), f"{model.name} unloaded while busy"
        engine.check_integrity()
        self.unloaded.append(model.name)
        super().unload(model)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": build_tiny_model_dir("llama", root / "llama"),
        "qwen3": build_tiny_model_dir("qwen3", root / "qwen3", seed=1),
    }


@pytest.fixture(scope="module")
def references(tiny_dirs: dict[str, Path]) -> dict[str, str]:
    """Each tiny model's greedy continuation of PROMPT, by mlx-lm alone."""
    out = {}
    for name, path in tiny_dirs.items():
        loaded = load_model(str(path))
        ids = list(loaded.tokenizer.encode(PROMPT))
        out[name] = loaded.tokenizer.decode(greedy_reference(loaded.model, ids, MAX_TOKENS))
    return out


def serve(declarations, config=None) -> tuple[BackgroundServer, AuditingLoader]:  # noqa: ANN001
    server = serve_models_in_background(
        declarations, ENGINE_CONFIG, config or ServerConfig(port=0), AuditingLoader
    )
    return server, server.app.state.server.loader


def complete(url: str, model: str, **fields) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body | fields, timeout=300)


def statuses(url: str) -> dict[str, str]:
    models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    return {m["id"]: m["status"] for m in models}


@pytest.fixture(scope="module")
def swapping(tiny_dirs: dict[str, Path]) -> Iterator[tuple[BackgroundServer, AuditingLoader]]:
    declarations = [
        ModelDeclaration(str(tiny_dirs["llama"]), names=("llama", "default")),
        ModelDeclaration(str(tiny_dirs["qwen3"]), names=("qwen3",)),
        ModelDeclaration(None, names=("smol",)),
    ]
    server, loader = serve(declarations, ServerConfig(port=0, max_loaded_models=1))
    try:
        yield server, loader
    finally:
        server.stop()


class TestSwapping:
    def test_models_are_listed_with_their_status(self, swapping) -> None:  # noqa: ANN001
        server, _ = swapping
        listed = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
        assert [(m["id"], m["status"]) for m in listed] == [
            ("llama", "loaded"),
            ("qwen3", "unloaded"),
            ("smol", "unloaded"),
        ], listed
        assert listed[0]["max_model_len"] > 0 and "max_model_len" not in listed[1], listed
        alias = httpx.get(server.url + "/v1/models/default", timeout=30).json()
        assert alias["id"] == "default" and alias["status"] == "loaded", alias

    def test_alternating_requests_are_all_right(self, swapping, references) -> None:  # noqa: ANN001
        server, loader = swapping
        order = ["qwen3", "llama", "qwen3", "smol", "llama", "default", "qwen3"]
        with ThreadPoolExecutor(len(order)) as pool:
            responses = list(pool.map(lambda m: complete(server.url, m), order))
        smol = None
        for model, response in zip(order, responses, strict=True):
            assert response.status_code == 200, (model, response.text)
            text = response.json()["choices"][0]["text"]
            arch = {"default": "llama"}.get(model, model)
            if arch == "smol":
                smol = text
                continue
            assert text == references[arch], (model, text, references[arch])
        assert smol is not None and smol.strip(), "the embedded model answered"
        listed = statuses(server.url)
        assert list(listed.values()).count("loaded") == 1, listed
        # Every unload checked its engine's slots (AuditingLoader) and each residency
        # loaded once: loads == unloads + the one still loaded.
        samples = scrape(server.url)
        loads = sum(counted(samples, "mlxserve:model_loads_total", n) for n in listed)
        assert loads == len(loader.unloaded) + 1, (loads, loader.unloaded)

    def test_ten_first_requests_cause_one_load(self, swapping) -> None:  # noqa: ANN001
        server, _ = swapping
        target = next(n for n, s in statuses(server.url).items() if s == "unloaded")
        before = counted(scrape(server.url), "mlxserve:model_loads_total", target)
        with ThreadPoolExecutor(10) as pool:
            responses = list(pool.map(lambda _: complete(server.url, target), range(10)))
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        after = counted(scrape(server.url), "mlxserve:model_loads_total", target)
        assert after - before == 1, (before, after)


def counted(samples: dict, name: str, model: str) -> float:
    """A per-model sample of a scrape (0 when the model has none yet)."""
    return samples.get((name, frozenset({("model_name", model)})), 0.0)


@pytest.fixture(scope="module")
def lifecycle(tiny_dirs: dict[str, Path]) -> Iterator[tuple[BackgroundServer, AuditingLoader]]:
    declarations = [
        ModelDeclaration(str(tiny_dirs["llama"]), names=("pinned",), pinned=True),
        ModelDeclaration(str(tiny_dirs["qwen3"]), names=("brief",), ttl=1.0),
        # Slow enough (the embedded SmolLM2 on the CPU) to be caught mid-request.
        ModelDeclaration(None, names=("busy",)),
    ]
    server, loader = serve(declarations, ServerConfig(port=0, memory_budget="8GiB"))
    try:
        yield server, loader
    finally:
        server.stop()


class TestLifecycle:
    def test_an_idle_model_is_unloaded_after_its_ttl(self, lifecycle) -> None:  # noqa: ANN001
        server, loader = lifecycle
        assert complete(server.url, "brief").status_code == 200
        assert statuses(server.url)["brief"] == "loaded"
        deadline = time.monotonic() + 10
        while statuses(server.url)["brief"] != "unloaded":
            assert time.monotonic() < deadline, "the idle time-out never unloaded it"
            time.sleep(0.2)
        assert "brief" in loader.unloaded
        assert statuses(server.url)["pinned"] == "loaded", "a pinned model stays"
        unloads = counted(scrape(server.url), "mlxserve:model_unloads_total", "brief")
        assert unloads >= 1

    def test_unloading_a_busy_model_waits_for_its_requests(self, lifecycle) -> None:  # noqa: ANN001
        server, _ = lifecycle
        body = {"model": "busy", "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
        body |= {"stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            events = sse_payloads(r.iter_lines())
            next(events)  # it runs
            done: list[httpx.Response] = []
            unloading = threading.Thread(
                target=lambda: done.append(
                    httpx.post(server.url + "/v1/models/busy/unload", timeout=120)
                )
            )
            unloading.start()
            time.sleep(0.5)
            assert not done, "the unload waits while the stream runs"
            refused = complete(server.url, "busy")
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "model_unloading", refused.text
            rest = list(events)
        assert rest[-1] == "[DONE]" and all("error" not in e for e in rest[:-1]), rest[-3:]
        unloading.join(60)
        assert done and done[0].json()["status"] == "unloaded", done and done[0].text

    def test_a_forced_unload_ends_the_requests(self, lifecycle) -> None:  # noqa: ANN001
        server, _ = lifecycle
        assert httpx.post(server.url + "/v1/models/busy/load", timeout=120).json()["status"] == (
            "loaded"
        )
        body = {"model": "busy", "prompt": PROMPT, "max_tokens": 400, "temperature": 0}
        body |= {"stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            events = sse_payloads(r.iter_lines())
            next(events)
            forced = httpx.post(server.url + "/v1/models/busy/unload?force=true", timeout=60)
            assert forced.json()["status"] == "unloaded", forced.text
            rest = list(events)
        errors = [e for e in rest if isinstance(e, dict) and "error" in e]
        assert errors and errors[0]["error"]["code"] == "model_unloaded", rest[-3:]

    @pytest.mark.parametrize(
        "name", ["../pinned", "/tmp/model", "org/repo", "https://example.com/m", "PINNED", ""]
    )
    def test_undeclared_names_load_nothing(self, lifecycle, name: str) -> None:  # noqa: ANN001
        server, loader = lifecycle
        before = dict(loader.progress)
        response = complete(server.url, name)
        assert response.status_code in (400, 404), response.text
        if response.status_code == 404:
            assert response.json()["error"]["code"] == "model_not_found", response.text
        admin = httpx.post(server.url + f"/v1/models/{name}/load", timeout=30)
        assert admin.status_code in (404, 405), admin.text
        assert loader.progress.keys() == before.keys(), "nothing was loaded"

    def test_health_lists_every_model(self, lifecycle) -> None:  # noqa: ANN001
        server, _ = lifecycle
        health = httpx.get(server.url + "/health", timeout=30)
        assert health.status_code == 200, health.text
        models = health.json()["models"]
        assert set(models) == {"pinned", "brief", "busy"}, models
        assert models["pinned"] == {"status": "loaded"}, models

    def test_metrics_have_one_series_per_model(self, lifecycle) -> None:  # noqa: ANN001
        server, _ = lifecycle
        text = httpx.get(server.url + "/metrics", timeout=30).text
        helps = [line for line in text.splitlines() if line.startswith("# HELP")]
        assert len(helps) == len(set(helps)), "no metric family is exported twice"
        assert 'mlxserve:num_requests_running{model_name="pinned"}' in text, text[:500]


class TestNoRoom:
    def test_a_model_over_the_budget_is_a_503(self, tiny_dirs: dict[str, Path]) -> None:
        declarations = [
            ModelDeclaration(str(tiny_dirs["llama"]), names=("first",), pinned=True),
            ModelDeclaration(None, names=("large",)),
        ]
        server, _ = serve(declarations, ServerConfig(port=0, memory_budget="40MiB"))
        try:
            response = complete(server.url, "large")
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "model_overloaded", response.text
            assert complete(server.url, "first").status_code == 200, "the others still serve"
        finally:
            server.stop()


class TestCli:
    def test_repeated_model_options(self, tiny_dirs: dict[str, Path], references) -> None:  # noqa: ANN001
        args = [
            "--model", f"{tiny_dirs['llama']},name=a",
            "--model", f"{tiny_dirs['qwen3']},name=b,max_total_tokens=256",
            "--max-loaded-models", "1", "--max-total-tokens", "512", "--log-level", "warning",
        ]  # fmt: skip
        with cli_server(args) as (_, url):
            assert statuses(url) == {"a": "loaded", "b": "unloaded"}
            response = complete(url, "b")
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == references["qwen3"]
            assert statuses(url) == {"a": "unloaded", "b": "loaded"}

    def test_a_served_name_needs_one_model(self, tiny_dirs: dict[str, Path]) -> None:
        import subprocess
        import sys

        cmd = [sys.executable, "-m", "mlxserve.server.cli", "--model", str(tiny_dirs["llama"])]
        cmd += ["--model", str(tiny_dirs["qwen3"]), "--served-model-name", "x"]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and "name=NAME" in result.stderr, result.stderr
