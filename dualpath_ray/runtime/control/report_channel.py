"""Engines' and readers' reports to the scheduler on one authenticated socket each.

Why not Ray calls: at the paper's 48P96D every turn ends with at least one message to the one
scheduler (its result, from one of 768 decode engines that each finish a few turns a second, so
nothing batches them), and readers tell it their read queues as they change. An incoming call to
an async Ray actor costs the receiver 350-900 us of CPU on this project's VMs; the same message
as a frame on a socket the scheduler's event loop reads costs it ~35 us (benchmarks/README.md,
"Control plane"). Everything else (lifecycle, calls with answers) stays on Ray.

Wire, per connection (TCP, one per sending process):
  server -> client  NONCE_BYTES random bytes
  client -> server  HMAC-SHA256(secret, nonce), then its 16-byte client id
  client -> server  frames: FRAME (payload length, sequence number) + a pickled message
  server -> client  ACK (the highest sequence number it has handled), after each read

Nothing is unpickled before the client has proved it holds the secret, and only the scheduler's
`report_channel` Ray method (behind Ray's own authentication) hands the secret out; a connection
that fails the proof, or announces a frame over MAX_FRAME_BYTES, is closed.

Delivery is at least once and in order, like a Ray call to an actor with max_task_retries=-1:
a client keeps each frame until it is acknowledged and sends the unacknowledged ones again, in
order, on its next connection (to the same scheduler or to its restarted incarnation). A server
remembers the last sequence number it handled per client id, so a frame resent to the same
incarnation is not handled twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import pickle
import socket
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

LOG = logging.getLogger("dualpath_ray.report_channel")

FRAME = struct.Struct("!IQ")  # payload length, sequence number
ACK = struct.Struct("!Q")  # highest sequence number handled
NONCE_BYTES = 32
CLIENT_ID_BYTES = 16
MAX_FRAME_BYTES = 64 << 20  # a report carries a step's results and tokens: far below this
MAX_UNACKED = 65536  # frames a client keeps for a scheduler that does not answer; the oldest go first
SEND_TIMEOUT_S = 10.0  # a scheduler that takes nothing for this long is treated as gone: reconnect
RECONNECT_BACKOFF_S = (0.05, 1.0)  # first and longest wait between attempts to connect


@dataclass(frozen=True)
class ChannelAddress:
    """Where one scheduler incarnation reads reports, and the secret a sender proves."""

    host: str
    port: int
    secret: bytes


def proof(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, nonce, hashlib.sha256).digest()


# --- the scheduler's side: runs on its event loop --------------------------------------------


class ReportServer:
    """Accepts senders and hands every message to `deliver` on the event loop, in each sender's
    order. `deliver` must not block; an exception it raises is logged and the frame counts as
    handled (a Ray call would have answered the sender with the error)."""

    def __init__(self, deliver: Callable[[Any], None], secret: bytes) -> None:
        self.deliver = deliver
        self.secret = secret
        self.handled: dict[bytes, int] = {}  # client id -> highest sequence number handled
        self.frames = 0
        self.rejected = 0  # connections closed for a wrong proof or an oversized frame
        self.server: asyncio.AbstractServer | None = None
        self.connections: set[asyncio.Transport] = set()
        self.address: ChannelAddress | None = None

    @classmethod
    async def start(cls, deliver: Callable[[Any], None], host: str, port: int = 0) -> ReportServer:
        channel = cls(deliver, os.urandom(32))
        loop = asyncio.get_running_loop()
        channel.server = await loop.create_server(lambda: _ReportProtocol(channel), host, port)
        bound = channel.server.sockets[0].getsockname()
        channel.address = ChannelAddress(host, int(bound[1]), channel.secret)
        return channel

    def close(self) -> None:
        """Stop accepting and end every connection (senders reconnect and resend)."""
        if self.server is not None:
            self.server.close()
        for transport in list(self.connections):
            transport.close()

    def _handle(self, client_id: bytes, seq: int, payload: bytes) -> None:
        if seq <= self.handled.get(client_id, 0):
            return  # sent again after a reconnect: handled already
        self.handled[client_id] = seq
        self.frames += 1
        try:
            self.deliver(pickle.loads(payload))
        except Exception:  # noqa: BLE001 - one bad message must not close a sender's channel
            LOG.exception("report channel: a message could not be handled")


class _ReportProtocol(asyncio.Protocol):
    """One sender's connection: the handshake, then frames."""

    def __init__(self, channel: ReportServer) -> None:
        self.channel = channel
        self.buffer = bytearray()
        self.nonce = os.urandom(NONCE_BYTES)
        self.client_id: bytes | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport, not necessarily a subclass of asyncio.Transport: Ray runs async
        # actors on uvloop where it is installed (vLLM and uvicorn[standard] bring it), and
        # uvloop's TCPTransport only implements the interface.
        if not hasattr(transport, "write"):
            raise TypeError(f"report channel: a stream transport was expected, got {type(transport).__name__}")
        self.transport = transport  # type: ignore[assignment]
        self.channel.connections.add(transport)
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.write(self.nonce)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.channel.connections.discard(self.transport)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.client_id is None and not self._authenticate():
            return
        assert self.client_id is not None and self.transport is not None
        last = None
        while len(self.buffer) >= FRAME.size:
            length, seq = FRAME.unpack_from(self.buffer)
            if length > MAX_FRAME_BYTES:
                self._reject(f"a frame of {length} bytes (at most {MAX_FRAME_BYTES})")
                return
            end = FRAME.size + length
            if len(self.buffer) < end:
                break
            payload = bytes(self.buffer[FRAME.size:end])
            del self.buffer[:end]
            self.channel._handle(self.client_id, seq, payload)
            last = seq
        if last is not None and not self.transport.is_closing():
            self.transport.write(ACK.pack(last))

    def _authenticate(self) -> bool:
        """True once the sender proved the secret and named itself; False while bytes are missing
        (or after closing a sender that failed)."""
        needed = len(self.nonce) + CLIENT_ID_BYTES
        if len(self.buffer) < needed:
            return False
        answer = bytes(self.buffer[:len(self.nonce)])
        if not hmac.compare_digest(answer, proof(self.channel.secret, self.nonce)):
            self._reject("a wrong proof of the secret")
            return False
        self.client_id = bytes(self.buffer[len(self.nonce):needed])
        del self.buffer[:needed]
        return True

    def _reject(self, why: str) -> None:
        assert self.transport is not None
        self.channel.rejected += 1
        peer = self.transport.get_extra_info("peername")
        LOG.warning("report channel: closed the connection from %s: %s", peer, why)
        self.buffer.clear()
        self.transport.close()


# --- a sender's side: any thread may send ----------------------------------------------------


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


class ReportClient:
    """One sending process's channel to the scheduler. `send` never blocks on the scheduler's
    absence: while there is no connection, frames wait (up to MAX_UNACKED) and a background
    thread finds the scheduler with `resolve` (a Ray call that waits for a restarting scheduler)
    and connects. A thread per connection reads the acknowledgements."""

    def __init__(self, resolve: Callable[[], ChannelAddress], name: str) -> None:
        self.resolve = resolve
        self.name = name
        self.client_id = uuid.uuid4().bytes
        self.sent = 0  # frames sent, resends not counted
        self.connects = 0
        self.dropped = 0  # frames given up (MAX_UNACKED)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._seq = 0
        self._unacked: dict[int, tuple[bytes, SentReport]] = {}  # in sequence order
        self._connecting = False
        self._closed = False

    def send(self, message: Any) -> SentReport:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        pending = SentReport()
        with self._lock:
            if self._closed:
                pending.settle(ConnectionError(f"{self.name}: report channel closed"))
                return pending
            self._seq += 1
            frame = FRAME.pack(len(payload), self._seq) + payload
            self._unacked[self._seq] = (frame, pending)
            self.sent += 1
            self._bound_unacked()
            if self._sock is not None:
                try:
                    self._sock.sendall(frame)
                except OSError as exc:
                    self._drop(self._sock, exc)
            if self._sock is None:
                self._connect_in_background()
        return pending

    def unacked(self) -> int:
        with self._lock:
            return len(self._unacked)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sock, self._sock = self._sock, None
            pending = [p for _, p in self._unacked.values()]
            self._unacked.clear()
        if sock is not None:
            sock.close()
        for p in pending:
            p.settle(ConnectionError(f"{self.name}: report channel closed"))

    # Everything below runs with the lock held unless it says otherwise.

    def _bound_unacked(self) -> None:
        while len(self._unacked) > MAX_UNACKED:
            oldest = next(iter(self._unacked))
            _, pending = self._unacked.pop(oldest)
            self.dropped += 1
            pending.settle(ConnectionError(f"{self.name}: {MAX_UNACKED} reports unacknowledged; the oldest dropped"))

    def _drop(self, sock: socket.socket, why: BaseException) -> None:
        if self._sock is sock:
            LOG.info("%s: report channel lost (%r); reconnecting", self.name, why)
            self._sock = None
            sock.close()

    def _connect_in_background(self) -> None:
        if not self._connecting and not self._closed:
            self._connecting = True
            threading.Thread(target=self._connect_loop, name=f"{self.name}-connect", daemon=True).start()

    def _connect_loop(self) -> None:
        """Without the lock: find the scheduler and connect, with backoff, until connected or
        closed; then send every unacknowledged frame again, in order."""
        wait_s = RECONNECT_BACKOFF_S[0]
        while True:
            try:
                sock = self._open(self.resolve())
            except Exception as exc:  # noqa: BLE001 - no scheduler yet, or it is restarting
                LOG.info("%s: report channel not connected yet (%r); retrying in %.2fs", self.name, exc, wait_s)
                time.sleep(wait_s)
                wait_s = min(2 * wait_s, RECONNECT_BACKOFF_S[1])
                with self._lock:
                    if self._closed:
                        self._connecting = False
                        return
                continue
            with self._lock:
                self._connecting = False
                if self._closed:
                    sock.close()
                    return
                try:
                    for frame, _ in self._unacked.values():
                        sock.sendall(frame)
                except OSError as exc:
                    sock.close()
                    LOG.info("%s: report channel lost while resending (%r)", self.name, exc)
                    self._connecting = True
                    continue
                self._sock = sock
                self.connects += 1
            threading.Thread(target=self._read_acks, args=(sock,), name=f"{self.name}-acks", daemon=True).start()
            return

    def _open(self, address: ChannelAddress) -> socket.socket:
        """Without the lock: a connection that passed the handshake."""
        sock = socket.create_connection((address.host, address.port), timeout=SEND_TIMEOUT_S)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = _recv_exactly(sock, NONCE_BYTES)
            sock.sendall(proof(address.secret, nonce) + self.client_id)
        except BaseException:
            sock.close()
            raise
        return sock

    def _read_acks(self, sock: socket.socket) -> None:
        """Without the lock: settle acknowledged frames until the connection ends."""
        buffer = bytearray()
        while True:
            try:
                data = sock.recv(65536)
            except socket.timeout:
                with self._lock:
                    if self._sock is not sock:
                        return
                continue
            except OSError as exc:
                data, error = b"", exc
            else:
                error = ConnectionError("the scheduler closed the report channel")
            if not data:
                with self._lock:
                    self._drop(sock, error)
                    if self._sock is None and self._unacked:
                        self._connect_in_background()
                return
            buffer += data
            whole = len(buffer) - len(buffer) % ACK.size
            if whole:
                (acked,) = ACK.unpack_from(buffer, whole - ACK.size)
                del buffer[:whole]
                self._settle_through(acked)

    def _settle_through(self, acked: int) -> None:
        settled = []
        with self._lock:
            for seq in list(self._unacked):
                if seq > acked:
                    break
                settled.append(self._unacked.pop(seq)[1])
        for pending in settled:
            pending.settle()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the scheduler closed the report channel during the handshake")
        data += chunk
    return bytes(data)
