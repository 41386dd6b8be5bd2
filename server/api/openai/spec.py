"""OpenAI request bodies -> the neutral ``GenerationSpec`` (``server/serving/spec.py``)."""

from __future__ import annotations

from mlxserve.scheduler.constraints import Constraint
from mlxserve.server.api.openai.schemas import GenerationRequest
from mlxserve.server.serving.cache_namespace import cache_namespace
from mlxserve.server.serving.spec import GenerationSpec, SamplingSpec


def sampling_spec(body: GenerationRequest) -> SamplingSpec:
    """The sampling fields of a chat or completion request."""
    return SamplingSpec(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=body.logit_bias,
        min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos,
        logprobs=body.logprobs_count(),
        prompt_logprobs=body.prompt_logprobs_count(),
    )


def generation_spec(
    body: GenerationRequest,
    kind: str,
    prompt_ids: list[int],
    prompt_param: str,
    constraint: Constraint | None,
    tenant: str | None = None,
) -> GenerationSpec:
    """The spec of a chat (``kind`` "chatcmpl", prompt in "messages") or completion
    ("cmpl", "prompt") request whose prompt is ``prompt_ids``, sent by ``tenant`` (None: the
    shared tenant)."""
    return GenerationSpec(
        kind=kind,
        prompt_ids=prompt_ids,
        prompt_param=prompt_param,
        max_tokens=body.requested_max_tokens(),
        n=body.n,
        stop=body.stop_strings,
        sampling=sampling_spec(body),
        constraint=constraint,
        cache_namespace=cache_namespace(tenant, body.cache_salt),
    )
