"""Per-row sampling inside one batch: each row obeys only its own parameters."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxserve.mlx_backend.sampler import Sampler
from mlxserve.scheduler.batch import SamplingArrays


def params(rows: list[dict]) -> SamplingArrays:
    get = lambda key, default, dtype: np.array(  # noqa: E731
        [r.get(key, default) for r in rows], dtype=dtype
    )
    return SamplingArrays(
        temperature=get("temperature", 1.0, np.float32),
        top_p=get("top_p", 1.0, np.float32),
        top_k=get("top_k", 0, np.int32),
        min_p=get("min_p", 0.0, np.float32),
    )


LOGITS = mx.array(np.log(np.array([0.5, 0.3, 0.1, 0.06, 0.04], dtype=np.float32)))


def draw(rows: list[dict], n: int = 400, seed: int = 0) -> np.ndarray:
    """``n`` draws for each row: returns ``[n, B]`` token ids."""
    sampler = Sampler(seed)
    logits = mx.broadcast_to(LOGITS, (len(rows), LOGITS.shape[0]))
    p = params(rows)
    return np.stack([np.array(sampler(logits, p)) for _ in range(n)])


class TestGreedyAndFilters:
    def test_greedy_row_beside_a_sampled_row(self):
        out = draw([{"temperature": 0.0}, {"temperature": 1.0}])
        assert (out[:, 0] == 0).all(), "the greedy row must always take the argmax"
        assert len(set(out[:, 1].tolist())) > 2, "the sampled row should vary"

    def test_top_k_limits_the_choices(self):
        out = draw([{"top_k": 1}, {"top_k": 2}])
        assert set(out[:, 0].tolist()) == {0}, "top_k=1 is greedy"
        assert set(out[:, 1].tolist()) == {0, 1}, "top_k=2 draws only the two best"

    def test_top_p_keeps_the_smallest_prefix_reaching_p(self):
        out = draw([{"top_p": 0.5}, {"top_p": 0.85}])
        assert set(out[:, 0].tolist()) == {0}, "0.5 is reached by the first token alone"
        assert set(out[:, 1].tolist()) == {0, 1, 2}, "0.85 needs the first three tokens"

    def test_top_p_that_is_zero_in_float32_keeps_the_best_token(self):
        # 5e-324 is > 0 (so the API takes it) but 0 as float32: it used to remove every
        # token, and the draw then came from an all -inf row (anything, even a token a
        # grammar forbids).
        logits = mx.broadcast_to(LOGITS[::-1], (2, LOGITS.shape[0]))  # the best is id 4
        p, sampler = params([{"top_p": 5e-324}, {"top_p": 1e-46}]), Sampler(0)
        out = np.stack([np.array(sampler(logits, p)) for _ in range(50)])
        assert set(out.ravel().tolist()) == {4}, "the most likely token always stays"

    def test_min_p_drops_tokens_below_a_share_of_the_best(self):
        out = draw([{"min_p": 0.5}, {"min_p": 0.15}])
        assert set(out[:, 0].tolist()) == {0, 1}, "0.3 >= 0.5*0.5 stays, 0.1 goes"
        assert set(out[:, 1].tolist()) == {0, 1, 2}, "0.06 < 0.15*0.5 goes"

    def test_sampling_frequencies_follow_the_distribution(self):
        out = draw([{"temperature": 1.0}], n=2000)
        freq = np.bincount(out[:, 0], minlength=5) / out.shape[0]
        assert abs(freq[0] - 0.5) < 0.05 and abs(freq[1] - 0.3) < 0.05, freq

    def test_low_temperature_sharpens(self):
        out = draw([{"temperature": 0.05}])
        assert (out[:, 0] == 0).mean() > 0.99, "temperature 0.05 is nearly greedy"
