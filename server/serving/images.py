"""Images of a request, protocol-neutral: sources -> bytes -> checked, decoded images ->
the vision encoder's prepared prompt.

Adapters put each image part of a message into the conversation as
``{"type": "image", "source": ImageSource}``; ``take_images`` pulls the sources out (the
template sees ``{"type": "image"}``, which vision templates render as the model's image
placeholder). After the prompt is rendered and tokenized, ``prepare_images`` loads and
checks the images (limits of ``ServerConfig``: count, bytes, pixels, URL policy; each
violation a 400 naming the image) and runs the model's vision encoder, off the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlxserve.scheduler.multimodal import ImageSpan, MultimodalPrompt, multimodal_prompt
from mlxserve.server.config import ServerConfig
from mlxserve.server.http.errors import APIError, invalid_request
from mlxserve.server.serving.limits import RETRY_AFTER_S
from mlxserve.server.serving.offload import offload

_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,", re.I)


@dataclass(frozen=True)
class ImageSource:
    """Where an image comes from: inline bytes (base64 decoded later) or a URL.

    Attributes:
        data: base64 text of the image (None for a URL).
        url: an http(s) URL (None for inline data).
        param: the request field holding it, named in errors.
    """

    param: str
    data: str | None = None
    url: str | None = None

    @classmethod
    def of_url(cls, url: str, param: str) -> ImageSource:
        """An OpenAI ``image_url``: a ``data:`` URL (base64) or an http(s) URL.

        Raises:
            ValueError: any other URL (request validation turns it into a 400).
        """
        match = _DATA_URL.match(url)
        if match is not None:
            return cls(param, data=url[match.end() :])
        if url.lower().startswith("data:"):
            raise ValueError(f"{param}: a data: URL must be base64 ('data:image/png;base64,...')")
        if not url.lower().startswith(("http://", "https://")):
            raise ValueError(f"{param}: an image URL must be a data:, http: or https: URL")
        return cls(param, url=url)


@dataclass(frozen=True)
class DecodedImage:
    """A checked image: RGB pixels (PIL), the sha256 of its bytes (its content key), and
    the bytes (to decode again should a preempted request need its features back)."""

    image: Any
    digest: str
    data: bytes = field(repr=False)


def image_part(source: ImageSource) -> dict[str, Any]:
    """The conversation's content part for an image."""
    return {"type": "image", "source": source}


def take_images(conversation: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list]:
    """The conversation as templates take it (image parts without their sources) and the
    sources in prompt order."""
    sources: list[ImageSource] = []
    out = []
    for message in conversation:
        content = message.get("content")
        if isinstance(content, list) and any(p.get("type") == "image" for p in content):
            parts = []
            for part in content:
                if part.get("type") == "image":
                    sources.append(part["source"])
                    parts.append({"type": "image"})
                else:
                    parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    return out, sources


def _fetch(url: str, config: ServerConfig, param: str) -> bytes:
    limit = config.max_image_bytes

    class _HttpOnly(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001, ANN202
            if not newurl.lower().startswith(("http://", "https://")):
                raise urllib.error.URLError("redirect to a non-http(s) URL")
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    opener = urllib.request.build_opener(_HttpOnly)
    timeout = config.image_url_timeout or None
    # The socket timeout bounds each read; the deadline bounds the whole fetch (a server
    # sending a byte at a time would otherwise hold the worker indefinitely).
    deadline = time.monotonic() + timeout if timeout else None
    chunks: list[bytes] = []
    size = 0
    try:
        with opener.open(url, timeout=timeout) as response:
            while chunk := response.read1(64 * 1024):
                chunks.append(chunk)
                size += len(chunk)
                if limit and size > limit:
                    raise invalid_request(f"{param}: the image is over {limit} bytes", param)
                if deadline is not None and time.monotonic() > deadline:
                    raise invalid_request(
                        f"{param}: the image URL took over {timeout:g} s to fetch", param
                    )
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise invalid_request(f"{param}: the image URL could not be fetched: {e}", param) from e
    return b"".join(chunks)


def _load(source: ImageSource, config: ServerConfig) -> bytes:
    param = source.param
    if source.url is not None:
        if not config.allow_image_urls:
            raise invalid_request(
                f"{param}: image URLs are not fetched by this server (start it with "
                "--allow-image-urls); send the image inline as a base64 data: URL",
                param,
                code="image_url_not_allowed",
            )
        return _fetch(source.url, config, param)
    text = source.data or ""
    limit = config.max_image_bytes
    if limit and len(text) * 3 // 4 > limit + 3:
        raise invalid_request(f"{param}: the image is over {limit} bytes", param)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise invalid_request(f"{param}: the image is not valid base64", param) from e
    if limit and len(data) > limit:
        raise invalid_request(f"{param}: the image is over {limit} bytes", param)
    return data


def _decode(data: bytes, param: str, pixels_left: int) -> tuple[DecodedImage, int]:
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if pixels_left and width * height > pixels_left:
            raise invalid_request(
                f"{param}: the request's images are over the server's pixel limit", param
            )
        image.load()
        rgb = image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise invalid_request(f"{param}: the image could not be decoded: {e}", param) from e
    return DecodedImage(rgb, hashlib.sha256(data).hexdigest(), data), width * height


def load_images(sources: list[ImageSource], config: ServerConfig) -> list[DecodedImage]:
    """Fetch or decode every image, checking the request's limits (blocking).

    Raises:
        APIError: 400 over a limit, for a URL without ``--allow-image-urls``, or for an
            image that cannot be fetched or decoded.
    """
    if config.max_images_per_request and len(sources) > config.max_images_per_request:
        raise invalid_request(
            f"the request has {len(sources)} images; at most "
            f"{config.max_images_per_request} are allowed",
            sources[config.max_images_per_request].param,
        )
    images = []
    pixels_left = config.max_image_pixels
    for source in sources:
        image, pixels = _decode(_load(source, config), source.param, pixels_left)
        images.append(image)
        if config.max_image_pixels:
            pixels_left = max(1, pixels_left - pixels)
    return images


async def prepare_images(
    vision: Any, prompt_ids: list[int], sources: list[ImageSource], config: ServerConfig
) -> tuple[list[int], MultimodalPrompt | None]:
    """The prompt with each image's placeholder expanded, and its images for the engine
    (``prompt_ids`` and None when there are no images).

    Args:
        vision: the model's vision encoder (None: a text-only model).

    Raises:
        APIError: 400 for a text-only model given images, an image over a limit, or a
            prompt whose image placeholders do not match its images; 429 when
            ``--max-queue`` prompts already wait for the vision encoder.
    """
    if not sources:
        return prompt_ids, None
    if vision is None:
        raise invalid_request(
            "This model does not take images; send text only or use a vision model.",
            sources[0].param,
            code="images_not_supported",
        )
    if config.max_queue and vision.pending >= config.max_queue:
        raise APIError(
            429,
            f"The server is busy: {vision.pending} requests are already waiting for the "
            f"vision encoder (limit {config.max_queue}). Please retry later.",
            type="rate_limit_exceeded",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    images = await offload(load_images, sources, config)
    try:
        prepared = await asyncio.wrap_future(vision.submit(prompt_ids, images))
    except ValueError as e:
        raise invalid_request(f"The images do not fit the prompt: {e}", sources[0].param) from e
    return prepared.ids, multimodal_prompt(prepared, _restorer(vision, images))


def _restorer(vision: Any, images: list[DecodedImage]) -> Callable[[ImageSpan], np.ndarray]:
    """How a request gets an image's released features back: the vision encoder's cache,
    else the image's bytes decoded and encoded again. Holds the bytes only (not pixels)."""
    data = {image.digest: image.data for image in images}

    def restore(span: ImageSpan) -> np.ndarray:
        image, _ = _decode(data[span.digest], "image", 0)
        return vision.features(image)

    return restore
