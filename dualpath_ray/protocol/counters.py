"""Exact byte counters of a node's NICs, split by read path where a path applies."""

from __future__ import annotations

from dualpath_ray.protocol.types import READ_SIDES

from dataclasses import dataclass, field

PATHS = tuple(side.value for side in READ_SIDES)  # the counters' keys: plain strings


@dataclass
class NodeCounters:
    """Bytes through one node's storage NIC and its engines' compute NICs.

    snic_read: hit Full Blocks read from the store, by the read path of their request;
    snic_write: persisted Full Blocks; cnic_in / cnic_out: KV an engine moved into / out of its
    memory over the transport, by the read path of the request it belongs to; store_read_s: wall
    seconds the node's reader had a hit read in flight (runtime/reader/read_time.py), so
    sum(snic_read) / store_read_s is the rate its reads ran at while it read.
    """

    snic_read: dict[str, int] = field(default_factory=lambda: {p: 0 for p in PATHS})
    snic_write: int = 0
    cnic_in: dict[str, int] = field(default_factory=lambda: {p: 0 for p in PATHS})
    cnic_out: dict[str, int] = field(default_factory=lambda: {p: 0 for p in PATHS})
    store_read_s: float = 0.0

    def merge(self, other: NodeCounters) -> None:
        for path in PATHS:
            self.snic_read[path] += other.snic_read[path]
            self.cnic_in[path] += other.cnic_in[path]
            self.cnic_out[path] += other.cnic_out[path]
        self.snic_write += other.snic_write
        self.store_read_s += other.store_read_s
