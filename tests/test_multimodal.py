"""The numpy side of image inputs: prefix-cache keys of image placeholders, the image
positions of a prefill chunk, M-RoPE positions inside and after the prompt, and the
server's image checks that need no model."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest

from mlxserve.scheduler.multimodal import ImageSpan, MultimodalPrompt, chunk_images
from mlxserve.server.config import ServerConfig
from mlxserve.server.http.errors import APIError
from mlxserve.server.serving.images import (
    ImageSource,
    load_images,
    prepare_images,
    take_images,
)


def _prompt() -> MultimodalPrompt:
    a = ImageSpan(2, 3, np.arange(6, dtype=np.float32).reshape(3, 2), "aa" * 32)
    b = ImageSpan(7, 2, np.arange(4, dtype=np.float32).reshape(2, 2) + 100, "bb" * 32)
    positions = np.tile(np.array([0, 1, 2, 2, 2, 3, 4, 5, 5, 6], np.int32), (3, 1))
    return MultimodalPrompt([a, b], positions, position_delta=-3)


class TestCacheKeys:
    def test_placeholders_carry_the_image_key(self):
        mm = _prompt()
        ids = np.arange(12, dtype=np.int32)
        keyed = mm.cache_ids(ids)
        assert (keyed[2:5] == mm.spans[0].cache_keys).all(), keyed
        assert (keyed[7:9] == mm.spans[1].cache_keys).all(), keyed
        assert list(keyed[[0, 1, 5, 6, 9, 10, 11]]) == [0, 1, 5, 6, 9, 10, 11], keyed

    def test_keys_are_negative_and_differ_by_content(self):
        a, b = _prompt().spans
        assert (a.cache_keys < 0).all() and (b.cache_keys < 0).all(), (a.cache_keys, b.cache_keys)
        assert a.cache_keys[0] != b.cache_keys[0], "two images share a prefix-cache key"
        same = ImageSpan(40, 3, a.features, a.digest)
        assert (same.cache_keys == a.cache_keys).all(), "the keys depend on more than the content"

    def test_a_prompt_cut_inside_an_image(self):
        mm = _prompt()
        keyed = mm.cache_ids(np.arange(4, dtype=np.int32))
        assert (keyed[2:4] == mm.spans[0].cache_keys[:2]).all(), keyed


class TestChunkImages:
    def test_a_chunk_ending_inside_an_image(self):
        chunk = chunk_images(_prompt(), 0, 4)
        assert list(chunk.columns) == [2, 3], chunk.columns
        assert chunk.features.tolist() == [[0, 1], [2, 3]], chunk.features

    def test_a_chunk_spanning_the_rest_of_one_image_and_another(self):
        chunk = chunk_images(_prompt(), 4, 6)
        assert list(chunk.columns) == [0, 3, 4], chunk.columns
        assert chunk.features[:, 0].tolist() == [4, 100, 102], chunk.features

    def test_a_chunk_without_images(self):
        assert chunk_images(_prompt(), 9, 3) is None


class TestRelease:
    def test_without_restore_features_are_kept(self):
        mm = _prompt()
        mm.release_before(100)
        assert all(span.features is not None for span in mm.spans), "released with no way back"

    def test_released_features_come_back_through_restore(self):
        mm = _prompt()
        mm.restore = lambda span: np.full((span.length, 2), 7.0, np.float32)
        mm.release_before(6)
        assert mm.spans[0].features is None and mm.spans[1].features is not None, mm.spans
        chunk = chunk_images(mm, 0, 4)
        assert chunk.features.tolist() == [[7, 7], [7, 7]], chunk.features
        assert mm.restored == 1, mm.restored

    def test_the_server_restores_from_the_image_bytes(self):
        from PIL import Image

        from mlxserve.server.serving.images import _restorer

        buffer = io.BytesIO()
        Image.new("RGB", (4, 3), (1, 2, 3)).save(buffer, format="PNG")
        source = ImageSource("p", data=base64.b64encode(buffer.getvalue()).decode())
        [image] = load_images([source], ServerConfig())
        seen = []

        class Vision:
            def features(self, img):  # noqa: ANN001, ANN202
                seen.append(img)
                return np.zeros((1, 2), np.float32)

        restore = _restorer(Vision(), [image])
        restore(ImageSpan(0, 1, None, image.digest))
        assert seen[0].digest == image.digest and seen[0].image.size == (4, 3), seen


class TestPositions:
    def test_inside_and_after_the_prompt(self):
        got = _prompt().positions_of(8, 4)
        assert got[0].tolist() == [5, 6, 10 - 3, 11 - 3], got

    def test_without_a_table_the_index_plus_delta(self):
        mm = MultimodalPrompt([], None, position_delta=0)
        assert mm.positions_of(5, 2).tolist() == [[5, 6]] * 3


class TestImageChecks:
    def test_take_images_keeps_template_parts(self):
        source = ImageSource("p", data="AAAA")
        conversation = [
            {
                "role": "user",
                "content": [{"type": "image", "source": source}, {"type": "text", "text": "hi"}],
            },
            {"role": "assistant", "content": "ok"},
        ]
        taken, sources = take_images(conversation)
        assert sources == [source], sources
        assert taken[0]["content"] == [{"type": "image"}, {"type": "text", "text": "hi"}], taken
        assert taken[1] == conversation[1], taken

    @pytest.mark.parametrize("url", ["file:///etc/passwd", "data:text/plain,hello", "gopher://x"])
    def test_other_urls_are_refused(self, url):
        with pytest.raises(ValueError):
            ImageSource.of_url(url, "p")

    def test_oversize_base64_is_refused_before_decoding(self):
        source = ImageSource("p", data=base64.b64encode(b"x" * 5000).decode())
        with pytest.raises(APIError) as e:
            load_images([source], ServerConfig(max_image_bytes=1000))
        assert e.value.status_code == 400 and "bytes" in e.value.message, e.value

    def test_a_busy_vision_encoder_is_429(self):
        class Busy:
            pending = 4

        source = ImageSource("p", data="AAAA")
        with pytest.raises(APIError) as e:
            asyncio.run(prepare_images(Busy(), [1], [source], ServerConfig(max_queue=4)))
        assert e.value.status_code == 429, e.value
        assert "Retry-After" in (e.value.headers or {}), e.value.headers
