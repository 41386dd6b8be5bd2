"""``--kv-bits 8`` end to end: the embedded SmolLM2 served over HTTP from quantized pools
sized by a memory budget (``/metrics`` shows the slots), with completions ``echo`` +
logprobs against mlx-lm's quantized cache, and ``n > 1`` choices sharing cached slots."""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import numpy as np
import openai
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxserve.mlx_backend import memory
from mlxserve.mlx_backend.kv.layer_layout import probe_layout
from mlxserve.mlx_backend.kv.quantization import KVQuantization
from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.lifecycle.launch import BackgroundServer
from tests.ops_helpers import metric, running_server, scrape
from tests.quantized_reference import quantized_caches

BUDGET = 64 * 2**20
ENGINE_CONFIG = EngineConfig(max_running_requests=4, mem_fraction=0.5, kv_bits=8)
TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom"


@pytest.fixture(scope="module")
def server(smollm: LoadedModel) -> Iterator[BackgroundServer]:
    # The pools are sized from "free memory" while the engine starts: a fixed budget here.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(memory, "available_memory_bytes", lambda: BUDGET)
        servers = running_server(smollm, ENGINE_CONFIG)
        srv = servers.__enter__()
    try:
        yield srv
    finally:
        servers.__exit__(None, None, None)


class TestSlotsFromTheBudget:
    def test_metrics_show_the_quantized_slot_count(self, server, smollm):
        layout = probe_layout(smollm.model)
        per_token = layout.bytes_per_token("full", KVQuantization(8, 64))
        want = int(BUDGET * ENGINE_CONFIG.mem_fraction) // per_token
        got = metric(scrape(server.url), "mlxserve:kv_cache_total_tokens")
        assert got == want, f"kv_cache_total_tokens {got}, expected {want} 8-bit slots"
        float_slots = int(BUDGET * ENGINE_CONFIG.mem_fraction) // layout.bytes_per_token("full")
        assert got >= 3.5 * float_slots, f"{got} slots vs {float_slots} float32 slots"


class TestEchoLogprobs:
    def test_prompt_logprobs_match_mlx_lm_with_a_quantized_cache(self, client, model, smollm):
        reply = client.completions.create(
            model=model, prompt=TEXT, max_tokens=1, temperature=0, echo=True, logprobs=0
        )
        got = reply.choices[0].logprobs.token_logprobs
        assert got[0] is None, "nothing predicts the first prompt token"
        ids = smollm.tokenizer.encode(TEXT)
        assert len(got) == len(ids) + 1, (len(got), len(ids))
        want = prompt_logprobs(smollm.model, ids, 8)
        floats = prompt_logprobs(smollm.model, ids, None)
        gaps = np.abs(np.array(got[1 : len(ids)]) - want)
        moved = np.abs(want - floats)
        # NOTE: served on the CPU default path (folded), whose float order differs from
        # mlx-lm's quantized SDPA; across SmolLM2's 30 layers that order moves a few values
        # across a quantization level (mlx-lm's own dense attention over the same
        # quantized cache sits a median 4.7e-3 from its quantized SDPA on this text). So
        # the bound is relative: closer to the reference than 8-bit K/V moves it.
        assert np.median(gaps) <= 0.5 * np.median(moved), (np.median(gaps), np.median(moved))
        assert gaps.max() <= moved.max(), (gaps.max(), moved.max())


def prompt_logprobs(model, ids: list[int], bits: int | None) -> np.ndarray:
    """mlx-lm's logprob of each prompt token after the first, on a quantized cache."""
    caches = make_prompt_cache(model)
    if bits is not None:
        caches = quantized_caches(caches, bits, 64)
    logits = model(mx.array([ids]), cache=caches)[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return np.array([float(logprobs[i, ids[i + 1]]) for i in range(len(ids) - 1)])


class TestSeveralChoices:
    def test_greedy_choices_equal_a_single_request(self, client: openai.OpenAI, model):
        messages = [{"role": "user", "content": "Name a fruit and its color."}]
        single = client.chat.completions.create(
            model=model, messages=messages, max_tokens=10, temperature=0
        )
        several = client.chat.completions.create(
            model=model, messages=messages, max_tokens=10, temperature=0, n=3, logprobs=True
        )
        assert len(several.choices) == 3
        want = single.choices[0].message.content
        for choice in several.choices:
            assert choice.message.content == want, (choice.index, choice.message.content, want)
            assert len(choice.logprobs.content) == several.usage.completion_tokens // 3
        assert several.usage.prompt_tokens_details.cached_tokens > 0, "no slot was reused"
