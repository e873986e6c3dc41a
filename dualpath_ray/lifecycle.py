"""Lifecycles as tables: one `Lifecycle` per kind of thing, declared as (state, event) -> state.

Extents, window slots, staged reads, engine jobs and helper pools each have a lifecycle whose
illegal moves are bugs to catch at the move, not later as a freed slot overwritten or a job
handed off twice. Each declares its table once and moves only through `Lifecycle.move`, which
returns the next state or raises the lifecycle's own error (a `TransitionError`) naming the thing,
the event and the state, so a caller can catch one lifecycle's errors without catching another's.

The bottom of the package: it imports nothing of dualpath_ray, so every layer may use it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

State = TypeVar("State", bound=enum.Enum)
Event = TypeVar("Event", bound=enum.Enum)


class TransitionError(RuntimeError):
    """A move its lifecycle forbids (a bug in the caller's ordering, never a user error). Each
    lifecycle raises a subclass of its own."""


@dataclass(frozen=True)
class Lifecycle(Generic[State, Event]):
    """A lifecycle's table of legal moves and the error an illegal one raises.

    `moves` maps (state, event) to the next state; a pair not in it is illegal. `hints` may say,
    per state, what is legal there; the error message carries it.
    """

    moves: Mapping[tuple[State, Event], State]
    error: type[TransitionError]
    hints: Mapping[State, str] = field(default_factory=dict)

    @classmethod
    def of_targets(cls, targets: Mapping[State, Iterable[State]], error: type[TransitionError]) -> Lifecycle[State, State]:
        """A lifecycle whose events are the states to move to: `targets` lists where each state may go."""
        return cls({(state, target): target for state, allowed in targets.items() for target in allowed}, error)

    def move(self, subject: str, current: State, event: Event) -> State:
        """The next state of `subject` (e.g. "extent 3") after `event`, or `error` if illegal."""
        target = self.moves.get((current, event))
        if target is None:
            hint = self.hints.get(current)
            raise self.error(
                f"{subject}: {event.value} is illegal in state {current.name}" + (f" ({hint})" if hint else "")
            )
        return target
