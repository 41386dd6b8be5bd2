"""API keys: ``Authorization: Bearer KEY`` on the API routes, checked in constant time.

Protected: every ``/v1`` route, ``/tokenize`` and ``/detokenize``; with ``protect_ops`` also
``/health``, ``/metrics`` and ``/version``. Routes of protocols whose clients send the key
as ``x-api-key: KEY`` (Anthropic's) take that header too. Keys are never logged; a refusal
says only that the key is missing or wrong. With several keys, each is a tenant: the
request's ``scope["state"]["tenant"]`` names which key it carried (``key-<index>``), and
the prefix cache keeps tenants apart (``server/serving/cache_namespace.py``).
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Sequence

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from mlxserve.server.http.errors import APIError, ErrorShapes

OPS_PATHS = ("/health", "/metrics", "/version")
_API_PATHS = ("/v1", "/tokenize", "/detokenize")


def needs_key(path: str, protect_ops: bool) -> bool:
    """Whether a request to ``path`` must carry an API key."""
    if any(path == p or path.startswith(p + "/") for p in _API_PATHS):
        return True
    return protect_ops and path in OPS_PATHS


def key_is_valid(authorization: str | None, keys: Sequence[bytes]) -> bool:
    """Whether an ``Authorization`` header carries one of ``keys`` as a Bearer token."""
    return matching_key(authorization, keys) is not None


def matching_key(authorization: str | None, keys: Sequence[bytes]) -> int | None:
    """The index of the key an ``Authorization`` header carries as a Bearer token (None:
    none of ``keys``)."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return _index_of(token.strip(), keys)


def _index_of(token: str, keys: Sequence[bytes]) -> int | None:
    """Which of ``keys`` ``token`` is. Every key is compared, each with
    ``hmac.compare_digest``, so the time taken does not depend on how much of a key
    matched, nor on which key did."""
    candidate = token.encode()
    matched = None
    for index, key in enumerate(keys):
        if hmac.compare_digest(candidate, key) and matched is None:
            matched = index
    return matched


class APIKeyAuth:
    """ASGI middleware: 401 (in the route's error shape) unless a protected request has a
    valid key.

    Args:
        app: the wrapped app.
        keys: the accepted keys (non-empty).
        protect_ops: also protect ``/health``, ``/metrics`` and ``/version``.
        shapes: the app's error shapes.
        tenants: with several keys, mark each request with its key's tenant.
        x_api_key_prefixes: route prefixes that also take the key as ``x-api-key``.
    """

    def __init__(
        self,
        app: ASGIApp,
        keys: Sequence[str],
        protect_ops: bool,
        shapes: ErrorShapes,
        tenants: bool = True,
        x_api_key_prefixes: Sequence[str] = (),
    ) -> None:
        if not keys:
            raise ValueError("APIKeyAuth needs at least one key")
        self.app = app
        self._keys = [k.encode() for k in keys]
        self._protect_ops = protect_ops
        self._shapes = shapes
        self._tenants = tenants and len(keys) > 1
        self._x_api_key_prefixes = tuple(x_api_key_prefixes)

    def _takes_x_api_key(self, path: str) -> bool:
        return any(path == p or path.startswith(p + "/") for p in self._x_api_key_prefixes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and needs_key(scope["path"], self._protect_ops):
            headers = dict(scope["headers"])
            header = headers.get(b"authorization")
            value = header.decode("latin-1") if header is not None else None
            index = matching_key(value, self._keys)
            how = "'Authorization: Bearer YOUR_KEY'"
            if self._takes_x_api_key(scope["path"]):
                how = "'x-api-key: YOUR_KEY' or " + how
                x_key = headers.get(b"x-api-key")
                if x_key is not None:
                    x_index = _index_of(x_key.decode("latin-1").strip(), self._keys)
                    index = x_index if x_index is not None else index
                    value = value or "x-api-key"
            if index is None:
                message = (
                    "Incorrect API key provided."
                    if value
                    else f"Missing API key: send it as {how}."
                )
                error = APIError(
                    401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
                )
                await self._shapes.response(error, scope["path"])(scope, receive, send)
                return
            if self._tenants:
                scope.setdefault("state", {})["tenant"] = f"key-{index}"
        await self.app(scope, receive, send)


def tenant_of(request: Request) -> str | None:
    """The tenant the API key of ``request`` names (None: one key, or none)."""
    return request.scope.get("state", {}).get("tenant")


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: assume it resolves elsewhere
