"""Image inputs through the engine: what the vision path costs beside a text prompt.

A random-weight Qwen2-VL of a few hundred MB (``tests/tiny_vision.py``'s config, scaled
up; no download) is loaded as the server loads it, then, one request at a time through
the engine:

1. the vision encoder on one image, cold and then from its feature cache;
2. the time to the first token of a prompt with that image against a text-only prompt of
   the same length (what the image's placeholder embeddings and M-RoPE positions add);
3. the same image prompt again: a prefix-cache hit (image placeholders keyed by content).

    .venv/bin/python -m bench.vision [--side 448] [--repeat 3]

Prints a markdown table; the timings are medians of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from pathlib import Path

from mlxserve.mlx_backend.cpu.blas import enable_fast_blas

enable_fast_blas()

from mlxserve.mlx_backend.loading.loader import load_model  # noqa: E402
from mlxserve.mlx_backend.vision.encoder import ImageInput  # noqa: E402
from mlxserve.scheduler.config import EngineConfig  # noqa: E402
from mlxserve.scheduler.multimodal import multimodal_prompt  # noqa: E402
from mlxserve.scheduler.sampling_params import SamplingParams  # noqa: E402
from mlxserve.server.lifecycle.engines import build_engine  # noqa: E402
from mlxserve.server.serving.conversation import render_chat  # noqa: E402
from tests.conftest import Collector  # noqa: E402
from tests.tiny_vision import build_tiny_vlm_dir, digest, random_png  # noqa: E402

SIZES = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
    "vision_config": {"depth": 8, "embed_dim": 384, "hidden_size": 512, "num_heads": 6},
}


def _image(png: bytes) -> ImageInput:
    from PIL import Image

    return ImageInput(Image.open(io.BytesIO(png)).convert("RGB"), digest(png))


def _ttft(engine, rid: str, ids: list[int], mm=None) -> tuple[float, int]:  # noqa: ANN001
    collector = Collector()
    start = time.perf_counter()
    engine.add_request(
        rid, ids, SamplingParams(temperature=0.0, max_tokens=1), collector.callback(rid), images=mm
    )
    final = collector.wait(rid, timeout=600)
    return time.perf_counter() - start, final.cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", type=int, default=448, help="image side in pixels")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    pixels = args.side * args.side
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_vlm_dir(
            "qwen2_vl",
            Path(tmp) / "qwen2-vl",
            overrides=SIZES,
            processor_overrides={"min_pixels": pixels, "max_pixels": pixels},
        )
        loaded = load_model(str(path))
    vision, tokenizer = loaded.vision, loaded.tokenizer
    engine = build_engine(loaded, EngineConfig(max_total_tokens=16384, max_prefill_tokens=4096))
    engine.start()
    try:
        # Warm-up: the first forwards of each shape pay one-time costs.
        _ttft(engine, "warm-text", list(range(1, 40)))
        rows = []
        cold, warm, image_ttft, text_ttft, hit_ttft = [], [], [], [], []
        for r in range(args.repeat):
            png = random_png(1000 + r, width=args.side, height=args.side)
            content = [{"type": "image"}, {"type": "text", "text": "describe the picture"}]
            _, ids = render_chat(tokenizer, [{"role": "user", "content": content}])
            start = time.perf_counter()
            ready = vision.prepare(ids, [_image(png)])
            cold.append(time.perf_counter() - start)
            start = time.perf_counter()
            vision.prepare(ids, [_image(png)])
            warm.append(time.perf_counter() - start)
            text = [(7 * i + r) % 250 + 1 for i in range(len(ready.ids))]
            text_ttft.append(_ttft(engine, f"text-{r}", text)[0])
            image_ttft.append(_ttft(engine, f"img-{r}", ready.ids, multimodal_prompt(ready))[0])
            seconds, cached = _ttft(engine, f"hit-{r}", ready.ids, multimodal_prompt(ready))
            hit_ttft.append(seconds)
        placeholders = ready.images[0].length
        rows.append(("vision encoder, cold (one image)", statistics.median(cold)))
        rows.append(("vision encoder, feature cache hit", statistics.median(warm)))
        rows.append((f"TTFT, text prompt of {len(ready.ids)} tokens", statistics.median(text_ttft)))
        rows.append(
            (f"TTFT, image prompt ({placeholders} placeholders)", statistics.median(image_ttft))
        )
        rows.append((f"TTFT, same image again ({cached} cached)", statistics.median(hit_ttft)))
    finally:
        engine.shutdown()
        vision.close()
    print(f"| {args.side}x{args.side} image, random Qwen2-VL | seconds (median of {args.repeat}) |")
    print("|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.4f} |")


if __name__ == "__main__":
    main()
