"""The quality parts of ``bench/kv_quant.py``: greedy agreement with the float pool
(mlxserve's, and mlx-lm's own alone), and a text's mean log-likelihood over HTTP."""

from __future__ import annotations

import sys
from typing import Any

from bench.kv_quant_common import BITS, GROUP_SIZE, corpus, make_engine, pool_name, serve

# A fixed English text for the log-likelihood figure (public-domain: the opening of
# Dickens's "A Tale of Two Cities").
TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was "
    "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, "
    "it was the season of Light, it was the season of Darkness, it was the spring of hope, "
    "it was the winter of despair, we had everything before us, we had nothing before us, "
    "we were all going direct to Heaven, we were all going direct the other way - in short, "
    "the period was so far like the present period, that some of its noisiest authorities "
    "insisted on its being received, for good or for evil, in the superlative degree of "
    "comparison only."
)


def agreement(got: dict[int, list[int]], ref: dict[int, list[int]]) -> dict[str, float]:
    same = total = prefix = 0
    for i, want in ref.items():
        have = got[i]
        same += sum(a == b for a, b in zip(have, want, strict=False))
        total += len(want)
        n = 0
        while n < min(len(have), len(want)) and have[n] == want[n]:
            n += 1
        prefix += n / len(want)
    return {"positional": same / total, "common_prefix": prefix / len(ref)}


def quality(loaded: Any, requests: int, max_tokens: int, timeout_s: float) -> dict:
    """Greedy tokens of each pool (the backend's default attention path) against the
    float pool's."""
    from mlxserve.scheduler.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = corpus(loaded, requests)
    tokens = {}
    for bits in BITS:
        engine = make_engine(
            loaded, bits, None, max_total_tokens=requests * 512, max_running_requests=requests
        )
        res = serve(engine, prompts, params, timeout_s)
        tokens[pool_name(bits)] = res["tokens"]
        path = engine.executor.quantized_attention if bits else "float"
        print(f"quality {pool_name(bits)}: done ({path})", file=sys.stderr)
    return _agreement_report(tokens, requests, max_tokens)


def mlx_lm_quality(loaded: Any, requests: int, max_tokens: int) -> dict:
    """The same agreement for mlx-lm itself: each prompt generated alone on its float
    cache and on a ``QuantizedKVCache`` per layer from the first token."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

    def generate(prompt: list[int], bits: int | None) -> list[int]:
        caches = make_prompt_cache(loaded.model)
        if bits is not None:
            caches = [
                QuantizedKVCache(GROUP_SIZE, bits) if type(c) is KVCache else c for c in caches
            ]
        steps = generate_step(
            mx.array(prompt),
            loaded.model,
            max_tokens=max_tokens,
            sampler=lambda x: mx.argmax(x, axis=-1),
            prompt_cache=caches,
        )
        return [int(t) for t, _ in steps]

    prompts = corpus(loaded, requests)
    tokens = {pool_name(b): {i: generate(p, b) for i, p in enumerate(prompts)} for b in BITS}
    return _agreement_report(tokens, requests, max_tokens)


def loglik(loaded: Any) -> dict:
    """Mean log-likelihood per token of ``TEXT`` (completions ``echo`` + ``logprobs``)."""
    import openai

    from mlxserve.scheduler.config import EngineConfig
    from mlxserve.server.lifecycle.launch import serve_in_background

    out: dict[str, Any] = {"text_chars": len(TEXT), "pools": {}}
    for bits in BITS:
        config = EngineConfig(max_total_tokens=4096, kv_bits=bits, kv_group_size=GROUP_SIZE)
        server = serve_in_background(loaded, config)
        try:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
            res = client.completions.create(
                model=loaded.model_id,
                prompt=TEXT,
                max_tokens=1,
                echo=True,
                logprobs=0,
                temperature=0.0,
            )
        finally:
            server.stop()
        values = [v for v in res.choices[0].logprobs.token_logprobs if v is not None]
        # The last entry is the generated token's; the text's own are the others.
        values = values[:-1]
        out["pools"][pool_name(bits)] = {
            "tokens": len(values),
            "mean_loglik": sum(values) / len(values),
        }
    return out


def _agreement_report(tokens: dict[str, dict], requests: int, max_tokens: int) -> dict:
    """Each pool's greedy tokens against the float pool's ("off")."""
    out: dict[str, Any] = {"requests": requests, "max_tokens": max_tokens, "pools": {}}
    for name, got in tokens.items():
        agree = agreement(got, tokens["off"])
        out["pools"][name] = {
            "greedy_equal_positional": agree["positional"],
            "greedy_equal_prefix": agree["common_prefix"],
        }
    return out
