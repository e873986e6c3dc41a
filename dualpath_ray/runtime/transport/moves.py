"""What a transport moves and how a caller waits for it: typed errors, regions of registered
pools and their checks, the transport lifecycle (one transition function), `Transfer`, a posted
move to poll or block on, and the stats counters. Shared by the Transport base class (base.py)
and every backend; the checks live here so each backend gets them without repeating them.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol
from dataclasses import dataclass, fields

_SPIN_S = 0.001  # wait() polls without sleeping this long: NIXL moves of <= 4 MiB finish inside it
_FIRST_PAUSE_S = 50e-6
_MAX_PAUSE_S = 1e-3

class TransportError(RuntimeError):
    """A move cannot be done or did not complete; its destination regions are undefined."""


class PeerDiedError(TransportError):
    """The peer endpoint is dead, restarted or unknown: its regions are gone."""


class RegionError(TransportError):
    """A region is outside its pool, sizes differ, the pool is unknown, or a view is unusable."""


@dataclass(frozen=True)
class Region:
    """Bytes [offset, offset + nbytes) of the registered pool `pool` of one endpoint."""

    pool: str
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


Move = tuple[Region, Region]  # (local region, remote region), equal nbytes


@dataclass(frozen=True)
class PoolInfo:
    name: str
    nbytes: int
    device: str  # "cpu" or "cuda:0"


@dataclass(frozen=True)
class EndpointInfo:
    """What a peer needs to address this endpoint; fetched once per peer."""

    endpoint: str
    incarnation: str
    kind: str
    pools: tuple[PoolInfo, ...]
    backend: object


@dataclass(frozen=True)
class TransportStats:
    posted: int = 0  # transfers posted to a peer or copied locally
    descriptors: int = 0  # contiguous moves after coalescing
    bytes_read: int = 0  # bytes of completed reads
    bytes_written: int = 0  # bytes of completed writes
    peer_calls: int = 0  # Ray actor calls this transport issued itself


class StatsCounter:
    """The running TransportStats of one transport: every thread of the endpoint adds to it, so
    increments and snapshots take a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = {f.name: 0 for f in fields(TransportStats)}

    def add(self, **increments: int) -> None:
        with self._lock:
            for name, value in increments.items():
                self._values[name] += value

    def snapshot(self) -> TransportStats:
        with self._lock:
            return TransportStats(**self._values)


@dataclass(frozen=True)
class InfoRequest:
    """Any peer -> endpoint: your EndpointInfo."""


class TransportState(enum.Enum):
    REGISTERING = "registering"  # pools may be registered; no moves until seal()
    AWAITING_WORLD = "awaiting_world"  # gloo only: sealed, no world joined yet
    READY = "ready"
    BROKEN = "broken"  # gloo only: the world is unusable until setup_gloo_world runs again
    CLOSED = "closed"


_TRANSITIONS: dict[TransportState, frozenset[TransportState]] = {
    TransportState.REGISTERING: frozenset(
        {TransportState.AWAITING_WORLD, TransportState.READY, TransportState.CLOSED}
    ),
    TransportState.AWAITING_WORLD: frozenset({TransportState.READY, TransportState.CLOSED}),
    TransportState.READY: frozenset({TransportState.READY, TransportState.BROKEN, TransportState.CLOSED}),
    TransportState.BROKEN: frozenset({TransportState.READY, TransportState.CLOSED}),
    TransportState.CLOSED: frozenset(),
}


def next_state(current: TransportState, target: TransportState) -> TransportState:
    """The one transition function of a transport's lifecycle; rejects illegal moves."""
    if target not in _TRANSITIONS[current]:
        raise TransportError(f"transport cannot go from {current.value} to {target.value}")
    return target


def check_region(region: object, pools: Mapping[str, PoolInfo], owner: str, where: str) -> Region:
    """`region` must lie inside one of `owner`'s pools; messages name the field and the fix."""
    if not isinstance(region, Region):
        raise RegionError(f"{where} is {type(region).__name__}, not a Region; build it with region_of(pool, view)")
    pool = pools.get(region.pool)
    if pool is None:
        raise RegionError(f"{where}.pool {region.pool!r} is not a pool of {owner}; its pools are {sorted(pools)}")
    if not isinstance(region.offset, int) or region.offset < 0:
        raise RegionError(f"{where}.offset is {region.offset!r}; it must be an int >= 0")
    if not isinstance(region.nbytes, int) or region.nbytes <= 0:
        raise RegionError(f"{where}.nbytes is {region.nbytes!r}; it must be an int > 0")
    if region.end > pool.nbytes:
        raise RegionError(
            f"{where} ends at byte {region.end}, past the end of {owner}'s pool {pool.name!r} "
            f"({pool.nbytes} bytes); shrink nbytes or fix the offset"
        )
    return region


def check_moves(moves: object, where: str) -> list[Move]:
    """A non-empty sequence of (local, remote) Region pairs of equal size."""
    if not isinstance(moves, Sequence) or isinstance(moves, (str, bytes)) or not moves:
        raise RegionError(f"{where}: moves must be a non-empty list of (local, remote) Region pairs")
    checked: list[Move] = []
    for index, move in enumerate(moves):
        if not isinstance(move, tuple) or len(move) != 2:
            raise RegionError(f"{where}: moves[{index}] must be a (local Region, remote Region) tuple")
        local, remote = move
        if isinstance(local, Region) and isinstance(remote, Region) and local.nbytes != remote.nbytes:
            raise RegionError(
                f"{where}: moves[{index}] local nbytes {local.nbytes} != remote nbytes {remote.nbytes}; "
                "a move copies equal byte counts"
            )
        checked.append((local, remote))
    return checked


def coalesce_moves(moves: Sequence[Move]) -> list[Move]:
    """Merge each move into the previous one when both sides continue it, keeping list order.

    A run of blocks in consecutive slots then costs one descriptor / one gloo message."""
    merged: list[Move] = []
    for local, remote in moves:
        if merged:
            last_local, last_remote = merged[-1]
            if (
                local.pool == last_local.pool
                and remote.pool == last_remote.pool
                and local.offset == last_local.end
                and remote.offset == last_remote.end
            ):
                nbytes = last_local.nbytes + local.nbytes
                merged[-1] = (
                    Region(local.pool, last_local.offset, nbytes),
                    Region(remote.pool, last_remote.offset, nbytes),
                )
                continue
        merged.append((local, remote))
    return merged


class Transfer:
    """One posted move (read or write) of a list of regions. Thread-safe to poll.

    The outcome is sticky: once done() returned True it stays True, once it raised every later
    call raises the same error. A transfer still running at its deadline (posted + the
    transport's timeout_s) or when wait(timeout_s) expires is aborted, then fails."""

    def __init__(
        self, op: str, peer: str, nbytes: int, deadline: float, on_done: Callable[[Transfer], None]
    ) -> None:
        self.op = op
        self.peer = peer
        self.nbytes = nbytes
        self._deadline = deadline
        self._on_done = on_done
        self._lock = threading.Lock()
        self._finished = False
        self._error: TransportError | None = None

    def done(self) -> bool:
        """Polls the backend once; True once every byte landed; raises TransportError on failure."""
        with self._lock:
            return self._advance(None)

    def wait(self, timeout_s: float | None = None) -> int:
        """Blocks (spins briefly, then short sleeps) until done; returns nbytes; raises on failure.

        timeout_s=None waits up to the transfer's deadline."""
        start = time.monotonic()
        limit = math.inf if timeout_s is None else start + timeout_s
        pause = _FIRST_PAUSE_S
        while True:
            now = time.monotonic()
            with self._lock:
                if self._advance(f"wait({timeout_s}) expired" if now >= limit else None):
                    return self.nbytes
            if now - start >= _SPIN_S:
                time.sleep(pause)
                pause = min(2 * pause, _MAX_PAUSE_S)

    def _advance(self, give_up: str | None) -> bool:
        if self._finished:
            return True
        if self._error is not None:
            raise self._error
        try:
            if self._poll():
                self._finished = True
                self._on_done(self)
                return True
            if give_up is None and time.monotonic() >= self._deadline:
                give_up = "did not complete before the transport timeout"
            if give_up is not None:
                raise self._abort(give_up)
        except TransportError as exc:
            self._error = exc
            raise
        return False

    # ---- backend hooks -----------------------------------------------------------------
    def _poll(self) -> bool:
        """Advance the backend once; True when complete; raise TransportError on failure."""
        return True

    def _abort(self, reason: str) -> TransportError:
        """Give up: after this returns no byte of this transfer may land; the error to raise."""
        return TransportError(f"{self.op} with {self.peer}: {reason}")


class Waitable(Protocol):
    """What `end_all` waits on: a Transfer, or an engine port's Pending."""

    def wait(self, timeout_s: float | None = None) -> object: ...


def end_all(posted: Iterable[Waitable], timeout_s: float) -> None:
    """After a failure: let every posted transfer end, either way, before the memory it reads or
    writes is reused (a window slot, pages vLLM hands to another request). Their own errors are
    dropped: what failed has failed already; only the ending matters."""
    for transfer in posted:
        try:
            transfer.wait(timeout_s)
        except Exception:  # noqa: BLE001 - see the docstring
            pass
