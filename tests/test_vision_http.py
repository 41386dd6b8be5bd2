"""Image inputs over HTTP with the official SDKs: a tiny random Qwen2-VL model beside a
text-only one. Answers equal mlx-vlm's own generation; the same image in a later request
is a prefix-cache hit with the same answer, a different image a miss at its first
placeholder; bad, oversize or disallowed images are 400s in the protocol's shape."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import anthropic
import openai
import pytest

from mlxserve.mlx_backend.loading.loader import load_model
from mlxserve.server.config import ServerConfig
from mlxserve.server.lifecycle.launch import BackgroundServer
from mlxserve.server.models.declarations import ModelDeclaration
from mlxserve.server.serving.conversation import render_chat
from tests.ops_helpers import metric, scrape
from tests.test_multi_model import serve
from tests.test_vision_engine import _image
from tests.tiny_models import build_tiny_model_dir
from tests.tiny_vision import (
    IMAGE_TOKEN_ID,
    build_tiny_vlm_dir,
    random_png,
    vlm_reference,
)

MAX_TOKENS = 5
CONFIG = ServerConfig(
    port=0, max_images_per_request=2, max_image_bytes=60_000, max_image_pixels=12_000
)


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def flat_png(width: int, height: int) -> bytes:
    """A one-colour PNG: few bytes, many pixels."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def image_message(png: bytes | str, text: str = "what is this?") -> list[dict]:
    url = png if isinstance(png, str) else data_url(png)
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": text},
            ],
        }
    ]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vision-http")
    return {
        "vlm": build_tiny_vlm_dir("qwen2_vl", root / "qwen2-vl"),
        "text": build_tiny_model_dir("llama", root / "llama"),
    }


@pytest.fixture(scope="module")
def server(dirs: dict[str, Path]) -> Iterator[BackgroundServer]:
    declarations = [
        ModelDeclaration(str(dirs["vlm"]), ("vlm",)),
        ModelDeclaration(str(dirs["text"]), ("text",)),
    ]
    server, _ = serve(declarations, CONFIG)
    try:
        yield server
    finally:
        server.stop()  # AuditingLoader: every engine accounts for every slot at unload


@pytest.fixture(scope="module")
def expected(dirs: dict[str, Path]):  # noqa: ANN201
    """The text mlx-vlm's own generation gives a one-image chat prompt."""
    loaded = load_model(str(dirs["vlm"]))
    tokenizer = loaded.tokenizer

    def answer(png: bytes, text: str = "what is this?") -> tuple[str, int, int]:
        conversation = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}
        ]
        _, ids = render_chat(tokenizer, conversation)
        prepared = loaded.vision.prepare(ids, [_image(png)])
        tokens = vlm_reference(dirs["vlm"], prepared.ids, [png], MAX_TOKENS)
        return tokenizer.decode(tokens), len(prepared.ids), prepared.ids.index(IMAGE_TOKEN_ID)

    yield answer
    loaded.vision.close()


def chat(client: openai.OpenAI, messages: list[dict], model: str = "vlm"):  # noqa: ANN201
    return client.chat.completions.create(
        model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )


class TestOpenAIChatImages:
    def test_answer_equals_mlx_vlm(self, client, expected):
        png = random_png(11)
        text, prompt_len, _ = expected(png)
        got = chat(client, image_message(png))
        assert got.choices[0].message.content == text, (got.choices[0].message.content, text)
        assert got.usage.prompt_tokens == prompt_len, "the image's placeholders were not expanded"

    def test_n_choices_share_the_image(self, client, expected):
        png = random_png(12)
        text, _, _ = expected(png)
        got = client.chat.completions.create(
            model="vlm", messages=image_message(png), max_tokens=MAX_TOKENS, temperature=0, n=2
        )
        assert [c.message.content for c in got.choices] == [text, text], got.choices

    def test_streamed_answer_equals_mlx_vlm(self, client, expected):
        png = random_png(13)
        text, _, _ = expected(png)
        stream = client.chat.completions.create(
            model="vlm",
            messages=image_message(png),
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
        )
        got = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert got == text, (got, text)

    def test_same_image_hits_the_prefix_cache_and_a_different_one_misses(self, client, expected):
        first, second = random_png(21), random_png(22)
        text, _, image_at = expected(first)
        cold = chat(client, image_message(first))
        warm = chat(client, image_message(first))
        assert warm.choices[0].message.content == text == cold.choices[0].message.content
        cached = warm.usage.prompt_tokens_details.cached_tokens
        assert cached > image_at, f"the same image was not a prefix hit ({cached} cached)"
        other = chat(client, image_message(second))
        missed = other.usage.prompt_tokens_details.cached_tokens
        assert missed <= image_at, f"a different image hit the cache past its start ({missed})"
        assert other.choices[0].message.content == expected(second)[0]

    def test_vision_metrics_count_images(self, server, client):
        chat(client, image_message(random_png(31)))
        samples = scrape(server.url)
        images = metric(samples, "mlxserve:images_processed_total")
        seconds = metric(samples, "mlxserve:vision_encoder_seconds_total")
        assert images >= 1, f"{images} images counted"
        assert seconds > 0, f"{seconds} vision encoder seconds"


class TestVisionCache:
    def test_same_image_skips_the_vision_tower(self, server, client):
        png = random_png(61)
        chat(client, image_message(png))
        before = scrape(server.url)
        chat(client, image_message(png, "and now?"))
        after = scrape(server.url)
        name = "mlxserve:images_processed_total"
        assert metric(after, name) == metric(before, name), "the same image was encoded again"
        hits = "mlxserve:vision_cache_hits_total"
        assert metric(after, hits) == metric(before, hits) + 1, "no vision cache hit counted"


class TestImageErrors:
    @pytest.mark.parametrize(
        "url",
        [
            "data:image/png;base64,%%%notbase64",
            "data:image/png;base64," + base64.b64encode(b"not an image").decode(),
            "data:image/png,rawbytes",
            "ftp://example.com/cat.png",
        ],
        ids=["bad-base64", "not-an-image", "not-base64-url", "bad-scheme"],
    )
    def test_malformed_image_is_400(self, client, url):
        with pytest.raises(openai.BadRequestError):
            chat(client, image_message(url))

    def test_url_refused_without_the_flag(self, client):
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, image_message("http://127.0.0.1:9/cat.png"))
        assert "allow-image-urls" in str(e.value), e.value

    def test_too_many_images(self, client):
        png = data_url(random_png(1, width=30, height=30))
        parts = [{"type": "image_url", "image_url": {"url": png}}] * 3
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, [{"role": "user", "content": parts}])
        assert "at most 2" in str(e.value), e.value

    def test_too_many_pixels(self, client):
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, image_message(flat_png(200, 100)))
        assert "pixel" in str(e.value), e.value

    def test_too_many_bytes(self, client):
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, image_message("data:image/png;base64," + "A" * 100_000))
        assert "bytes" in str(e.value), e.value

    def test_tokenize_refuses_images(self, http):
        body = {"model": "vlm", "messages": image_message(random_png(1))}
        response = http.post("/tokenize", json=body)
        assert response.status_code == 400, response.text
        assert "images" in response.json()["error"]["message"], response.text

    def test_text_model_refuses_images(self, client):
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, image_message(random_png(1)), model="text")
        assert "does not take images" in str(e.value), e.value


class _PNGHandler(http.server.BaseHTTPRequestHandler):
    """Serves ``/cat.png`` (one image), ``/big.png`` (over the byte limit),
    ``/slow.png`` (4 s a byte at a time), 404 else."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/slow.png":  # a byte at a time: each read is quick, the whole is not
            self.send_response(200)
            self.send_header("Content-Length", "40")
            self.end_headers()
            for _ in range(40):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
            return
        body = {"/cat.png": URL_PNG, "/big.png": b"x" * 100_000}.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # noqa: ANN002
        pass


URL_PNG = random_png(71)


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PNGHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def url_client(dirs: dict[str, Path]) -> Iterator[openai.OpenAI]:
    """A server started with --allow-image-urls."""
    config = replace(CONFIG, allow_image_urls=True, image_url_timeout=1.0)
    server, _ = serve([ModelDeclaration(str(dirs["vlm"]), ("vlm",))], config)
    try:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    finally:
        server.stop()


class TestImageURLs:
    def test_fetched_image_equals_inline(self, url_client, image_host, expected):
        got = chat(url_client, image_message(image_host + "/cat.png"))
        assert got.choices[0].message.content == expected(URL_PNG)[0], got

    @pytest.mark.parametrize(
        ("path", "says"), [("/big.png", "bytes"), ("/nope.png", "fetched"), ("/slow.png", "took")]
    )
    def test_bad_fetches_are_400(self, url_client, image_host, path, says):
        with pytest.raises(openai.BadRequestError) as e:
            chat(url_client, image_message(image_host + path))
        assert says in str(e.value), e.value


@pytest.fixture(scope="module")
def claude(server: BackgroundServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=300)


def anthropic_image(data: bytes | None = None, url: str | None = None) -> dict:
    if url is not None:
        return {"type": "image", "source": {"type": "url", "url": url}}
    encoded = base64.b64encode(data).decode()
    return {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": encoded},
    }


class TestAnthropicImageBlocks:
    def test_answer_equals_mlx_vlm(self, claude, expected):
        png = random_png(41)
        text, prompt_len, _ = expected(png)
        content = [anthropic_image(png), {"type": "text", "text": "what is this?"}]
        got = claude.messages.create(
            model="vlm",
            max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": content}],
            extra_body={"temperature": 0},
        )
        assert got.content[0].text == text, (got.content, text)
        assert got.usage.input_tokens + (got.usage.cache_read_input_tokens or 0) == prompt_len

    def test_count_tokens_counts_the_placeholders(self, claude, expected):
        png = random_png(42)
        _, prompt_len, _ = expected(png)
        content = [anthropic_image(png), {"type": "text", "text": "what is this?"}]
        count = claude.messages.count_tokens(
            model="vlm", messages=[{"role": "user", "content": content}]
        )
        assert count.input_tokens == prompt_len, (count.input_tokens, prompt_len)

    @pytest.mark.parametrize(
        "block",
        [
            {
                "type": "image",
                "source": {"type": "base64", "media_type": "image/png", "data": "%%"},
            },
            anthropic_image(url="http://127.0.0.1:9/cat.png"),
        ],
        ids=["bad-base64", "url-without-flag"],
    )
    def test_bad_image_is_400_in_anthropic_shape(self, claude, block):
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(
                model="vlm",
                max_tokens=MAX_TOKENS,
                messages=[{"role": "user", "content": [block, {"type": "text", "text": "hi"}]}],
            )
        assert e.value.body["type"] == "error", e.value.body
        assert e.value.body["error"]["type"] == "invalid_request_error", e.value.body


class TestResponsesInputImage:
    def test_answer_equals_mlx_vlm(self, client, expected):
        png = random_png(51)
        text, prompt_len, _ = expected(png)
        got = client.responses.create(
            model="vlm",
            max_output_tokens=MAX_TOKENS,
            temperature=0,
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_image", "image_url": data_url(png)},
                        {"type": "input_text", "text": "what is this?"},
                    ],
                }
            ],
        )
        assert got.output_text == text, (got.output_text, text)
        assert got.usage.input_tokens == prompt_len, (got.usage.input_tokens, prompt_len)

    def test_file_id_image_is_400(self, client):
        with pytest.raises(openai.BadRequestError):
            client.responses.create(
                model="vlm",
                max_output_tokens=MAX_TOKENS,
                input=[{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}],
            )
