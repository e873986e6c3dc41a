"""Engines' and readers' reports to the scheduler on one authenticated socket each.

Why not Ray calls: at the paper's 48P96D every turn ends with at least one message to the one
scheduler (its result, from one of 768 decode engines that each finish a few turns a second, so
nothing batches them), and readers tell it their read queues as they change. An incoming call to
an async Ray actor costs the receiver 350-900 us of CPU on this project's VMs; the same message
as a frame on a socket the scheduler's event loop reads costs it ~35 us (benchmarks/README.md,
"Control plane"). Everything else (lifecycle, calls with answers) stays on Ray.

Wire, per connection (TCP, one per sending process; byte layouts in report_frames.py):
  server -> client  a fresh random nonce
  client -> server  hello: its 16-byte client id, a fresh client nonce, the number of the first
                    frame it will send, and a MAC of the nonce and those under the secret
  client -> server  frames: (payload length, sequence number), the payload, a 16-byte tag
  server -> client  ACK: the highest sequence number handled, a 16-byte tag, after each read
The secret is the scheduler incarnation's random one, handed out only by its `report_channel`
Ray method (behind Ray's own authentication). Tags are keyed BLAKE2b under a key derived from
the secret, both nonces and the client id, so they bind every frame and every ACK to this
connection and this direction: a frame or ACK recorded on one connection and replayed onto
another fails its tag. The payload is a `Codec` message of REPORT_TYPES (protocol/wire.py:
msgpack of the protocol dataclasses, never pickle).

What the server refuses, closing the connection (`rejected`) before it decodes anything of it:
a wrong proof, a frame over MAX_FRAME_BYTES, a tag that does not verify, a frame numbered other
than the connection's next (the hello's `first`, then one more each). A numbered jump such as
2^64-1 therefore never reaches the sender's count, so no frame can make the server skip a
sender's later ones. A peer that has not finished the handshake within
ChannelLimits.handshake_timeout_s (one that says nothing, or dribbles bytes) is closed
(`timed_out`, an event loop timer), and while max_unauthenticated such peers are open a new
connection is closed at once (`refused`). An authenticated frame whose payload is no message
(a bug of its sender) is logged, counted (`undecodable`) and skipped like a message `deliver`
fails on: the channel goes on.

The client checks each ACK's tag (an ACK that fails, or acknowledges a frame never sent on that
connection, ends the connection and counts `forged_acks`): only the server that holds the
connection's key can make a client forget a frame, so an on-path peer cannot make it drop frames
the scheduler never handled. Replaying one of the connection's own genuine ACKs only repeats a
true statement (everything up to n was handled). Nothing is encrypted: the reports are no
secret, only their authorship and integrity matter.

Delivery is at least once and in order, like a Ray call to an actor with max_task_retries=-1:
a client keeps each frame's payload until it is acknowledged and sends the unacknowledged ones
again, in order, sealed with the new connection's key, on its next connection (to the same
scheduler or to its restarted incarnation). Handling is exactly once per incarnation: the server
remembers the last sequence number it handled per client id (report_senders.py) and skips a
frame sent again; a sender it does not know (a restarted scheduler never saw it) starts at its
hello's `first`. A client that gave frames up (MAX_UNACKED while no scheduler answered) starts
its next connection past them, and the server's count follows. The table of senders is trimmed
(report_senders.py says how, and why exactly-once survives it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any, Callable

from dualpath_ray.protocol.messages import EngineReport, ReaderReport
from dualpath_ray.protocol.wire import Codec, WireError
from dualpath_ray.runtime.reporting.frames import (
    FRAME, HELLO_BYTES, MAX_FRAME_BYTES, MAX_SEQ, NONCE_BYTES, TAG_BYTES, SessionKeys, open_hello,
)
from dualpath_ray.runtime.reporting.senders import Senders, SequenceGap

LOG = logging.getLogger("dualpath_ray.report_channel")

REPORT_TYPES = (EngineReport, ReaderReport)  # what the channel carries (and what their fields reach)


@dataclass(frozen=True)
class ChannelAddress:
    """Where one scheduler incarnation reads reports, and the secret a sender proves."""

    host: str
    port: int
    secret: bytes


@dataclass(frozen=True)
class ChannelLimits:
    """What the server allows peers that have not proven the secret, and how long it remembers
    senders that left (report_senders.py)."""

    handshake_timeout_s: float = 5.0  # a connection must have sent a valid hello by then
    max_unauthenticated: int = 64  # connections still in their handshake; more are closed at once
    forget_after_s: float = 3600.0
    max_senders: int = 1 << 16


# --- the scheduler's side: runs on its event loop --------------------------------------------


class ReportServer:
    """Accepts senders and hands every message to `deliver` on the event loop, in each sender's
    order. `deliver` must not block; an exception it raises is logged and the frame counts as
    handled (a Ray call would have answered the sender with the error). `clock` is the event
    loop's time (the senders' idle times)."""

    def __init__(
        self, deliver: Callable[[Any], None], secret: bytes, clock: Callable[[], float],
        limits: ChannelLimits = ChannelLimits(),
    ) -> None:
        self.deliver = deliver
        self.secret = secret
        self.clock = clock
        self.limits = limits
        self.codec = Codec(REPORT_TYPES)
        self.senders = Senders(limits.forget_after_s, limits.max_senders)
        self.frames = 0  # frames handled (resends skipped not counted)
        self.rejected = 0  # connections closed for breaking the protocol (see the module docstring)
        self.timed_out = 0  # connections closed for not finishing the handshake in time
        self.refused = 0  # connections closed at once: max_unauthenticated handshakes were open
        self.undecodable = 0  # authenticated frames whose payload was no message: skipped
        self.unauthenticated = 0  # connections open in their handshake now
        self.server: asyncio.AbstractServer | None = None
        self.connections: set[asyncio.Transport] = set()
        self.address: ChannelAddress | None = None

    @property
    def handled(self) -> dict[bytes, int]:
        """Client id -> the highest sequence number handled, of the senders remembered."""
        return self.senders.handled

    @classmethod
    async def start(
        cls, deliver: Callable[[Any], None], host: str, port: int = 0, limits: ChannelLimits = ChannelLimits(),
    ) -> ReportServer:
        loop = asyncio.get_running_loop()
        channel = cls(deliver, os.urandom(32), loop.time, limits)
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
        """A frame whose tag and number the connection checked; SequenceGap if the sender's
        count says otherwise (the connection is then closed)."""
        if not self.senders.take(client_id, seq):
            return  # sent again after a reconnect: handled already
        self.frames += 1
        try:
            message = self.codec.decode(payload)
        except WireError as exc:
            self.undecodable += 1
            LOG.error("report channel: frame %d of a sender is no report (%s); skipped", seq, exc)
            return
        try:
            self.deliver(message)
        except Exception:  # noqa: BLE001 - one bad message must not close a sender's channel
            LOG.exception("report channel: a message could not be handled")


class _ReportProtocol(asyncio.Protocol):
    """One sender's connection: the handshake, then frames."""

    def __init__(self, channel: ReportServer) -> None:
        self.channel = channel
        self.buffer = bytearray()
        self.nonce = os.urandom(NONCE_BYTES)
        self.client_id: bytes | None = None
        self.keys: SessionKeys | None = None
        self.expected = 0  # the number the connection's next frame must carry
        self.transport: asyncio.Transport | None = None
        self.handshake: asyncio.TimerHandle | None = None  # set while it counts as unauthenticated

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport, not necessarily a subclass of asyncio.Transport: Ray runs async
        # actors on uvloop where it is installed (vLLM and uvicorn[standard] bring it), and
        # uvloop's TCPTransport only implements the interface.
        if not hasattr(transport, "write"):
            raise TypeError(f"report channel: a stream transport was expected, got {type(transport).__name__}")
        self.transport = transport  # type: ignore[assignment]
        channel = self.channel
        if channel.unauthenticated >= channel.limits.max_unauthenticated:
            channel.refused += 1
            if channel.refused & (channel.refused - 1) == 0:  # the 1st, 2nd, 4th, ...: a flood does not flood the log
                LOG.warning("report channel: refused %s (%d so far): %d handshakes already open",
                            transport.get_extra_info("peername"), channel.refused, channel.unauthenticated)
            transport.close()
            return
        channel.connections.add(transport)  # type: ignore[arg-type]
        channel.unauthenticated += 1
        self.handshake = asyncio.get_running_loop().call_later(
            channel.limits.handshake_timeout_s, self._handshake_expired
        )
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.write(self.nonce)  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.channel.connections.discard(self.transport)
        self._authenticated()
        if self.client_id is not None:
            self.channel.senders.end(self.client_id, self.channel.clock())
            self.client_id = None

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        if self.transport.is_closing():
            return  # closed for a fault: nothing more of it is read
        self.buffer += data
        if self.keys is None and not self._authenticate():
            return
        assert self.client_id is not None and self.keys is not None
        last = None
        while len(self.buffer) >= FRAME.size:
            length, seq = FRAME.unpack_from(self.buffer)
            if length > MAX_FRAME_BYTES:
                self._reject(f"a frame of {length} bytes (at most {MAX_FRAME_BYTES})")
                return
            end = FRAME.size + length + TAG_BYTES
            if len(self.buffer) < end:
                break
            header = bytes(self.buffer[: FRAME.size])
            payload = bytes(self.buffer[FRAME.size:end - TAG_BYTES])
            if not self.keys.frame_verifies(header, payload, bytes(self.buffer[end - TAG_BYTES:end])):
                self._reject(f"frame {seq}'s tag does not verify")
                return
            if seq != self.expected:
                self._reject(f"frame {seq} where this connection's next is {self.expected}")
                return
            del self.buffer[:end]
            self.expected += 1
            try:
                self.channel._handle(self.client_id, seq, payload)
            except SequenceGap as exc:
                self._reject(str(exc))
                return
            last = seq
        if last is not None and not self.transport.is_closing():
            self.transport.write(self.keys.seal_ack(last))

    def _authenticate(self) -> bool:
        """True once the sender proved the secret and named itself; False while bytes are missing
        (or after closing a sender that failed)."""
        if len(self.buffer) < HELLO_BYTES:
            return False
        hello = open_hello(self.channel.secret, self.nonce, bytes(self.buffer[:HELLO_BYTES]))
        if hello is None:
            self._reject("a wrong proof of the secret")
            return False
        if not 1 <= hello.first <= MAX_SEQ:
            self._reject(f"a first frame number of {hello.first}")
            return False
        del self.buffer[:HELLO_BYTES]
        self._authenticated()
        self.keys = SessionKeys(self.channel.secret, self.nonce, hello)
        self.expected = hello.first
        self.client_id = hello.client_id
        self.channel.senders.begin(hello.client_id, hello.first, self.channel.clock())
        return True

    def _authenticated(self) -> None:
        """The connection no longer counts as an open handshake (proven, or gone)."""
        if self.handshake is not None:
            self.handshake.cancel()
            self.handshake = None
            self.channel.unauthenticated -= 1

    def _handshake_expired(self) -> None:
        self.handshake = None
        self.channel.unauthenticated -= 1
        self.channel.timed_out += 1
        assert self.transport is not None
        if self.channel.timed_out & (self.channel.timed_out - 1) == 0:  # the 1st, 2nd, 4th, ...
            LOG.warning("report channel: closed %s (%d so far): no valid hello within %.1fs",
                        self.transport.get_extra_info("peername"), self.channel.timed_out,
                        self.channel.limits.handshake_timeout_s)
        self.buffer.clear()
        self.transport.close()

    def _reject(self, why: str) -> None:
        assert self.transport is not None
        self.channel.rejected += 1
        LOG.warning("report channel: closed the connection from %s: %s", self.transport.get_extra_info("peername"), why)
        self.buffer.clear()
        self.transport.close()
