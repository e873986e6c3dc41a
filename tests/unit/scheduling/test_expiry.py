"""Idle expiry (scheduling/expiry.py) on a fake clock: a key unused for ttl_s is forgotten, a use
keeps it another ttl_s, and a sweep stops at the first fresh key."""

from __future__ import annotations

import pytest

from dualpath_ray.scheduling.expiry import IdleExpiry


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_keys_idle_for_the_ttl_are_forgotten_oldest_first() -> None:
    clock = FakeClock()
    keys = IdleExpiry(10.0, clock)
    keys.touch("a")
    clock.now = 4.0
    keys.touch("b")
    clock.now = 9.9
    assert keys.sweep() == [] and len(keys) == 2, "nothing is forgotten before ttl_s of idleness"
    clock.now = 10.0
    assert keys.sweep() == ["a"] and "b" in keys, "a key idle for ttl_s is forgotten, a younger one kept"
    clock.now = 14.0
    assert keys.sweep() == ["b"] and len(keys) == 0, "every key goes once idle for ttl_s"


def test_a_use_keeps_a_key_another_ttl() -> None:
    clock = FakeClock()
    keys = IdleExpiry(10.0, clock)
    keys.touch("a")
    keys.touch("b")
    clock.now = 8.0
    keys.touch("a")
    clock.now = 12.0
    assert keys.sweep() == ["b"] and list(keys) == ["a"], "the key used at 8 s lives until 18 s"
    keys.discard("a")
    assert len(keys) == 0, "a discarded key is gone at once"


def test_a_ttl_that_is_not_positive_is_an_error_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="runtime.session_ttl_s"):
        IdleExpiry(0.0, FakeClock())
