"""The host staging buffer of one node (paper: PE buffer / DE buffer), in Full Block slots.

One uint8 tensor [capacity, n_layer, block_size, bytes_per_token_per_layer], allocated once and
pinned where CUDA exists (kv/host_memory.py), so H2D/D2H and RDMA can use it directly. A request leases an extent: a set
of slots, not necessarily contiguous, one per Full Block it needs. Storage reads fill whole
slots; layer-by-layer movement uses Layer Block views of them. Nothing is copied to convert.

An extent's lifecycle is FREE -> LEASED -> (IN_FLIGHT -> LEASED)* -> FREE, and every move goes
through `transition`, so an extent cannot be released while a transfer still writes into it,
nor a transfer begun on slots that were handed back. A transfer is anything that reads into or
out of the slots: a store read filling them, a store write or a D2H pull using them.

An owner that is done with an extent whatever it is doing (its engine died and the extent is
reclaimed; its engine freed it while a read still fills it) retires it: a LEASED extent is
free at once; an IN_FLIGHT one becomes RETIRING, takes no new transfer, and its slots return
to the free list only when the transfer ends (IN_FLIGHT -> RETIRING -> FREE). A slot is free only
when nothing reads into or out of it; the transfer learns it was retired (`state_of`) and may
stop early, at its next block.
"""

from __future__ import annotations

import enum
import itertools
import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch

from dualpath_ray.kv.direct_io import ALIGNMENT
from dualpath_ray.kv.host_memory import allocate_host_buffer
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.lifecycle import Lifecycle, TransitionError


class ExtentState(enum.Enum):
    FREE = "free"
    LEASED = "leased"
    IN_FLIGHT = "in_flight"
    RETIRING = "retiring"  # retired during a transfer: free when that transfer ends


class ExtentEvent(enum.Enum):
    LEASE = "lease"
    BEGIN_TRANSFER = "begin_transfer"
    END_TRANSFER = "end_transfer"
    RELEASE = "release"
    RETIRE = "retire"


class ExtentTransitionError(TransitionError):
    """An extent was asked to make a move its lifecycle forbids."""


EXTENT_LIFECYCLE = Lifecycle(
    moves={
        (ExtentState.FREE, ExtentEvent.LEASE): ExtentState.LEASED,
        (ExtentState.LEASED, ExtentEvent.BEGIN_TRANSFER): ExtentState.IN_FLIGHT,
        (ExtentState.IN_FLIGHT, ExtentEvent.END_TRANSFER): ExtentState.LEASED,
        (ExtentState.LEASED, ExtentEvent.RELEASE): ExtentState.FREE,
        (ExtentState.LEASED, ExtentEvent.RETIRE): ExtentState.FREE,
        (ExtentState.IN_FLIGHT, ExtentEvent.RETIRE): ExtentState.RETIRING,
        (ExtentState.RETIRING, ExtentEvent.END_TRANSFER): ExtentState.FREE,
    },
    error=ExtentTransitionError,
    hints={
        ExtentState.FREE: "the extent is not leased (never leased, or already released)",
        ExtentState.LEASED: "the extent is leased with no transfer in flight",
        ExtentState.IN_FLIGHT: "a transfer is in flight: end_transfer first (one transfer at a time)",
        ExtentState.RETIRING: "it was retired during a transfer: only that transfer's end_transfer (which frees it)",
    },
)


class PoolIntegrityError(RuntimeError):
    """The pool's slot accounting is inconsistent (a bug, never a user error)."""


def transition(extent_id: int, current: ExtentState, event: ExtentEvent) -> ExtentState:
    """The one place extent moves are decided: the next state, or ExtentTransitionError."""
    return EXTENT_LIFECYCLE.move(f"extent {extent_id}", current, event)


@dataclass(frozen=True)
class Extent:
    """Slots of the pool leased to one owner, in block order."""

    extent_id: int
    owner: str
    slots: tuple[int, ...]

    @property
    def n_blocks(self) -> int:
        return len(self.slots)


class PoolCounts(NamedTuple):
    """Slots by state; free + leased + in_flight == capacity always. `retiring` counts the
    in_flight slots already retired (free once their transfer ends): they are not free."""

    free: int
    leased: int
    in_flight: int
    capacity: int
    retiring: int = 0


@dataclass
class _Lease:
    extent: Extent
    state: ExtentState


class BufferPool:
    """Full Block slots of one node's staging buffer, leased out as extents."""

    def __init__(self, capacity_blocks: int, layout: KVLayout, pin: bool = True) -> None:
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be an int >= 1, got {capacity_blocks!r}")
        self.layout = layout
        self.capacity = capacity_blocks
        self.buffer, self.pinning = allocate_host_buffer(
            (capacity_blocks, *layout.full_block_shape), pin, alignment=ALIGNMENT
        )
        self.pinned = self.pinning.pinned  # reported by the node's reader (dualpath status)
        self._lock = threading.Lock()
        self._free: list[int] = list(reversed(range(capacity_blocks)))
        self._leases: dict[int, _Lease] = {}
        self._ids = itertools.count()

    @property
    def nbytes(self) -> int:
        return self.capacity * self.layout.full_block_bytes

    def free_blocks(self) -> int:
        """Slots free right now (a lease of more waits; staging cancels to cover the rest)."""
        with self._lock:
            return len(self._free)

    def lease(self, owner: str, n_blocks: int) -> Extent | None:
        """Lease `n_blocks` slots to `owner`; None while fewer slots are free."""
        if not isinstance(owner, str) or not owner:
            raise ValueError(f"owner must be a non-empty string, got {owner!r}")
        if isinstance(n_blocks, bool) or not isinstance(n_blocks, int) or n_blocks < 1:
            raise ValueError(f"n_blocks must be an int >= 1, got {n_blocks!r}")
        if n_blocks > self.capacity:
            raise ValueError(
                f"n_blocks {n_blocks} exceeds the pool capacity {self.capacity}: it could never "
                "be leased; raise cluster.buffer_blocks_per_node or split the request"
            )
        with self._lock:
            if n_blocks > len(self._free):
                return None
            slots = tuple(self._free.pop() for _ in range(n_blocks))
            extent = Extent(next(self._ids), owner, slots)
            state = transition(extent.extent_id, ExtentState.FREE, ExtentEvent.LEASE)
            self._leases[extent.extent_id] = _Lease(extent, state)
            return extent

    def grow(self, extent_id: int, n_blocks: int) -> Extent | None:
        """Append `n_blocks` free slots to a LEASED extent, keeping block order (its old slots,
        then the new ones: a block's position in the extent never moves, so bytes already read
        into it stay where their grant says); None while fewer slots are free. The extent keeps
        its id: a grant of it names the grown extent."""
        if isinstance(n_blocks, bool) or not isinstance(n_blocks, int) or n_blocks < 0:
            raise ValueError(f"n_blocks must be an int >= 0, got {n_blocks!r}")
        with self._lock:
            lease = self._live_lease(extent_id)
            if lease.extent.n_blocks + n_blocks > self.capacity:
                raise ValueError(
                    f"extent {extent_id} of {lease.extent.n_blocks} blocks cannot grow by {n_blocks}: "
                    f"that exceeds the pool capacity {self.capacity}"
                )
            if n_blocks > len(self._free):
                return None
            added = tuple(self._free.pop() for _ in range(n_blocks))
            lease.extent = Extent(extent_id, lease.extent.owner, lease.extent.slots + added)
            return lease.extent

    def adopt(self, extent_id: int, owner: str) -> Extent:
        """A LEASED extent changes owner (a staged extent handed to the request that claims it):
        same id, same slots, so nothing is copied."""
        if not isinstance(owner, str) or not owner:
            raise ValueError(f"owner must be a non-empty string, got {owner!r}")
        with self._lock:
            lease = self._live_lease(extent_id)
            lease.extent = Extent(extent_id, owner, lease.extent.slots)
            return lease.extent

    def begin_transfer(self, extent_id: int) -> None:
        """Mark the extent as the target or source of a transfer in progress."""
        self._move(extent_id, ExtentEvent.BEGIN_TRANSFER)

    def end_transfer(self, extent_id: int) -> bool:
        """The transfer ended: LEASED again (False), or freed if it was retired meanwhile (True)."""
        return self._move(extent_id, ExtentEvent.END_TRANSFER) is ExtentState.FREE

    def release(self, extent_id: int) -> None:
        """Give the extent's slots back; illegal while a transfer is in flight."""
        self._move(extent_id, ExtentEvent.RELEASE)

    def retire(self, extent_id: int) -> bool:
        """The owner is done with the extent: free now if LEASED (True), else RETIRING, freed by
        the end_transfer of the transfer in flight (False)."""
        return self._move(extent_id, ExtentEvent.RETIRE) is ExtentState.FREE

    def state_of(self, extent_id: int) -> ExtentState:
        with self._lock:
            lease = self._leases.get(extent_id)
            return ExtentState.FREE if lease is None else lease.state

    def extent(self, extent_id: int) -> Extent:
        """The live extent with this id; KeyError if it is not leased."""
        with self._lock:
            lease = self._leases.get(extent_id)
        if lease is None:
            raise KeyError(f"extent {extent_id} is not leased (never leased or already released)")
        return lease.extent

    def full_block(self, slot: int) -> torch.Tensor:
        """Slot `slot` as a Full Block [n_layer, block_size, bytes] view of the buffer."""
        if not 0 <= slot < self.capacity:
            raise IndexError(f"slot {slot} outside [0, {self.capacity})")
        return self.buffer[slot]

    def full_blocks(self, extent: Extent | int) -> list[torch.Tensor]:
        """The extent's Full Block views, in block order."""
        return [self.buffer[slot] for slot in self._live(extent).slots]

    def holders(self) -> dict[str, int]:
        """Owner -> blocks it holds (leased or in a transfer): who to blame for a pool not free."""
        with self._lock:
            held: dict[str, int] = {}
            for lease in self._leases.values():
                held[lease.extent.owner] = held.get(lease.extent.owner, 0) + lease.extent.n_blocks
            return held

    def check_integrity(self) -> PoolCounts:
        """Count every slot's state; raise PoolIntegrityError if any slot is lost or shared."""
        with self._lock:
            holder: list[str | None] = [None] * self.capacity
            for slot in self._free:
                self._claim(holder, slot, "the free list")
            counts = {ExtentState.LEASED: 0, ExtentState.IN_FLIGHT: 0, ExtentState.RETIRING: 0}
            for extent_id, lease in self._leases.items():
                for slot in lease.extent.slots:
                    self._claim(holder, slot, f"extent {extent_id}")
                counts[lease.state] += lease.extent.n_blocks
            retiring = counts[ExtentState.RETIRING]
            result = PoolCounts(
                len(self._free), counts[ExtentState.LEASED], counts[ExtentState.IN_FLIGHT] + retiring,
                self.capacity, retiring,
            )
        if result.free + result.leased + result.in_flight != self.capacity:
            lost = [slot for slot, who in enumerate(holder) if who is None]
            raise PoolIntegrityError(f"slots {lost[:10]} are neither free nor leased ({result})")
        return result

    def _claim(self, holder: list[str | None], slot: int, who: str) -> None:
        if not 0 <= slot < self.capacity:
            raise PoolIntegrityError(f"{who} holds slot {slot} outside [0, {self.capacity})")
        if holder[slot] is not None:
            raise PoolIntegrityError(f"slot {slot} is held by both {holder[slot]} and {who}")
        holder[slot] = who

    def _live(self, extent: Extent | int) -> Extent:
        extent_id = extent if isinstance(extent, int) else extent.extent_id
        live = self.extent(extent_id)
        if isinstance(extent, Extent) and extent != live:
            raise ValueError(f"extent {extent} does not match the pool's extent {live}")
        return live

    def _live_lease(self, extent_id: int) -> _Lease:
        """The lease of a LEASED extent (caller holds the lock). Growing or re-owning one in a
        transfer would change slots or owner under a transfer that addresses them: refused."""
        lease = self._leases.get(extent_id)
        current = ExtentState.FREE if lease is None else lease.state
        if lease is None or current is not ExtentState.LEASED:
            raise ExtentTransitionError(
                f"extent {extent_id}: only a LEASED extent can grow or change owner, it is {current.name} "
                f"({EXTENT_LIFECYCLE.hints[current]})"
            )
        return lease

    def _move(self, extent_id: int, event: ExtentEvent) -> ExtentState:
        with self._lock:
            lease = self._leases.get(extent_id)
            current = ExtentState.FREE if lease is None else lease.state
            target = transition(extent_id, current, event)
            # Only LEASE leaves FREE, and lease() applies it, so here `lease` is never None.
            assert lease is not None
            if target is ExtentState.FREE:
                del self._leases[extent_id]
                self._free.extend(reversed(lease.extent.slots))
            else:
                lease.state = target
            return target
