"""Request bookkeeping: named lengths and token slicing across prompt and output."""

from __future__ import annotations

import pytest

from mlxserve.scheduler.request import Request
from mlxserve.scheduler.sampling_params import SamplingParams


def make(prompt, output, max_tokens=16) -> Request:
    req = Request("r", list(prompt), SamplingParams(max_tokens=max_tokens), lambda e: None)
    req.output_ids = list(output)
    return req


class TestTokenIds:
    def test_every_slice_matches_prompt_plus_output(self):
        req = make([1, 2, 3, 4], [5, 6, 7])
        full = [1, 2, 3, 4, 5, 6, 7]
        for start in range(len(full) + 1):
            for end in range(start, len(full) + 1):
                assert req.token_ids(start, end) == full[start:end], (start, end)

    def test_out_of_range_is_an_internal_error(self):
        with pytest.raises(AssertionError):
            make([1], [2]).token_ids(0, 3)


class TestLengths:
    def test_named_lengths(self):
        req = make([1, 2, 3], [4, 5], max_tokens=10)
        req.computed_len = 4
        assert (req.prompt_len, req.output_len, req.seq_len) == (3, 2, 5)
        assert req.pending_len == 1, "one token (the last sampled) is left to feed"
        assert req.remaining_tokens == 8

    def test_empty_prompt_is_refused(self):
        with pytest.raises(ValueError, match="empty prompt"):
            make([], [])
