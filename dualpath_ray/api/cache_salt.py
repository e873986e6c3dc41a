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
"""

from __future__ import annotations

import hashlib
import json

from dualpath_ray.api.validation import RequestError

# Long enough for any random token (vLLM suggests 43 base64 characters, 256 bits).
MAX_CACHE_SALT_CHARS = 1024


def check_cache_salt(value: object, field: str = "cache_salt") -> str | None:
    """A `cache_salt` as sent: None (no salt) or a non-empty string of at most MAX_CACHE_SALT_CHARS."""
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_CACHE_SALT_CHARS:
        shown = value[:40] + "..." if isinstance(value, str) and len(value) > 40 else value
        raise RequestError(
            f"{field} must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, or left out "
            f"(got {shown!r}); requests with the same {field} share cached prefixes, others never do", field,
        )
    return value


def combined_salt(tenant_salt: str | None, request_salt: str | None) -> str | None:
    """The salt of a request of `tenant_salt` (None: the only tenant) that sent `request_salt`
    (None: none); None when neither is set, so a single-tenant server without `cache_salt` keys
    blocks exactly as before."""
    if tenant_salt is None and request_salt is None:
        return None
    return hashlib.sha256(json.dumps([tenant_salt, request_salt]).encode()).hexdigest()
