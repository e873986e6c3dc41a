"""Cache salts: which requests may share cached prefixes (pure: no Ray).

A request's blocks are keyed under its KV namespace (kv/index.py); a salt makes that namespace
its own (`salted_namespace`), so the blocks of one salt are never hit by a request of another.
Without salting, `usage.prompt_tokens_details.cached_tokens` tells any client whether some other
client already sent a prompt's prefix.

Two sources combine into the salt the rollout-server gets:
- the tenant's salt: with several API keys, one per key (api/api_keys.py), so tenants never share;
- the request's `cache_salt` field (vLLM's name): a client separates its own requests further,
  e.g. per end user. Within a tenant, requests with the same `cache_salt` share.
The combination is a SHA-256 digest of both (unambiguous: a tenant cannot pick a `cache_salt`
that reproduces another tenant's salt), so neither the tenant nor the client's string travels on.
The rollout-server checks a salt and salts the namespace with it (api/validation.py
`check_cache_salt`, `salt_namespace`), as it checks every other argument of a turn.
"""

from __future__ import annotations

import hashlib
import json


def combined_salt(tenant_salt: str | None, request_salt: str | None) -> str | None:
    """The salt of a request of `tenant_salt` (None: the only tenant) that sent `request_salt`
    (None: none); None when neither is set, so a single-tenant server without `cache_salt` keys
    blocks exactly as before."""
    if tenant_salt is None and request_salt is None:
        return None
    return hashlib.sha256(json.dumps([tenant_salt, request_salt]).encode()).hexdigest()
