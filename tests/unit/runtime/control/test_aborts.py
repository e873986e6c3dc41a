"""Abort marks (runtime/control/aborts.py) on a fake clock: a trajectory's mark refuses its later
turns until cleared or until it has refused none for runtime.session_ttl_s, so marks of
trajectories that never come back do not pile up."""

from __future__ import annotations

from dualpath_ray.runtime.control.aborts import Aborts
from tests.unit.scheduling.test_expiry import FakeClock

TTL = 60.0


def test_a_mark_refuses_later_turns_and_expires_once_idle() -> None:
    clock = FakeClock()
    aborts = Aborts(TTL, clock)
    assert aborts.start("traj7/t0"), "a turn of a trajectory not aborted runs"
    assert aborts.abort_prefix("traj7/") == ["traj7/t0"], "the turn in flight is returned to abort now"
    aborts.end("traj7/t0")
    clock.now = 30.0
    assert not aborts.start("traj7/t1"), "a later turn of the aborted trajectory is refused"
    clock.now = 30.0 + TTL - 1
    assert not aborts.start("traj7/t2"), "each refusal keeps the mark another ttl"
    assert aborts.marks() == 1
    clock.now = 30.0 + 2 * TTL
    assert aborts.marks() == 0, "a mark that refused nothing for ttl is forgotten"
    assert aborts.start("traj7/t3"), "once forgotten, the trajectory runs again (as after clear_aborts)"
    aborts.end("traj7/t3")
    assert not aborts.running, "nothing of the turns is left running"


def test_thousands_of_marks_are_forgotten_and_looked_up_by_prefix() -> None:
    clock = FakeClock()
    aborts = Aborts(TTL, clock)
    for i in range(5000):
        aborts.abort_prefix(f"session{i}/")
    assert aborts.marks() == 5000
    assert not aborts.start("session4321/t9"), "with more marks than characters in an id, the lookup is by prefix"
    assert aborts.start("session50000/t0") and aborts.start("other/t0"), "an id no mark prefixes runs"
    clock.now = TTL / 2
    assert not aborts.start("session4321/t10"), "its mark refuses again (and so is kept)"
    aborts.abort_prefix("late/")
    clock.now = TTL
    assert aborts.marks() == 2, "the marks idle for ttl are gone; the one refusing at ttl/2 and the late one stay"
    clock.now = 2 * TTL
    assert aborts.marks() == 0, "the table returns to its starting size"


def test_clear_forgets_marks_at_once() -> None:
    aborts = Aborts(TTL, FakeClock())
    aborts.abort_prefix("a/")
    aborts.abort_prefix("b/")
    aborts.clear(["a/"])
    assert aborts.start("a/t0") and not aborts.start("b/t0"), "only the cleared trajectory runs again"
    aborts.clear()
    assert aborts.marks() == 0 and aborts.start("b/t1"), "clear() forgets every mark"
