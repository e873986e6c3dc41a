"""The report channel's seals (runtime/reporting/frames.py): what a tag binds."""

from __future__ import annotations

import os

from dualpath_ray.runtime.reporting.frames import (
    ACK_BYTES, FRAME, HELLO_FIELDS, TAG_BYTES, Hello, SessionKeys, open_hello, seal_hello,
)

SECRET = os.urandom(32)
NONCE = os.urandom(32)
HELLO = Hello(b"c" * 16, b"n" * 16, 1)


def split(frame: bytes) -> tuple[bytes, bytes, bytes]:
    return frame[: FRAME.size], frame[FRAME.size:-TAG_BYTES], frame[-TAG_BYTES:]


def test_a_hello_proves_the_secret_for_this_nonce_and_these_fields():
    sealed = seal_hello(SECRET, NONCE, HELLO)
    assert open_hello(SECRET, NONCE, sealed) == HELLO, "the genuine hello opens"
    assert open_hello(os.urandom(32), NONCE, sealed) is None, "another secret fails"
    assert open_hello(SECRET, os.urandom(32), sealed) is None, "a hello recorded for another nonce fails"
    tampered = HELLO_FIELDS.pack(HELLO.client_id, HELLO.client_nonce, 2**64 - 1) + sealed[HELLO_FIELDS.size:]
    assert open_hello(SECRET, NONCE, tampered) is None, "a changed first frame number fails the proof"


def test_a_frame_tag_binds_its_number_length_payload_and_connection():
    keys = SessionKeys(SECRET, NONCE, HELLO)
    header, payload, tag = split(keys.seal_frame(5, b"payload"))
    assert keys.frame_verifies(header, payload, tag), "the genuine frame verifies"
    assert not keys.frame_verifies(FRAME.pack(len(payload), 6), payload, tag), "another number fails"
    assert not keys.frame_verifies(header, b"pAyload", tag), "another payload fails"
    others = [
        SessionKeys(SECRET, os.urandom(32), HELLO),  # another connection: the server's nonce differs
        SessionKeys(SECRET, NONCE, HELLO._replace(client_nonce=b"m" * 16)),
        SessionKeys(SECRET, NONCE, HELLO._replace(client_id=b"d" * 16)),
        SessionKeys(os.urandom(32), NONCE, HELLO),
    ]
    assert not any(k.frame_verifies(header, payload, tag) for k in others), "no other connection's key takes it"


def test_an_acknowledgement_is_bound_to_its_number_and_connection():
    keys = SessionKeys(SECRET, NONCE, HELLO)
    ack = keys.seal_ack(9)
    assert len(ack) == ACK_BYTES and keys.open_ack(ack) == 9, "the genuine ACK opens"
    assert SessionKeys(SECRET, os.urandom(32), HELLO).open_ack(ack) is None, "replayed on another connection it fails"
    assert keys.open_ack(ack[:-1] + bytes([ack[-1] ^ 1])) is None, "a changed tag fails"
    assert keys.open_ack(keys.seal_ack(10)[:8] + ack[8:]) is None, "another number under this tag fails"
