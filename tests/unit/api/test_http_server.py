"""Slow and greedy clients against the endpoint's real uvicorn on localhost (api/http_server.py,
the body deadline of api/openai_guards.py): a client that dribbles its headers byte by byte, one
that connects and says nothing, one that dribbles its body, one whose headers never end, all cut
off within their deadline; a well-behaved client keeps its kept-alive connection across an idle
pause longer than the head deadline; and past `limit_concurrency` a request is a 503. Raw sockets
(asyncio streams) play the clients; the app is the OpenAI app over a fake rollout-server.

Times: the deadlines are 0.5 s, a dribbler would go on for 10 s, and a cut-off must come within
DEADLINE_SLACK_S of its deadline (generous, for a loaded machine)."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")

from uvicorn.protocols.http.h11_impl import H11Protocol  # noqa: E402

from dualpath_ray.api.http_limits import HttpLimits  # noqa: E402
from dualpath_ray.api.http_server import uvicorn_config  # noqa: E402
from dualpath_ray.api.openai_app import OpenAIEndpoint, build_app  # noqa: E402
from dualpath_ray.config import parse_config  # noqa: E402
from tests.unit.api.fake_rollout_server import FakeRolloutServer  # noqa: E402

DEADLINE_S = 0.5
DEADLINE_SLACK_S = 3.0
DRIBBLE_S = 10.0  # how long a slow client would keep sending
DRIBBLE_EVERY_S = 0.05
BASES: list[Any] = [None, H11Protocol]  # what uvicorn picks here (httptools' when installed), and h11's
BODY = json.dumps({"model": "dualpath-tiny", "prompt": [1, 2, 3], "max_tokens": 2}).encode()


def app(limits: HttpLimits) -> Any:
    cfg = parse_config({})
    return build_app(OpenAIEndpoint(FakeRolloutServer(), None, cfg, limits.max_prompts), None, limits)


@asynccontextmanager
async def serving(limits: HttpLimits, base: Any = None, config: Any = None) -> AsyncIterator[int]:
    """The endpoint's uvicorn (or one of `config`) on a free localhost port, for the block."""
    server = uvicorn.Server(config or uvicorn_config(app(limits), "127.0.0.1", 0, limits, base))
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        assert not task.done(), f"uvicorn did not start: {task.exception() if task.done() else None}"
        await asyncio.sleep(0.01)
    try:
        yield int(server.servers[0].sockets[0].getsockname()[1])
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)


async def dribble_until_closed(port: int, first: bytes, drip: bytes) -> tuple[float, bytes]:
    """Send `first`, then `drip` a byte every DRIBBLE_EVERY_S for up to DRIBBLE_S; returns when
    the server closed the connection (seconds after connecting; DRIBBLE_S and more if it never
    did) and what it answered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()

    async def drip_bytes() -> None:
        writer.write(first)
        for byte in (drip * int(DRIBBLE_S / DRIBBLE_EVERY_S))[: int(DRIBBLE_S / DRIBBLE_EVERY_S)]:
            await asyncio.sleep(DRIBBLE_EVERY_S)
            writer.write(bytes([byte]))
            await writer.drain()

    sender = asyncio.ensure_future(drip_bytes())
    answer = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), DRIBBLE_S + DEADLINE_SLACK_S):
            answer += chunk
    except (asyncio.TimeoutError, ConnectionError):
        pass
    closed_after = time.monotonic() - started
    sender.cancel()
    await asyncio.gather(sender, return_exceptions=True)
    writer.close()
    return closed_after, answer


def head(content_length: int | None = None) -> bytes:
    length = f"Content-Length: {content_length}\r\n" if content_length is not None else ""
    return (f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n{length}\r\n").encode()


@pytest.mark.parametrize("base", BASES, ids=["auto", "h11"])
def test_a_client_dribbling_its_headers_is_cut_off_at_the_head_deadline(base: Any) -> None:
    limits = HttpLimits(head_timeout_s=DEADLINE_S)

    async def scenario() -> tuple[float, bytes]:
        async with serving(limits, base) as port:
            return await dribble_until_closed(port, b"POST /v1/completions HTTP/1.1\r\nX-Slow: ", b"abcdefgh")

    closed_after, answer = asyncio.run(scenario())
    assert closed_after < DEADLINE_S + DEADLINE_SLACK_S, (
        f"a head sent byte by byte holds no connection past the head deadline (closed after {closed_after:.1f} s)"
    )
    assert answer.startswith(b"HTTP/1.1 408"), f"the client is told why: 408 Request Timeout (got {answer[:40]!r})"


def test_without_the_head_deadline_uvicorn_keeps_a_dribbler() -> None:
    """Why the deadline is there: uvicorn's own config (what the endpoint ran before) lets a
    dribbler hold its connection well past the deadline the guarded server enforces."""
    plain = uvicorn.Config(app(HttpLimits()), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    held_s = DEADLINE_S + DEADLINE_SLACK_S

    async def scenario() -> bool:
        async with serving(HttpLimits(), config=plain) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nX-Slow: ")
            deadline = time.monotonic() + held_s
            while time.monotonic() < deadline:
                writer.write(b"a")
                await writer.drain()
                await asyncio.sleep(DRIBBLE_EVERY_S)
            still_open = not reader.at_eof()
            writer.close()
            return still_open

    assert asyncio.run(scenario()), "plain uvicorn has no head deadline: the dribbler is still connected"


def test_a_silent_connection_is_closed_at_the_head_deadline() -> None:
    async def scenario() -> tuple[float, bytes]:
        async with serving(HttpLimits(head_timeout_s=DEADLINE_S)) as port:
            return await dribble_until_closed(port, b"", b"")

    closed_after, answer = asyncio.run(scenario())
    assert closed_after < DEADLINE_S + DEADLINE_SLACK_S, f"a connection that sends nothing is closed ({closed_after:.1f} s)"
    assert answer == b"", "nothing is answered to a connection that asked nothing"


def test_a_client_dribbling_its_body_gets_408_at_the_body_deadline() -> None:
    async def scenario() -> tuple[float, bytes]:
        async with serving(HttpLimits(head_timeout_s=DEADLINE_S, body_timeout_s=DEADLINE_S)) as port:
            return await dribble_until_closed(port, head(len(BODY)), BODY)

    closed_after, answer = asyncio.run(scenario())
    assert closed_after < DEADLINE_S + DEADLINE_SLACK_S, f"a body sent byte by byte is cut off ({closed_after:.1f} s)"
    assert answer.startswith(b"HTTP/1.1 408"), f"the client gets 408 (got {answer[:40]!r})"
    error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "request_timeout" and "--body-timeout-s" in error["message"], (
        f"the 408 names the limit and how to raise it: {error}"
    )


def test_headers_over_the_size_limit_are_a_431() -> None:
    async def scenario() -> tuple[float, bytes]:
        async with serving(HttpLimits(max_head_bytes=4096)) as port:
            return await dribble_until_closed(port, b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 8192, b"")

    closed_after, answer = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 431"), f"headers past --max-head-bytes are refused (got {answer[:40]!r})"
    assert closed_after < DEADLINE_SLACK_S, "and the connection is closed at once"


def test_a_kept_alive_connection_idle_longer_than_the_head_deadline_still_serves() -> None:
    """The head deadline counts from a later head's first byte: the idle time before it is the
    keep-alive timer's, so a client pausing between requests keeps its connection."""
    async def scenario() -> list[bytes]:
        async with serving(HttpLimits(head_timeout_s=DEADLINE_S, keep_alive_s=30)) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            statuses = []
            for _ in range(2):
                writer.write(head(len(BODY)) + BODY)
                status = await asyncio.wait_for(reader.readline(), 10)
                headers = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                length = int(next(line.split(b":")[1] for line in headers.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                await asyncio.wait_for(reader.readexactly(length), 10)
                statuses.append(status)
                await asyncio.sleep(DEADLINE_S * 3)  # idle, longer than the head deadline
            writer.close()
            return statuses

    statuses = asyncio.run(scenario())
    assert [s.split()[1] for s in statuses] == [b"200", b"200"], (
        f"both requests on one kept-alive connection are served: {statuses}"
    )


def test_past_limit_concurrency_a_request_is_a_503() -> None:
    async def scenario() -> tuple[bytes, bytes]:
        async with serving(HttpLimits(limit_concurrency=2, head_timeout_s=30)) as port:
            _, idle = await asyncio.open_connection("127.0.0.1", port)  # holds a slot, says nothing
            refused = await one_get(port)
            idle.close()
            await asyncio.sleep(0.5)  # the server sees the idle connection go
            return refused, await one_get(port)

    refused, served = asyncio.run(scenario())
    assert refused.split()[1] == b"503", f"a connection past --limit-concurrency is answered 503: {refused!r}"
    assert served.split()[1] == b"200", f"once a slot is free, requests are served again: {served!r}"


async def one_get(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
    status = await asyncio.wait_for(reader.readline(), 10)
    writer.close()
    return status
