"""The protocol-neutral generation spec: what every protocol adapter builds from its request.

An adapter (OpenAI chat or completions today; Anthropic Messages and OpenAI Responses next)
parses its body, renders and tokenizes the prompt, compiles its output constraint, and
hands one ``GenerationSpec`` to ``Admission.submit``. Nothing below this point knows which
protocol a request came in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxserve.scheduler.constraints import Constraint
from mlxserve.scheduler.multimodal import MultimodalPrompt


@dataclass(frozen=True)
class SamplingSpec:
    """How tokens are chosen, as the client asked (None: the server's default).

    Attributes:
        temperature: softmax temperature (default 1.0; 0 is greedy).
        top_p: nucleus mass (default 1.0: off).
        top_k: keep the k most likely tokens (None, 0 or -1: off).
        min_p: drop tokens below this share of the most likely one's probability.
        seed: the request's seed (choice ``i`` of ``n`` samples with ``seed + i``).
        presence_penalty: OpenAI's presence penalty.
        frequency_penalty: OpenAI's frequency penalty.
        repetition_penalty: vLLM's multiplicative repetition penalty.
        logit_bias: token id -> bias added to its logit.
        min_tokens: tokens generated before EOS and stop strings may end the request.
        ignore_eos: keep generating past end-of-sequence tokens.
        logprobs: alternatives to return per generated token (None: no logprobs).
        prompt_logprobs: alternatives to return per prompt token (None: none).
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None


@dataclass(frozen=True)
class GenerationSpec:
    """One request, ready for the engine.

    Attributes:
        kind: the response id's prefix (``chatcmpl``, ``cmpl``, ``msg``, ``resp``).
        prompt_ids: the prompt's tokens.
        prompt_param: the request field holding the prompt, named in errors.
        max_tokens: the completion budget asked for (None: what the context leaves; 0: the
            prompt only, e.g. for its logprobs).
        n: choices to generate (they share the prompt's prefill).
        stop: stop strings, matched on the text.
        sampling: how tokens are chosen.
        constraint: the compiled grammar the output follows (None: unconstrained).
        cache_namespace: the prefix-cache namespace (``cache_namespace.py``; "": shared).
        response_id: the id the response gets (None: ``{kind}-{random hex}``); for
            protocols whose ids look otherwise (``msg_...``, ``resp_...``).
        images: the prompt's images, encoded (``serving/images.py``; None: text only).
    """

    kind: str
    prompt_ids: list[int]
    prompt_param: str
    max_tokens: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    constraint: Constraint | None = None
    cache_namespace: str = ""
    response_id: str | None = None
    images: MultimodalPrompt | None = None
