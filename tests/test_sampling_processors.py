"""Per-row sampling features on the numpy + sampler side, no model: parameter validation,
the batch's sampling arrays, penalties / bias against mlx-lm's own logits processors,
seeded draws, the min_tokens mask and raw logprobs."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_logits_processors

from mlxserve.mlx_backend.logits import LastTokenLogits
from mlxserve.mlx_backend.logprobs import sampled_logprobs
from mlxserve.mlx_backend.penalties import process_logits
from mlxserve.mlx_backend.sampler import Sampler
from mlxserve.scheduler.request import Request
from mlxserve.scheduler.sampling_arrays import build_sampling_arrays
from mlxserve.scheduler.sampling_params import SamplingParams
from tests.test_logits import ScaledHeadModel


def request(prompt, output=(), cached=None, **params) -> Request:
    """A request whose next forward feeds from ``cached`` (default: only the last token)."""
    req = Request("r", list(prompt), SamplingParams(**params), lambda e: None)
    req.output_ids = list(output)
    req.computed_len = req.seq_len - 1 if cached is None else cached
    return req


def decode_rows(reqs: list[Request]) -> list[tuple[Request, int]]:
    return [(r, r.pending_len) for r in reqs]


class TestValidation:
    @pytest.mark.parametrize(
        "field, value",
        [
            ("presence_penalty", 2.5),
            ("frequency_penalty", -2.1),
            ("repetition_penalty", 0.0),
            ("repetition_penalty", 1e-320),  # 0 in float32: logits / 0
            ("repetition_penalty", 1e308),  # inf in float32
            ("repetition_penalty", math.nan),
            ("min_tokens", -1),
            ("min_tokens", 17),
            ("logprobs", 21),
            ("prompt_logprobs", -1),
            ("seed", 1.5),
            ("logit_bias", ((-1, 1.0),)),
            ("logit_bias", ((3, 101.0),)),
            ("logit_bias", ((3, 1.0), (3, 2.0))),
        ],
    )
    def test_bad_values_name_the_field(self, field, value):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})

    def test_logit_bias_dict_is_normalized(self):
        p = SamplingParams(logit_bias={5: 1, 2: -3.5})
        assert p.logit_bias == ((5, 1.0), (2, -3.5))
        assert hash(p) == hash(SamplingParams(logit_bias=((5, 1.0), (2, -3.5))))


class TestSamplingArrays:
    def test_plain_batch_builds_no_optional_arrays(self):
        s = build_sampling_arrays(decode_rows([request([1, 2, 3]), request([4], [5])]), {9})
        assert s.seeds is s.penalties is s.logit_bias is s.banned is None
        assert s.logprobs is None and s.prompt_logprobs is None

    def test_min_tokens_bans_eos_and_stops_until_reached(self):
        reqs = [
            request([1, 2], [3], min_tokens=2, stop_token_ids=(7,)),
            request([1, 2], [3, 4], min_tokens=2, stop_token_ids=(7,)),
            request([1, 2], [], min_tokens=1, ignore_eos=True, stop_token_ids=(8,)),
        ]
        banned = build_sampling_arrays(decode_rows(reqs), {9}).banned
        got = sorted(zip(banned.rows.tolist(), banned.token_ids.tolist(), strict=True))
        assert got == [(0, 7), (0, 9), (2, 8)], "row 1 reached min_tokens; row 2 ignores eos"
        assert np.isneginf(banned.values).all()

    def test_prompt_targets_cross_chunk_boundaries(self):
        prompt = list(range(10, 20))
        first, middle, last = (request(prompt, cached=c, prompt_logprobs=2) for c in (0, 4, 8))
        rows = [(first, 4), (middle, 4), (last, 2)]
        targets = build_sampling_arrays(rows).prompt_logprobs.targets
        assert targets[0].tolist() == [11, 12, 13, 14], "position 3 predicts chunk 2's first"
        assert targets[1].tolist() == [15, 16, 17, 18]
        assert targets[2].tolist() == [19, -1, -1, -1], "the last position predicts output"

    def test_prompt_logprobs_are_not_asked_again_after_output(self):
        req = request([1, 2, 3], [4], cached=0, prompt_logprobs=1)  # recompute after preempt
        assert build_sampling_arrays([(req, 4)]).prompt_logprobs is None

    def test_penalty_window_is_the_last_tokens_of_prompt_and_output(self):
        req = request(list(range(1, 30)), [40, 41], presence_penalty=0.5)
        context = build_sampling_arrays(decode_rows([req, request([5])])).penalties.context_ids
        assert context[0].tolist() == list(range(12, 30)) + [40, 41]
        assert (context[1] == -1).all(), "rows without penalties get no window"


ROW_SETTINGS = [
    {},
    {"repetition_penalty": 1.3},
    {"presence_penalty": 0.7, "frequency_penalty": -0.4},
    {"frequency_penalty": 1.5, "logit_bias": {3: 5.0, 60: -2.0}},
    {"repetition_penalty": 0.8, "presence_penalty": -1.0, "logit_bias": {0: 1.5}},
]


class TestProcessorsMatchMlxLm:
    @pytest.mark.parametrize("seed", range(3))
    def test_batched_processing_equals_mlx_lm_per_row(self, seed):
        rng = np.random.default_rng(seed)
        V = 64
        logits = mx.array(rng.normal(0, 3, (len(ROW_SETTINGS), V)).astype(np.float32))
        reqs, want = [], []
        for b, settings in enumerate(ROW_SETTINGS):
            # Short histories and ones longer than the 20-token window, with repeats.
            history = rng.integers(0, 12, size=int(rng.integers(1, 40))).tolist()
            reqs.append(request(history[:1], history[1:], **settings, max_tokens=64))
            row = logits[b : b + 1]
            for processor in make_logits_processors(**settings):
                row = processor(mx.array(history), row)
            want.append(row)
        params = build_sampling_arrays(decode_rows(reqs))
        got = process_logits(logits, params)
        np.testing.assert_allclose(np.array(got), np.array(mx.concatenate(want)), rtol=1e-6)

    def test_out_of_vocabulary_ids_are_dropped_not_indexed(self):
        logits = mx.zeros((2, 8))
        reqs = [
            request([1], logit_bias={3: 2.0, 8: 1.0, 10**9: 1.0}),
            request([1], min_tokens=1, stop_token_ids=(2, 50)),
        ]
        got = np.array(process_logits(logits, build_sampling_arrays(decode_rows(reqs))))
        assert got[0].tolist() == [0, 0, 0, 2.0, 0, 0, 0, 0]
        assert np.isneginf(got[1, 2]) and np.isfinite(np.delete(got[1], 2)).all()

    def test_ban_wins_over_bias_and_raw_logits_stay_untouched(self):
        logits = mx.zeros((1, 8))
        req = request([1], min_tokens=1, stop_token_ids=(3,), logit_bias={3: 100.0})
        got = process_logits(logits, build_sampling_arrays(decode_rows([req])))
        assert np.isneginf(np.array(got)[0, 3])
        assert (np.array(logits) == 0).all(), "the caller's logits must not be modified"


PROBS = np.array([0.5, 0.3, 0.1, 0.06, 0.04], dtype=np.float32)


def seeded_rows(positions, seed=123, **params) -> list[Request]:
    """One decoding request per entry, ``positions[i]`` tokens into its output."""
    return [request([1], [0] * n, seed=seed, max_tokens=10_000, **params) for n in positions]


class TestSeededDraws:
    def test_a_seeded_row_ignores_its_batch_and_the_engine_rng(self):
        logits = mx.array(np.log(np.tile(PROBS, (1, 60))))  # 300 tokens, near-uniform
        alone = Sampler(seed=0)(logits, build_sampling_arrays(decode_rows(seeded_rows([7]))))
        others = [request([1], temperature=1.0), request([2], temperature=0.0)]
        batch = [others[0], *seeded_rows([7]), others[1], *seeded_rows([7], top_k=300)]
        params = build_sampling_arrays(decode_rows(batch))
        for engine_seed in (1, 2, 3):
            got = Sampler(seed=engine_seed)(mx.broadcast_to(logits, (4, 300)), params)
            assert int(got[1]) == int(got[3]) == int(alone[0]), "seed + position decide"

    def test_positions_and_seeds_change_the_draw(self):
        logits = mx.array(np.log(np.tile(PROBS, (1, 60))))
        reqs = seeded_rows(range(20)) + seeded_rows([0] * 20, seed=None) + seeded_rows([0])
        reqs += [request([1], seed=s) for s in range(20)]
        batch = mx.broadcast_to(logits, (len(reqs), 300))
        got = np.array(Sampler()(batch, build_sampling_arrays(decode_rows(reqs))))
        assert len(set(got[:20].tolist())) > 10, "positions of one seed must differ"
        assert len(set(got[41:].tolist())) > 10, "seeds must differ"
        assert got[40] == got[0], "same seed, same position"

    def test_seeded_frequencies_follow_the_distribution(self):
        reqs = seeded_rows(range(3000), seed=7)
        logits = mx.broadcast_to(mx.array(np.log(PROBS)), (len(reqs), len(PROBS)))
        got = np.array(Sampler()(logits, build_sampling_arrays(decode_rows(reqs))))
        freq = np.bincount(got, minlength=len(PROBS)) / len(got)
        np.testing.assert_allclose(freq, PROBS, atol=0.03)


class TestSampledLogprobs:
    def test_raw_log_softmax_and_sorted_top_k(self):
        rng = np.random.default_rng(0)
        raw = rng.normal(0, 2, (3, 50)).astype(np.float32)
        tokens = mx.array([4, 9, 17], dtype=mx.int32)
        got = sampled_logprobs(mx.array(raw), tokens, np.array([3, -1, 0], np.int32))
        mx.eval(got.arrays())
        got = got.to_numpy()
        want = raw - np.log(np.exp(raw).sum(-1, keepdims=True))
        assert got.rows.tolist() == [0, 2], "row 1 did not ask"
        np.testing.assert_allclose(got.logprobs, want[[0, 2], [4, 17]], atol=1e-5)
        entry = got.entry(0, 3)
        assert [t for t, _ in entry.top] == np.argsort(-want[0])[:3].tolist()
        np.testing.assert_allclose([lp for _, lp in entry.top], np.sort(want[0])[::-1][:3])
        assert got.entry(1, 0).top == ()


class TestLogitsAtPositions:
    @pytest.mark.parametrize("split", [True, False])
    def test_chosen_positions_equal_the_models_logits(self, tiny_llama, split):
        model = tiny_llama.model if split else ScaledHeadModel(tiny_llama.model)
        logits = LastTokenLogits(model)
        assert (logits.head is not None) == split
        inputs = mx.array([[5, 6, 7, 8], [9, 10, 0, 0]], dtype=mx.int32)
        rows, positions = mx.array([0, 1, 0, 0, 1]), mx.array([3, 1, 0, 1, 0])
        got = logits.at(inputs, None, rows, positions)
        want = model(inputs)[rows, positions]
        assert mx.abs(got - want).max().item() < 1e-4
