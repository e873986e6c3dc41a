"""The keys the OpenAI-compatible endpoint accepts, and the tenant each one names (pure: no Ray).

A key is kept only as its SHA-256 digest (what travels to the endpoint's actor) and a presented
key is compared digest to digest in constant time, so neither the comparison's time nor its length
tells anything about a key. With several keys a presented key is compared with every one of them
(no early exit), so the time taken does not say which one matched either.

Each key is a tenant. With more than one key, a tenant's requests carry a cache salt derived from
its key's digest (`ApiKeys.tenant_salt`): its prompts' blocks are keyed apart from every other
tenant's, so `usage.prompt_tokens_details.cached_tokens` cannot tell one client what another's
prompts held. With one key (or none) there is one tenant and every request shares the cache.

The key file (`dualpath serve --api-key-file PATH`) holds one key per line; blank lines and lines
whose first non-blank character is `#` are skipped, and the whitespace around a key is dropped. A
key is printable ASCII without spaces (what an `Authorization: Bearer` header can carry), and no
key appears twice.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

API_KEY_ENV = "DUALPATH_API_KEY"
# The domain of a tenant's salt, so the salt is not the key's digest itself (what authenticates).
_TENANT_DOMAIN = b"dualpath-ray cache tenant\0"


class ApiKeyFileError(ValueError):
    """The key file cannot be used; the message names the file, the line and the fix."""


@dataclass(frozen=True)
class ApiKey:
    """The key a client must present, as its SHA-256 digest."""

    digest: bytes

    @classmethod
    def of(cls, secret: str) -> ApiKey:
        if not secret:
            raise ValueError(f"the API key is empty; pass a non-empty --api-key or {API_KEY_ENV}, or neither")
        return cls(hashlib.sha256(secret.encode()).digest())

    def accepts(self, authorization: str | None) -> bool:
        """Whether an Authorization header value is `Bearer <this key>`."""
        return self.matches(_presented(authorization)) and _is_bearer(authorization)

    def matches(self, presented: bytes) -> bool:
        """Whether a presented key's digest is this key's (constant time)."""
        return hmac.compare_digest(presented, self.digest)


@dataclass(frozen=True)
class ApiKeys:
    """Every key the endpoint accepts (at least one)."""

    keys: tuple[ApiKey, ...]

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError("ApiKeys needs at least one key; pass None for an endpoint without keys")

    @classmethod
    def of(cls, secrets: list[str] | tuple[str, ...]) -> ApiKeys:
        return cls(tuple(ApiKey.of(secret) for secret in secrets))

    def match(self, authorization: str | None) -> ApiKey | None:
        """The key an Authorization header value presents as `Bearer <key>`; None if none."""
        presented = _presented(authorization)
        found = None
        for key in self.keys:  # every key is compared: the time does not say which one matched
            if key.matches(presented):
                found = key
        return found if _is_bearer(authorization) else None

    def tenant_salt(self, key: ApiKey) -> str | None:
        """The cache salt of `key`'s tenant: None with one key (every client shares the cache),
        else a hex digest of the key's digest, which names the tenant without holding its key."""
        if len(self.keys) == 1:
            return None
        return hashlib.sha256(_TENANT_DOMAIN + key.digest).hexdigest()


def _presented(authorization: str | None) -> bytes:
    _, _, token = (authorization or "").strip().partition(" ")
    return hashlib.sha256(token.strip().encode()).digest()


def _is_bearer(authorization: str | None) -> bool:
    scheme, _, _ = (authorization or "").strip().partition(" ")
    return scheme.lower() == "bearer"


def _check_key(key: str, where: str) -> None:
    bad = next((c for c in key if not "!" <= c <= "~"), None)
    if bad is not None:
        raise ApiKeyFileError(
            f"{where}: the key holds {bad!r}; a key is printable ASCII without spaces (what an "
            "'Authorization: Bearer' header carries): fix the line or make it a comment with '#'"
        )


def read_api_key_file(path: Path) -> list[str]:
    """The keys of a key file (format: the module docstring), in file order."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ApiKeyFileError(f"--api-key-file {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ApiKeyFileError(f"--api-key-file {path}: cannot be read as UTF-8 text ({exc})") from None
    keys: list[str] = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        where = f"--api-key-file {path} line {number}"
        _check_key(key, where)
        if key in first_line:
            raise ApiKeyFileError(f"{where}: the same key as line {first_line[key]}; each key names one tenant, "
                                  "list it once")
        first_line[key] = number
        keys.append(key)
    if not keys:
        raise ApiKeyFileError(f"--api-key-file {path} holds no key: put one key per line ('#' starts a comment), "
                              "or leave the flag out to serve without a key")
    return keys
