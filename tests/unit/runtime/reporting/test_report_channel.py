"""The report channel (runtime/reporting/channel.py) on real sockets, without Ray: a server on an
event loop in a thread, clients as engines and readers use them. What it refuses from hostile
peers: test_report_channel_security.py."""

from __future__ import annotations

import time
from typing import Any, Iterator

import pytest

from dualpath_ray.runtime.reporting import client as report_client
from dualpath_ray.runtime.reporting.channel import ChannelAddress
from dualpath_ray.runtime.reporting.client import ReportClient
from dualpath_ray.runtime.reporting.frames import MAX_FRAME_BYTES, FRAME
from tests.unit.runtime.reporting._report_peers import (
    LoopThread, RawSender, closed_by_peer, encode, report, start_server, wait_until,
)


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.stop()


def test_messages_arrive_in_order_and_acknowledgements_settle_them(loop):
    delivered: list[Any] = []
    server = start_server(loop, delivered.append)
    client = ReportClient(lambda: server.address, "engine")
    sent = [client.send(report(i)) for i in range(200)]
    for pending in sent:
        pending.wait(10)
    assert delivered == [report(i) for i in range(200)], "every message is handed over once, in send order"
    assert client.unacked() == 0 and client.connects == 1, "acknowledged frames are forgotten; one connection served all"
    client.close()
    loop.call(server.close)


def test_a_sender_without_the_secret_is_closed_before_anything_is_decoded(loop):
    delivered: list[Any] = []
    server = start_server(loop, delivered.append)
    sender = RawSender(server, secret=b"not the secret")
    sender.hello()
    sender.send(sender.frame(1, encode(report(1))))
    assert closed_by_peer(sender.sock), "the server closes a connection that failed the proof"
    sender.close()
    assert delivered == [] and server.rejected == 1, "no frame of an unproven sender is handled"
    loop.call(server.close)


def test_an_oversized_frame_closes_its_connection(loop):
    delivered: list[Any] = []
    server = start_server(loop, delivered.append)
    sender = RawSender(server)
    sender.hello()
    sender.send(FRAME.pack(MAX_FRAME_BYTES + 1, 1))
    assert closed_by_peer(sender.sock), "a frame over the limit ends the connection"
    sender.close()
    assert delivered == [] and server.rejected == 1, "nothing of it was handled"
    loop.call(server.close)


def test_a_frame_sent_again_to_the_same_server_is_handled_once(loop):
    delivered: list[Any] = []
    server = start_server(loop, delivered.append)
    first = RawSender(server)
    first.hello(first=1)
    first.send(first.frame(1, encode(report(1))), first.frame(2, encode(report(2))))
    wait_until(lambda: len(delivered) == 2)
    first.close()
    again = RawSender(server, client_id=first.client_id)  # a reconnect resends what was not acked
    again.hello(first=1)
    again.send(*(again.frame(seq, encode(report(seq))) for seq in (1, 2, 3)))
    assert again.ack() == 3, "the acknowledgement, under the new connection's key, names the last frame handled"
    again.close()
    assert delivered == [report(1), report(2), report(3)], "frames already handled from this client id are skipped"
    loop.call(server.close)


def test_a_message_that_fails_to_be_handled_does_not_close_the_channel(loop):
    delivered: list[Any] = []

    def deliver(message: Any) -> None:
        if message == report(666):
            raise ValueError("a handler bug")
        delivered.append(message)

    server = start_server(loop, deliver)
    client = ReportClient(lambda: server.address, "engine")
    client.send(report(666)).wait(10)
    client.send(report(1)).wait(10)
    assert delivered == [report(1)] and client.connects == 1, "the next message is handled on the same connection"
    client.close()
    loop.call(server.close)


def test_frames_wait_for_a_restarted_scheduler_and_reach_it_in_order(loop):
    first: list[Any] = []
    old = start_server(loop, first.append)
    current = {"address": old.address}
    client = ReportClient(lambda: current["address"], "engine")
    client.send(report(0)).wait(10)
    loop.call(old.close)  # the scheduler's process died: its connections end
    current["address"] = None  # and the restarted one is not up yet: resolve fails meanwhile

    def resolve() -> ChannelAddress:
        if current["address"] is None:
            raise ConnectionError("no scheduler yet")
        return current["address"]

    client.resolve = resolve
    waiting = [client.send(report(i)) for i in range(1, 6)]
    time.sleep(0.3)
    assert not any(p.done() for p in waiting), "nothing is acknowledged while no scheduler is there"
    second: list[Any] = []
    new = start_server(loop, second.append)
    current["address"] = new.address
    for pending in waiting:
        pending.wait(10)
    assert first == [report(0)], "the old incarnation got what it acknowledged"
    assert second == [report(i) for i in range(1, 6)], "the new incarnation gets the rest, in order, once each"
    assert client.connects == 2
    client.close()
    loop.call(new.close)


def test_a_client_bounds_what_it_keeps_for_an_absent_scheduler(monkeypatch):
    monkeypatch.setattr(report_client, "MAX_UNACKED", 3)

    def resolve() -> ChannelAddress:
        raise ConnectionError("no scheduler")

    client = ReportClient(resolve, "reader")
    sent = [client.send(report(i)) for i in range(5)]
    for pending in sent[:2]:
        with pytest.raises(ConnectionError):
            pending.done()
    assert client.dropped == 2 and client.unacked() == 3, "the oldest frames beyond the bound are given up"
    client.close()
    for pending in sent[2:]:
        with pytest.raises(ConnectionError):
            pending.wait(1)


def test_frames_a_client_gave_up_do_not_stop_the_server_taking_its_later_ones(loop, monkeypatch):
    """The server knew the sender (it handled frame 1); while the sender could not reach it, it
    gave frames 2 and 3 up (MAX_UNACKED). Its next connection starts at 4: the server's count
    follows, rather than refusing 4 as a jump for ever."""
    monkeypatch.setattr(report_client, "MAX_UNACKED", 3)
    delivered: list[Any] = []
    server = start_server(loop, delivered.append)
    reachable = {"yes": True}

    def resolve() -> ChannelAddress:
        if not reachable["yes"]:
            raise ConnectionError("partitioned")
        assert server.address is not None
        return server.address

    client = ReportClient(resolve, "reader")
    client.send(report(1)).wait(10)
    reachable["yes"] = False
    loop.call(lambda: [t.close() for t in list(server.connections)])
    wait_until(lambda: not server.connections)
    sent = [client.send(report(i)) for i in range(2, 7)]
    assert client.dropped == 2, "frames 2 and 3 were given up"
    reachable["yes"] = True
    for pending in sent[2:]:
        pending.wait(10)
    assert delivered == [report(1), report(4), report(5), report(6)], "the frames kept arrive, in order, once"
    assert server.senders.given_up == 2 and server.rejected == 0, "the gap is the given-up frames, not a fault"
    client.close()
    loop.call(server.close)


def test_a_connection_closed_by_the_client_ends_its_sender_entry_as_idle(loop):
    server = start_server(loop, lambda message: None)
    client = ReportClient(lambda: server.address, "engine")
    client.send(report(1)).wait(10)
    client.close()
    wait_until(lambda: not server.connections)
    assert server.handled == {client.client_id: 1}, "the sender is remembered (within the horizon) after it left"
    assert server.unauthenticated == 0, "no connection counts as an open handshake once gone"
    loop.call(server.close)


def test_the_channel_carries_only_its_reports():
    client = ReportClient(lambda: ChannelAddress("127.0.0.1", 1, b"s"), "engine")
    with pytest.raises(TypeError):
        client.send(("report", 1))  # what pickle carried; the codec refuses it at the sender
    assert client.sent == 0, "nothing was queued"
    client.close()
