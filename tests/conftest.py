"""Shared fixtures: tiny random models, the embedded SmolLM2, engines checked for leaks."""

from __future__ import annotations

# NOTE: before anything imports mlx.core: libmlx binds cblas_sgemm when it is loaded, and
# the suite runs ~10x faster with OpenBLAS than with the wheel's reference BLAS.
from mlxserve.mlx_backend.cpu.blas import enable_fast_blas

enable_fast_blas()

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import llama

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.scheduler.engine import Engine
from mlxserve.scheduler.outputs import RequestOutput
from mlxserve.scheduler.sampling_params import SamplingParams
from mlxserve.server.lifecycle.engines import build_engine


class NoEosTokenizer:
    """Enough tokenizer for engine tests on random models: no end-of-sequence token."""

    eos_token_ids: list[int] = []


def make_tiny_llama(seed: int = 0, head_dim: int | None = None) -> LoadedModel:
    """A 2-layer random llama whose greedy output varies token to token (untied head,
    unit-scale embeddings), so a wrong KV read shows up as a different token; 2 K/V heads
    of ``head_dim`` (None: 16, hidden over heads)."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        vocab_size=256,
        tie_word_embeddings=False,
    )
    model = llama.Model(args)
    weights = []
    for name, w in tree_flatten(model.parameters()):
        if w.ndim == 2:
            std = 1.0 if "embed" in name else w.shape[1] ** -0.5
            w = mx.random.normal(w.shape) * std
        weights.append((name, w))
    model.load_weights(weights)
    mx.eval(model.parameters())
    name = "tiny-llama" if head_dim is None else f"tiny-llama-d{head_dim}"
    return LoadedModel(model, NoEosTokenizer(), name, {}, context_length=512)


def greedy_reference(model, prompt: list[int], max_tokens: int, eos: set[int] = frozenset()):
    """mlx-lm's own single-sequence greedy generation: the oracle."""
    out = []
    sampler = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=sampler):
        out.append(int(token))
        if int(token) in eos:
            break
    return out


class Collector:
    """Gathers engine events per request; ``wait`` blocks until a request finished."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.final: dict[str, RequestOutput] = {}
        self._done: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def callback(self, request_id: str) -> Callable[[RequestOutput], None]:
        with self._lock:
            self._done[request_id] = threading.Event()
            self.tokens[request_id] = []

        def on_output(event: RequestOutput) -> None:
            self.tokens[request_id].extend(event.new_token_ids)
            if event.finished:
                self.final[request_id] = event
                self._done[request_id].set()

        return on_output

    def wait_tokens(self, request_id: str, n: int, timeout: float = 60.0) -> None:
        """Block until the request has produced ``n`` tokens (it is decoding)."""
        deadline = time.monotonic() + timeout
        while len(self.tokens[request_id]) < n and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(self.tokens[request_id]) >= n, f"{request_id} never reached {n} tokens"

    def wait(self, request_id: str, timeout: float = 60.0) -> RequestOutput:
        assert self._done[request_id].wait(timeout), f"{request_id} did not finish in {timeout}s"
        return self.final[request_id]


def submit(engine: Engine, collector: Collector, rid: str, prompt, **params) -> None:
    engine.add_request(rid, prompt, SamplingParams(**params), collector.callback(rid))


def spy_row_groups(engine, phase: str | None = None) -> list[int]:
    """Record how many forwards each step of ``engine`` ran (its batch's row groups), for
    the steps of ``phase`` only when given."""
    seen: list[int] = []
    forward, launch = engine.executor.forward, engine.executor.launch

    def record(batch) -> None:
        if phase is None or batch.phase == phase:
            seen.append(max(1, len(batch.row_groups)))

    def recording(batch):
        record(batch)
        return forward(batch)

    def recording_launch(batch, *after):
        record(batch)
        return launch(batch, *after)

    engine.executor.forward = recording
    engine.executor.launch = recording_launch  # decode steps the engine overlaps
    return seen


def gather_attention(monkeypatch) -> None:
    """Run engines built after this on the pure-MLX attention path (MLX's SDPA over the
    gathered K/V), as without the native op."""
    from mlxserve.mlx_backend.attention import native

    off = native.NativeStatus(False, "turned off by the test")
    monkeypatch.setattr(native, "native_status", lambda: off)


class AttentionSpy:
    """Counts the native attention op's calls and the dispatch's runtime fallbacks, and the
    native elementwise ops' calls (``native_ops``: "swiglu", "rope", "rms_norm")."""

    def __init__(self) -> None:
        self.native_calls = 0
        self.fallbacks: list[tuple[int, str]] = []
        self.elementwise_calls: dict[str, int] = {"swiglu": 0, "rope": 0, "rms_norm": 0}


@pytest.fixture
def attention_spy(monkeypatch) -> AttentionSpy:
    from mlxserve.mlx_backend import native_ops
    from mlxserve.mlx_backend.attention import dispatch, native

    spy = AttentionSpy()
    op = native.ragged_attention
    silu_mul, rope_op, rms_norm_op = native_ops.silu_mul, native_ops.rope_op, native_ops.rms_norm_op

    def counting(*args, **kwargs):
        spy.native_calls += 1
        return op(*args, **kwargs)

    def counting_silu_mul(gate, x):
        spy.elementwise_calls["swiglu"] += 1
        return silu_mul(gate, x)

    def counting_rope_op(*args):
        spy.elementwise_calls["rope"] += 1
        return rope_op(*args)

    def counting_rms_norm_op(*args):
        spy.elementwise_calls["rms_norm"] += 1
        return rms_norm_op(*args)

    monkeypatch.setattr(native, "ragged_attention", counting)
    monkeypatch.setattr(native_ops, "silu_mul", counting_silu_mul)
    monkeypatch.setattr(native_ops, "rope_op", counting_rope_op)
    monkeypatch.setattr(native_ops, "rms_norm_op", counting_rms_norm_op)
    monkeypatch.setattr(
        dispatch, "_warn_once", lambda layer, why: spy.fallbacks.append((layer, why))
    )
    return spy


@pytest.fixture(scope="session")
def tiny_llama() -> LoadedModel:
    return make_tiny_llama()


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    """The embedded SmolLM2 as ``mlxserve`` serves it on the CPU backend: dequantized."""
    from mlxserve.mlx_backend.loading.dequantize import dequantize_for_cpu
    from mlxserve.mlx_backend.loading.loader import load_model

    loaded = load_model(None)
    status = dequantize_for_cpu(loaded.model)
    assert status.dequantized, status.reason
    return loaded


def audit_and_stop(engines: list[Engine]) -> None:
    """Teardown of engine fixtures: each engine must go idle with every slot accounted for;
    each is shut down."""
    for engine in engines:
        try:
            assert engine.wait_idle(60), "engine did not go idle"
            engine.check_integrity()
        finally:
            engine.shutdown()


@pytest.fixture
def make_engine() -> Iterator[Callable[..., Engine]]:
    """Build started engines; on teardown each must go idle with every slot accounted for."""
    engines: list[Engine] = []

    def build(loaded: LoadedModel, draft: LoadedModel | None = None, **config) -> Engine:
        engine = build_engine(loaded, EngineConfig(**config), draft=draft)
        engine.start()
        engines.append(engine)
        return engine

    yield build
    audit_and_stop(engines)


# The HTTP test modules each start one ``server`` (a module fixture of their own, with their
# engine sizes); these build on whichever ``server`` the requesting module defines.
@pytest.fixture(scope="module")
def client(server: Any) -> Any:
    """The official OpenAI client on the module's server."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def http(server: Any) -> Iterator[Any]:
    """An httpx client on the module's server."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def model(smollm: LoadedModel) -> str:
    """The served model's id."""
    return smollm.model_id
