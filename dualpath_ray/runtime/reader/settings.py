"""What a node's reader core is handed besides its store and SNIC links: plain settings
(`ReaderSettings`, which the actor takes from the config) and the fault plan as the core asks it
(`ReaderFaults`: faults/injector.py FaultInjector, or tests/fakes.py ScriptedFaults)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

from dualpath_ray.faults.injector import FaultCount
from dualpath_ray.faults.plan import FaultSite, FaultSpec
from dualpath_ray.runtime.reader.recent_keys import DEFAULT_KEY_CAP


@dataclass(frozen=True)
class ReaderSettings:
    """What one node's reader core needs to know, as plain values (the actor takes them from the
    config: cluster.buffer_blocks_per_node and pin_host_buffers, twice runtime.transfer_timeout_s,
    runtime.kv_digests, store.stale_temporary_s)."""

    node_id: str
    buffer_blocks: int
    lease_timeout_s: float
    kv_digests: bool = True
    # Temporaries of crashed puts older than this are swept at start; younger ones may be a put
    # still running on another node of a shared mount.
    stale_temporary_s: float = 600.0
    pin_host_buffers: bool = False
    # This process's transport incarnation: grants name it, so a free or persist addressed to an
    # extent of a dead incarnation is recognised as stale (the actor checks it).
    incarnation: str = ""
    # scheduler.stage_buffer_fraction: at most this share of the buffer holds staged extents.
    stage_buffer_fraction: float = 0.5
    # How many keys of damaged, corrupt and unreadable blocks the reader remembers, each (the
    # oldest dropped first: runtime/reader/recent_keys.py).
    bad_key_cap: int = DEFAULT_KEY_CAP
    # scheduler.share_buffer_blocks when scheduler.share_in_flight is on, else 0: the hot tier of
    # freshly computed prompt blocks (runtime/reader/hot_blocks.py); 0 = none.
    hot_blocks: int = 0

    @property
    def stage_cap_blocks(self) -> int:
        return int(self.buffer_blocks * self.stage_buffer_fraction)


class ReaderFaults(Protocol):
    """The fault plan as the reader core asks it (faults/injector.py FaultInjector, or a fake)."""

    @property
    def active(self) -> bool:
        """Whether any fault applies to this reader: without one the core never calls `decide`."""
        ...

    @property
    def corruption_rng(self) -> random.Random:
        """Where a store_read corrupt fault flips its byte."""
        ...

    def decide(self, site: FaultSite, method: str | None = None) -> FaultSpec | None: ...

    def counts(self) -> dict[str, FaultCount]: ...
