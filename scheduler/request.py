"""A request's state inside the engine, with its lengths as named properties."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from mlxserve.scheduler.constraints import Constraint
from mlxserve.scheduler.multimodal import MultimodalPrompt
from mlxserve.scheduler.outputs import RequestOutput, TokenLogprob
from mlxserve.scheduler.sampling_params import SamplingParams
from mlxserve.scheduler.stats import RequestStats


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request.

    Lengths, one set (``seq_len = prompt_len + output_len``)::

        all_ids:  | prompt ...................... | output ........ |
        row:      |<- tree_len ->|                                  (slots the prefix cache owns)
                  |<------- computed_len ------->|<- pending_len ->|
                  |<------- allocated_len ---------------->|        (+ the chunk in flight)

    - ``computed_len``: positions whose K/V (and recurrent state) are in the pools;
    - ``pending_len = seq_len - computed_len``: to feed in the next forward(s), 1 while
      decoding, more while (chunk-)prefilling;
    - ``allocated_len``: positions of the row with a slot: ``computed_len`` plus the chunk
      of the step in flight;
    - ``tree_len``: the leading positions whose slots belong to the prefix cache's tree
      (``tree_node`` is the locked node ending there);
    - ``prefix_hit_len``: prompt tokens the first admission found in the prefix cache
      (None before it; reported as usage's ``cached_tokens``).

    A preempted request has ``computed_len = 0`` and recomputes ``prompt + output`` on
    resume.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    on_output: Callable[[RequestOutput], None]
    arrival: int = 0
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    row: int | None = None
    computed_len: int = 0
    # Slots written into this request's row: computed_len plus the in-flight chunk.
    allocated_len: int = 0
    # First position still held in the sliding-window slot space (see token_spaces.py).
    sliding_start: int = 0
    # The recurrent-state slot of a model with recurrent layers, while running.
    state_slot: int | None = None
    # Positions 0..tree_len-1 of the row name prefix-cache slots (the cache owns them);
    # tree_node is the locked tree node ending there (None: nothing locked).
    tree_len: int = 0
    tree_node: object | None = None
    # Prompt tokens the first admission found in the prefix cache (reported in usage).
    prefix_hit_len: int | None = None
    # The prefix-cache namespace: a request only reuses the cached prefixes of requests of
    # the same namespace (a tenant, a client's cache_salt); "" is the shared one.
    cache_namespace: str = ""
    # A state slot the executor fills with this request's state after the current step's
    # forward (a prefix-cache snapshot at the chunk's end), inserted by process().
    pending_snapshot: int | None = None
    # Prompt logprobs (params.prompt_logprobs) by prompt position, gathered chunk by chunk
    # until the first token's event carries them.
    prompt_logprob_entries: list[TokenLogprob | None] = field(default_factory=list)
    # Timestamps for metrics (queued, scheduled, first/last token), stamped by the engine.
    stats: RequestStats = field(default_factory=RequestStats)
    # The grammar the output must follow (structured output), if any.
    constraint: Constraint | None = None
    # An embedding request: its prompt is prefilled and never sampled; it finishes when the
    # prompt is in, with the final hidden state of its last position.
    embed: bool = False
    # The prompt's images (vision models): their features and placeholder positions.
    images: MultimodalPrompt | None = None
    # Speculative decoding (``speculation.py``): the tokens proposed for the step in flight
    # (fed after the row's last token, not part of the output until verified), the row's
    # recent acceptance rate (0.5 before its first verification) with the decayed counts
    # ``(accepted, proposed)`` behind it, and the steps the policy passed it over in a row.
    draft_ids: list[int] = field(default_factory=list)
    draft_acceptance: float = 0.5
    draft_weights: tuple[float, float] = (0.0, 0.0)
    draft_skipped: int = 0
    # A draft model's K/V (``draft.py``) are right for positions 0..draft_len-1 of the row.
    draft_len: int = 0
    _ids_array: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id}: empty prompt")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_len(self) -> int:
        return len(self.output_ids)

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.output_len

    @property
    def pending_len(self) -> int:
        return self.seq_len - self.computed_len

    @property
    def remaining_tokens(self) -> int:
        """Tokens this request may still generate (none for an embedding request)."""
        if self.embed:
            return 0
        return self.params.max_tokens - self.output_len

    def all_ids(self) -> np.ndarray:
        """``prompt + output`` as int32, the prefix cache's key (cached until the sequence
        grows: the prefix cache compares it against the tree and other requests every step
        a request waits). An image's placeholders carry its content's key instead."""
        if self._ids_array is None or len(self._ids_array) != self.seq_len:
            ids = np.array(self.prompt_ids + self.output_ids, np.int32)
            self._ids_array = ids if self.images is None else self.images.cache_ids(ids)
        return self._ids_array

    def forget_cached_ids(self) -> None:
        """Drop ``all_ids()``'s cached array, which is kept while the length is unchanged:
        needed when a token is replaced in place (``lookahead.assumed_next_token``)."""
        self._ids_array = None

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens of ``prompt + output`` in ``[start, end)``."""
        assert 0 <= start <= end <= self.seq_len, (start, end, self.seq_len)
        p = self.prompt_len
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:  # decode: no copy of the whole sequence per step
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]
