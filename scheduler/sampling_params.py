"""Per-request sampling parameters: the plain dataclass the server hands the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

# Tokens (prompt + output, most recent last) the repetition / presence / frequency penalties
# look at: mlx-lm's ``make_logits_processors`` default context size.
PENALTY_CONTEXT = 20
# Most top-k alternatives a request may ask for (OpenAI's ``top_logprobs`` limit).
MAX_LOGPROBS = 20
# OpenAI's range of a ``logit_bias`` value.
MAX_LOGIT_BIAS = 100.0
# Largest top_k the engine takes: the sampler holds it as int32 (a larger value once killed
# the engine thread); anything past the vocabulary means "off" anyway.
MAX_TOP_K = 2**31 - 1

# Penalties are applied in float32: a repetition_penalty that rounds to 0 or to inf there
# turns logits into inf or NaN (0 / 0), so it must be a normal float32.
MIN_REPETITION_PENALTY = float(np.finfo(np.float32).tiny)
MAX_REPETITION_PENALTY = float(np.finfo(np.float32).max)


# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS).
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops (token-level; stop strings live in server/).

    ``temperature`` below ``MIN_TEMPERATURE`` (0 included) means greedy: dividing logits by
    a tiny temperature overflows to infinity (``1e-40`` gave garbage). ``top_k == 0`` and
    ``top_p == 1`` and ``min_p == 0`` disable those filters.

    Attributes:
        seed: with a seed, the request's draws come from its own key derived from
            ``(seed, output position)``, so the same request gives the same tokens whatever
            else shares its batches. ``None`` uses the engine's RNG.
        presence_penalty: subtracted once from the logit of each token among the last
            ``PENALTY_CONTEXT`` tokens of prompt + output (OpenAI range -2..2).
        frequency_penalty: subtracted once per occurrence in that window (-2..2).
        repetition_penalty: sign-aware multiplicative penalty on the window's tokens
            (divides positive logits, multiplies negative ones; 1 = off). mlx-lm semantics.
        logit_bias: ``(token_id, bias)`` pairs added to the logits (a dict is accepted and
            converted). Token ids must be below the vocabulary size (the engine also drops
            out-of-range ids rather than index past the logits).
        min_tokens: EOS and ``stop_token_ids`` cannot be sampled before this many tokens.
        logprobs: ``None`` = off; ``k`` = return the sampled token's logprob plus the top
            ``k`` alternatives (raw log-softmax of the model, before any sampling transform).
        prompt_logprobs: ``None`` = off; ``k`` = logprob of every prompt token given its
            prefix (the first has none) plus the top ``k`` alternatives at each position.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in [0, {MAX_TOP_K}], got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be > 0 and a finite float32 (between "
                f"{MIN_REPETITION_PENALTY:.4g} and {MAX_REPETITION_PENALTY:.4g}), "
                f"got {self.repetition_penalty}"
            )
        self._check_logit_bias()
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be None or in [0, {MAX_LOGPROBS}], got {value}")

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = tuple((int(k), float(v)) for k, v in bias.items())
        else:
            bias = tuple((int(k), float(v)) for k, v in bias)
        # Frozen dataclass: normalizing the field in place is the documented way to do it.
        object.__setattr__(self, "logit_bias", bias)
        ids = [token for token, _ in bias]
        if any(token < 0 for token in ids):
            raise ValueError(f"logit_bias token ids must be >= 0, got {min(ids)}")
        if len(set(ids)) != len(ids):
            raise ValueError("logit_bias lists a token id more than once")
        for token, value in bias:
            if not (math.isfinite(value) and abs(value) <= MAX_LOGIT_BIAS):
                raise ValueError(
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {value} for token {token}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )
