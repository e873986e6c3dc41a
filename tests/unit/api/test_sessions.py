"""Session turn numbering (api/sessions.py) on a fake clock: a conversation idle for
runtime.session_ttl_s is forgotten, one with a turn in flight never is, and the table returns to
its starting size after thousands of short sessions."""

from __future__ import annotations

from dualpath_ray.api.sessions import SessionIds
from tests.unit.scheduling.test_expiry import FakeClock

TTL = 30.0


def test_an_idle_session_is_forgotten_and_numbers_from_t0_again() -> None:
    clock = FakeClock()
    ids = SessionIds(TTL, clock)
    assert ids.next_turn("chat") == "chat/t0"
    ids.turn_ended("chat")
    clock.now = TTL - 1
    assert ids.next_turn("chat") == "chat/t1", "a session used within the ttl keeps its numbering"
    ids.turn_ended("chat")
    clock.now = 2 * TTL
    assert len(ids) == 0, "a session idle for the ttl is forgotten"
    assert ids.next_turn("chat") == "chat/t0", "a forgotten session starts again from t0"


def test_a_session_with_a_turn_in_flight_is_never_forgotten() -> None:
    clock = FakeClock()
    ids = SessionIds(TTL, clock)
    ids.next_turn("long")
    clock.now = 5 * TTL  # a turn longer than the ttl (runtime.request_timeout_s may exceed it)
    ids.next_turn("other")
    assert len(ids) == 2, "the session whose turn is still in flight is kept"
    assert ids.next_turn("long") == "long/t1", "its numbering goes on: a concurrent turn never reuses an id"
    ids.turn_ended("long")
    ids.turn_ended("long")
    clock.now = 6 * TTL - 1
    assert len(ids) == 2, "its idle time runs from its last turn's end"
    clock.now = 7 * TTL
    assert len(ids) == 1, "idle for the ttl since its last turn ended, it is forgotten"
    ids.turn_ended("other")
    clock.now = 9 * TTL
    assert len(ids) == 0 and not ids.active, "nothing is left once every session is idle"


def test_thousands_of_short_sessions_leave_the_table_as_it_started() -> None:
    clock = FakeClock()
    ids = SessionIds(TTL, clock)
    for i in range(5000):
        clock.now = i * 0.001
        ids.next_turn(f"s{i}")
        ids.turn_ended(f"s{i}")
    assert len(ids) == 5000, "every session of the last ttl is remembered"
    clock.now = 5 + TTL
    assert len(ids) == 0 and not ids.turns and len(ids.idle) == 0, "all idle: the table is back to empty"
