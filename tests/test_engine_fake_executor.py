"""The engine over the Executor protocol alone: a numpy fake backend, no MLX anywhere.

The fake's "model" reads its K/V pool the way a real one does: each written slot holds the
token fed at that position, and a row's next token is the sum of the tokens at every slot
it reads, modulo the vocabulary. So the outputs equal a reference computed from the
sequence only when the scheduler hands out, writes and reads the right slots, across
chunked prefill, decode and the prefix cache.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np

from mlxserve.scheduler.batch import ForwardBatch, ForwardOutput
from mlxserve.scheduler.config import EngineConfig
from mlxserve.scheduler.engine import Engine
from mlxserve.scheduler.executor import Executor
from mlxserve.scheduler.memory_plan import MemoryPlan, MemoryStats, PoolRequest
from mlxserve.scheduler.outputs import RequestOutput
from mlxserve.scheduler.sampling_params import SamplingParams
from tests.import_graph import ROOT

VOCAB = 97


class SumModelExecutor:
    """Implements ``Executor``: token at each written slot, next token = sum read % VOCAB."""

    def __init__(self, slots: int = 256) -> None:
        self.slots = slots
        self.pool: np.ndarray | None = None
        self.forwards = 0
        self.closed = False

    @property
    def vocab_size(self) -> int:
        return VOCAB

    def materialize(self) -> None:
        pass

    def plan(self, request: PoolRequest) -> MemoryPlan:
        return MemoryPlan(full_tokens=min(self.slots, request.max_total_tokens or self.slots))

    def allocate(self, plan: MemoryPlan) -> None:
        self.pool = np.zeros(plan.full_tokens + 1, np.int64)  # slot 0: padding

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        assert self.pool is not None
        self.forwards += 1
        out = np.zeros(batch.batch_size, np.int32)
        for b in range(batch.batch_size):
            n = int(batch.extend_lens[b])
            self.pool[batch.write_slots[b, :n]] = batch.input_ids[b, :n]
            total = int(batch.computed_lens[b]) + n
            out[b] = int(self.pool[batch.read_slots[b, :total]].sum()) % VOCAB
        return ForwardOutput(next_token_ids=out)

    def memory(self) -> MemoryStats:
        return MemoryStats(active=0 if self.pool is None else self.pool.nbytes)

    def close(self) -> None:
        self.closed = True


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(max_tokens):
        token = sum(seq) % VOCAB
        out.append(token)
        seq.append(token)
    return out


def run(engine: Engine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    done = {rid: threading.Event() for rid in prompts}

    def collector(rid: str):
        def on_output(event: RequestOutput) -> None:
            tokens[rid].extend(event.new_token_ids)
            if event.finished:
                assert event.finish_reason == "length", event
                done[rid].set()

        return on_output

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params, collector(rid))
    for rid in prompts:
        assert done[rid].wait(30), f"{rid} did not finish"
    return tokens


class TestFakeExecutor:
    def test_a_fake_satisfies_the_protocol(self) -> None:
        executor: Executor = SumModelExecutor()
        assert executor.vocab_size == VOCAB

    def test_requests_run_through_the_engine(self) -> None:
        executor = SumModelExecutor()
        config = EngineConfig(max_total_tokens=256, max_running_requests=4, max_prefill_tokens=8)
        engine = Engine(executor, config, context_length=128)
        engine.start()
        try:
            prompts = {
                "short": [3, 1, 4],
                "long": list(range(1, 30)),  # 29 tokens: prefilled in chunks of 8
                "shared": list(range(1, 30)) + [5],  # reuses "long"'s cached prefix
            }
            got = run(engine, {"short": prompts["short"], "long": prompts["long"]}, 6)
            got |= run(engine, {"shared": prompts["shared"]}, 6)
            for rid, prompt in prompts.items():
                assert got[rid] == reference(prompt, 6), rid
            assert engine.stats().prefix_cache_hits > 0, "the shared prefix was reused"
            assert engine.wait_idle(10)
            engine.check_integrity()
        finally:
            engine.shutdown()
        assert executor.closed, "the engine closes its executor on the engine thread"

    def test_the_engine_imports_no_mlx(self) -> None:
        code = (
            "import sys\n"
            "import mlxserve.scheduler.engine, mlxserve.scheduler.client\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "[]", out.stdout
