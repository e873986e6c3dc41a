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
    # What one SNIC reads per second, in tokens (alpha / alpha_seconds): staging is ordered only
    # where it can finish within the hinted tool time, and a next turn claims it only once it
    # should have. 0: unknown, no such check (tests of the bookkeeping alone).
    read_tokens_per_s: float = 0.0


@dataclass(frozen=True)
class StageOrder:
    """Read `keys` (a chain of stored blocks, from the first) into the buffer of `node_id` and
    hold them for `ttl_s` from when the reader gets the order, under the lease owner `stage_id`."""

    stage_id: str
    node_id: str
    keys: tuple[str, ...]
    ttl_s: float
    expires_at: float  # on the scheduler's clock: after this the core no longer prefers the node
    ready_at: float = 0.0  # when its read should be done (the node's queue ahead, then its own)
    tokens: int = 0  # hit tokens it stages

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
    too_short: int = 0  # hinted turns whose tool time could not cover the read: nothing ordered
    unready: int = 0  # next turns that came before their chain could be read: read as usual


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
    # Tokens of each node's orders not yet claimed or expired: staging work queued at its reader.
    _pending: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._by_last_key)

    def plan(
        self, keys: tuple[str, ...], tokens: int, expect_s: float | None, now: float, read_q: Mapping[str, int],
        group_tok: Mapping[str, int],
    ) -> StageOrder | None:
        """The order for a finished turn whose context is the chain `keys` (`tokens` hit tokens),
        hinted to continue in `expect_s` seconds, or None (no hint, staging off, too few blocks,
        no decode node takes work, the chain is staged already, or no node can read it within the
        tool time). `read_q`: the decode nodes that take work and their read queues; `group_tok`:
        each such node's summed decode tok (the tie-break).

        The node is the one whose SNIC would finish it first: its read queue, then the staging
        already ordered there, then this chain (the read-path rule, taken ahead of time). An
        order that could not finish before the next turn arrives is not made: that turn would be
        steered to a node whose SNIC is still busy with it, while the other path's sat idle."""
        self.expire(now)
        if not self.settings.enabled or expect_s is None or expect_s < 0 or not read_q:
            return None
        if len(keys) < max(1, self.settings.min_blocks) or keys[-1] in self._by_last_key:
            return None
        ahead = {n: read_q[n] + self._pending.get(n, 0) for n in read_q}
        node = min(ahead, key=lambda n: (ahead[n], group_tok.get(n, 0), n))
        rate = self.settings.read_tokens_per_s
        read_s = (ahead[node] + tokens) / rate if rate > 0 else 0.0
        if read_s > expect_s:
            self.stats.too_short += 1
            return None
        ttl = expect_s * (1.0 + self.settings.slack) + self.settings.margin_s
        order = StageOrder(stage_id_of(keys), node, keys, ttl, now + ttl, now + read_s, tokens)
        self._by_last_key[keys[-1]] = order
        self._pending[node] = self._pending.get(node, 0) + tokens
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
                self._forget(order)
                if now < order.ready_at:
                    # It came before its chain could be read: steering it to that node's SNIC,
                    # still busy with the read, would idle the other path. Read as usual; the
                    # reader expires the extent.
                    self.stats.unready += 1
                    return None
                self.stats.claimed += 1
                self.stats.claimed_blocks += order.blocks
                return order
        return None

    def _forget(self, order: StageOrder) -> None:
        del self._by_last_key[order.keys[-1]]
        left = self._pending.get(order.node_id, 0) - order.tokens
        if left > 0:
            self._pending[order.node_id] = left
        else:
            self._pending.pop(order.node_id, None)

    def expire(self, now: float) -> list[StageOrder]:
        """Drop the orders whose time is up (their readers free them on their own clocks)."""
        dropped = []
        while self._expiries and self._expiries[0][0] <= now:
            _, last_key = heapq.heappop(self._expiries)
            order = self._by_last_key.get(last_key)
            if order is not None and order.expires_at <= now:
                self._forget(order)
                dropped.append(order)
        self.stats.expired += len(dropped)
        return dropped

    def drop_node(self, node_id: str) -> None:
        """The node's reader is gone: nothing it staged can be claimed."""
        for order in list(self._by_last_key.values()):
            if order.node_id == node_id:
                self._forget(order)
