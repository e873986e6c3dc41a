"""A sending process's side of the report channel (the protocol: runtime/reporting/channel.py).
Any thread may send."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable

from dualpath_ray.protocol.wire import Codec
from dualpath_ray.runtime.reporting.channel import REPORT_TYPES, ChannelAddress
from dualpath_ray.runtime.reporting.frames import (
    ACK_BYTES, CLIENT_NONCE_BYTES, NONCE_BYTES, Hello, SessionKeys, seal_hello,
)

LOG = logging.getLogger("dualpath_ray.report_channel")

MAX_UNACKED = 65536  # frames a client keeps for a scheduler that does not answer; the oldest go first
SEND_TIMEOUT_S = 10.0  # a scheduler that takes nothing for this long is treated as gone: reconnect
RECONNECT_BACKOFF_S = (0.05, 1.0)  # first and longest wait between attempts to connect


class SentReport:
    """A frame on its way, as a `Pending`: done once the scheduler acknowledged it; `wait` raises
    ConnectionError if the client was closed (or dropped it: MAX_UNACKED) first."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def settle(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def done(self) -> bool:
        if not self._done.is_set():
            return False
        if self._error is not None:
            raise self._error
        return True

    def wait(self, timeout_s: float | None = None) -> None:
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"no acknowledgement within {timeout_s}s")
        self.done()


class _Link:
    """One connection that passed the handshake: its socket, its keys, and the highest frame
    number sent on it (an acknowledgement above that is a forgery)."""

    def __init__(self, sock: socket.socket, keys: SessionKeys) -> None:
        self.sock = sock
        self.keys = keys
        self.sent_through = 0


class ReportClient:
    """One sending process's channel to the scheduler. `send` never blocks on the scheduler's
    absence: while there is no connection, frames wait (up to MAX_UNACKED) and a background
    thread finds the scheduler with `resolve` (a Ray call that waits for a restarting scheduler)
    and connects. A thread per connection reads the acknowledgements."""

    def __init__(self, resolve: Callable[[], ChannelAddress], name: str) -> None:
        self.resolve = resolve
        self.name = name
        self.client_id = uuid.uuid4().bytes
        self.codec = Codec(REPORT_TYPES)
        self.sent = 0  # frames sent, resends not counted
        self.connects = 0
        self.dropped = 0  # frames given up (MAX_UNACKED)
        self.forged_acks = 0  # acknowledgements that failed their tag (or named a frame never sent)
        self._lock = threading.Lock()
        self._link: _Link | None = None
        self._seq = 0
        self._unacked: dict[int, tuple[bytes, SentReport]] = {}  # payloads, in sequence order
        self._connecting = False
        self._closed = False
        # Before the next attempt to connect: 0 after an acknowledgement came, else growing, so
        # a scheduler (or anything at its address) that closes every connection is not hammered.
        self._retry_in_s = 0.0

    def send(self, message: Any) -> SentReport:
        """Queue `message` (an EngineReport or ReaderReport; TypeError, at once, for anything the
        codec cannot carry) and send it if connected."""
        payload = self.codec.encode(message)
        pending = SentReport()
        with self._lock:
            if self._closed:
                pending.settle(ConnectionError(f"{self.name}: report channel closed"))
                return pending
            self._seq += 1
            self._unacked[self._seq] = (payload, pending)
            self.sent += 1
            self._bound_unacked()
            if self._link is not None:
                self._send_frame(self._link, self._seq, payload)
            if self._link is None:
                self._connect_in_background()
        return pending

    def unacked(self) -> int:
        with self._lock:
            return len(self._unacked)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            link, self._link = self._link, None
            pending = [p for _, p in self._unacked.values()]
            self._unacked.clear()
        if link is not None:
            _end(link.sock)
        for p in pending:
            p.settle(ConnectionError(f"{self.name}: report channel closed"))

    # Everything below runs with the lock held unless it says otherwise.

    def _send_frame(self, link: _Link, seq: int, payload: bytes) -> None:
        # Counted as sent before it goes: the server may acknowledge it before sendall returns.
        link.sent_through = seq
        try:
            link.sock.sendall(link.keys.seal_frame(seq, payload))
        except OSError as exc:
            self._drop(link, exc)

    def _bound_unacked(self) -> None:
        while len(self._unacked) > MAX_UNACKED:
            oldest = next(iter(self._unacked))
            _, pending = self._unacked.pop(oldest)
            self.dropped += 1
            pending.settle(ConnectionError(f"{self.name}: {MAX_UNACKED} reports unacknowledged; the oldest dropped"))

    def _drop(self, link: _Link, why: BaseException) -> None:
        if self._link is link:
            LOG.info("%s: report channel lost (%r); reconnecting", self.name, why)
            self._link = None
            _end(link.sock)

    def _connect_in_background(self) -> None:
        if not self._connecting and not self._closed:
            self._connecting = True
            threading.Thread(target=self._connect_loop, name=f"{self.name}-connect", daemon=True).start()

    def _connect_loop(self) -> None:
        """Without the lock: find the scheduler and connect, with backoff, until connected or
        closed; then send every unacknowledged frame again, in order, under the new keys."""
        while True:
            with self._lock:
                wait_s = self._retry_in_s
                if self._closed:
                    self._connecting = False
                    return
                # Pessimistic: an acknowledgement on the new connection sets it back to 0.
                self._retry_in_s = min(max(2 * wait_s, RECONNECT_BACKOFF_S[0]), RECONNECT_BACKOFF_S[1])
            time.sleep(wait_s)
            try:
                address = self.resolve()
                sock, nonce = self._open(address)
            except Exception as exc:  # noqa: BLE001 - no scheduler yet, or it is restarting
                LOG.info("%s: report channel not connected yet (%r); retrying", self.name, exc)
                continue
            with self._lock:
                if self._closed:
                    sock.close()
                    continue
                try:
                    link = self._start_link(sock, address, nonce)
                except OSError as exc:
                    sock.close()
                    LOG.info("%s: report channel lost while resending (%r)", self.name, exc)
                    continue
                self._link = link
                self._connecting = False
                self.connects += 1
            threading.Thread(target=self._read_acks, args=(link,), name=f"{self.name}-acks", daemon=True).start()
            return

    def _start_link(self, sock: socket.socket, address: ChannelAddress, nonce: bytes) -> _Link:
        """The hello, then every unacknowledged frame, on a new connection: its first frame is the
        oldest one kept (frames given up before it are skipped by the server too)."""
        hello = Hello(self.client_id, os.urandom(CLIENT_NONCE_BYTES), next(iter(self._unacked), self._seq + 1))
        link = _Link(sock, SessionKeys(address.secret, nonce, hello))
        sock.sendall(seal_hello(address.secret, nonce, hello))
        for seq, (payload, _) in self._unacked.items():
            link.sent_through = seq
            sock.sendall(link.keys.seal_frame(seq, payload))
        return link

    def _open(self, address: ChannelAddress) -> tuple[socket.socket, bytes]:
        """Without the lock: a connection and the server's nonce."""
        sock = socket.create_connection((address.host, address.port), timeout=SEND_TIMEOUT_S)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = recv_exactly(sock, NONCE_BYTES)
        except BaseException:
            sock.close()
            raise
        return sock, nonce

    def _read_acks(self, link: _Link) -> None:
        """Without the lock: settle acknowledged frames until the connection ends."""
        buffer = bytearray()
        while True:
            try:
                data = link.sock.recv(65536)
            except socket.timeout:
                with self._lock:
                    if self._link is not link:
                        return
                continue
            except OSError as exc:
                data, error = b"", exc
            else:
                error = ConnectionError("the scheduler closed the report channel")
            if data:
                buffer += data
                whole = len(buffer) - len(buffer) % ACK_BYTES
                acked = [link.keys.open_ack(bytes(buffer[at:at + ACK_BYTES])) for at in range(0, whole, ACK_BYTES)]
                del buffer[:whole]
                if not acked or self._settle_through(link, acked):
                    continue
                error = ConnectionError("an acknowledgement that is no genuine one")
            with self._lock:
                self._drop(link, error)
                if self._link is None and self._unacked:
                    self._connect_in_background()
            return

    def _settle_through(self, link: _Link, acked: list[int | None]) -> bool:
        """Without the lock: settle the frames up to the last acknowledgement; False (nothing
        settled) if any of them failed its tag or names a frame never sent on this connection."""
        settled = []
        with self._lock:
            if any(seq is None or seq > link.sent_through for seq in acked):
                self.forged_acks += 1
                LOG.warning("%s: an acknowledgement failed its check; reconnecting", self.name)
                return False
            self._retry_in_s = 0.0
            through = acked[-1]
            assert through is not None
            for seq in list(self._unacked):
                if seq > through:
                    break
                settled.append(self._unacked.pop(seq)[1])
        for pending in settled:
            pending.settle()
        return True


def _end(sock: socket.socket) -> None:
    """Close `sock` so that the server sees it end: a plain close from another thread leaves a
    recv blocked in the acknowledgement thread, which keeps the connection open."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already reset by the peer
    sock.close()


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    """Exactly n bytes from `sock` (ConnectionError if it closes first)."""
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the scheduler closed the report channel during the handshake")
        data += chunk
    return bytes(data)
