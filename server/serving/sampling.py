"""A request's parameters -> the engine's ``SamplingParams`` (one per choice).

Checks that need the model are made here: ``logit_bias`` token ids inside the vocabulary
(MLX does not bounds-check, so a bad id must never reach the engine) and ``min_tokens``
within the resolved token budget. With ``n`` > 1 and a ``seed``, choice ``i`` samples with
``seed + i``: the choices differ, and each is reproducible.
"""

from __future__ import annotations

from mlxserve.scheduler.sampling_params import SamplingParams
from mlxserve.server.api.openai.schemas import INT64_MAX, INT64_MIN, GenerationRequest
from mlxserve.server.http.errors import invalid_request


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
    body: GenerationRequest, max_tokens: int, vocab_size: int, index: int = 0
) -> SamplingParams:
    """The sampling parameters of choice ``index`` of ``body``.

    Args:
        body: the parsed request.
        max_tokens: the resolved completion budget (>= 1).
        vocab_size: tokens the model can take and produce.
        index: the choice (0..n-1).

    Raises:
        APIError: 400 for parameters the model or the budget cannot take.
    """
    if body.min_tokens > max_tokens:
        raise invalid_request(
            f"'min_tokens' ({body.min_tokens}) must not exceed the completion budget "
            f"'max_tokens' ({max_tokens}).",
            param="min_tokens",
        )
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            # top_k past the vocabulary keeps every token: it is "off" (and fits int32).
            top_k=0 if (body.top_k or 0) >= vocab_size else max(body.top_k or 0, 0),
            min_p=body.min_p or 0.0,
            ignore_eos=body.ignore_eos,
            seed=choice_seed(body.seed, index),
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0,
            logit_bias=check_logit_bias(body.logit_bias, vocab_size),
            min_tokens=body.min_tokens,
            logprobs=body.logprobs_count(),
            prompt_logprobs=body.prompt_logprobs_count(),
        )
    except ValueError as e:
        # The schema checks the same ranges first; this is the engine's last word.
        raise invalid_request(f"Invalid sampling parameters: {e}") from e
