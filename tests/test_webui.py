"""The chat page's routes (server/webui/): the page and its files with their content types
and security headers, ``--no-webui``, the Host check and API keys around it, the page
served while a model loads, the vendored libraries as pinned, and the wheel's package data.

The page in a browser is tests/test_webui_browser.py.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import tomllib
from fastapi.testclient import TestClient

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.server.app import create_app
from mlxserve.server.cli import build_parser
from mlxserve.server.config import ServerConfig
from mlxserve.server.lifecycle.loading import LoadProgress
from mlxserve.server.webui.routes import STATIC_DIR, load_assets
from tests.import_graph import ROOT
from tests.scripted_engine import ScriptedEngine


def loading_client(**config: object) -> TestClient:
    """A client of an app still loading its model (no engine needed for the page)."""
    app = create_app(None, None, ServerConfig(**config), LoadProgress())
    return TestClient(app, base_url="http://127.0.0.1:8000")


class _Tokenizer:
    """Enough of a tokenizer for an app whose routes under test generate nothing."""

    eos_token_ids = [0]

    def __len__(self) -> int:
        return 10


def ready_client(**config: object) -> TestClient:
    """A client of an app serving a model (a scripted engine that is never asked)."""
    loaded = LoadedModel(None, _Tokenizer(), "m", {"vocab_size": 10}, context_length=64)
    app = create_app(loaded, ScriptedEngine(lambda prompt, params: []), ServerConfig(**config))
    return TestClient(app, base_url="http://127.0.0.1:8000")


@pytest.fixture(scope="module")
def client() -> TestClient:
    return ready_client()


def directives(policy: str) -> dict[str, list[str]]:
    out = {}
    for part in policy.split(";"):
        name, *values = part.split()
        out[name] = values
    return out


def page_references(html: str) -> list[str]:
    """The URLs the page's HTML loads (scripts, styles, icons)."""
    return re.findall(r'(?:src|href)="(/webui/[^"]+)"', html)


def module_imports(source: str) -> list[str]:
    return re.findall(r'^import [^;]*? from "(\./[^"]+)";', source, re.M)


class TestPage:
    def test_the_page_is_html(self, client: TestClient) -> None:
        response = client.get("/")
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "text/html; charset=utf-8"
        assert "<title>mlxserve</title>" in response.text
        assert response.headers["x-content-type-options"] == "nosniff"

    def test_the_csp_allows_this_server_only_and_no_inline_script(self, client: TestClient) -> None:
        csp = directives(client.get("/").headers["content-security-policy"])
        assert csp["default-src"] == ["'self'"], csp
        assert csp["script-src"] == ["'self'"], "no 'unsafe-inline', no 'unsafe-eval'"
        assert csp["connect-src"] == ["'self'"], csp
        assert csp["object-src"] == ["'none'"] and csp["base-uri"] == ["'none'"], csp
        assert csp["frame-ancestors"] == ["'none'"], csp
        assert csp["require-trusted-types-for"] == ["'script'"], csp

    def test_no_inline_handlers_or_styles(self, client: TestClient) -> None:
        html = client.get("/").text
        assert not re.search(r"<script(?![^>]*\bsrc=)", html), "every script has a src"
        assert not re.search(r"\son[a-z]+=", html), "no inline event handlers"
        assert not re.search(r"\sstyle=", html) and "<style" not in html, "no inline styles"

    def test_head_and_revalidation(self, client: TestClient) -> None:
        page = client.get("/")
        head = client.head("/")
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-length"] == str(len(page.content))
        assert page.headers["cache-control"] == "no-cache"
        again = client.get("/", headers={"If-None-Match": page.headers["etag"]})
        assert again.status_code == 304 and again.content == b""
        assert "content-security-policy" in again.headers


class TestAssets:
    TYPES = {
        ".js": "text/javascript; charset=utf-8",
        ".mjs": "text/javascript; charset=utf-8",
        ".css": "text/css; charset=utf-8",
        ".svg": "image/svg+xml",
        ".md": "text/plain; charset=utf-8",
    }

    def test_what_the_page_loads_is_served_with_its_type(self, client: TestClient) -> None:
        urls = page_references(client.get("/").text)
        assert {"/webui/app.js", "/webui/style.css", "/webui/favicon.svg"} <= set(urls), urls
        for url in urls:
            response = client.get(url)
            assert response.status_code == 200, (url, response.text)
            assert response.headers["content-type"] == self.TYPES[Path(url).suffix], url
            assert "content-security-policy" in response.headers, url

    def test_every_module_import_is_served(self, client: TestClient) -> None:
        seen, todo = set(), ["app.js"]
        while todo:
            name = todo.pop()
            response = client.get("/webui/" + name)
            assert response.status_code == 200, f"{name} is imported but not served"
            seen.add(name)
            folder = Path(name).parent
            for target in module_imports(response.text):
                resolved = (folder / target).as_posix().removeprefix("./")
                if resolved not in seen:
                    todo.append(resolved)
        assert {"vendor/marked.esm.js", "vendor/purify.es.mjs", "markdown.js"} <= seen, seen

    def test_licenses_are_served_as_text(self, client: TestClient) -> None:
        for name in ("README.md", "marked.LICENSE.md", "dompurify.LICENSE.txt"):
            response = client.get("/webui/vendor/" + name)
            assert response.status_code == 200, name
            assert response.headers["content-type"] == "text/plain; charset=utf-8", name

    @pytest.mark.parametrize(
        "path",
        [
            "/webui/nope.js",
            "/webui/index.html",
            "/webui/../config.py",
            "/webui/%2e%2e/routes.py",
            "/webui/vendor/marked.esm.js.map",
            "/webui/",
            "/index.html",
        ],
    )
    def test_anything_else_is_a_404(self, client: TestClient, path: str) -> None:
        response = client.get(path)
        assert response.status_code == 404, (path, response.status_code)
        assert response.json()["error"]["message"], response.text


class TestSwitchedOff:
    def test_no_webui_answers_404(self) -> None:
        client = ready_client(webui=False)
        for path in ("/", "/webui/app.js", "/webui/vendor/README.md"):
            response = client.get(path)
            assert response.status_code == 404, (path, response.status_code)
            assert "content-security-policy" not in response.headers

    def test_the_cli_flag(self) -> None:
        parser = build_parser()
        assert parser.parse_args([]).webui is True
        assert parser.parse_args(["--no-webui"]).webui is False


class TestAroundThePage:
    def test_served_while_the_model_loads(self) -> None:
        client = loading_client()
        assert client.get("/").status_code == 200
        assert client.get("/webui/app.js").status_code == 200
        assert client.get("/v1/models").status_code == 503, "the API still waits"

    def test_the_host_check_refuses_the_page(self, client: TestClient) -> None:
        for path in ("/", "/webui/app.js"):
            response = client.get(path, headers={"Host": "evil.example"})
            assert response.status_code == 400, (path, response.status_code)
            assert response.json()["error"]["code"] == "invalid_host", response.text
            assert "content-security-policy" not in response.headers, "not the page"

    def test_with_an_api_key_the_page_is_public_the_api_is_not(self) -> None:
        client = ready_client(api_key="secret", protect_metrics=True)
        assert client.get("/").status_code == 200, "a browser cannot send a key to open it"
        assert client.get("/webui/app.js").status_code == 200
        assert client.get("/v1/models").status_code == 401


class TestVendored:
    def test_the_files_are_the_pinned_ones(self) -> None:
        readme = (STATIC_DIR / "vendor" / "README.md").read_text()
        pinned = dict(re.findall(r"^\| `([^`]+)` \|.*\| `([0-9a-f]{64})` \|$", readme, re.M))
        assert set(pinned) == {"marked.esm.js", "purify.es.mjs"}, pinned
        for name, digest in pinned.items():
            actual = hashlib.sha256((STATIC_DIR / "vendor" / name).read_bytes()).hexdigest()
            assert actual == digest, f"{name} differs from the pinned copy"

    def test_each_library_has_its_license(self) -> None:
        assert (
            "Permission is hereby granted" in (STATIC_DIR / "vendor/marked.LICENSE.md").read_text()
        )
        apache = (STATIC_DIR / "vendor/dompurify.LICENSE.txt").read_text()
        assert "Apache License" in apache


class TestPackageData:
    def test_the_wheel_takes_every_file_of_the_page(self) -> None:
        package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
            "package-data"
        ]
        # setuptools expands each pattern as a (non-recursive) glob in its package's folder.
        taken = set()
        for package, patterns in package_data.items():
            folder = ROOT.joinpath(*package.split(".")[1:])
            taken |= {p for pattern in patterns for p in folder.glob(pattern) if p.is_file()}
        files = {p for p in STATIC_DIR.rglob("*") if p.is_file()}
        missed = sorted(p.relative_to(STATIC_DIR).as_posix() for p in files - taken)
        assert not missed, f"not in [tool.setuptools.package-data]: {missed}"
        assert {STATIC_DIR / name for name in load_assets()} <= taken
