"""uvicorn with the endpoint's connection limits (api/http_limits.py), slow clients included.

uvicorn bounds connections (`limit_concurrency`, a 503 past it) and idle kept-alive connections
(`timeout_keep_alive`), but not the time a request's head takes to arrive: a fresh connection has
no timer at all, and any byte cancels the keep-alive one, so a client that sends its headers a
byte at a time (slowloris) holds a connection, and with enough of them every slot of
`limit_concurrency`, for as long as it likes. Its httptools parser (the one uvicorn picks when it
is installed) has no bound on a head's size either.

`HeadDeadline` adds both to uvicorn's HTTP/1.1 protocols (httptools' and h11's): a request head
must be complete within `head_timeout_s` of the connection opening (the first request) or of its
own first byte (a later one: the idle time before it is the keep-alive timer's), and within
`max_head_bytes`; otherwise the client gets 408 (431 for the size) and the connection is closed.
A head is complete when uvicorn made the request's cycle, which both protocols do on the head's
last byte; the body that follows is the app's to time (api/openai_guards.py, `body_timeout_s`),
and the response (a generation may take minutes) is not timed here.
"""

from __future__ import annotations

import asyncio
from typing import Any

from dualpath_ray.api.http_limits import HttpLimits

_CLOSING = b"content-length: 0\r\nconnection: close\r\n\r\n"
TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\n" + _CLOSING
TOO_LARGE_RESPONSE = b"HTTP/1.1 431 Request Header Fields Too Large\r\n" + _CLOSING


class HeadDeadline:
    """Mixed in before a uvicorn HTTP/1.1 protocol class (see `guarded_protocol`), which provides
    `transport`, `loop`, `cycle` (None before the first request, else the latest request's, with
    `more_body` and `response_complete`) and `data_received`. The deadline is armed only while no
    request runs; `_head_bytes` counts the bytes of the head not yet complete."""

    head_timeout_s: float
    max_head_bytes: int
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    cycle: Any

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        head_bytes = self._body_received()  # else these bytes are (or end) the body being received
        super().data_received(data)  # type: ignore[misc]
        if self.cycle is not before:  # a head completed: its request runs, untimed here
            self._disarm()
            self._head_bytes = 0
            return
        if not head_bytes or self.transport.is_closing():
            return
        self._head_bytes += len(data)
        if self._head_bytes > self.max_head_bytes:
            self._refuse(TOO_LARGE_RESPONSE)
        elif self._head_timer is None and self._waiting_for_head():
            # The first bytes of a later request's head: its deadline starts now. A head sent
            # while the request before it is answered (pipelined) is bounded in size only: a
            # deadline there would cut the answer short.
            self._arm()

    def _waiting_for_head(self) -> bool:
        """No request runs: the connection waits for the next one's head."""
        return self.cycle is None or bool(self.cycle.response_complete)

    def _body_received(self) -> bool:
        """The latest request's body arrived whole (or none runs): more bytes are a next head."""
        return self._waiting_for_head() or not self.cycle.more_body

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._waiting_for_head() and not self.transport.is_closing():
            # A connection that sent nothing of a head is closed as uvicorn closes an idle one.
            self._refuse(TIMEOUT_RESPONSE if self._head_bytes else b"")

    def _refuse(self, response: bytes) -> None:
        self._disarm()
        if response:
            self.transport.write(response)
        self.transport.close()


def guarded_protocol(limits: HttpLimits, base: type[asyncio.Protocol] | None = None) -> type[asyncio.Protocol]:
    """`base` (default: the HTTP/1.1 protocol uvicorn picks, httptools' when installed, else
    h11's) with `HeadDeadline` at `limits`."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    attributes = {"head_timeout_s": limits.head_timeout_s, "max_head_bytes": limits.max_head_bytes}
    return type(f"HeadDeadline{base.__name__}", (HeadDeadline, base), attributes)


def uvicorn_config(app: Any, host: str, port: int, limits: HttpLimits,
                   base: type[asyncio.Protocol] | None = None) -> Any:
    """uvicorn's Config of the endpoint: the app on host:port with every connection limit (over
    the HTTP/1.1 protocol `base`, as `guarded_protocol`)."""
    import uvicorn

    return uvicorn.Config(
        app, host=host, port=port, log_level="warning", lifespan="off", http=guarded_protocol(limits, base),
        limit_concurrency=limits.limit_concurrency, timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
        h11_max_incomplete_event_size=limits.max_head_bytes,
    )
