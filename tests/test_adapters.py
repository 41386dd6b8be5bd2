"""LoRA adapters: a declared model may be ``base + adapter`` (an mlx-lm adapter dir), served
under its own name; its greedy output equals ``mlx_lm.load(base, adapter_path=...)``'s.
Two adapters and the base itself share the base's weight arrays (one copy in memory, counted
once by the memory budget); a bad adapter dir fails its model's load with a 503 that says
why, and the others keep serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from mlx.utils import tree_flatten

from mlxserve.server.config import ServerConfig
from mlxserve.server.lifecycle.launch import BackgroundServer
from mlxserve.server.models.declarations import ModelDeclaration
from tests.conftest import greedy_reference
from tests.test_multi_model import MAX_TOKENS, PROMPT, complete, serve
from tests.tiny_adapters import build_lora_adapter_dir
from tests.tiny_models import build_tiny_model_dir


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    base = build_tiny_model_dir("llama", root / "base")
    return {
        "base": base,
        "one": build_lora_adapter_dir(base, root / "adapter-one", seed=1),
        "two": build_lora_adapter_dir(base, root / "adapter-two", seed=2, num_layers=1),
    }


@pytest.fixture(scope="module")
def references(dirs: dict[str, Path]) -> dict[str, str]:
    """Greedy continuations of PROMPT by mlx-lm's own load (with its adapter)."""
    from mlx_lm import load

    out = {}
    for name, adapter in (("base", None), ("one", dirs["one"]), ("two", dirs["two"])):
        model, tokenizer = load(str(dirs["base"]), adapter_path=adapter and str(adapter))
        ids = list(tokenizer.encode(PROMPT))
        out[name] = tokenizer.decode(greedy_reference(model, ids, MAX_TOKENS))
    return out


@pytest.fixture(scope="module")
def server(dirs: dict[str, Path]) -> Iterator[BackgroundServer]:
    base = str(dirs["base"])
    declarations = [
        ModelDeclaration(base, ("base",)),
        ModelDeclaration(base, ("one",), adapter=str(dirs["one"])),
        ModelDeclaration(base, ("two",), adapter=str(dirs["two"])),
        ModelDeclaration(base, ("broken",), adapter=str(dirs["base"])),  # not an adapter dir
    ]
    server, _ = serve(declarations, ServerConfig(port=0, memory_budget="2GiB"))
    try:
        yield server
    finally:
        server.stop()


def executor_model(server: BackgroundServer, name: str):  # noqa: ANN201
    return server.app.state.server.models.get(name).engine.executor.model


class TestAdapters:
    def test_each_equals_mlx_lm_adapter_load(self, server, references) -> None:  # noqa: ANN001
        assert len(set(references.values())) == 3, f"the adapters change the output: {references}"
        for name in ("one", "two", "base", "one"):
            response = complete(server.url, name)
            assert response.status_code == 200, (name, response.text)
            text = response.json()["choices"][0]["text"]
            assert text == references[name], (name, text, references[name])

    def test_the_base_weights_are_the_same_arrays(self, server) -> None:  # noqa: ANN001
        for name in ("base", "one", "two"):
            assert complete(server.url, name).status_code == 200
        trees = {n: executor_model(server, n) for n in ("base", "one", "two")}
        base = trees["base"].model.layers[1].self_attn.q_proj
        one = trees["one"].model.layers[1].self_attn.q_proj
        two = trees["two"].model.layers[1].self_attn.q_proj
        assert type(one).__name__ == "LoRALinear" and type(base).__name__ == "Linear"
        assert one.linear.weight is base.weight and two.linear.weight is base.weight
        assert one.lora_a is not two.lora_a, "each adapter has its own matrices"
        base_ids = {id(v) for _, v in tree_flatten(trees["base"].parameters())}
        for name in ("one", "two"):
            params = tree_flatten(trees[name].parameters())
            shared = [k for k, v in params if id(v) in base_ids]
            own = [k for k, v in params if id(v) not in base_ids]
            assert len(shared) == len(base_ids), (name, len(shared), len(base_ids))
            assert own and all(k.endswith(("lora_a", "lora_b")) for k in own), own

    def test_the_budget_counts_the_base_once(self, server) -> None:  # noqa: ANN001
        for name in ("base", "one", "two"):
            assert complete(server.url, name).status_code == 200
        registry = server.app.state.server.models
        entries = [e for e in registry.entries() if e.name in ("base", "one", "two")]
        keys = {key for e in entries for key in e.shared_bytes}
        assert len(keys) == 1, [e.shared_bytes for e in entries]
        base_bytes = entries[0].shared_bytes[keys.pop()]
        own = sum(e.resident_bytes for e in entries)
        assert registry.memory_in_use() == own + base_bytes, (registry.memory_in_use(), own)
        adapter_bytes = [e.resident_bytes - e.served.engine.plan.pool_bytes for e in entries]
        assert adapter_bytes[0] == 0 and 0 < adapter_bytes[1] < base_bytes, adapter_bytes

    def test_a_bad_adapter_dir_is_a_503_that_says_why(self, server) -> None:  # noqa: ANN001
        response = complete(server.url, "broken")
        assert response.status_code == 503, response.text
        assert "adapter" in response.json()["error"]["message"], response.text
        assert complete(server.url, "one").status_code == 200, "the others still serve"
        listed = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
        assert {m["id"]: m["status"] for m in listed}["broken"] == "unloaded", listed
