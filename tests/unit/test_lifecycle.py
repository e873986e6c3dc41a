"""The lifecycle helper (dualpath_ray/lifecycle.py) and the tables declared for it: a legal move
returns the table's state, an illegal one raises the lifecycle's own error naming the subject,
the event and the state."""

from __future__ import annotations

import enum

import pytest

from dualpath_ray.kv.paged import PAGE_OWNER_LIFECYCLE, PageEvent, PageOwnerState, PageTransitionError
from dualpath_ray.kv.pool import EXTENT_LIFECYCLE, ExtentTransitionError
from dualpath_ray.kv.read_helpers import HELPER_LIFECYCLE, HelperTransitionError
from dualpath_ray.kv.staged import STAGE_LIFECYCLE, StageTransitionError
from dualpath_ray.kv.window import SLOT_LIFECYCLE, SlotTransitionError
from dualpath_ray.lifecycle import Lifecycle, TransitionError
from dualpath_ray.runtime.decode.job import DECODE_LIFECYCLE, DecodeState, DecodeTransitionError
from dualpath_ray.runtime.prefill.job import PREFILL_LIFECYCLE, PrefillTransitionError


class Door(enum.Enum):
    SHUT = "shut"
    OPEN = "open"


class Push(enum.Enum):
    OPEN = "open"
    CLOSE = "close"


class DoorError(TransitionError):
    pass


DOOR = Lifecycle({(Door.SHUT, Push.OPEN): Door.OPEN, (Door.OPEN, Push.CLOSE): Door.SHUT}, DoorError,
                 hints={Door.OPEN: "only close it"})


def test_a_legal_move_returns_the_tables_state():
    assert DOOR.move("door 1", Door.SHUT, Push.OPEN) is Door.OPEN, "the table's next state"
    assert DOOR.move("door 1", Door.OPEN, Push.CLOSE) is Door.SHUT, "and back"


def test_an_illegal_move_raises_the_lifecycles_own_error_naming_subject_event_and_state():
    with pytest.raises(DoorError, match=r"^door 1: open is illegal in state OPEN \(only close it\)$"):
        DOOR.move("door 1", Door.OPEN, Push.OPEN)
    with pytest.raises(DoorError, match=r"^door 2: close is illegal in state SHUT$"):
        DOOR.move("door 2", Door.SHUT, Push.CLOSE)


def test_a_target_table_moves_to_the_listed_states_only():
    doors = Lifecycle.of_targets({Door.SHUT: {Door.OPEN}, Door.OPEN: set()}, DoorError)
    assert doors.move("d", Door.SHUT, Door.OPEN) is Door.OPEN, "a listed target is the next state"
    with pytest.raises(DoorError, match="shut is illegal in state OPEN"):
        doors.move("d", Door.OPEN, Door.SHUT)


@pytest.mark.parametrize("lifecycle, error", [
    (EXTENT_LIFECYCLE, ExtentTransitionError), (SLOT_LIFECYCLE, SlotTransitionError),
    (HELPER_LIFECYCLE, HelperTransitionError), (STAGE_LIFECYCLE, StageTransitionError),
    (PAGE_OWNER_LIFECYCLE, PageTransitionError), (PREFILL_LIFECYCLE, PrefillTransitionError),
    (DECODE_LIFECYCLE, DecodeTransitionError),
])
def test_every_declared_lifecycle_raises_its_own_error(lifecycle, error):
    assert lifecycle.error is error and issubclass(error, TransitionError), (
        "each lifecycle raises its own TransitionError subclass, so callers catch one without another"
    )
    states = {state for state, _ in lifecycle.moves} | set(lifecycle.moves.values())
    assert all(isinstance(s, enum.Enum) for s in states), "states are enum members"


def test_the_page_pool_and_decode_job_tables_refuse_what_they_did_before():
    with pytest.raises(PageTransitionError, match="request r: allocate is illegal in state UNKNOWN"):
        PAGE_OWNER_LIFECYCLE.move("request r", PageOwnerState.UNKNOWN, PageEvent.ALLOCATE)
    with pytest.raises(DecodeTransitionError, match="request r: running is illegal in state DONE"):
        DECODE_LIFECYCLE.move("request r", DecodeState.DONE, DecodeState.RUNNING)
