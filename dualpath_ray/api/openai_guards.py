"""What the OpenAI-compatible endpoint checks before a request reaches a handler: the API key
and the body, its size and the time it takes to arrive (pure: no Ray).

The key works as OpenAI's and vLLM's (`--api-key` / `VLLM_API_KEY`): every route but /health
needs `Authorization: Bearer <key>`, and a request without it, or with another key, is a 401 in
OpenAI's error shape. The endpoint may accept several keys (api/api_keys.py: digests only,
compared in constant time); the key a request presented names its tenant, and that tenant's
cache salt (None with a single key) goes to the handler in the request's state (TENANT_SALT).

The body limit is checked on the declared Content-Length before anything is read, and again on
the bytes as they arrive (a chunked body declares none), so an oversized body is a 413 before it
is parsed or held whole. The body must arrive whole within a deadline (a client that sends it a
byte at a time is a 408, and its connection is closed); the head's deadline is the server's
(api/http_server.py).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable

from dualpath_ray.api.api_keys import API_KEY_ENV, ApiKey, ApiKeys
from dualpath_ray.api.http_limits import DEFAULT_MAX_BODY_BYTES
from dualpath_ray.api.openai_protocol import APIError

__all__ = ["API_KEY_ENV", "DEFAULT_MAX_BODY_BYTES", "ApiKey", "ApiKeys", "BearerAuth", "read_limited_body"]

OPEN_PATHS = frozenset({"/health"})  # a load balancer's probe carries no key
# The request-state key (Starlette's request.state) of the tenant's cache salt.
TENANT_SALT = "dualpath_tenant_salt"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def unauthorized(authorization: str | None) -> APIError:
    if not authorization:
        message = "no API key: send the header 'Authorization: Bearer <key>' (the key `dualpath serve` was given)"
    else:
        message = "incorrect API key in the Authorization header: send 'Authorization: Bearer <key>'"
    return APIError(message, None, 401, code="invalid_api_key")


def too_large(size: int, limit: int, declared: bool) -> APIError:
    amount = f"{size} bytes" if declared else f"more than {limit} bytes"
    return APIError(
        f"the request body is {amount}, over this server's limit of {limit} bytes; send a shorter request or "
        "restart `dualpath serve` with a larger --max-body-bytes", None, 413, code="request_too_large",
    )


class BearerAuth:
    """ASGI middleware: an HTTP request to any path but OPEN_PATHS without one of the keys is
    answered 401 here; everything else goes on to the app, with its tenant's salt in its state."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        authorization = _header(scope, b"authorization")
        key = self.keys.match(authorization)
        if key is not None:
            # A new state for this request: the server's copy of its app state is not shared.
            state = {**scope.get("state", {}), TENANT_SALT: self.keys.tenant_salt(key)}
            await self.app({**scope, "state": state}, receive, send)
            return
        error = unauthorized(authorization)
        body = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": error.status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]})
        await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


def too_slow(timeout_s: float) -> APIError:
    return APIError(
        f"the request body did not arrive within {timeout_s:g} s of its headers; send it at once, or restart "
        "`dualpath serve` with a larger --body-timeout-s", None, 408, code="request_timeout",
    )


async def read_limited_body(request: Any, limit: int, timeout_s: float) -> bytes:
    """The body of a Starlette request, refused once it is over `limit` bytes (413) or once it
    took more than `timeout_s` to arrive (408: the connection is then closed, as the rest of the
    body is never read)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared), limit, declared=True)
    chunks, size = [], 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    stream = request.stream().__aiter__()
    while True:
        try:  # asyncio.timeout is Python 3.11's; this runs on 3.10 too
            chunk = await asyncio.wait_for(stream.__anext__(), deadline - loop.time())
        except StopAsyncIteration:
            return b"".join(chunks)
        except asyncio.TimeoutError:
            raise too_slow(timeout_s) from None
        size += len(chunk)
        if size > limit:
            raise too_large(size, limit, declared=False)
        chunks.append(chunk)
