"""The forward ceiling: bare batched decode of the model, the upper bound of a server's decode.

The model is loaded the way mlxserve loads it (fast BLAS enabled before MLX is imported,
``mlx_backend.loading.loader.load_model``, then float32 dequantization on the CPU backend). For each
batch size B it prefills B equal-length prompts into mlx-lm's own ``KVCache`` (one per layer,
batch B) and times N greedy decode steps, two ways:

- ``sync``: forward, argmax, ``mx.eval`` each step (what a server that hands every token to
  the host before planning the next step can at best do);
- ``pipelined``: the next step's graph is built and queued (``mx.async_eval``) before the
  previous token is read back, as ``mlx_lm.generate`` does.

The prompts are prefilled once per batch size; each decode run is repeated (the cache
trimmed back to the prompt each time) and the fastest kept (the machine may be shared). Example::

    .venv/bin/python -m bench.forward_ceiling --model /tmp/smollm2-mlx --batch 1 4 16 32 \
        --steps 32 --json ceiling.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _env  # noqa: E402  (no mlx import: must precede mlx.core)


@dataclass
class CeilingResult:
    """Decode rates of one batch size (tokens per second over the whole batch)."""

    batch: int
    prompt_tokens: int
    steps: int
    prefill_tok_s: float
    sync_tok_s: float
    pipelined_tok_s: float

    @property
    def ceiling_tok_s(self) -> float:
        """The better of the two decode loops."""
        return max(self.sync_tok_s, self.pipelined_tok_s)


def _decode(model, cache, y, steps: int, pipelined: bool) -> float:  # noqa: ANN001
    """Run ``steps`` greedy decode steps from tokens ``y`` (shape [B]); returns seconds."""
    import mlx.core as mx

    def step(tokens):  # noqa: ANN001, ANN202
        return mx.argmax(model(tokens[:, None], cache=cache)[:, -1, :], axis=-1)

    start = time.perf_counter()
    if pipelined:
        for _ in range(steps):
            nxt = step(y)
            mx.async_eval(nxt)
            y.tolist()  # wait for the previous token, as a server reading it back would
            y = nxt
        y.tolist()
    else:
        for _ in range(steps):
            y = step(y)
            mx.eval(y)
            y.tolist()
    return time.perf_counter() - start


def prompt_ids(batch: int, prompt_tokens: int, vocab_size: int) -> list[list[int]]:
    """The ``batch`` random prompts of ``prompt_tokens`` token ids decoded at batch ``batch``
    (seeded by the batch size, so every run and ``bench.engine_steps`` see the same ones).
    Ids are drawn from ``[100, 20000)`` cut to the model's vocabulary of ``vocab_size``: an
    id past it would be read out of bounds (MLX does not check)."""
    import numpy as np

    high = min(20_000, vocab_size)
    low = min(100, high - 1)
    rng = np.random.default_rng(batch)
    return rng.integers(low, high, size=(batch, prompt_tokens)).tolist()


def measure(model, batch: int, prompt_tokens: int, steps: int, repeats: int) -> CeilingResult:  # noqa: ANN001
    """Prefill ``batch`` prompts of ``prompt_tokens`` tokens, then time ``steps`` decode steps.

    The prompt is prefilled once; before each timed run the cache is trimmed back to the
    prompt, so every run decodes over the same context lengths. Sync and pipelined runs
    alternate, ``repeats`` of each, and the fastest of each is kept.
    """
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from mlxserve.mlx_backend.logits import vocab_size

    ids = mx.array(np.array(prompt_ids(batch, prompt_tokens, vocab_size(model))), dtype=mx.int32)
    cache = make_prompt_cache(model)
    start = time.perf_counter()
    y = mx.argmax(model(ids, cache=cache)[:, -1, :], axis=-1)
    mx.eval(y)
    prefill_s = time.perf_counter() - start

    def rewind() -> None:
        for layer in cache:
            layer.trim(layer.offset - prompt_tokens)

    _decode(model, cache, y, 2, pipelined=False)  # first-use costs of the decode shapes
    best = {"sync": float("inf"), "pipelined": float("inf")}
    for _ in range(repeats):
        for mode in best:
            rewind()
            best[mode] = min(best[mode], _decode(model, cache, y, steps, mode == "pipelined"))
    return CeilingResult(
        batch=batch,
        prompt_tokens=prompt_tokens,
        steps=steps,
        prefill_tok_s=batch * prompt_tokens / prefill_s,
        sync_tok_s=batch * steps / best["sync"],
        pipelined_tok_s=batch * steps / best["pipelined"],
    )


def load(model_spec: str | None) -> tuple[object, object, list[str]]:
    """Load the model as mlxserve does; returns the model, its tokenizer and setup notes."""
    notes = [_env.enable_blas()]
    from mlxserve.mlx_backend.loading.loader import load_model

    loaded = load_model(model_spec)
    notes.append(_env.dequantize(loaded.model))
    return loaded.model, loaded.tokenizer, notes


def corpus_prompt_tokens(tokenizer, seed: int = 0, count: int = 12) -> int:  # noqa: ANN001
    """Mean chat-templated token length of the first ``count`` prompts of the corpus."""
    from bench.corpus import chat_ids, make_prompts

    lengths = []
    for prompt in make_prompts(seed, count):
        lengths.append(len(chat_ids(tokenizer, prompt)))
    return round(sum(lengths) / len(lengths))


def run(
    model_spec: str | None, batches: list[int], prompt_tokens: int, steps: int, repeats: int
) -> tuple[list[CeilingResult], list[str]]:
    """Measure every batch size; prints one line per batch size to stderr.

    ``prompt_tokens`` 0 means the mean prompt length of the benchmark corpus.
    """
    model, tokenizer, notes = load(model_spec)
    if prompt_tokens <= 0:
        prompt_tokens = corpus_prompt_tokens(tokenizer)
        notes.append(f"prompt tokens: {prompt_tokens} (mean of the corpus's chat prompts)")
    for note in notes:
        print(f"[forward_ceiling] {note}", file=sys.stderr, flush=True)
    results = []
    for b in batches:
        r = measure(model, b, prompt_tokens, steps, repeats)
        print(
            f"[forward_ceiling] B={b:>3} prefill {r.prefill_tok_s:8.1f} tok/s  decode sync "
            f"{r.sync_tok_s:7.1f}  pipelined {r.pipelined_tok_s:7.1f} tok/s",
            file=sys.stderr,
            flush=True,
        )
        results.append(r)
    return results, notes


def to_json(results: list[CeilingResult], notes: list[str]) -> dict:
    """A JSON-ready dict of the results."""
    rows = [asdict(r) | {"ceiling_tok_s": r.ceiling_tok_s} for r in results]
    return {"notes": notes, "results": rows}


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model spec as for mlxserve (default: embedded)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument(
        "--prompt-tokens", type=int, default=0, help="prompt length (0: the corpus's mean)"
    )
    p.add_argument("--steps", type=int, default=32, help="decode steps timed")
    p.add_argument("--repeats", type=int, default=2, help="best of this many measurements")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    results, notes = run(args.model, args.batch, args.prompt_tokens, args.steps, args.repeats)
    if args.json:
        args.json.write_text(json.dumps(to_json(results, notes), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
