"""What the Scheduler actor's status calls answer (`in_flight`, `service_view`, `tracked`,
`call_counts`): typed, frozen records built by the actor from its collaborators, so a caller
reads named fields (a misspelt one is an AttributeError, not a silent 0) and nothing it holds
changes under it. Each has `to_json()`: the plain dict `dualpath status --json`, the benchmarks'
results and the tests' diffs have always read, with the same keys."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Mapping

from dualpath_ray.runtime.telemetry.scheduler_counts import SchedulerCounts


@dataclass(frozen=True)
class RequestView:
    """One live request at the scheduler: its lifecycle state (scheduling/requests.py
    RequestState's value), current attempt and the engines it holds ("" until placed)."""

    state: str
    attempt: int
    prefill_engine: str
    decode_engine: str

    def to_json(self) -> dict[str, str | int]:
        return asdict(self)


@dataclass(frozen=True)
class ServiceView:
    """Who is out of service and why: engines dead for good or presumed dead from silence,
    engines not holding the published weights, nodes whose reader is gone or unavailable, nodes
    whose hits are read through the DE path instead (each sorted), and the last incarnation seen
    of each actor."""

    dead: tuple[str, ...]
    presumed_dead: tuple[str, ...]
    unready: tuple[str, ...]
    readers_dead: tuple[str, ...]
    readers_unavailable: tuple[str, ...]
    no_pe_reads: tuple[str, ...]
    incarnations: Mapping[str, str]

    def to_json(self) -> dict[str, list[str]]:
        lists = {name: list(getattr(self, name)) for name in (
            "dead", "presumed_dead", "unready", "readers_dead", "readers_unavailable", "no_pe_reads")}
        return {**lists, "incarnations": [f"{name}={inc}" for name, inc in sorted(self.incarnations.items())]}


@dataclass(frozen=True)
class TrackedTables:
    """Sizes of every per-request table the Scheduler actor keeps, and the aborted trajectories'
    marks (a soak test checks they return to their starting size once the turns are done)."""

    requests: int  # the core's request records
    pending: int  # turns awaiting their result (serving)
    clients: int  # submitted turns by client
    suspects: int  # results held back while their attempt is checked
    streams: int  # streamed turns' queues
    running: int  # request ids in flight (aborts)
    abort_marks: int  # aborted trajectory prefixes still marked
    silent: int  # liveness: engines unanswered this round
    unheld: int  # liveness: attempts no engine named yet
    delivering: int  # liveness: attempts whose handoff is on its way

    def to_json(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class ToolStagingCounts:
    """Tool-time staging at the scheduler: chains ordered staged (and their blocks), claimed by
    a next turn (and their blocks), expired unclaimed, claims the placement could not honour,
    hints whose tool time could not cover the read, and next turns that came before their chain
    was read."""

    orders: int
    order_blocks: int
    claims: int
    claimed_blocks: int
    expired: int
    missed: int
    too_short: int
    unready: int


@dataclass(frozen=True)
class ChannelRefusals:
    """The report channel's refusals: connections closed for breaking the protocol (a bad MAC, a
    jump in numbering), for not finishing the handshake in time or past the cap, and
    authenticated frames whose payload was no message."""

    rejected: int
    timed_out: int
    refused: int
    undecodable: int


@dataclass(frozen=True)
class CallCounts:
    """How often each entry point ran and what came of it: the actor's own counts (`received`:
    calls, turns, decisions, the watchdog), the calls it sent by method, the store's index and
    evictions, restarts and adoptions, client mailboxes, the rounds' pulls, the compute path,
    re-reads elsewhere by cause, tool-time staging and the report channel (None before it runs)."""

    received: SchedulerCounts
    sent: Mapping[str, int]
    evicted_blocks: int
    indexed_blocks: int
    unpublished_blocks: int
    readmitted: int
    adopted: int  # results this incarnation adopted from the engines (overrides received.adopted)
    adoptions_dropped: int
    restarted: bool  # this is a restarted incarnation of the actor
    mailboxes: int
    dropped_results: int
    queue_full: int  # turns refused because the serving queue was full
    decode_pulls: int
    prefill_pulls: int
    recomputed_hit_tokens: int
    reread_elsewhere: Mapping[str, int] = field(default_factory=dict)  # by cause (ErrorKind value)
    staging: ToolStagingCounts = ToolStagingCounts(0, 0, 0, 0, 0, 0, 0, 0)
    channel: ChannelRefusals | None = None
    # Late binding's and in-flight sharing's totals (SchedulerCore.sharing_counts), by name.
    sharing: Mapping[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, int]:
        """Every count under one flat key, as `call_counts` always answered: the received counts
        by name, `sent_<method>`, `reread_elsewhere_<cause>`, `stage_<count>`, `channel_<count>`."""
        staging, channel = self.staging, self.channel
        flat = {
            **self.received.as_dict(), **{f"sent_{method}": n for method, n in self.sent.items()},
            "evicted_blocks": self.evicted_blocks, "indexed_blocks": self.indexed_blocks,
            "unpublished_blocks": self.unpublished_blocks, "readmitted": self.readmitted, "adopted": self.adopted,
            "adoptions_dropped": self.adoptions_dropped, "restarted": int(self.restarted), "mailboxes": self.mailboxes,
            "dropped_results": self.dropped_results, "queue_full": self.queue_full,
            "decode_pulls": self.decode_pulls, "prefill_pulls": self.prefill_pulls,
            "recomputed_hit_tokens": self.recomputed_hit_tokens,
            **{f"reread_elsewhere_{cause}": n for cause, n in self.reread_elsewhere.items()},
            **self.sharing,
            "stage_orders": staging.orders, "stage_order_blocks": staging.order_blocks,
            "stage_claims": staging.claims, "stage_claimed_blocks": staging.claimed_blocks,
            "stage_expired": staging.expired, "stage_missed": staging.missed,
            "stage_too_short": staging.too_short, "stage_unready": staging.unready,
        }
        if channel is not None:
            flat.update(channel_rejected=channel.rejected, channel_timed_out=channel.timed_out,
                        channel_refused=channel.refused, channel_undecodable=channel.undecodable)
        return flat
