"""The report channel server's memory of its senders (runtime/reporting/senders.py): frames
handled once per sender, numbered without gaps, and a table that stays bounded."""

from __future__ import annotations

import pytest

from dualpath_ray.runtime.reporting.senders import Senders, SequenceGap

A, B = b"a" * 16, b"b" * 16


def test_a_sender_is_taken_frame_by_frame_and_resends_are_skipped():
    senders = Senders(forget_after_s=60.0, capacity=8)
    senders.begin(A, 1, now=0.0)
    assert [senders.take(A, seq) for seq in (1, 2)] == [True, True], "the next frames are handled"
    assert [senders.take(A, seq) for seq in (1, 2)] == [False, False], "frames handled already are skipped"
    with pytest.raises(SequenceGap):
        senders.take(A, 4)  # frame 3 is due
    assert senders.handled[A] == 2, "a refused jump leaves the count where it was"


def test_a_sender_new_to_the_server_starts_at_its_first_frame():
    """A restarted scheduler never saw this sender: its oldest unacknowledged frame starts it."""
    senders = Senders(forget_after_s=60.0, capacity=8)
    senders.begin(A, 17, now=0.0)
    assert senders.take(A, 17) and senders.handled[A] == 17, "frame 17 is the sender's first here and handled"


def test_frames_a_known_sender_gave_up_move_its_count_past_them():
    senders = Senders(forget_after_s=60.0, capacity=8)
    senders.begin(A, 1, now=0.0)
    senders.take(A, 1)
    senders.end(A, now=1.0)
    senders.begin(A, 5, now=2.0)  # it gave frames 2-4 up while it could not connect
    assert senders.given_up == 3 and senders.take(A, 5), "the given-up frames are counted; frame 5 is handled"


def test_a_sender_back_within_the_horizon_keeps_its_count():
    senders = Senders(forget_after_s=60.0, capacity=8)
    senders.begin(A, 1, now=0.0)
    senders.take(A, 1)
    senders.end(A, now=1.0)
    senders.begin(B, 1, now=30.0)  # a newcomer trims: A is idle for 29 s only
    senders.begin(A, 1, now=31.0)  # A reconnects and resends its unacknowledged frame 1
    assert not senders.take(A, 1), "frame 1 is not handled a second time"


def test_an_idle_sender_is_forgotten_past_the_horizon_but_a_connected_one_never():
    senders = Senders(forget_after_s=60.0, capacity=8)
    senders.begin(A, 1, now=0.0)
    senders.end(A, now=1.0)
    senders.begin(B, 1, now=2.0)  # B stays connected
    senders.begin(b"c" * 16, 1, now=1000.0)
    assert A not in senders.handled and senders.forgotten == 1, "A, idle for 999 s, is forgotten"
    assert B in senders.handled, "B, connected all along, is kept however old"
    senders.begin(A, 5, now=1001.0)
    assert senders.take(A, 5), "A, back, is taken as a new sender: its first frame starts it"


def test_the_table_holds_at_most_capacity_idle_senders_forgetting_the_oldest():
    senders = Senders(forget_after_s=3600.0, capacity=4)
    ids = [bytes([i]) * 16 for i in range(20)]
    for t, client in enumerate(ids):
        senders.begin(client, 1, now=float(t))
        senders.take(client, 1)
        senders.end(client, now=float(t) + 0.5)
    assert len(senders.handled) == 4, "no more than capacity entries"
    assert list(senders.handled) == ids[-4:], "the ones kept are the most recently active"


def test_a_sender_with_two_connections_is_idle_only_when_both_ended():
    """A reconnect can be accepted before the server noticed its old connection end."""
    senders = Senders(forget_after_s=10.0, capacity=8)
    senders.begin(A, 1, now=0.0)
    senders.begin(A, 1, now=1.0)
    senders.end(A, now=2.0)
    senders.begin(B, 1, now=100.0)
    assert A in senders.handled, "A still has a connection: kept"
    senders.end(A, now=101.0)
    senders.begin(b"c" * 16, 1, now=200.0)
    assert A not in senders.handled, "idle since its last connection ended, past the horizon: forgotten"
