"""A node's table of staged extents (tool-time staging, scheduling/staging.py), by stage_id: the
rules a reader applies to them, shared by the runtime's reader (runtime/reader/stager.py) and the
simulator's (sim/staged.py), so the two cannot drift apart.

A `StageOrder` makes the reader lease an extent under the order's `stage_id` and read the
order's keys into it behind every real read; the entry here tracks that extent until a next turn
claims it, its time is up, buffer pressure cancels it, or its read fails:

    READING --read_done--> HELD --claim--> CLAIMED
    READING --promote--> PROMOTED --read_done--> CLAIMED       (a claim arrived mid-read)
    READING | HELD --expire--> EXPIRED
    READING | HELD --cancel--> CANCELLED                       (buffer pressure)
    READING | PROMOTED --fail--> FAILED                        (a store read failed)

Every move goes through `transition` (the table `STAGE_LIFECYCLE`). An order is refused (skipped)
when it has no blocks, its stage_id is live already, or its blocks would take the staging past
its cap (`StagedTable.refuses`); under buffer pressure the oldest unclaimed entries go first
(`StagedTable.victims`). Who frees the extent: while READING or PROMOTED the thread
reading it owns it (an EXPIRED or CANCELLED entry it still reads is freed by that thread at its
next block); a HELD one is freed by whoever ends it; a CLAIMED one belongs to its claimant. A
PROMOTED entry is neither expired nor cancelled: a claimant is waiting for it.

Pure bookkeeping, no lock and no clock of its own: the reader core guards the table with its
lock and passes `now` (time.monotonic on the actor, the event loop's clock in the simulator) to
every call that needs a time.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from dualpath_ray.lifecycle import Lifecycle, TransitionError


class StageState(enum.Enum):
    READING = "reading"
    PROMOTED = "promoted"
    HELD = "held"
    CLAIMED = "claimed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    FAILED = "failed"


class StageEvent(enum.Enum):
    READ_DONE = "read_done"
    PROMOTE = "promote"
    CLAIM = "claim"
    EXPIRE = "expire"
    CANCEL = "cancel"
    FAIL = "fail"


class StageTransitionError(TransitionError):
    """A staged extent was asked to make a move its lifecycle forbids."""


STAGE_LIFECYCLE = Lifecycle(
    moves={
        (StageState.READING, StageEvent.READ_DONE): StageState.HELD,
        (StageState.READING, StageEvent.PROMOTE): StageState.PROMOTED,
        (StageState.PROMOTED, StageEvent.READ_DONE): StageState.CLAIMED,
        (StageState.HELD, StageEvent.CLAIM): StageState.CLAIMED,
        (StageState.READING, StageEvent.EXPIRE): StageState.EXPIRED,
        (StageState.HELD, StageEvent.EXPIRE): StageState.EXPIRED,
        (StageState.READING, StageEvent.CANCEL): StageState.CANCELLED,
        (StageState.HELD, StageEvent.CANCEL): StageState.CANCELLED,
        (StageState.READING, StageEvent.FAIL): StageState.FAILED,
        (StageState.PROMOTED, StageEvent.FAIL): StageState.FAILED,
    },
    error=StageTransitionError,
)
LIVE = frozenset({StageState.READING, StageState.PROMOTED, StageState.HELD})
# Entries a claim may take, and those buffer pressure or expiry may end.
CLAIMABLE = frozenset({StageState.READING, StageState.HELD})
ENDABLE = CLAIMABLE


def transition(stage_id: str, current: StageState, event: StageEvent) -> StageState:
    """The one place staged-extent moves are decided: the next state, or StageTransitionError."""
    return STAGE_LIFECYCLE.move(f"staged extent {stage_id}", current, event)


@dataclass
class StagedExtent:
    """One order's extent. `read` counts its blocks already in the buffer (a prefix of keys)."""

    stage_id: str
    keys: tuple[str, ...]
    extent_id: int
    deadline: float  # receipt time + ttl_s, on the reader's clock
    state: StageState = StageState.READING
    read: int = 0

    @property
    def blocks(self) -> int:
        return len(self.keys)


@dataclass
class StagingCounts:
    """Blocks by what became of them (exported as dualpath_staged_blocks, label outcome):
    staged: read into the buffer ahead; used: claimed by a next turn; expired: freed unclaimed at
    their deadline; cancelled: freed for a real lease (buffer pressure); skipped: of orders
    refused (no room under the cap, a duplicate stage_id, no keys); failed: of orders whose store
    read failed; missed: of claims that found no usable entry and read them again."""

    staged: int = 0
    used: int = 0
    expired: int = 0
    cancelled: int = 0
    skipped: int = 0
    failed: int = 0
    missed: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


@dataclass
class StagedTable:
    """The live staged extents, in order of receipt (dict order: oldest first), and the blocks
    the staging holds in the buffer (live entries plus ended ones whose reader has not yet freed
    them), which the cap bounds."""

    counts: StagingCounts = field(default_factory=StagingCounts)
    held_blocks: int = 0
    _live: dict[str, StagedExtent] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._live)

    def get(self, stage_id: str) -> StagedExtent | None:
        return self._live.get(stage_id)

    def refuses(self, stage_id: str, blocks: int, cap_blocks: int) -> bool:
        """Whether an order is skipped rather than leased: no blocks, its stage_id live already (the
        live entry holds those blocks and keeps its deadline), or the staging would pass its cap."""
        return blocks == 0 or stage_id in self._live or self.held_blocks + blocks > cap_blocks

    def add(self, entry: StagedExtent) -> None:
        if entry.stage_id in self._live:
            raise StageTransitionError(f"staged extent {entry.stage_id} is already live")
        self._live[entry.stage_id] = entry
        self.held_blocks += entry.blocks

    def move(self, entry: StagedExtent, event: StageEvent) -> StageState:
        """Apply `event` to the entry; one that leaves LIVE leaves the table (its stage_id may be
        ordered again) and is counted by its outcome."""
        entry.state = transition(entry.stage_id, entry.state, event)
        if entry.state not in LIVE:
            if self._live.get(entry.stage_id) is entry:
                del self._live[entry.stage_id]
            self._count_end(entry)
        return entry.state

    def released(self, entry: StagedExtent) -> None:
        """The entry's extent left the staging (freed, or adopted by its claimant)."""
        self.held_blocks -= entry.blocks
        if self.held_blocks < 0:
            raise StageTransitionError(f"staged blocks went negative releasing {entry.stage_id}")

    def due(self, now: float) -> list[StagedExtent]:
        """Entries that may expire now (deadline passed; a PROMOTED one is claimed, never due)."""
        return [e for e in self._live.values() if e.deadline <= now and e.state in ENDABLE]

    def next_deadline(self) -> float | None:
        """The earliest deadline of an entry that can still expire; None when there is none."""
        deadlines = [e.deadline for e in self._live.values() if e.state in ENDABLE]
        return min(deadlines) if deadlines else None

    def victims(self, shortfall: int) -> list[StagedExtent]:
        """Oldest unclaimed entries whose blocks cover `shortfall` (all of them if they cannot).
        Blocks of ended entries their readers have yet to free count as covering it already: a
        lease woken before they are freed must not cancel more than it needs."""
        chosen: list[StagedExtent] = []
        covered = self.held_blocks - sum(e.blocks for e in self._live.values())
        for entry in self._live.values():
            if covered >= shortfall:
                break
            if entry.state in ENDABLE:
                chosen.append(entry)
                covered += entry.blocks
        return chosen

    def _count_end(self, entry: StagedExtent) -> None:
        if entry.state is StageState.CLAIMED:
            self.counts.used += entry.blocks
        elif entry.state is StageState.EXPIRED:
            self.counts.expired += entry.blocks
        elif entry.state is StageState.CANCELLED:
            self.counts.cancelled += entry.blocks
        elif entry.state is StageState.FAILED:
            self.counts.failed += entry.blocks
