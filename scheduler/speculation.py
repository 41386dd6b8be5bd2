"""Speculative decoding inside the continuous batch: which rows get proposals, and what a
verified row emits.

A decoding row normally feeds its last token and gets one new token. With a proposal
``d_0 .. d_{k-1}`` (``ngram.py``, or a draft model's greedy continuation: ``draft.py``)
it feeds ``[last, d_0, .., d_{k-1}]`` in the same forward
as every other row of the step, and the executor samples a token ``y_j`` at each of those
``k + 1`` positions exactly as a plain decode step would have at that output position
(``mlx_backend/spec_verify.py``). The row then emits ``y_0 .. y_m`` where ``m`` is the first
``j`` with ``y_j != d_j`` (or ``k``: every proposal accepted, ``y_k`` is the bonus token).

Why this is exact: ``y_j`` is the token the model picks given the prefix up to ``d_{j-1}``;
while ``y_j == d_j`` that prefix is the real output, so every emitted token is the one
non-speculative decoding would have produced. For greedy rows ``y_j`` is the argmax (the
longest prefix matching argmax, plus the bonus token). For sampled rows ``y_j`` is a
Gumbel-max draw from the processed distribution ``p_j``; for a one-hot proposal that is the
standard rejection sampler: ``d_j`` is accepted with probability ``p_j(d_j)`` (``min(1,
p/q)`` with ``q`` one-hot), and on rejection the token is distributed as ``p_j`` without
``d_j``, renormalized (the residual). A seeded row's noise at output position ``i`` comes
from ``(seed, i)`` alone, so a seeded request gives the same tokens with speculation as
without.

Rows whose distribution depends on what was sampled before them in a way the expanded
positions cannot reproduce run without proposals: penalties (they count earlier outputs),
grammar constraints (the matcher advances token by token), ``min_tokens`` not yet reached
(the EOS mask changes at that position) and logit bias (kept simple: no proposals); so do
requests with images (vision models: their explicit M-RoPE positions are not verified with
proposals yet).

The adaptive policy (``SpeculationPolicy``): a forward costs ``a + b x tokens`` (measured on
this backend, ``StepCost``), so a proposal of ``D`` tokens from a row whose recent
acceptance rate is ``alpha`` adds ``b D`` seconds for ``alpha D`` expected tokens. It is
worth it while ``alpha`` beats the step's current tokens per unit of cost (with a margin,
``GAIN_MARGIN``): at batch 1 almost
any proposal pays (the forward's fixed cost dominates), at batch 32 on the CPU only rows that
accept most of what they are given are proposed for. A draft model's proposal of depth ``k``
also costs ``k`` sequential draft forwards (measured): the step keeps the depth with the
most expected tokens per second, none if no depth beats the step without proposals.
A draft proposal is one-hot too (the draft's argmax), so the same verification is exact.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from mlxserve.scheduler.config import EngineConfig
from mlxserve.scheduler.ngram import propose_ngram
from mlxserve.scheduler.request import Request
from mlxserve.scheduler.row_groups import FORWARD_OVERHEAD_TOKENS

logger = logging.getLogger(__name__)

# A row's acceptance rate is (accepted + 1) / (proposed + 2) over its recent proposals,
# each older verification's counts weighted down by this factor: one lucky one-token probe
# moves it less than a fully accepted run, and a fresh row starts at 1/2.
ACCEPTANCE_DECAY = 0.7
# Proposals must promise this much more than they cost: the cost fit is noisy on a loaded
# CPU, and in a batch whose rows all decode to max_tokens a row's accepted tokens save a
# step only when the slowest row's do too.
GAIN_MARGIN = 1.25
# A row the policy passed over this many steps in a row (or a row never verified) gets a
# one-token probe, so a request whose text turns repetitive later is noticed.
PROBE_AFTER_STEPS = 16
# Decode steps remembered for the cost fit.
COST_SAMPLES = 64
# What a row's proposal holds between the policy and the draft model's forwards.
DRAFT_PLACEHOLDER = -1


@dataclass
class SpecStats:
    """Counters of vLLM's ``spec_decode_*`` metrics."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class StepCost:
    """The cost of a decode forward as ``a + b x tokens``, fit to measured steps.

    Only the ratio ``a / b`` matters to the policy (in tokens: what the fixed part of a
    forward is worth). It is identifiable only when steps fed different token counts; until
    then (and whenever the fit is not sane) the row-group cost model's
    ``FORWARD_OVERHEAD_TOKENS`` stands in (SmolLM2-135M on this 2-CPU VM: a one-token
    forward ~115-150 ms, each further token ~6.5-9 ms). The fit is kept within a factor
    of 2 of that: on a loaded CPU the thread count and the neighbours change a step's time
    by more than the tokens do (measured, ``docs/benchmarks.md``: fits from 0.8 to 13 ms a
    token in one run), and an outlier fit must not turn the policy on or off.
    """

    def __init__(self) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=COST_SAMPLES)

    def observe(self, tokens: int, seconds: float) -> None:
        if seconds > 0:
            self._samples.append((tokens, seconds))

    def seconds_per_token(self) -> float | None:
        """``b``: the recent steps' median of ``seconds / (a/b + tokens)`` (None before any
        step was measured)."""
        if not self._samples:
            return None
        n, t = np.array(self._samples, np.float64).T
        return float(np.median(t / (self.overhead_tokens + n)))

    @property
    def overhead_tokens(self) -> float:
        if len(self._samples) >= 8:
            n, t = np.array(self._samples, np.float64).T
            if n.std() >= 1.0:
                b, a = np.polyfit(n, t, 1)
                if b > 0 and a > 0:
                    low, high = FORWARD_OVERHEAD_TOKENS / 2, FORWARD_OVERHEAD_TOKENS * 2
                    return float(min(max(a / b, low), high))
        return float(FORWARD_OVERHEAD_TOKENS)


class Speculator:
    """Proposes tokens for decoding rows and turns verified rows into emitted tokens.

    Args:
        config: the engine's configuration (method, K, the n-gram sizes).
        max_context_len: no proposal runs a row past its context.
    """

    def __init__(self, config: EngineConfig, max_context_len: int) -> None:
        self.method = config.speculative_method
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.max_context_len = max_context_len
        self.stats = SpecStats(accepted_per_pos=[0] * self.k)
        self.cost = StepCost()
        # Seconds of one draft-model forward (the draft method; set by the scheduler).
        self.draft_seconds = 0.0
        # The acceptance rate over every row's recent verifications (decayed counts).
        self.draft_weights: tuple[float, float] = (0.0, 0.0)
        self.draft_acceptance = 0.5
        self._steps_since_probe = 0

    def eligible(self, req: Request) -> bool:
        """The row's tokens can be verified position by position (see the module doc)."""
        p = req.params
        return not (
            req.embed
            or req.images is not None
            or req.constraint is not None
            or p.uses_penalties
            or p.logit_bias
            or req.output_len < p.min_tokens
        )

    def propose(self, rows: list[Request], slots: int, step_tokens: int) -> int:
        """Set ``draft_ids`` of the ``rows`` (decoding rows of this step, one token each
        already) worth proposing for, within ``slots`` free token slots; returns the draft
        tokens given out.

        Args:
            step_tokens: tokens the step feeds before any proposal (its cost so far).
        """
        ratio = self.cost.overhead_tokens
        tokens, expected = float(step_tokens), float(len(rows))
        candidates: list[tuple[Request, list[int], bool]] = []
        self._steps_since_probe += 1
        for req in rows:
            req.draft_ids = []
            cap = min(self.k, req.remaining_tokens - 1, self.max_context_len - req.seq_len - 1)
            if cap <= 0 or not self.eligible(req):
                continue
            if self.method == "draft" and req.draft_weights[1] == 0 and self.draft_weights[1]:
                # A draft model's acceptance is mostly the pair of models': a new row starts
                # from the engine's, not from a probe (whose catch-up is the whole prompt).
                req.draft_weights = self.draft_weights
                req.draft_acceptance = self.draft_acceptance
            probe = req.draft_acceptance * (ratio + tokens) <= GAIN_MARGIN * expected
            fresh = req.draft_weights[1] == 0
            if probe and not fresh and not self._may_probe(req, candidates):
                req.draft_skipped += 1  # not worth it even as the first proposal
                continue
            if (
                fresh
                and self.method == "draft"
                and any(c[0].draft_weights[1] == 0 for c in candidates)
            ):
                continue  # until one verification says how the draft does, one row tries it
            draft = self._candidate(req, 1 if probe else cap)
            if draft:
                candidates.append((req, draft, probe))
        candidates.sort(key=lambda c: -c[0].draft_acceptance)
        given = 0
        for req, draft, probe in candidates:
            alpha = req.draft_acceptance
            if not probe and alpha * (ratio + tokens) <= GAIN_MARGIN * expected:
                req.draft_skipped += 1
                continue
            draft = draft[: slots - given]
            if not draft:
                break
            req.draft_skipped = 0
            req.draft_ids = draft
            given += len(draft)
            tokens += len(draft)
            expected += alpha * len(draft)
        if given and self.method == "draft":
            probes = {id(r) for r, _, probe in candidates if probe}
            given = self._bound_draft_forwards(
                [r for r in rows if id(r) not in probes], step_tokens
            ) + sum(len(r.draft_ids) for r in rows if id(r) in probes)
        return given

    def _may_probe(self, req: Request, candidates: list[tuple[Request, list[int], bool]]) -> bool:
        """Whether a row the policy passes over gets a one-token probe now: after
        ``PROBE_AFTER_STEPS`` passed-over steps of its own (n-gram: its text may turn
        repetitive), or for a draft model, whose acceptance is mostly the pair of models',
        one row of the engine every ``PROBE_AFTER_STEPS`` steps (each probe costs draft
        forwards, and its catch-up)."""
        if self.method != "draft":
            return req.draft_skipped + 1 >= PROBE_AFTER_STEPS
        if self._steps_since_probe < PROBE_AFTER_STEPS or any(c[2] for c in candidates):
            return False
        self._steps_since_probe = 0
        return True

    def _candidate(self, req: Request, n: int) -> list[int]:
        """Up to ``n`` proposed tokens: the n-gram continuation, or for the draft method
        ``n`` placeholders the draft model fills once the slots are allocated
        (``draft.py``)."""
        if self.method == "draft":
            return [DRAFT_PLACEHOLDER] * n
        return propose_ngram(req.all_ids(), self.min_n, self.max_n, n)

    def _bound_draft_forwards(self, rows: list[Request], step_tokens: int) -> int:
        """Cut the draft method's proposals to the depth worth its forwards; returns the
        proposed tokens left.

        A proposal of depth ``k`` costs ``k`` sequential forwards of the draft model
        (``draft_seconds`` each, measured) besides the verified tokens' share of the served
        model's forward; the depth kept is the one with the most expected tokens per second
        of the step, none when no depth beats the step without proposals. (Probes are not
        cut: they measure the draft rather than pay for themselves.)
        """
        b = self.cost.seconds_per_token()
        if b is None or not any(r.draft_ids for r in rows):
            return sum(len(r.draft_ids) for r in rows)
        step = b * (self.cost.overhead_tokens + step_tokens)
        plain = len(rows) / step
        best, best_rate = 0, plain * GAIN_MARGIN
        for depth in range(1, max(len(r.draft_ids) for r in rows) + 1):
            given = sum(min(len(r.draft_ids), depth) for r in rows)
            gain = sum(_expected(r.draft_acceptance, min(len(r.draft_ids), depth)) for r in rows)
            rate = (len(rows) + gain) / (step + b * given + depth * self.draft_seconds)
            if rate > best_rate:
                best, best_rate = depth, rate
        for req in rows:
            req.draft_ids = req.draft_ids[:best]
        return sum(len(r.draft_ids) for r in rows)

    def verify(self, req: Request, draft: list[int], sampled: np.ndarray) -> list[int]:
        """The tokens a row verified against ``draft`` emits: ``sampled[j]`` (the token
        picked at the ``j``-th of its last ``1 + len(draft)`` fed positions) up to and
        including the first that differs from the proposal. Updates the row's acceptance
        rate and the counters."""
        k = len(draft)
        m = 0
        while m < k and int(sampled[m]) == draft[m]:
            m += 1
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += k
        s.num_accepted_tokens += m
        for j in range(m):
            s.accepted_per_pos[j] += 1
        accepted, proposed = req.draft_weights
        accepted = ACCEPTANCE_DECAY * accepted + m
        proposed = ACCEPTANCE_DECAY * proposed + k
        req.draft_weights = (accepted, proposed)
        req.draft_acceptance = (accepted + 1) / (proposed + 2)
        accepted, proposed = self.draft_weights
        self.draft_weights = (ACCEPTANCE_DECAY * accepted + m, ACCEPTANCE_DECAY * proposed + k)
        self.draft_acceptance = (self.draft_weights[0] + 1) / (self.draft_weights[1] + 2)
        return [int(t) for t in sampled[: m + 1]]


def _expected(alpha: float, depth: int) -> float:
    """Expected accepted tokens of a ``depth``-token proposal whose tokens are each
    accepted with probability ``alpha`` (a run stops at the first rejection)."""
    return sum(alpha**j for j in range(1, depth + 1))


def speculation_for(
    config: EngineConfig, max_context_len: int, recurrent: bool
) -> Speculator | None:
    """The engine's speculator, or None when speculation is off or cannot be exact here."""
    if config.speculative_method == "off":
        return None
    if recurrent:
        logger.warning(
            "speculative decoding (--speculative-method %s) is disabled: this model has "
            "recurrent layers, whose state cannot be rolled back to a rejected position",
            config.speculative_method,
        )
        return None
    source = (
        f"draft model {config.draft_model}"
        if config.speculative_method == "draft"
        else f"n-grams of {config.prompt_lookup_min}..{config.prompt_lookup_max}"
    )
    logger.info(
        "speculative decoding: %s, up to %d tokens a row (%s)",
        config.speculative_method,
        config.num_speculative_tokens,
        source,
    )
    return Speculator(config, max_context_len)
