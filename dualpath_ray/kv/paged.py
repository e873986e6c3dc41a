"""A decode engine's KV memory ("HBM"): a preallocated pool of pages with per-request tables.

One tensor [n_pages, n_layer, block_size, bytes_per_token_per_layer] uint8 on the engine's device:
a page has exactly the Full Block layout, so the prompt's KV arrives from a buffer extent one Full
Block per page, and a page that has filled up is persisted as it is. A request first reserves
the pages its prompt and output can ever need (when the scheduler places it), then allocates them
as its KV grows; its block table lists its pages in token order.

A request's lifecycle in the pool is RESERVED -> ACTIVE -> released, and every move goes through
`transition`, so pages are never allocated beyond a reservation nor handed out twice.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.lifecycle import Lifecycle, TransitionError


class PageOwnerState(enum.Enum):
    UNKNOWN = "unknown"  # the pool holds no reservation of it (never made, or released)
    RESERVED = "reserved"
    ACTIVE = "active"
    RELEASED = "released"


class PageEvent(enum.Enum):
    RESERVE = "reserve"
    ALLOCATE = "allocate"
    RELEASE = "release"


class PageTransitionError(TransitionError):
    """A request asked the page pool for a move its lifecycle forbids."""


PAGE_OWNER_LIFECYCLE = Lifecycle(
    moves={
        (PageOwnerState.UNKNOWN, PageEvent.RESERVE): PageOwnerState.RESERVED,
        (PageOwnerState.RESERVED, PageEvent.ALLOCATE): PageOwnerState.ACTIVE,
        (PageOwnerState.ACTIVE, PageEvent.ALLOCATE): PageOwnerState.ACTIVE,
        (PageOwnerState.RESERVED, PageEvent.RELEASE): PageOwnerState.RELEASED,
        (PageOwnerState.ACTIVE, PageEvent.RELEASE): PageOwnerState.RELEASED,
    },
    error=PageTransitionError,
)


class PagePoolFullError(RuntimeError):
    """A reservation does not fit in the pages nobody has reserved."""


class PageIntegrityError(RuntimeError):
    """The page accounting is inconsistent (a bug, never a user error)."""


def transition(owner: str, current: PageOwnerState, event: PageEvent) -> PageOwnerState:
    """The one place page-owner moves are decided: the next state, or PageTransitionError."""
    return PAGE_OWNER_LIFECYCLE.move(f"request {owner}", current, event)


class PageCounts(NamedTuple):
    """free + allocated == capacity; reserved >= allocated (reserved counts allocated pages too)."""

    free: int
    allocated: int
    reserved: int
    capacity: int


@dataclass
class _Owner:
    reserved: int
    state: PageOwnerState
    pages: list[int] = field(default_factory=list)


class PagedKVPool:
    """Pages of Full Block layout, reserved and allocated per request."""

    def __init__(self, n_pages: int, layout: KVLayout, device: str | torch.device = "cpu", storage: bool = True) -> None:
        """`storage` False: the books only (reservations, tables), no page memory; the KV lives
        in a compute's own pages (runtime/compute/held_kv.py: vLLM's), whose count the books
        mirror for admission."""
        if isinstance(n_pages, bool) or not isinstance(n_pages, int) or n_pages < 1:
            raise ValueError(f"n_pages must be an int >= 1, got {n_pages!r}")
        self.layout = layout
        self.capacity = n_pages
        self.tensor = torch.empty(
            (n_pages if storage else 0, *layout.full_block_shape), dtype=torch.uint8, device=device
        )
        self._lock = threading.Lock()
        self._free: list[int] = list(reversed(range(n_pages)))
        self._owners: dict[str, _Owner] = {}
        self._reserved = 0

    @property
    def unreserved_pages(self) -> int:
        with self._lock:
            return self.capacity - self._reserved

    def pages_for(self, tokens: int) -> int:
        return self.layout.blocks_for(tokens)

    def reserve(self, owner: str, n_pages: int) -> None:
        """Set aside n_pages for `owner`; PagePoolFullError if fewer are unreserved."""
        if n_pages < 1:
            raise ValueError(f"request {owner}: a reservation needs at least one page (got {n_pages})")
        with self._lock:
            state = transition(owner, self._state(owner), PageEvent.RESERVE)
            if self._reserved + n_pages > self.capacity:
                raise PagePoolFullError(
                    f"request {owner}: {n_pages} pages do not fit; {self.capacity - self._reserved} of "
                    f"{self.capacity} are unreserved (cluster.hbm_tokens_per_engine sets the pool)"
                )
            self._owners[owner] = _Owner(n_pages, state)
            self._reserved += n_pages

    def allocate(self, owner: str, n_pages: int) -> list[int]:
        """Append n_pages to the owner's table, within its reservation; returns the new pages."""
        with self._lock:
            entry = self._owners.get(owner)
            state = transition(owner, self._state(owner), PageEvent.ALLOCATE)
            assert entry is not None  # ALLOCATE is legal only for a known owner
            if len(entry.pages) + n_pages > entry.reserved:
                raise PageTransitionError(
                    f"request {owner}: {len(entry.pages)} + {n_pages} pages exceed its reservation of {entry.reserved}"
                )
            new = [self._free.pop() for _ in range(n_pages)]
            entry.pages.extend(new)
            entry.state = state
            return new

    def ensure(self, owner: str, tokens: int) -> tuple[int, ...]:
        """Allocate pages until the table covers `tokens` tokens; returns the whole table. (Once
        per running sequence per decode step: one hold of the lock when the table covers them.)"""
        with self._lock:
            entry = self._owners.get(owner)
            if entry is None:
                raise KeyError(f"request {owner} holds no pages")
            missing = self.pages_for(tokens) - len(entry.pages)
            if missing <= 0:
                return tuple(entry.pages)
        self.allocate(owner, missing)
        return self.table(owner)

    def table(self, owner: str) -> tuple[int, ...]:
        with self._lock:
            entry = self._owners.get(owner)
            if entry is None:
                raise KeyError(f"request {owner} holds no pages")
            return tuple(entry.pages)

    def holds(self, owner: str) -> bool:
        with self._lock:
            return owner in self._owners

    def release(self, owner: str) -> None:
        """Give back the owner's pages and reservation."""
        with self._lock:
            entry = self._owners.get(owner)
            transition(owner, self._state(owner), PageEvent.RELEASE)
            assert entry is not None
            del self._owners[owner]
            self._free.extend(reversed(entry.pages))
            self._reserved -= entry.reserved

    def page(self, page: int) -> torch.Tensor:
        """Page `page` as a Full Block [n_layer, block_size, bytes] view."""
        if not len(self.tensor):
            raise RuntimeError("this page pool keeps books only: its KV lives in the compute's pages (HeldKV)")
        return self.tensor[page]

    def check_integrity(self) -> PageCounts:
        """Count every page; raise PageIntegrityError if one is lost, shared or over-allocated."""
        with self._lock:
            holder: list[str | None] = [None] * self.capacity
            for page in self._free:
                self._claim(holder, page, "the free list")
            allocated = 0
            for owner, entry in self._owners.items():
                if len(entry.pages) > entry.reserved:
                    raise PageIntegrityError(f"request {owner} holds {len(entry.pages)} pages > reserved {entry.reserved}")
                for page in entry.pages:
                    self._claim(holder, page, f"request {owner}")
                allocated += len(entry.pages)
            reserved = sum(entry.reserved for entry in self._owners.values())
            total = self._reserved  # read under the lock: a concurrent reserve must not look like a disagreement
            counts = PageCounts(len(self._free), allocated, reserved, self.capacity)
        lost = [page for page, who in enumerate(holder) if who is None]
        if lost or counts.free + counts.allocated != self.capacity:
            raise PageIntegrityError(f"pages {lost[:10]} are neither free nor held ({counts})")
        if reserved != total or reserved > self.capacity:
            raise PageIntegrityError(f"reservations {reserved} disagree with the total {total}")
        return counts

    def _state(self, owner: str) -> PageOwnerState:
        entry = self._owners.get(owner)
        return PageOwnerState.UNKNOWN if entry is None else entry.state

    def _claim(self, holder: list[str | None], page: int, who: str) -> None:
        if not 0 <= page < self.capacity:
            raise PageIntegrityError(f"{who} holds page {page} outside [0, {self.capacity})")
        if holder[page] is not None:
            raise PageIntegrityError(f"page {page} is held by both {holder[page]} and {who}")
        holder[page] = who
