"""The acceptance test of the engine on the real embedded model (SmolLM2-135M-Instruct GGUF):
six concurrent chat prompts of different lengths, one arriving while the others decode,
give exactly mlx-lm's single-sequence greedy tokens."""

from __future__ import annotations

import pytest

from tests.conftest import Collector, greedy_reference, submit

QUESTIONS = [
    "What is the capital of France?",
    "Hello there, how are you today?",
    "Write one sentence about the sea, the wind and the old lighthouse keeper who watched both.",
    "What is two plus two? Answer briefly.",
    "Name a colour.",
    "Translate 'good morning' into Spanish and explain when people say it.",
]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def prompts(smollm):
    tok = smollm.tokenizer
    return [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def references(smollm, prompts):
    eos = set(smollm.tokenizer.eos_token_ids)
    return [greedy_reference(smollm.model, p, MAX_TOKENS, eos) for p in prompts]


class TestSmolLM2BatchedGreedy:
    # overlap "on": decode steps built ahead (scheduler/lookahead.py), off by default here.
    @pytest.mark.parametrize("overlap", ["auto", "on"])
    def test_six_concurrent_requests_match_mlx_lm(
        self, smollm, make_engine, prompts, references, overlap
    ):
        assert len({len(p) for p in prompts}) == len(prompts), "prompt lengths must differ"
        engine = make_engine(smollm, max_total_tokens=2048, max_running_requests=8, overlap=overlap)
        col = Collector()
        for i, prompt in enumerate(prompts[:5]):
            submit(engine, col, str(i), prompt, max_tokens=MAX_TOKENS, temperature=0.0)
        col.wait_tokens("0", 2, timeout=300)
        submit(engine, col, "5", prompts[5], max_tokens=MAX_TOKENS, temperature=0.0)
        for i, want in enumerate(references):
            final = col.wait(str(i), timeout=300)
            got = col.tokens[str(i)]
            assert got == want, (
                f"request {i}: engine {smollm.tokenizer.decode(got)!r} "
                f"!= mlx-lm {smollm.tokenizer.decode(want)!r}"
            )
            expected_reason = "stop" if want[-1] in smollm.tokenizer.eos_token_ids else "length"
            assert final.finish_reason == expected_reason, (i, final)
