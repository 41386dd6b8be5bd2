"""Which prefix-cache namespace a request runs in: its tenant and its ``cache_salt``.

The prefix cache shares the K/V of a prompt prefix between requests, so whether a prompt
hits (``cached_tokens``, and the time to the first token) tells a client whether someone
else sent that prefix before. With several API keys each key is a tenant and tenants never
share cached prefixes (``--no-prefix-cache-per-key`` shares them); within a tenant, a
request with a ``cache_salt`` (vLLM's field) only shares with requests of the same salt,
for apps that serve several users behind one key. A tenant's own repeated prompt still
hits. The price of isolation: identical prompts of different tenants are computed (and
held in the pool) once per tenant.
"""

from __future__ import annotations

import hashlib


def cache_namespace(tenant: str | None, salt: str | None) -> str:
    """The namespace of a request from ``tenant`` (None: the shared one) with ``salt``
    (None: unsalted); "" is the default, shared namespace."""
    if tenant is None and salt is None:
        return ""
    digest = hashlib.sha256()
    for part in (tenant or "", salt or ""):
        digest.update(part.encode("utf-8", "surrogatepass") + b"\0")
    return digest.hexdigest()[:32]
