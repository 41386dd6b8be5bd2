"""A spec's sampling fields -> the engine's ``SamplingParams`` (one per choice).

Checks that need the model are made here: ``logit_bias`` token ids inside the vocabulary
(MLX does not bounds-check, so a bad id must never reach the engine) and ``min_tokens``
within the resolved token budget. With ``n`` > 1 and a ``seed``, choice ``i`` samples with
``seed + i``: the choices differ, and each is reproducible.
"""

from __future__ import annotations

from mlxserve.scheduler.sampling_params import SamplingParams
from mlxserve.server.http.errors import invalid_request
from mlxserve.server.serving.spec import SamplingSpec

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` (wrapped to stay a signed 64-bit integer)."""
    if seed is None:
        return None
    value = seed + index
    if value > INT64_MAX:
        value -= 2**64
    return max(value, INT64_MIN)


def check_logit_bias(
    bias: dict[int, float] | None, vocab_size: int
) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as engine pairs.

    Raises:
        APIError: 400 naming ``logit_bias`` for a token id outside ``[0, vocab_size)``.
    """
    if not bias:
        return ()
    bad = sorted(t for t in bias if not 0 <= t < vocab_size)
    if bad:
        raise invalid_request(
            f"Token id {bad[0]} in 'logit_bias' is outside the vocabulary [0, {vocab_size}).",
            param="logit_bias",
        )
    return tuple(sorted(bias.items()))


def engine_params(
    sampling: SamplingSpec, max_tokens: int, vocab_size: int, index: int = 0
) -> SamplingParams:
    """The sampling parameters of choice ``index`` of a request.

    Args:
        sampling: the request's sampling fields.
        max_tokens: the resolved completion budget (>= 1).
        vocab_size: tokens the model can take and produce.
        index: the choice (0..n-1).

    Raises:
        APIError: 400 for parameters the model or the budget cannot take.
    """
    if sampling.min_tokens > max_tokens:
        raise invalid_request(
            f"'min_tokens' ({sampling.min_tokens}) must not exceed the completion budget "
            f"'max_tokens' ({max_tokens}).",
            param="min_tokens",
        )
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if sampling.temperature is None else sampling.temperature,
            top_p=1.0 if sampling.top_p is None else sampling.top_p,
            # top_k past the vocabulary keeps every token: it is "off" (and fits int32).
            top_k=0 if (sampling.top_k or 0) >= vocab_size else max(sampling.top_k or 0, 0),
            min_p=sampling.min_p or 0.0,
            ignore_eos=sampling.ignore_eos,
            seed=choice_seed(sampling.seed, index),
            presence_penalty=sampling.presence_penalty or 0.0,
            frequency_penalty=sampling.frequency_penalty or 0.0,
            repetition_penalty=sampling.repetition_penalty or 1.0,
            logit_bias=check_logit_bias(sampling.logit_bias, vocab_size),
            min_tokens=sampling.min_tokens,
            logprobs=sampling.logprobs,
            prompt_logprobs=sampling.prompt_logprobs,
        )
    except ValueError as e:
        # The schema checks the same ranges first; this is the engine's last word.
        raise invalid_request(f"Invalid sampling parameters: {e}") from e
