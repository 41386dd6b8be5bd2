"""Speculative decoding behind the HTTP API: a stop string inside an accepted run cuts the
text and the usage exactly where plain decoding would, and /metrics counts the proposals.
Real server (``--speculative-method ngram``), engine and embedded SmolLM2."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.scheduler.sampling_params import SamplingParams
from mlxserve.server.lifecycle.launch import BackgroundServer
from tests.conftest import Collector
from tests.ops_helpers import running_server

ENGINE_CONFIG = EngineConfig(
    max_total_tokens=2048, max_running_requests=4, speculative_method="ngram"
)
TEXT = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
PROMPT = f"{TEXT}\n{TEXT}\n{TEXT}\none two"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(smollm: LoadedModel) -> Iterator[BackgroundServer]:
    with running_server(smollm, ENGINE_CONFIG) as srv:
        yield srv


def plain_tokens(make_engine, smollm: LoadedModel) -> list[int]:
    """The prompt's greedy continuation without speculation."""
    engine = make_engine(smollm, max_total_tokens=1024, max_running_requests=1)
    col = Collector()
    ids = smollm.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    engine.add_request("p", ids, params, col.callback("p"))
    col.wait("p")
    return col.tokens["p"]


class TestStopStringInsideAcceptedRun:
    def test_text_and_usage_as_without_speculation(
        self, client, model: str, server, smollm, make_engine
    ) -> None:
        tokens = plain_tokens(make_engine, smollm)
        tok = smollm.tokenizer
        full = tok.decode(tokens)
        stop = " seven"
        assert stop in full, f"the continuation should repeat the text: {full!r}"
        # Plain decoding stops on the token that completes the stop string.
        count = next(i + 1 for i in range(len(tokens)) if stop in tok.decode(tokens[: i + 1]))
        body = {"model": model, "prompt": PROMPT, "temperature": 0, "max_tokens": MAX_TOKENS}
        body["extra_body"] = {"ignore_eos": True}
        whole = client.completions.create(**body)
        assert whole.choices[0].text == full, "speculative output differs from plain decoding"
        cut = client.completions.create(**body, stop=[stop])
        assert cut.choices[0].text == full[: full.index(stop)], cut.choices[0].text
        assert cut.choices[0].finish_reason == "stop"
        assert cut.usage.completion_tokens == count, (cut.usage, count)
        metrics = server.engine.stats()
        assert metrics.spec_num_accepted_tokens > 5, f"the repeat was not accepted: {metrics}"

    def test_metrics_exported(self, http, model: str) -> None:
        text = http.get("/metrics").text
        for name in (
            "mlxserve:spec_decode_num_drafts_total",
            "mlxserve:spec_decode_num_draft_tokens_total",
            "mlxserve:spec_decode_num_accepted_tokens_total",
            'mlxserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="',
        ):
            assert name in text, f"{name} missing from /metrics"
