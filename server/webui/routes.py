"""``GET /``: the built-in chat page, and its files under ``/webui/``.

The page is plain HTML, CSS and JavaScript modules from ``static/`` (installed as package
data), with a pinned copy of two libraries in ``static/vendor/`` (see its README). Only the
files found there when the app is built are served, each from memory, so no request path
ever reaches the file system. Every answer carries a Content-Security-Policy that lets the
page load and connect to this server only, run no inline script and no ``eval``, and write
HTML into the document only through the sanitizer's Trusted Types policy.

The page itself is public (a browser cannot send a key to open it); it asks for the API
key when ``/v1/models`` says one is needed, keeps it in the browser's storage and sends it
as ``Authorization: Bearer``, never in a URL.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import Response

from mlxserve.server.http.errors import APIError

STATIC_DIR = Path(__file__).resolve().parent / "static"
ASSET_PREFIX = "/webui/"

CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "font-src 'self'",
        "manifest-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
        "object-src 'none'",
        "require-trusted-types-for 'script'",
        "trusted-types dompurify",
    )
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
    # Revalidate every time (the ETag makes that a 304): an upgraded server's page is
    # never mixed with a cached older script.
    "Cache-Control": "no-cache",
}
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".md": "text/plain; charset=utf-8",
    ".txt": "text/plain; charset=utf-8",
    "": "text/plain; charset=utf-8",  # LICENSE
}


def is_webui_path(path: str) -> bool:
    """Whether ``path`` is the page or one of its files (served while a model loads)."""
    return path == "/" or path.startswith(ASSET_PREFIX)


@dataclass(frozen=True)
class Asset:
    """One file of the page, held in memory."""

    body: bytes
    content_type: str
    etag: str


@functools.cache
def load_assets(root: Path = STATIC_DIR) -> dict[str, Asset]:
    """Every servable file under ``root``, by its path relative to it (``vendor/x.js``);
    read once per process.

    Files of a type not in ``CONTENT_TYPES`` (source maps, editor leftovers) are left out.

    Raises:
        FileNotFoundError: ``root`` has no ``index.html`` (a broken install).
    """
    assets = {}
    for path in sorted(root.rglob("*")):
        content_type = CONTENT_TYPES.get(path.suffix)
        if not path.is_file() or content_type is None:
            continue
        body = path.read_bytes()
        etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
        assets[path.relative_to(root).as_posix()] = Asset(body, content_type, etag)
    if "index.html" not in assets:
        raise FileNotFoundError(f"the web UI's index.html is missing from {root}")
    return assets


def _answer(asset: Asset, request: Request) -> Response:
    headers = {**SECURITY_HEADERS, "ETag": asset.etag}
    if asset.etag in request.headers.get("if-none-match", ""):
        return Response(status_code=304, headers=headers)
    body = b"" if request.method == "HEAD" else asset.body
    response = Response(body, media_type=asset.content_type, headers=headers)
    if request.method == "HEAD":
        response.headers["Content-Length"] = str(len(asset.body))
    return response


def add_webui_routes(app: FastAPI, root: Path = STATIC_DIR) -> None:
    """``GET /`` (the page) and ``GET /webui/{file}`` (its scripts, styles, licenses).

    Plain Starlette routes: they are not API routes, so ``/openapi.json`` leaves them out.
    """
    assets = load_assets(root)

    async def webui_page(request: Request) -> Response:
        return _answer(assets["index.html"], request)

    async def webui_asset(request: Request) -> Response:
        name = request.path_params["name"]
        asset = assets.get(name)
        if asset is None or name == "index.html":
            raise APIError(404, f"No web UI file {name!r}.", code="not_found")
        return _answer(asset, request)

    for path, endpoint in (("/", webui_page), (ASSET_PREFIX + "{name:path}", webui_asset)):
        app.add_route(path, endpoint, methods=["GET", "HEAD"], include_in_schema=False)
