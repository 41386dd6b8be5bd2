"""Image inputs through the engine: tiny random mlx-vlm models, batched with text rows,
checked token for token against mlx-vlm's own single-request generation."""

from __future__ import annotations

import io

import pytest

from mlxserve.mlx_backend.loading.loader import load_model
from mlxserve.mlx_backend.vision.encoder import ImageInput
from mlxserve.scheduler.multimodal import multimodal_prompt
from mlxserve.scheduler.sampling_params import SamplingParams
from mlxserve.server.serving.conversation import render_chat
from tests.conftest import Collector
from tests.tiny_vision import (
    build_tiny_vlm_dir,
    digest,
    random_png,
    vlm_reference,
)

MAX_TOKENS = 6


def _image(data: bytes) -> ImageInput:
    from PIL import Image

    return ImageInput(Image.open(io.BytesIO(data)).convert("RGB"), digest(data))


def _prompt(tokenizer, text: str, images: int) -> list[int]:  # noqa: ANN001
    """A user turn of ``images`` images then ``text``, rendered by the model's template
    (one placeholder per image)."""
    content = [{"type": "image"}] * images + [{"type": "text", "text": text}]
    return render_chat(tokenizer, [{"role": "user", "content": content}])[1]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3", "llava"])
def vlm_dir(request, tmp_path_factory):
    return build_tiny_vlm_dir(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def vlm(vlm_dir):
    loaded = load_model(str(vlm_dir))
    yield loaded
    loaded.vision.close()


def _submit(engine, collector, rid, ids, mm=None):
    engine.add_request(
        rid,
        ids,
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        collector.callback(rid),
        images=mm,
    )


class TestLoading:
    def test_vision_dir_loads_with_an_encoder(self, vlm):
        assert vlm.vision is not None, "a vision model directory loaded without its encoder"
        assert vlm.kind == "decoder", vlm.kind

    def test_an_unsupported_family_loads_through_mlx_lm(self, tmp_path):
        import json

        from tests.tiny_models import build_tiny_model_dir

        path = build_tiny_model_dir("llama", tmp_path / "llama-with-vision")
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "vision_config": {}}))
        (path / "preprocessor_config.json").write_text("{}")
        loaded = load_model(str(path))
        assert loaded.vision is None, "a family without image support got a vision encoder"


class TestBatchedImagesMatchMlxVlm:
    """Image and text-only requests in one batch, prefilled in chunks that end inside an
    image, give mlx-vlm's own tokens for each request alone."""

    def test_mixed_batch(self, vlm, vlm_dir, make_engine):
        images = [random_png(1), random_png(2, width=50, height=100)]
        cases = {
            "img-a": (_prompt(vlm.tokenizer, "what is this?", 1), [images[0]]),
            "text": (_prompt(vlm.tokenizer, "hello there, how are you", 0), []),
            "img-two": (_prompt(vlm.tokenizer, "compare", 2), images),
        }
        prepared = {}
        for rid, (ids, imgs) in cases.items():
            if imgs:
                ready = vlm.vision.prepare(ids, [_image(b) for b in imgs])
                prepared[rid] = (ready.ids, multimodal_prompt(ready))
            else:
                prepared[rid] = (ids, None)
        engine = make_engine(vlm, max_total_tokens=1024, max_prefill_tokens=7)
        collector = Collector()
        for rid, (ids, mm) in prepared.items():
            _submit(engine, collector, rid, ids, mm)
        for rid, (ids, _) in prepared.items():
            collector.wait(rid, timeout=120)
            want = vlm_reference(vlm_dir, ids, cases[rid][1], MAX_TOKENS)
            assert collector.tokens[rid] == want, f"{rid}: {collector.tokens[rid]} != {want}"
        assert engine.executor is not None


class TestPreemptedImageRequests:
    """A pool too small for every image request's decode preempts some. Features are
    released once the prefill passes their image; a preempted request recomputing its
    prompt gets them back through ``restore`` (with the prefix cache off, it must), and
    every request still gives mlx-vlm's tokens."""

    @pytest.mark.parametrize("prefix_cache", [True, False], ids=["cache", "no-cache"])
    def test_tiny_pool(self, vlm, vlm_dir, make_engine, prefix_cache):
        max_tokens = 12
        cases = []
        for seed in range(4):
            ids = _prompt(vlm.tokenizer, f"picture {seed}", 1)
            png = random_png(100 + seed)
            ready = vlm.vision.prepare(ids, [_image(png)])
            mm = multimodal_prompt(ready, lambda span, png=png: vlm.vision.features(_image(png)))
            cases.append((f"r{seed}", ready, png, mm))
        longest = max(len(r.ids) for _, r, _, _ in cases)
        # Two prompts fit (admission reserves a quarter of the decode budget), their
        # decodes do not: decoding must preempt.
        engine = make_engine(
            vlm, max_total_tokens=2 * longest + 6, disable_prefix_cache=not prefix_cache
        )
        collector = Collector()
        for rid, ready, _, mm in cases:
            engine.add_request(
                rid,
                ready.ids,
                SamplingParams(temperature=0.0, max_tokens=max_tokens),
                collector.callback(rid),
                images=mm,
            )
        for rid, ready, png, _ in cases:
            collector.wait(rid, timeout=120)
            want = vlm_reference(vlm_dir, ready.ids, [png], max_tokens)
            assert collector.tokens[rid] == want, f"{rid}: {collector.tokens[rid]} != {want}"
        assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
        released = [span.features is None for *_, mm in cases for span in mm.spans]
        assert all(released), "features were held after the prefill passed their image"
        if not prefix_cache:
            restored = sum(mm.restored for *_, mm in cases)
            assert restored > 0, "no preempted request needed its image's features back"


class TestImagePrefixCache:
    """The same image in a later request is a prefix hit past the image with the same
    tokens; a different image misses from its first placeholder on."""

    def test_same_hits_different_misses(self, vlm, vlm_dir, make_engine):
        engine = make_engine(vlm, max_total_tokens=1024)
        ids = _prompt(vlm.tokenizer, "describe it", 1)
        runs = {}
        for rid, seed in (("first", 7), ("again", 7), ("other", 8)):
            ready = vlm.vision.prepare(ids, [_image(random_png(seed))])
            collector = Collector()
            _submit(engine, collector, rid, ready.ids, multimodal_prompt(ready))
            final = collector.wait(rid, timeout=120)
            runs[rid] = (ready, collector.tokens[rid], final.cached_tokens)
        ready, first, _ = runs["first"]
        image = ready.images[0]
        _, again, hit = runs["again"]
        assert again == first, f"a prefix hit changed the output: {again} != {first}"
        assert hit > image.start + image.length - 1, f"the same image missed ({hit} cached)"
        other_ready, other, missed = runs["other"]
        assert missed <= image.start, f"a different image hit past its start ({missed})"
        want = vlm_reference(vlm_dir, other_ready.ids, [random_png(8)], MAX_TOKENS)
        assert other == want, f"the other image: {other} != {want}"


class _NewlineRunTokenizer:
    """Characters are their code points, a run of newlines one token (``1000 + run``),
    ``<boi>`` / ``<img>`` / ``<eoi>`` special tokens: Gemma's tokenizer in miniature."""

    SPECIALS = {"<boi>": 900, "<img>": 901, "<eoi>": 902}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        import re

        ids = []
        for piece in re.split(r"(<boi>|<img>|<eoi>|\n+)", text):
            if piece in self.SPECIALS:
                ids.append(self.SPECIALS[piece])
            elif piece.startswith("\n"):
                ids.append(1000 + len(piece))
            else:
                ids.extend(ord(c) for c in piece)
        return ids

    def decode(self, ids: list[int]) -> str:
        names = {v: k for k, v in self.SPECIALS.items()}
        return "".join(names.get(t) or ("\n" * (t - 1000) if t >= 1000 else chr(t)) for t in ids)


class TestGemma3Framing:
    """The framing newlines join the newlines around the placeholder, as Gemma3's
    processor gets them by tokenizing the expanded text."""

    def test_tokens_equal_the_processors_text_expansion(self):
        import numpy as np

        from mlxserve.mlx_backend.vision.encoder import VisionEncoder
        from mlxserve.mlx_backend.vision.families import EncodedImage, Gemma3Family

        tokenizer = _NewlineRunTokenizer()
        family = object.__new__(Gemma3Family)
        family.tokenizer, family._newline_counts = tokenizer, {}
        family.placeholder_id, family.image_token_id, family.end_id = 900, 901, 902
        family.encode = lambda image: EncodedImage(np.zeros((3, 2), np.float32), ())
        family.positions = lambda ids, images: (None, 0)
        encoder = VisionEncoder(family)
        try:
            text = "user\n<boi><boi>\ncompare\n"
            ready = encoder.prepare(
                tokenizer.encode(text), [ImageInputStub("a"), ImageInputStub("b")]
            )
        finally:
            encoder.close()
        framed = "\n\n<boi>" + "<img>" * 3 + "<eoi>\n\n"
        want = tokenizer.encode(text.replace("<boi>", framed))
        assert ready.ids == want, f"{tokenizer.decode(ready.ids)!r} != {tokenizer.decode(want)!r}"
        starts = [image.start for image in ready.images]
        assert [ready.ids[s : s + 3] for s in starts] == [[901] * 3] * 2, (ready.ids, starts)


class ImageInputStub:
    def __init__(self, digest: str) -> None:
        self.image, self.digest = None, digest
