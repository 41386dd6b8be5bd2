"""The oracle of quantized K/V: mlx-lm generating one prompt alone with a
``QuantizedKVCache(group_size, bits)`` per attention layer from the first token.

mlx-lm's own ``generate_step(kv_bits=...)`` is not that reference: it runs the first
prefill chunk on a float ``KVCache`` and converts the cache only afterwards, so the prompt's
attention sees float K/V. Here every attention cache is quantized before the prompt
runs. ``QuantizedKVCache`` quantizes each token's K/V per head along the head dim (its
``step`` only sizes its buffers), so a whole-prompt prefill stores the bytes a
token-by-token one would. mlx-lm has no quantized ``RotatingKVCache``; a sliding layer
gets ``WindowedQuantizedKVCache``, which keeps every position and masks to the window,
what a rotating cache computes. Recurrent caches stay mlx-lm's float ``ArraysCache``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import (
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    create_attention_mask,
    make_prompt_cache,
)

from mlxserve.mlx_backend.cpu.blas import adaptive_thread_control
from mlxserve.scheduler.outputs import RequestOutput
from mlxserve.scheduler.sampling_params import SamplingParams


class WindowedQuantizedKVCache(QuantizedKVCache):
    """A quantized cache of a sliding-window layer: all positions, masked to the window."""

    def __init__(self, group_size: int, bits: int, window: int) -> None:
        super().__init__(group_size=group_size, bits=bits)
        self.window = window

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return create_attention_mask(
            N, offset=self.offset, return_array=return_array, window_size=window_size or self.window
        )


class DequantizedKVCache:
    """mlx-lm's quantized storage handed to the model as dequantized K/V: it has no
    ``bits``, so the model runs its dense attention (with sinks, say) on the values a
    quantized cache holds."""

    def __init__(self, quantized: QuantizedKVCache) -> None:
        self._quantized = quantized

    @property
    def offset(self) -> int:
        return self._quantized.offset

    @property
    def state(self):
        return self._quantized.keys, self._quantized.values

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        q = self._quantized
        k, v = q.update_and_fetch(keys, values)
        return (
            mx.dequantize(*k, group_size=q.group_size, bits=q.bits),
            mx.dequantize(*v, group_size=q.group_size, bits=q.bits),
        )

    def make_mask(self, *args, **kwargs):
        return self._quantized.make_mask(*args, **kwargs)


def quantized_caches(caches: list, bits: int, group_size: int, dense: bool = False) -> list:
    """``caches`` (a model's prompt cache) with every attention cache quantized (handed
    out dequantized with ``dense``)."""
    out = []
    for cache in caches:
        if type(cache) is CacheList:
            out.append(CacheList(*quantized_caches(cache.caches, bits, group_size, dense)))
            continue
        if type(cache) is KVCache:
            quantized = QuantizedKVCache(group_size=group_size, bits=bits)
        elif type(cache) is RotatingKVCache:
            quantized = WindowedQuantizedKVCache(group_size, bits, cache.max_size)
        else:
            out.append(cache)
            continue
        out.append(DequantizedKVCache(quantized) if dense else quantized)
    return out


def reference(
    model,
    prompt: list[int],
    max_tokens: int,
    bits: int | None,
    group_size: int = 64,
    dense: bool = False,
) -> tuple[list[int], list[float]]:
    """Greedy tokens of ``prompt`` alone and each token's logprob; ``bits`` None: mlx-lm's
    float caches; ``dense``: quantized caches handed out dequantized (dense attention)."""
    with one_blas_thread():
        return _reference(model, prompt, max_tokens, bits, group_size, dense)


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """OpenBLAS on one thread for the block (where mlxserve's shim lets us set it).

    NOTE: beside other jobs a multi-threaded OpenBLAS gemm waits for its preempted
    threads: SmolLM2's reference took 4-18 s per prompt on two threads, 2 s on one
    (measured at load average 7). The engine adapts its own thread count; this does the
    same for the reference, and gives the count back afterwards.
    """
    control = adaptive_thread_control()
    if control is None:
        yield
        return
    cpus, set_threads = control
    set_threads(1)
    try:
        yield
    finally:
        set_threads(cpus)


def _reference(model, prompt, max_tokens, bits, group_size, dense):
    caches = make_prompt_cache(model)
    if bits is not None:
        caches = quantized_caches(caches, bits, group_size, dense)
    tokens, logprobs = [], []
    steps = generate_step(
        mx.array(prompt),
        model,
        max_tokens=max_tokens,
        sampler=lambda x: mx.argmax(x, axis=-1),
        prompt_cache=caches,
    )
    for token, lp in steps:
        tokens.append(int(token))
        logprobs.append(float(lp[int(token)]))
    return tokens, logprobs


class LogprobCollector:
    """Tokens and their logprobs per request; ``wait`` blocks until one finished."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.logprobs: dict[str, list[float]] = {}
        self.final: dict[str, RequestOutput] = {}
        self._done: dict[str, threading.Event] = {}

    def callback(self, rid: str) -> Callable[[RequestOutput], None]:
        self.tokens[rid], self.logprobs[rid] = [], []
        self._done[rid] = threading.Event()

        def on_output(event: RequestOutput) -> None:
            self.tokens[rid].extend(event.new_token_ids)
            self.logprobs[rid].extend(e.logprob for e in event.logprobs or ())
            if event.finished:
                self.final[rid] = event
                self._done[rid].set()

        return on_output

    def wait(self, rid: str, timeout: float = 120.0) -> RequestOutput:
        assert self._done[rid].wait(timeout), f"{rid} did not finish in {timeout}s"
        final = self.final[rid]
        assert final.finish_reason == "length", f"{rid} ended {final.finish_reason}: {final.error}"
        return final


def run_greedy(
    engine, prompts: list[list[int]], max_tokens: int, late: bool = True
) -> tuple[list[list[int]], list[list[float]]]:
    """Submit every prompt greedily with logprobs (the last once the first decodes) and
    return each one's tokens and logprobs."""
    col = LogprobCollector()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    for i, prompt in enumerate(prompts):
        if late and i == len(prompts) - 1 and i > 0:
            _wait_tokens(col, "0", 2)
        engine.add_request(str(i), prompt, params, col.callback(str(i)))
    for i in range(len(prompts)):
        col.wait(str(i))
    ids = [str(i) for i in range(len(prompts))]
    return [col.tokens[i] for i in ids], [col.logprobs[i] for i in ids]


def _wait_tokens(col: LogprobCollector, rid: str, n: int, timeout: float = 60.0) -> None:
    done = threading.Event()
    for _ in range(int(timeout / 0.005)):
        if len(col.tokens[rid]) >= n:
            return
        done.wait(0.005)
    raise AssertionError(f"{rid} never reached {n} tokens")


# How close the engine's logprobs are to the reference's, on every attention path.
# NOTE: not bit for bit, even where attention is mlx-lm's own: a position's float K/V
# differ in their last bits with the batch that computed them (7e-7 between a 20- and a
# 30-token prefill in mlx-lm's own caches), and now and then such a difference moves a
# value across a quantization level. Measured here: most logprobs within 2e-5, while
# after a flipped level a request's logprobs move by up to 8e-3 (recurrent_gemma, 8-bit).
# So: the median within ROUNDING_TOL, 10x below the median distance between the quantized
# and the float reference (tests/test_kv_quantization.py: TestTheReferenceSeesQuantization;
# a wrong K/V read moves every logprob), and each one within LEVEL_FLIP_TOL.
ROUNDING_TOL = 1e-4
LEVEL_FLIP_TOL = 3e-2


def logprob_gaps(got: list[list[float]], want: list[list[float]]) -> np.ndarray:
    """|difference| of every aligned pair of logprobs."""
    return np.array(
        [abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)]
    )


def assert_matches(
    label: str,
    outputs,
    refs,
    rounding_tol: float = ROUNDING_TOL,
    level_flip_tol: float = LEVEL_FLIP_TOL,
) -> None:
    """Greedy tokens equal, logprobs within the tolerances above (or those given)."""
    (tokens, logprobs), (ref_tokens, ref_logprobs) = outputs, refs
    for i, (got, want) in enumerate(zip(tokens, ref_tokens, strict=True)):
        assert got == want, f"{label} request {i}: engine {got} != mlx-lm {want}"
    gaps = logprob_gaps(logprobs, ref_logprobs)
    assert np.median(gaps) <= rounding_tol, f"{label}: median logprob gap {np.median(gaps):.1e}"
    assert gaps.max() <= level_flip_tol, f"{label}: a logprob moved by {gaps.max():.1e}"
