"""What the report channel (runtime/reporting/channel.py) refuses from hostile peers: forged
or injected frames, pickles, numbers that would silence a sender, peers that never finish the
handshake, forged acknowledgements; and that its memory of senders stays bounded (issue 31,
items 7 and 9)."""

from __future__ import annotations

import os
import pathlib
import pickle
import socket
import threading
from typing import Any, Iterator

import pytest

from dualpath_ray.runtime.reporting.channel import ChannelAddress, ChannelLimits
from dualpath_ray.runtime.reporting.client import ReportClient
from dualpath_ray.runtime.reporting.frames import ACK, HELLO_BYTES, NONCE_BYTES, TAG_BYTES
from tests.unit.runtime.reporting._report_peers import (
    LoopThread, RawSender, closed_by_peer, encode, recv_exactly, report, start_server, wait_until,
)


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.stop()


class Planted:
    """Unpickling it creates `path`: the file's existence says whether anything unpickled it."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (pathlib.Path.touch, (self.path,))


def test_a_frame_whose_tag_fails_closes_its_connection_and_is_never_delivered(loop):
    delivered: list[Any] = []
    server = start_server(loop, delivered.append)
    sender = RawSender(server)
    sender.hello()
    sender.send(sender.frame(1, encode(report(1))), sender.frame(2, encode(report(2)), forge_tag=True))
    assert closed_by_peer(sender.sock), "a frame that fails its tag ends the connection"
    sender.close()
    assert delivered == [report(1)], "the genuine frame before it was handled, the forged one never"
    assert server.rejected == 1 and server.frames == 1, "the rejection is counted; the forged frame is no frame handled"
    loop.call(server.close)


def test_a_frame_recorded_on_one_connection_fails_on_another(loop):
    """An on-path peer replays a genuine frame of another connection of the same sender."""
    delivered: list[Any] = []
    server = start_server(loop, delivered.append)
    original = RawSender(server)
    original.hello()
    recorded = original.frame(1, encode(report(1)))
    original.send(recorded)
    wait_until(lambda: delivered == [report(1)])
    original.close()
    replay = RawSender(server, client_id=original.client_id)
    replay.hello(first=1)
    replay.send(recorded)  # the first connection's frame, byte for byte: its tag is under that connection's key
    assert closed_by_peer(replay.sock), "the replayed frame fails its tag on this connection"
    replay.close()
    assert delivered == [report(1)] and server.rejected == 1, "nothing of the replay was handled"
    loop.call(server.close)


def test_a_pickle_is_never_unpickled_even_with_a_genuine_tag(loop, tmp_path):
    """The worst case: a sender that holds the secret (the tag is genuine) sends a pickle whose
    unpickling creates a file. The old channel unpickled every authenticated frame."""
    planted = tmp_path / "unpickled"
    delivered: list[Any] = []
    server = start_server(loop, delivered.append)
    sender = RawSender(server)
    sender.hello()
    sender.send(sender.frame(1, pickle.dumps(Planted(planted))), sender.frame(2, encode(report(2))))
    assert sender.ack() == 2, "both frames were taken (the bad one skipped, like a message deliver fails on)"
    sender.close()
    assert not planted.exists(), "nothing unpickled the payload: no code of the sender's choosing ran"
    assert delivered == [report(2)] and server.undecodable == 1, "the pickle was counted undecodable, never delivered"
    loop.call(server.close)


@pytest.mark.parametrize("jump", [2**64 - 1, 2**63, 3])
def test_a_frame_numbered_out_of_turn_does_not_silence_its_sender(loop, jump):
    """A frame numbered past the connection's next (even with a genuine tag: a broken sender of
    the same id) is refused; the real sender's frames still arrive. The old channel took 2^64-1
    as the sender's count and skipped all its later frames as resends."""
    delivered: list[Any] = []
    server = start_server(loop, delivered.append)
    client = ReportClient(lambda: server.address, "engine")
    client.send(report(1)).wait(10)
    rogue = RawSender(server, client_id=client.client_id)
    rogue.hello(first=2)
    rogue.send(rogue.frame(jump, encode(report(666))))
    assert closed_by_peer(rogue.sock), "a frame numbered out of turn ends its connection"
    rogue.close()
    later = [client.send(report(i)) for i in range(2, 5)]
    for pending in later:
        pending.wait(10)
    assert delivered == [report(i) for i in range(1, 5)], "the sender's later frames are all delivered"
    assert server.rejected == 1 and server.handled[client.client_id] == 4, "the jump never reached the sender's count"
    client.close()
    loop.call(server.close)


def test_a_hello_that_starts_beyond_the_sequence_space_is_refused(loop):
    delivered: list[Any] = []
    server = start_server(loop, delivered.append)
    sender = RawSender(server)
    sender.hello(first=2**64 - 1)
    sender.send(sender.frame(2**64 - 1, encode(report(1))))
    assert closed_by_peer(sender.sock), "a first frame number of 2^64-1 ends the connection"
    sender.close()
    assert delivered == [] and sender.client_id not in server.handled, "nothing was handled nor remembered"
    loop.call(server.close)


@pytest.mark.parametrize("dribble", [False, True])
def test_a_peer_that_does_not_finish_the_handshake_is_closed_after_the_timeout(loop, dribble):
    """Says nothing, or sends its hello a byte at a time too slowly (slowloris): the time limit
    is on the whole handshake, not between bytes."""
    server = start_server(loop, lambda message: None, ChannelLimits(handshake_timeout_s=0.5))
    assert server.address is not None
    with socket.create_connection((server.address.host, server.address.port), timeout=10) as sock:
        recv_exactly(sock, NONCE_BYTES)
        closed = threading.Event()
        if dribble:
            def drip() -> None:
                for _ in range(HELLO_BYTES - 1):
                    if closed.wait(0.05):
                        return
                    try:
                        sock.sendall(b"x")
                    except OSError:
                        return
            threading.Thread(target=drip, daemon=True).start()
        assert closed_by_peer(sock), "the server closes it (within the test's 10 s socket timeout)"
        closed.set()
    assert server.timed_out == 1 and server.unauthenticated == 0, "counted as timed out; no handshake left open"
    loop.call(server.close)


def test_connections_beyond_the_cap_of_open_handshakes_are_closed_at_once(loop):
    server = start_server(loop, lambda message: None, ChannelLimits(max_unauthenticated=2, handshake_timeout_s=30))
    assert server.address is not None
    address = (server.address.host, server.address.port)
    waiting = [socket.create_connection(address, timeout=5) for _ in range(2)]
    for sock in waiting:
        recv_exactly(sock, NONCE_BYTES)
    with socket.create_connection(address, timeout=5) as third:
        assert third.recv(NONCE_BYTES) == b"", "a third handshake is closed before it gets a nonce"
    assert server.refused == 1 and server.unauthenticated == 2, "counted as refused; the two open ones still wait"
    waiting[0].close()
    wait_until(lambda: server.unauthenticated == 1)
    client = ReportClient(lambda: server.address, "engine")
    client.send(report(1)).wait(10)
    assert client.connects == 1, "a slot freed by a closed handshake takes a genuine sender"
    client.close()
    waiting[1].close()
    loop.call(server.close)


class FakeScheduler:
    """A listener at the scheduler's address that does not hold the secret: it takes frames and
    acknowledges them all with ACKs it cannot tag."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            try:
                conn.sendall(os.urandom(NONCE_BYTES))
                recv_exactly(conn, HELLO_BYTES)
                conn.recv(65536)  # the frames
                conn.sendall(ACK.pack(1000) + os.urandom(TAG_BYTES))
                conn.recv(65536)  # until the client hangs up
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self.listener.close()


def test_a_forged_acknowledgement_does_not_make_a_client_drop_frames(loop):
    fake = FakeScheduler()
    target = {"address": ChannelAddress("127.0.0.1", fake.port, os.urandom(32))}
    client = ReportClient(lambda: target["address"], "engine")
    sent = [client.send(report(i)) for i in range(3)]
    wait_until(lambda: client.forged_acks >= 1)
    assert not any(p.done() for p in sent) and client.unacked() == 3, "a forged ACK settles nothing"
    delivered: list[Any] = []
    server = start_server(loop, delivered.append)
    target["address"] = server.address  # the real scheduler: the kept frames reach it
    for pending in sent:
        pending.wait(10)
    assert delivered == [report(i) for i in range(3)], "every frame the fake acknowledged is delivered, in order"
    client.close()
    fake.close()
    loop.call(server.close)


def test_the_sender_table_stays_bounded_with_many_short_lived_senders(loop):
    server = start_server(loop, lambda message: None, ChannelLimits(max_senders=8))
    for i in range(40):
        sender = RawSender(server)
        sender.hello()
        sender.send(sender.frame(1, encode(report(i))))
        assert sender.ack() == 1
        sender.close()
        wait_until(lambda: not server.connections)
    assert len(server.handled) <= 8, "at most max_senders senders are remembered"
    assert server.senders.forgotten == 40 - len(server.handled), "the others were forgotten, oldest first"
    loop.call(server.close)
