"""What the report channel's tests share: an event loop in a thread (as the scheduler actor has
one), a server on it, and a hand-made sender that speaks the wire itself, to send what a real
ReportClient never would."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from typing import Any, Callable

from dualpath_ray.protocol.messages import ReaderReport
from dualpath_ray.protocol.wire import Codec
from dualpath_ray.runtime.reporting.channel import REPORT_TYPES, ChannelLimits, ReportServer
from dualpath_ray.runtime.reporting.client import recv_exactly
from dualpath_ray.runtime.reporting.frames import (
    ACK_BYTES, CLIENT_ID_BYTES, CLIENT_NONCE_BYTES, FRAME, NONCE_BYTES, TAG_BYTES, Hello, SessionKeys, seal_hello,
)


class LoopThread:
    """An event loop in a thread, as the scheduler actor has one."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def call(self, fn: Callable[[], Any]) -> Any:
        async def wrapped() -> Any:
            return fn()
        return self.run(wrapped())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def start_server(
    loop: LoopThread, deliver: Callable[[Any], None], limits: ChannelLimits = ChannelLimits(),
) -> ReportServer:
    return loop.run(ReportServer.start(deliver, "127.0.0.1", limits=limits))


def wait_until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def report(i: int) -> ReaderReport:
    """A small message of the channel's, told apart by `i`."""
    return ReaderReport("n0", "reader/n0", "incarnation-1", i)


def encode(message: Any) -> bytes:
    return Codec(REPORT_TYPES).encode(message)


def closed_by_peer(sock: socket.socket) -> bool:
    """True if the server closed `sock` (what it had sent before is read and ignored)."""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


class RawSender:
    """A sender speaking the wire by hand: the handshake with `secret`, then frames as asked."""

    def __init__(self, server: ReportServer, secret: bytes | None = None, client_id: bytes | None = None) -> None:
        assert server.address is not None
        self.secret = server.address.secret if secret is None else secret
        self.client_id = client_id or os.urandom(CLIENT_ID_BYTES)
        self.sock = socket.create_connection((server.address.host, server.address.port), timeout=5)
        self.keys: SessionKeys | None = None

    def hello(self, first: int = 1) -> None:
        nonce = recv_exactly(self.sock, NONCE_BYTES)
        hello = Hello(self.client_id, os.urandom(CLIENT_NONCE_BYTES), first)
        self.keys = SessionKeys(self.secret, nonce, hello)
        self.sock.sendall(seal_hello(self.secret, nonce, hello))

    def frame(self, seq: int, payload: bytes, forge_tag: bool = False) -> bytes:
        """The bytes of frame `seq`, sealed with this connection's keys, or with a wrong tag."""
        assert self.keys is not None
        sealed = self.keys.seal_frame(seq, payload)
        if forge_tag:
            return FRAME.pack(len(payload), seq) + payload + bytes(TAG_BYTES)
        return sealed

    def send(self, *frames: bytes) -> None:
        self.sock.sendall(b"".join(frames))

    def ack(self) -> int | None:
        """The next acknowledgement, if its tag is this connection's."""
        assert self.keys is not None
        return self.keys.open_ack(recv_exactly(self.sock, ACK_BYTES))

    def close(self) -> None:
        self.sock.close()
