"""Several models behind one server: declared by name, loaded on demand (once, however many
requests ask), unloaded least recently used first, by an idle time-out or on request
(waiting for running requests, or ending them with ``force``), each model with its own
engine whose slots are all accounted for when it is unloaded; names that are not declared
(paths, URLs, hub ids) are 404s that load nothing."""

from __future__ import annotations

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
from tests.ops_helpers import metric, scrape
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
    config = config or ServerConfig(port=0)
    holder = {}

    def make_loader(metrics):  # noqa: ANN001, ANN202
        holder["loader"] = AuditingLoader(ENGINE_CONFIG, metrics)
        return holder["loader"]

    from mlxserve.server.app import create_app  # noqa: F401 - the loader needs the metrics

    server = serve_models_in_background(declarations, ENGINE_CONFIG, config, make_loader)
    return server, holder["loader"]


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
        loads = sum(metric(samples, "mlxserve:model_loads_total", model_name=n) for n in listed)
        assert loads == len(loader.unloaded) + 1, (loads, loader.unloaded)

    def test_ten_first_requests_cause_one_load(self, swapping) -> None:  # noqa: ANN001
        server, _ = swapping
        target = next(n for n, s in statuses(server.url).items() if s == "unloaded")
        before = (
            metric(scrape(server.url), "mlxserve:model_loads_total", model_name=target)
            if (_has(server.url, "mlxserve:model_loads_total", target))
            else 0
        )
        with ThreadPoolExecutor(10) as pool:
            responses = list(pool.map(lambda _: complete(server.url, target), range(10)))
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        after = metric(scrape(server.url), "mlxserve:model_loads_total", model_name=target)
        assert after - before == 1, (before, after)


def _has(url: str, name: str, model: str) -> bool:
    try:
        metric(scrape(url), name, model_name=model)
    except AssertionError:
        return False
    return True
