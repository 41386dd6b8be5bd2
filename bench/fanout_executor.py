"""An ``Executor`` that runs every batch through several MLX executors of one model, for
side-by-side step times under the same load (``bench/kv_quant.py``)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any


class FanOutExecutor:
    """The engine's ``Executor`` over several MLX executors of the same model (float and
    quantized pools, each attention path): every batch runs through each of them in a
    rotating order, timed; the first one's tokens drive the engine. All see the same
    batches over the same slot ids, so their step times compare side by side under the
    same load, step by step."""

    def __init__(
        self, loaded: Any, configs: list[tuple[int | None, str | None]], group_size: int = 64
    ) -> None:
        from mlxserve.mlx_backend.executor import MLXExecutor

        self.configs = configs
        self.group_size = group_size
        self.executors = [MLXExecutor(loaded.model, kv_attention=path) for _, path in configs]
        # Per step: phase, rows, seconds per executor.
        self.steps: list[tuple[str, int, list[float]]] = []

    @property
    def vocab_size(self) -> int:
        return self.executors[0].vocab_size

    def materialize(self) -> None:
        self.executors[0].materialize()

    def plan(self, request: Any) -> Any:
        plans = [
            ex.plan(dataclasses.replace(request, kv_bits=bits, kv_group_size=self.group_size))
            for ex, (bits, _) in zip(self.executors, self.configs, strict=True)
        ]
        assert len({p.full_tokens for p in plans}) == 1, "give every pool the same slots"
        return plans[0]

    def allocate(self, plan: Any) -> None:
        for ex in self.executors:
            ex.allocate(plan)

    def forward(self, batch: Any) -> Any:
        n = len(self.executors)
        times = [0.0] * n
        first = len(self.steps) % n
        out = None
        for k in range(n):
            i = (first + k) % n
            start = time.perf_counter()
            result = self.executors[i].forward(batch)
            times[i] = time.perf_counter() - start
            if i == 0:
                out = result
        self.steps.append((batch.phase, batch.batch_size, times))
        return out

    def memory(self) -> Any:
        return self.executors[0].memory()

    def close(self) -> None:
        for ex in self.executors:
            ex.close()
