"""Staging a session's next turn while its agent's tool runs (beyond the paper).

When a turn finishes and its caller says the session continues in about `expect_next_turn_s`
(a hint: the trace's tool latency in rollouts, a request field on the serving front ends), the
next prompt's prefix is already known: the whole context of the turn that just finished, whose
blocks are in the store. The scheduler core asks the reader of one decode node to read those
blocks into its buffer now, behind every real read, and to hold them for a while (a `StageOrder`).
When the next turn arrives and its hit blocks begin with the staged ones, the core places it on
that decode node's group and reads its hits through the DE path: the staged extent becomes the
decode-node extent every request leases, and the read it would have done is skipped.

Why a decode node: every request leases an extent on its decode node anyway (it holds the KV the
prefill sends), so staging there holds that one extent earlier instead of a second one; decode
placement picks a group once per request and can honour the preference, where prefill placement
is FIFO across groups; and the decode nodes' storage NICs are the ones DualPath finds idle. The
node is picked by the paper's read-path rule taken ahead of time: the decode node with the
shortest read queue (ties: the least loaded group), among those that take work.

What a wrong guess costs is bounded: an order lasts `ttl_s` (the hinted wait with slack, plus a
margin) and the reader frees it then; a session that never returns costs one expired extent. The
reader also cancels its oldest staged extents first when a real lease finds the buffer full.

Pure: no Ray, no clock of its own (every call takes `now`), shared by the runtime's scheduler and
the simulator.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Mapping

from dualpath_ray.protocol.messages import StagedRead


@dataclass(frozen=True)
class StagingSettings:
    """scheduler.stage_tool_time and its timing (config/sections.py SchedulerConfig)."""

    enabled: bool = False
    slack: float = 0.5  # the order lasts expect_next_turn_s * (1 + slack) + margin_s
    margin_s: float = 2.0
    min_blocks: int = 1  # fewer staged blocks than this are not worth an order


@dataclass(frozen=True)
class StageOrder:
    """Read `keys` (a chain of stored blocks, from the first) into the buffer of `node_id` and
    hold them for `ttl_s` from when the reader gets the order, under the lease owner `stage_id`."""

    stage_id: str
    node_id: str
    keys: tuple[str, ...]
    ttl_s: float
    expires_at: float  # on the scheduler's clock: after this the core no longer prefers the node

    @property
    def blocks(self) -> int:
        return len(self.keys)

    def read(self) -> StagedRead:
        """What the prefill task carries to the reader that claims it."""
        return StagedRead(self.stage_id, self.node_id, self.blocks)


@dataclass
class StagingStats:
    """Orders the core gave, claimed by a next turn, and dropped unclaimed (expired). (A claim
    the placement could not honour is the dispatcher's `staged_missed`.)"""

    ordered: int = 0
    ordered_blocks: int = 0
    claimed: int = 0
    claimed_blocks: int = 0
    expired: int = 0


def stage_id_of(keys: tuple[str, ...]) -> str:
    """The lease owner of a staged chain: named by its last block's key, which names the chain."""
    return f"stage/{keys[-1]}"


@dataclass
class StagingBook:
    """The staged chains the core expects a next turn to claim, by the key of their last block."""

    settings: StagingSettings
    stats: StagingStats = field(default_factory=StagingStats)
    _by_last_key: dict[str, StageOrder] = field(default_factory=dict)
    _expiries: list[tuple[float, str]] = field(default_factory=list)  # heap of (expires_at, last key)

    def __len__(self) -> int:
        return len(self._by_last_key)

    def plan(
        self, keys: tuple[str, ...], expect_s: float | None, now: float, read_q: Mapping[str, int],
        group_tok: Mapping[str, int],
    ) -> StageOrder | None:
        """The order for a finished turn whose context is the chain `keys`, hinted to continue in
        `expect_s` seconds, or None (no hint, staging off, too few blocks, no decode node takes
        work, or the chain is staged already). `read_q`: the decode nodes that take work and their
        read queues; `group_tok`: each such node's summed decode tok (the tie-break)."""
        self.expire(now)
        if not self.settings.enabled or expect_s is None or expect_s < 0 or not read_q:
            return None
        if len(keys) < max(1, self.settings.min_blocks) or keys[-1] in self._by_last_key:
            return None
        node = min(read_q, key=lambda n: (read_q[n], group_tok.get(n, 0), n))
        ttl = expect_s * (1.0 + self.settings.slack) + self.settings.margin_s
        order = StageOrder(stage_id_of(keys), node, keys, ttl, now + ttl)
        self._by_last_key[keys[-1]] = order
        heapq.heappush(self._expiries, (order.expires_at, keys[-1]))
        self.stats.ordered += 1
        self.stats.ordered_blocks += order.blocks
        return order

    def claim(self, hit_keys: tuple[str, ...], now: float) -> StageOrder | None:
        """The staged chain a new turn's hits begin with (the longest), taken out of the book, or
        None. A chain longer than the hits is not claimed: the turn's prompt left the staged
        context (it expires)."""
        self.expire(now)
        if not self._by_last_key:
            return None
        for end in range(len(hit_keys), 0, -1):
            order = self._by_last_key.get(hit_keys[end - 1])
            if order is not None and order.keys == hit_keys[:end]:
                del self._by_last_key[hit_keys[end - 1]]
                self.stats.claimed += 1
                self.stats.claimed_blocks += order.blocks
                return order
        return None

    def expire(self, now: float) -> list[StageOrder]:
        """Drop the orders whose time is up (their readers free them on their own clocks)."""
        dropped = []
        while self._expiries and self._expiries[0][0] <= now:
            _, last_key = heapq.heappop(self._expiries)
            order = self._by_last_key.get(last_key)
            if order is not None and order.expires_at <= now:
                del self._by_last_key[last_key]
                dropped.append(order)
        self.stats.expired += len(dropped)
        return dropped

    def drop_node(self, node_id: str) -> None:
        """The node's reader is gone: nothing it staged can be claimed."""
        for last_key, order in list(self._by_last_key.items()):
            if order.node_id == node_id:
                del self._by_last_key[last_key]
