"""What a storage reader's `node_setup` answers (`dualpath status`): how its node's hardware is used."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeSetup:
    """Whether the node's staging buffer is pinned (`pinning`: how, or why not), and whether its
    SNIC is emulated (token buckets)."""

    buffer_pinned: bool
    pinning: str
    emulation: bool
