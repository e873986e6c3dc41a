"""What the Scheduler actor's one status call answers: `status(query)` with a `StatusQuery`
returns that query's view (STATUS_VIEWS maps each to its type), a typed, frozen record built
from the actor's collaborators (runtime/control/status.py), so a caller reads named fields (a
misspelt one is an AttributeError, not a silent 0) and nothing it holds changes under it. The
counting views have `to_json()`: the plain dict `dualpath status --json`, the benchmarks'
results and the tests' diffs have always read, with the same keys."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Mapping, NamedTuple

from dualpath_ray.runtime.telemetry.scheduler_counts import SchedulerCounts
from dualpath_ray.runtime.weights.ledger import Publication


class StatusQuery(enum.Enum):
    """What `Scheduler.status` is asked for; each answers with the view STATUS_VIEWS names."""

    DEPLOYMENT = "deployment"  # DeploymentView: the read-path mode, the engines, the published weights
    IN_FLIGHT = "in_flight"  # InFlightView: each live request
    INTEGRITY = "integrity"  # IntegrityView: the dispatcher's invariants checked (raises if broken)
    SERVICE = "service"  # ServiceView: who is out of service and why
    CALLS = "calls"  # CallCounts: how often each entry point ran and what came of it
    TRACKED = "tracked"  # TrackedTables: the per-request tables' sizes
    RECENT_TURNS = "recent_turns"  # RecentTurns: the latest served turns' latencies


@dataclass(frozen=True)
class DeploymentView:
    """What the scheduler was deployed with: its read-path mode, every engine's name, and the
    weights every engine holds now (the ledger's current publication; None before any)."""

    mode: str
    engines: tuple[str, ...]
    weights: Publication | None


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
class InFlightView:
    """Each live request at the scheduler, by request id (empty once every caller has its answer)."""

    requests: Mapping[str, RequestView]

    def to_json(self) -> dict[str, dict[str, str | int]]:
        return {rid: view.to_json() for rid, view in self.requests.items()}


@dataclass(frozen=True)
class IntegrityView:
    """The dispatcher's queue and book invariants held (a broken one raises, naming it, instead
    of answering), and how many requests it still holds: 0 once every caller has its answer."""

    requests: int


class TurnTiming(NamedTuple):
    """One served turn: when it finished (wall clock), its TTFT and TPOT, and its read path."""

    finished_at: float
    ttft_s: float
    tpot_s: float
    path: str


@dataclass(frozen=True)
class RecentTurns:
    """The latest served turns, oldest first (for `dualpath status`'s latency percentiles)."""

    turns: tuple[TurnTiming, ...]


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
        """Every count under one flat key, as the call counts always answered: the received counts
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


StatusView = DeploymentView | InFlightView | IntegrityView | ServiceView | CallCounts | TrackedTables | RecentTurns
# The view each query answers with (a test holds Scheduler.status to it).
STATUS_VIEWS: Mapping[StatusQuery, type] = {
    StatusQuery.DEPLOYMENT: DeploymentView, StatusQuery.IN_FLIGHT: InFlightView,
    StatusQuery.INTEGRITY: IntegrityView, StatusQuery.SERVICE: ServiceView, StatusQuery.CALLS: CallCounts,
    StatusQuery.TRACKED: TrackedTables, StatusQuery.RECENT_TURNS: RecentTurns,
}
