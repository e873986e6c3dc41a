"""The report channel's bytes and the keys that seal them (the protocol they make, and why, is in
runtime/reporting/channel.py's docstring).

MACs are keyed BLAKE2b (RFC 7693's keyed mode is a MAC; one call, no HMAC double hash: ~0.7 us
for a report frame on this project's VMs), each use separated by BLAKE2b's personalization. Tags
are 16 bytes: a forger's chance per try is 2^-128, and a try that fails costs it the connection.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import NamedTuple

NONCE_BYTES = 32  # the server's, fresh per connection
CLIENT_NONCE_BYTES = 16  # the client's, fresh per connection
CLIENT_ID_BYTES = 16
PROOF_BYTES = 32
TAG_BYTES = 16
MAX_SECRET_BYTES = 64  # BLAKE2b's longest key
MAX_FRAME_BYTES = 64 << 20  # a report carries a step's results and tokens: far below this
# Sequence numbers start at 1 and stay below 2^63: a sender would need 290 years at a billion
# frames a second to get there, so one above is a forgery or a bug, and refused.
MAX_SEQ = (1 << 63) - 1

HELLO_FIELDS = struct.Struct(f"!{CLIENT_ID_BYTES}s{CLIENT_NONCE_BYTES}sQ")  # client id, client nonce, first frame
HELLO_BYTES = HELLO_FIELDS.size + PROOF_BYTES
FRAME = struct.Struct("!IQ")  # payload length, sequence number; the payload and its tag follow
ACK = struct.Struct("!Q")  # the highest sequence number handled; its tag follows
ACK_BYTES = ACK.size + TAG_BYTES


class Hello(NamedTuple):
    """What a client says after the server's nonce: who it is, its half of the connection's
    freshness, and the number of the first frame it sends on this connection."""

    client_id: bytes
    client_nonce: bytes
    first: int


def _mac(key: bytes, person: bytes, size: int, *parts: bytes) -> bytes:
    if len(key) > MAX_SECRET_BYTES:
        raise ValueError(f"a report channel secret is at most {MAX_SECRET_BYTES} bytes")
    digest = hashlib.blake2b(key=key, person=person, digest_size=size)
    for part in parts:
        digest.update(part)
    return digest.digest()


def seal_hello(secret: bytes, nonce: bytes, hello: Hello) -> bytes:
    """The client's answer to `nonce`: its hello, proven with the secret."""
    fields = HELLO_FIELDS.pack(*hello)
    return fields + _mac(secret, b"dp-report-hello", PROOF_BYTES, nonce, fields)


def open_hello(secret: bytes, nonce: bytes, data: bytes) -> Hello | None:
    """The hello in the HELLO_BYTES `data`, or None if its proof of the secret is wrong."""
    fields = data[: HELLO_FIELDS.size]
    expected = _mac(secret, b"dp-report-hello", PROOF_BYTES, nonce, fields)
    if not hmac.compare_digest(expected, data[HELLO_FIELDS.size:HELLO_BYTES]):
        return None
    return Hello(*HELLO_FIELDS.unpack(fields))


class SessionKeys:
    """One connection's MAC keys, derived from the incarnation's secret and both nonces and the
    client id of its handshake: a frame or an acknowledgement recorded on one connection fails on
    every other (another nonce), and one direction's tags are no use in the other (another
    personalization)."""

    def __init__(self, secret: bytes, nonce: bytes, hello: Hello) -> None:
        session = _mac(secret, b"dp-report-key", 64, nonce, hello.client_id, hello.client_nonce)
        # Keyed once; each tag starts from a copy (cheaper than keying again).
        self._frames = hashlib.blake2b(key=session, person=b"dp-report-frame", digest_size=TAG_BYTES)
        self._acks = hashlib.blake2b(key=session, person=b"dp-report-ack", digest_size=TAG_BYTES)

    def seal_frame(self, seq: int, payload: bytes) -> bytes:
        """The frame of `payload` numbered `seq`: header, payload, tag over both."""
        header = FRAME.pack(len(payload), seq)
        tag = self._frames.copy()
        tag.update(header)
        tag.update(payload)
        return header + payload + tag.digest()

    def frame_verifies(self, header: bytes, payload: bytes, tag: bytes) -> bool:
        digest = self._frames.copy()
        digest.update(header)
        digest.update(payload)
        return hmac.compare_digest(digest.digest(), tag)

    def seal_ack(self, seq: int) -> bytes:
        body = ACK.pack(seq)
        tag = self._acks.copy()
        tag.update(body)
        return body + tag.digest()

    def open_ack(self, record: bytes) -> int | None:
        """The number an ACK_BYTES `record` acknowledges, or None if its tag is wrong."""
        tag = self._acks.copy()
        tag.update(record[: ACK.size])
        if not hmac.compare_digest(tag.digest(), record[ACK.size:ACK_BYTES]):
            return None
        (seq,) = ACK.unpack_from(record)
        return int(seq)
