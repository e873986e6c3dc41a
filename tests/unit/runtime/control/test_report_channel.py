"""The report channel (runtime/control/report_channel.py) on real sockets, without Ray: a server on an
event loop in a thread, clients as engines and readers use them."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any, Callable, Iterator

import pytest

from dualpath_ray.runtime.control import report_channel
from dualpath_ray.runtime.control.report_channel import (
    ACK, CLIENT_ID_BYTES, FRAME, MAX_FRAME_BYTES, NONCE_BYTES, ChannelAddress, ReportClient, ReportServer, proof,
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


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.stop()


def start_server(loop: LoopThread, delivered: list[Any]) -> ReportServer:
    return loop.run(ReportServer.start(delivered.append, "127.0.0.1"))


def wait_until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def handshake(sock: socket.socket, secret: bytes, client_id: bytes) -> None:
    nonce = report_channel._recv_exactly(sock, NONCE_BYTES)
    sock.sendall(proof(secret, nonce) + client_id)


def frame(seq: int, message: Any) -> bytes:
    import pickle

    payload = pickle.dumps(message)
    return FRAME.pack(len(payload), seq) + payload


def test_messages_arrive_in_order_and_acknowledgements_settle_them(loop):
    delivered: list[Any] = []
    server = start_server(loop, delivered)
    client = ReportClient(lambda: server.address, "engine")
    sent = [client.send(("report", i)) for i in range(200)]
    for pending in sent:
        pending.wait(10)
    assert delivered == [("report", i) for i in range(200)], "every message is handed over once, in send order"
    assert client.unacked() == 0 and client.connects == 1, "acknowledged frames are forgotten; one connection served all"
    client.close()
    loop.call(server.close)


def test_a_sender_without_the_secret_is_closed_before_anything_is_unpickled(loop):
    delivered: list[Any] = []
    server = start_server(loop, delivered)
    assert server.address is not None
    wrong = ChannelAddress(server.address.host, server.address.port, b"not the secret")
    with socket.create_connection((wrong.host, wrong.port), timeout=5) as sock:
        handshake(sock, wrong.secret, b"x" * CLIENT_ID_BYTES)
        sock.sendall(frame(1, "never handled"))
        assert sock.recv(64) == b"", "the server closes a connection that failed the proof"
    assert delivered == [] and server.rejected == 1, "no frame of an unproven sender is handled"
    loop.call(server.close)


def test_an_oversized_frame_closes_its_connection(loop):
    delivered: list[Any] = []
    server = start_server(loop, delivered)
    assert server.address is not None
    with socket.create_connection((server.address.host, server.address.port), timeout=5) as sock:
        handshake(sock, server.address.secret, b"y" * CLIENT_ID_BYTES)
        sock.sendall(FRAME.pack(MAX_FRAME_BYTES + 1, 1))
        assert sock.recv(64) == b"", "a frame over the limit ends the connection"
    assert delivered == [] and server.rejected == 1, "nothing of it was handled"
    loop.call(server.close)


def test_a_frame_sent_again_to_the_same_server_is_handled_once(loop):
    delivered: list[Any] = []
    server = start_server(loop, delivered)
    assert server.address is not None
    client_id = b"z" * CLIENT_ID_BYTES
    address = (server.address.host, server.address.port)
    with socket.create_connection(address, timeout=5) as sock:
        handshake(sock, server.address.secret, client_id)
        sock.sendall(frame(1, "a") + frame(2, "b"))
        wait_until(lambda: len(delivered) == 2)
    with socket.create_connection(address, timeout=5) as sock:  # a reconnect resends what was not acked
        handshake(sock, server.address.secret, client_id)
        sock.sendall(frame(1, "a") + frame(2, "b") + frame(3, "c"))
        acked = report_channel._recv_exactly(sock, ACK.size)
    assert delivered == ["a", "b", "c"], "frames already handled from this client id are skipped"
    assert ACK.unpack(acked) == (3,), "the acknowledgement names the last frame handled"
    loop.call(server.close)


def test_a_message_that_fails_to_be_handled_does_not_close_the_channel(loop):
    delivered: list[Any] = []

    def deliver(message: Any) -> None:
        if message == "boom":
            raise ValueError("a handler bug")
        delivered.append(message)

    server = loop.run(ReportServer.start(deliver, "127.0.0.1"))
    client = ReportClient(lambda: server.address, "engine")
    client.send("boom").wait(10)
    client.send("ok").wait(10)
    assert delivered == ["ok"] and client.connects == 1, "the next message is handled on the same connection"
    client.close()
    loop.call(server.close)


def test_frames_wait_for_a_restarted_scheduler_and_reach_it_in_order(loop):
    first: list[Any] = []
    old = start_server(loop, first)
    current = {"address": old.address}
    client = ReportClient(lambda: current["address"], "engine")
    client.send("before").wait(10)
    loop.call(old.close)  # the scheduler's process died: its connections end
    current["address"] = None  # and the restarted one is not up yet: resolve fails meanwhile

    def resolve() -> ChannelAddress:
        if current["address"] is None:
            raise ConnectionError("no scheduler yet")
        return current["address"]

    client.resolve = resolve
    waiting = [client.send(f"during-{i}") for i in range(5)]
    time.sleep(0.3)
    assert not any(p.done() for p in waiting), "nothing is acknowledged while no scheduler is there"
    second: list[Any] = []
    new = start_server(loop, second)
    current["address"] = new.address
    for pending in waiting:
        pending.wait(10)
    assert first == ["before"], "the old incarnation got what it acknowledged"
    assert second == [f"during-{i}" for i in range(5)], "the new incarnation gets the rest, in order, once each"
    assert client.connects == 2
    client.close()
    loop.call(new.close)


def test_a_client_bounds_what_it_keeps_for_an_absent_scheduler(monkeypatch):
    monkeypatch.setattr(report_channel, "MAX_UNACKED", 3)

    def resolve() -> ChannelAddress:
        raise ConnectionError("no scheduler")

    client = ReportClient(resolve, "reader")
    sent = [client.send(i) for i in range(5)]
    for pending in sent[:2]:
        with pytest.raises(ConnectionError):
            pending.done()
    assert client.dropped == 2 and client.unacked() == 3, "the oldest frames beyond the bound are given up"
    client.close()
    for pending in sent[2:]:
        with pytest.raises(ConnectionError):
            pending.wait(1)
