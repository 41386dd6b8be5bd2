"""Prefix cache through the engine: a hit never changes the output.

For every architecture of the hybrid suite (tiny random models, window 8, chunk 7) and for
the embedded SmolLM2, greedy tokens with the cache on equal mlx-lm's single-sequence
tokens cold, warm, in a multi-turn conversation, with requests sharing a prefix arriving
together, and after eviction and preemption under a tiny pool. Every engine is checked for
leaked slots on teardown (tree-owned slots included).
"""

from __future__ import annotations

import pytest

from mlxserve.scheduler.sampling_params import SamplingParams
from tests.conftest import Collector, greedy_reference, submit
from tests.test_hybrid_models import (
    CHUNK,
    DIR_ARCHITECTURES,
    IN_MEMORY_ARCHITECTURES,
    load_tiny,
    tiny_dirs,  # noqa: F401 - the module-scoped fixture
)
from tests.tiny_models import RECURRENT_ARCHITECTURES, SLIDING_ARCHITECTURES

MAX_TOKENS = 6
SYSTEM = [(5 * j) % 190 + 10 for j in range(17)]  # a shared "system prompt"


def run(engine, prompts: dict[str, list[int]], max_tokens=MAX_TOKENS):
    """Submit all at once; returns ({id: tokens}, {id: final event})."""
    col = Collector()
    for rid, prompt in prompts.items():
        submit(engine, col, rid, prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    finals = {rid: col.wait(rid) for rid in prompts}
    for rid, f in finals.items():
        assert f.finish_reason == "length", f"{rid} ended with {f.finish_reason}: {f.error}"
    return {rid: col.tokens[rid] for rid in prompts}, finals


def check(arch, model, prompts, outputs, max_tokens=MAX_TOKENS):
    for rid, prompt in prompts.items():
        want = greedy_reference(model, prompt, max_tokens)
        assert outputs[rid] == want, f"{arch} {rid}: engine {outputs[rid]} != mlx-lm {want}"


@pytest.mark.parametrize("arch", DIR_ARCHITECTURES + IN_MEMORY_ARCHITECTURES)
def test_cold_warm_multiturn_and_evicted_outputs_match_mlx_lm(arch, tiny_dirs, make_engine):  # noqa: F811
    loaded = load_tiny(arch, tiny_dirs)
    engine = make_engine(
        loaded, max_total_tokens=512, max_running_requests=8, max_prefill_tokens=CHUNK
    )
    sched = engine.scheduler
    # Cold: two requests sharing the system prompt, and the same prompt twice, together.
    cold = {"a": SYSTEM + [40, 41, 42], "b": SYSTEM + [50, 51], "a2": SYSTEM + [40, 41, 42]}
    out, finals = run(engine, cold)
    check(arch, loaded.model, cold, out)
    assert out["a"] == out["a2"]
    # The twin of "a" arrived with it but reused its prefill (all but the last token).
    assert finals["a2"].cached_tokens == len(cold["a2"]) - 1, finals["a2"]

    # Warm: an exact repeat, a new question on the same system prompt, and the next turn
    # of conversation "a" (its prompt + answer + a new message).
    turn2 = cold["a"] + out["a"] + [60, 61, 62, 63]
    warm = {"repeat": cold["b"], "c": SYSTEM + [70, 71, 72, 73], "turn2": turn2}
    out, finals = run(engine, warm)
    check(arch, loaded.model, warm, out)
    assert finals["repeat"].cached_tokens == len(cold["b"]) - 1
    # The whole first turn was in the pool: at least prompt + answer minus the last token.
    assert finals["turn2"].cached_tokens >= len(cold["a"]) + MAX_TOKENS - 1
    if arch not in SLIDING_ARCHITECTURES + IN_MEMORY_ARCHITECTURES:
        # Sliding models keep no window at the end of the system prompt; recurrent ones
        # resume from the snapshot at a chunk boundary inside it.
        want = len(SYSTEM) if arch not in RECURRENT_ARCHITECTURES else CHUNK
        assert finals["c"].cached_tokens >= want, finals["c"]

    # Partial eviction: evict half of the tree's nodes, then ask again.
    before = sched.cache.tree.node_count()
    _evict_on_engine_thread(engine, share=0.5)
    assert 0 < sched.cache.tree.node_count() < before
    again = {"turn2": turn2, "c": warm["c"], "d": SYSTEM + [80, 81]}
    out, _ = run(engine, again)
    check(arch, loaded.model, again, out)
    assert sched.prefix_cache_hits > 0


def _evict_on_engine_thread(engine, share: float) -> None:
    """Evict that share of the tree's nodes on the engine thread (the tree's owner), from
    the callback of a one-token request: the engine calls it between steps."""
    tree = engine.scheduler.cache.tree
    left = [int(tree.node_count() * share)]

    def enough() -> bool:
        left[0] -= 1
        return left[0] < 0

    col = Collector()
    record = col.callback("evict")

    def on_output(event):
        if event.finished:
            tree.evict(enough)
        record(event)

    engine.add_request("evict", [3], SamplingParams(max_tokens=1, temperature=0.0), on_output)
    col.wait("evict")


@pytest.mark.parametrize("arch", ["llama", "nemotron_h", "gemma3_text", "qwen3_next"])
def test_tiny_pool_evicts_and_preempts_shared_prefixes_exactly(arch, tiny_dirs, make_engine):  # noqa: F811
    loaded = load_tiny(arch, tiny_dirs)
    # 6 requests of ~30 tokens sharing 17 cannot all fit 96 slots: the cache is evicted
    # and running requests whose prefix is shared are preempted.
    engine = make_engine(
        loaded, max_total_tokens=96, max_running_requests=6, max_prefill_tokens=CHUNK
    )
    prompts = {f"r{i}": SYSTEM + [100 + i, 101 + i, 102 + i] for i in range(6)}
    out, _ = run(engine, prompts, max_tokens=12)
    check(arch, loaded.model, prompts, out, max_tokens=12)
    prompts = {f"s{i}": SYSTEM + [100 + i, 101 + i, 102 + i] for i in range(6)}
    out, _ = run(engine, prompts, max_tokens=12)
    check(arch, loaded.model, prompts, out, max_tokens=12)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    assert engine.scheduler.cache.tree.num_evicted_tokens > 0, "and eviction"


def test_n_identical_prompts_prefill_once(tiny_llama, make_engine):
    engine = make_engine(tiny_llama, max_total_tokens=512, max_prefill_tokens=64)
    prompt = list(range(10, 50))
    out, finals = run(engine, {str(i): prompt for i in range(3)})
    assert out["0"] == out["1"] == out["2"] == greedy_reference(tiny_llama.model, prompt, 6)
    # One full prefill, then one token each for the other two.
    assert engine.scheduler.prompt_tokens_computed == len(prompt) + 2
    assert sorted(f.cached_tokens for f in finals.values()) == [0, 39, 39]


def test_disabled_cache_recomputes_everything(tiny_llama, make_engine):
    engine = make_engine(tiny_llama, max_total_tokens=512, disable_prefix_cache=True)
    prompt = list(range(10, 30))
    run(engine, {"a": prompt})
    _, finals = run(engine, {"b": prompt})
    assert finals["b"].cached_tokens == 0
    assert engine.scheduler.prompt_tokens_computed == 2 * len(prompt)
    assert engine.scheduler.cache.tree is None


def test_smollm_multiturn_chat_warm_equals_cold(smollm, make_engine):
    tok = smollm.tokenizer
    system = {"role": "system", "content": "You are a terse assistant. Answer in few words."}
    turn1 = [system, {"role": "user", "content": "Name a primary color."}]
    engine = make_engine(smollm, max_total_tokens=2048, max_prefill_tokens=64)
    prompt1 = tok.apply_chat_template(turn1, add_generation_prompt=True)
    out, finals = run(engine, {"t1": prompt1}, max_tokens=8)
    check("smollm", smollm.model, {"t1": prompt1}, out, max_tokens=8)
    answer = tok.decode(out["t1"])
    turn2 = turn1 + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And another one?"},
    ]
    prompt2 = tok.apply_chat_template(turn2, add_generation_prompt=True)
    other = tok.apply_chat_template(
        [system, {"role": "user", "content": "Name a planet."}], add_generation_prompt=True
    )
    prompts = {"t2": prompt2, "other": other}
    out, finals = run(engine, prompts, max_tokens=8)
    check("smollm", smollm.model, prompts, out, max_tokens=8)
    assert finals["t2"].cached_tokens >= len(prompt1), "the first turn was reused"
    assert finals["other"].cached_tokens > 10, "the system prompt was reused"
