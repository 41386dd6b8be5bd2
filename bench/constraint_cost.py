"""Per-step cost of grammar constraints: computing the token masks and applying them.

For batch sizes 1 and 16, every row follows a JSON schema; the matchers walk through a
valid document token by token while the masks of all rows are computed (llguidance's
thread pool) and applied to ``[B, V]`` logits (the batched sampler's code). Reported: the
median and p90 milliseconds per step of each part, beside the median time of a plain
decode forward of the model at that batch (the cost being added to).

Example::

    .venv/bin/python -m bench.constraint_cost
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._env import dequantize, enable_blas  # noqa: E402 - BLAS before mlx

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "address"],
}
DOCUMENT = {
    "name": "Alice Smith",
    "age": 31,
    "tags": ["engineer", "runner", "cook"],
    "address": {"city": "Paris", "zip": "75001"},
}


def _ms(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(values, q) * 1000)


def measure(batch: int, model, tokenizer, compiler) -> dict[str, float]:  # noqa: ANN001
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from mlxserve.mlx_backend.sampler import apply_token_bitmask
    from mlxserve.scheduler.constraints import GrammarSpec

    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    constraints = [compiler.compile(spec) for _ in range(batch)]
    tokens = tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    logits = mx.random.normal((batch, compiler.vocab_size))
    mx.eval(logits)
    mask_s, apply_s = [], []
    for token in tokens:
        t0 = time.perf_counter()
        bitmask = compiler.masks(constraints)
        t1 = time.perf_counter()
        mx.eval(apply_token_bitmask(logits, bitmask))
        t2 = time.perf_counter()
        mask_s.append(t1 - t0)
        apply_s.append(t2 - t1)
        for c in constraints:
            c.accept(token)  # raises if the document broke the schema
    # A plain decode forward at this batch, for scale.
    cache = make_prompt_cache(model)
    x = mx.array(np.full((batch, 64), 5, np.int32))
    mx.eval(model(x, cache=cache))
    y = mx.array(np.full((batch, 1), 7, np.int32))
    forward_s = []
    for _ in range(10):
        t0 = time.perf_counter()
        mx.eval(model(y, cache=cache))
        forward_s.append(time.perf_counter() - t0)
    return {
        "batch": batch,
        "steps": len(tokens),
        "mask_ms_p50": _ms(mask_s, 50),
        "mask_ms_p90": _ms(mask_s, 90),
        "apply_ms_p50": _ms(apply_s, 50),
        "apply_ms_p90": _ms(apply_s, 90),
        "decode_forward_ms_p50": _ms(forward_s, 50),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    blas = enable_blas()
    from mlxserve.mlx_backend.loading.loader import load_model
    from mlxserve.scheduler.constraints import ConstraintCompiler

    loaded = load_model(None)
    weights = dequantize(loaded.model)
    from mlxserve.mlx_backend.logits import vocab_size

    eos = sorted(getattr(loaded.tokenizer, "eos_token_ids", None) or [])
    t0 = time.perf_counter()
    compiler = ConstraintCompiler(loaded.tokenizer, vocab_size(loaded.model), eos)
    build_s = time.perf_counter() - t0
    rows = [measure(b, loaded.model, loaded.tokenizer, compiler) for b in args.batch]
    print(f"model: embedded SmolLM2 ({weights}), BLAS: {blas}")
    print(f"tokenizer trie for llguidance built once in {build_s * 1000:.0f} ms")
    print("| batch | steps | mask p50 / p90 ms | apply p50 / p90 ms | decode forward p50 ms |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['steps']} | {r['mask_ms_p50']:.2f} / {r['mask_ms_p90']:.2f} "
            f"| {r['apply_ms_p50']:.2f} / {r['apply_ms_p90']:.2f} "
            f"| {r['decode_forward_ms_p50']:.1f} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"blas": blas, "build_s": build_s, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
