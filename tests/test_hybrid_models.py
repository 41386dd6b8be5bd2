"""Hybrid (recurrent + attention) and sliding-window models under batching, chunked
prefill and preemption: exactly mlx-lm's single-sequence greedy tokens.

Each architecture is a tiny random-weight model built from mlx-lm's own ``ModelArgs``,
saved as a model dir and loaded through ``load_model`` (``tests/tiny_models.py``).
Windows are 8 tokens, prompts up to 20 and chunks 7, so windows really slide and prompts
are really chunked. Every engine is checked for leaked token and state slots on teardown.
"""

from __future__ import annotations

import pytest

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.mlx_backend.loading.loader import load_model
from mlxserve.scheduler import row_groups
from mlxserve.scheduler.sampling_params import SamplingParams
from tests.conftest import (
    Collector,
    NoEosTokenizer,
    gather_attention,
    greedy_reference,
    spy_row_groups,
    submit,
)
from tests.tiny_models import (
    ARCHITECTURES,
    EXTRA_ARCHITECTURES,
    IN_MEMORY_ARCHITECTURES,
    RECURRENT_ARCHITECTURES,
    SLIDING_ARCHITECTURES,
    WINDOW,
    build_tiny_model,
    build_tiny_model_dir,
)

DIR_ARCHITECTURES = ARCHITECTURES + EXTRA_ARCHITECTURES

PROMPT_LENGTHS = (3, 11, 5, 20, 1, 9)
MAX_TOKENS = 12
CHUNK = 7


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: build_tiny_model_dir(arch, root / arch) for arch in DIR_ARCHITECTURES}


def load_tiny(arch: str, tiny_dirs) -> LoadedModel:
    """Through the normal loading path; gear only in memory (transformers rejects its
    config.json, see tests/tiny_models.py)."""
    if arch in IN_MEMORY_ARCHITECTURES:
        model, _ = build_tiny_model(arch)
        return LoadedModel(model, NoEosTokenizer(), arch, {}, context_length=512)
    return load_model(str(tiny_dirs[arch]))


def prompts_for(lengths=PROMPT_LENGTHS) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 200 + 10 for j in range(n)] for i, n in enumerate(lengths)]


def run_batch(engine, prompts, max_tokens=MAX_TOKENS, late=True):
    """Submit all prompts (the last after the first has started decoding)."""
    col = Collector()
    for i, prompt in enumerate(prompts):
        if late and i == len(prompts) - 1:
            col.wait_tokens("0", 2)
        submit(engine, col, str(i), prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    finals = [col.wait(str(i)) for i in range(len(prompts))]
    for f in finals:
        assert f.finish_reason == "length", f"request ended with {f.finish_reason}: {f.error}"
    return [col.tokens[str(i)] for i in range(len(prompts))]


def assert_exact(arch, outputs, references):
    for i, (got, want) in enumerate(zip(outputs, references, strict=True)):
        assert got == want, f"{arch} request {i}: engine {got} != mlx-lm {want}"


class TestExactUnderBatching:
    @pytest.mark.parametrize("arch", DIR_ARCHITECTURES + IN_MEMORY_ARCHITECTURES)
    def test_concurrent_chunked_requests_match_mlx_lm(
        self, arch, tiny_dirs, make_engine, attention_spy
    ):
        loaded = load_tiny(arch, tiny_dirs)
        prompts = prompts_for()
        refs = [greedy_reference(loaded.model, p, MAX_TOKENS) for p in prompts]
        engine = make_engine(
            loaded, max_total_tokens=512, max_running_requests=8, max_prefill_tokens=CHUNK
        )
        assert_exact(arch, run_batch(engine, prompts), refs)
        # With the dispatch on, the layers planned for the native op really ran on it.
        assert not attention_spy.fallbacks, f"{arch}: runtime fallbacks {attention_spy.fallbacks}"
        if engine.executor.attention.ragged_layers:
            assert attention_spy.native_calls > 0, f"{arch}: the native op never ran"
        for op in engine.executor.native_ops.ops:  # what the load-time probe saw it reach
            assert attention_spy.elementwise_calls[op] > 0, f"{arch}: native {op} never ran"

    @pytest.mark.parametrize("arch", DIR_ARCHITECTURES + IN_MEMORY_ARCHITECTURES)
    def test_decode_split_by_context_matches_mlx_lm(
        self, arch, tiny_dirs, make_engine, monkeypatch
    ):
        # On the pure-MLX attention path (MLX's SDPA over gathered K/V, as without the
        # native op) every distinct context length decodes in its own forward (recurrent
        # state, sliding windows and full attention each gathered and written back per group).
        gather_attention(monkeypatch)
        monkeypatch.setattr(row_groups, "DECODE_OVERHEAD_KEYS", 0)
        loaded = load_tiny(arch, tiny_dirs)
        prompts = prompts_for()
        refs = [greedy_reference(loaded.model, p, MAX_TOKENS) for p in prompts]
        engine = make_engine(loaded, max_total_tokens=512, max_running_requests=8)
        groups = spy_row_groups(engine, phase="decode")
        assert_exact(arch, run_batch(engine, prompts, late=False), refs)
        if engine.executor.layout.attention:
            assert max(groups) > 1, f"decode was meant to be split, got groups {groups}"
        else:
            assert max(groups) == 1, "without attention layers no decode row is padded"


class TestPreemption:
    @pytest.mark.parametrize("arch", ["nemotron_h", "jamba", "gemma3_text", "qwen3_next"])
    def test_preempted_requests_match_mlx_lm(self, arch, tiny_dirs, make_engine):
        loaded = load_tiny(arch, tiny_dirs)
        prompts = prompts_for((4, 6, 5, 7, 3, 6))
        refs = [greedy_reference(loaded.model, p, 20) for p in prompts]
        # 6 requests of up to 27 tokens cannot all fit in 64 full-attention slots.
        engine = make_engine(
            loaded, max_total_tokens=64, max_running_requests=6, max_prefill_tokens=CHUNK
        )
        outputs = run_batch(engine, prompts, max_tokens=20, late=False)
        assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
        assert_exact(arch, outputs, refs)


class TestSlidingWindowMemory:
    @pytest.mark.parametrize("arch", SLIDING_ARCHITECTURES + IN_MEMORY_ARCHITECTURES)
    def test_sliding_slots_stay_bounded_by_the_window(self, arch, tiny_dirs, make_engine):
        loaded = load_tiny(arch, tiny_dirs)
        engine = make_engine(loaded, max_total_tokens=512, max_prefill_tokens=CHUNK)
        sliding = engine.scheduler.spaces.sliding
        assert sliding is not None, f"{arch} should have a sliding-window slot space"
        total = sliding.allocator.size
        tree = engine.scheduler.cache.tree
        held, cached = [], []
        col = Collector()
        on_output = col.callback("long")

        def record(event):
            # Runs on the engine thread between steps: the allocator is quiescent.
            in_cache = tree.evictable["sliding"] + tree.protected["sliding"]
            held.append(total - sliding.allocator.available_size() - in_cache)
            cached.append(in_cache)
            on_output(event)

        prompt = prompts_for((16 * WINDOW,))[0]
        ref = greedy_reference(loaded.model, prompt, 3 * WINDOW)
        params = SamplingParams(max_tokens=3 * WINDOW, temperature=0.0, ignore_eos=True)
        engine.add_request("long", prompt, params, record)
        col.wait("long")
        assert col.tokens["long"] == ref, f"{arch}: long request differs from mlx-lm"
        assert max(held) <= WINDOW, (
            f"{arch}: a {len(prompt) + 3 * WINDOW}-token request held up to {max(held)} "
            f"sliding slots; the window is {WINDOW}"
        )
        # The prefix cache keeps the window behind its insert points (the prompt's end and
        # the finished sequence's end), nothing more.
        assert max(cached[:-1]) <= WINDOW - 1, f"{arch}: the cache kept {max(cached)} slots"
        assert cached[-1] <= 2 * (WINDOW - 1), "after the finish insert"


class TestRecurrentStateSlots:
    @pytest.mark.parametrize("arch", RECURRENT_ARCHITECTURES + IN_MEMORY_ARCHITECTURES)
    def test_one_state_slot_per_running_request(self, arch, tiny_dirs, make_engine):
        loaded = load_tiny(arch, tiny_dirs)
        engine = make_engine(loaded, max_total_tokens=512, max_running_requests=4)
        states = engine.scheduler.state_allocator
        assert states is not None, f"{arch} should have recurrent-state slots"
        # One state slot per request row, and as many again for prefix-cache snapshots.
        assert states.size == 8
        run_batch(engine, prompts_for((5, 9, 2)), max_tokens=4, late=False)
        assert engine.wait_idle(30)
        snapshots = engine.scheduler.cache.owned_states()
        assert 0 < len(snapshots) <= 8
        assert states.available_size() + len(snapshots) == 8, "a state slot leaked"
