"""The Scheduler actor's status views (runtime/telemetry/status_views.py), each built from the
collaborators that own its data (runtime/control/plane.py). They read what exists: before the
running parts have started (a restarted incarnation learning what the engines hold), what
belongs to them reads as none yet."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from dualpath_ray.runtime.control.plane import ControlPlane
from dualpath_ray.runtime.telemetry.status_views import (
    CallCounts,
    ChannelRefusals,
    DeploymentView,
    InFlightView,
    IntegrityView,
    RecentTurns,
    RequestView,
    ServiceView,
    StatusQuery,
    StatusView,
    ToolStagingCounts,
    TrackedTables,
    TurnTiming,
)


def status_view(plane: ControlPlane, query: StatusQuery) -> StatusView:
    """The view `query` asks for (its type: STATUS_VIEWS)."""
    if not isinstance(query, StatusQuery):
        raise TypeError(f"status(query): query is a StatusQuery (one of {[q.name for q in StatusQuery]}), not {query!r}")
    return _VIEWS[query](plane)


def _deployment(plane: ControlPlane) -> DeploymentView:
    return DeploymentView(plane.core.mode, tuple(plane.control.engines), plane.weight_updates.current())


def _in_flight(plane: ControlPlane) -> InFlightView:
    return InFlightView({
        rid: RequestView(e.state.value, e.spec.attempt if e.spec is not None else 0, e.prefill_engine, e.decode_engine)
        for rid, e in plane.core.requests.items()
    })


def _integrity(plane: ControlPlane) -> IntegrityView:
    plane.core.dispatcher.check_integrity()
    return IntegrityView(len(plane.core.requests))


def _service(plane: ControlPlane) -> ServiceView:
    core, running = plane.core, plane.running()
    known = running.watchdog.incarnations.known if running is not None else {}
    return ServiceView(
        tuple(sorted(core.dead)), tuple(sorted(core.presumed_dead)), tuple(sorted(core.unready)),
        tuple(sorted(core.readers_dead)), tuple(sorted(core.readers_unavailable)),
        tuple(sorted(core.dispatcher.no_pe_reads)), dict(known),
    )


def _calls(plane: ControlPlane) -> CallCounts:
    core, running, stats = plane.core, plane.running(), plane.core.staging.stats
    rounds = running.decisions.rounds.stats if running is not None else None
    channel = running.reports if running is not None else None
    return CallCounts(
        received=replace(plane.calls), sent=dict(plane.control.sent),
        evicted_blocks=core.eviction.stats.evicted_blocks if core.eviction is not None else 0,
        indexed_blocks=len(core.index), unpublished_blocks=core.unpublished_blocks, readmitted=core.readmitted,
        adopted=plane.adoptions.adopted, adoptions_dropped=plane.adoptions.dropped, restarted=bool(plane.restarted),
        mailboxes=len(plane.mailboxes), dropped_results=plane.mailboxes.dropped,
        queue_full=running.serving.refused if running is not None else 0,
        decode_pulls=rounds.decode_pulls if rounds else 0, prefill_pulls=rounds.prefill_pulls if rounds else 0,
        recomputed_hit_tokens=core.dispatcher.recomputed_hit_tokens, reread_elsewhere=dict(core.reread_elsewhere),
        sharing=core.sharing_counts(),
        staging=ToolStagingCounts(
            stats.ordered, stats.ordered_blocks, stats.claimed, stats.claimed_blocks, stats.expired,
            core.dispatcher.staged_missed, stats.too_short, stats.unready,
        ),
        channel=None if channel is None else ChannelRefusals(
            channel.rejected, channel.timed_out, channel.refused, channel.undecodable,
        ),
    )


def _tracked(plane: ControlPlane) -> TrackedTables:
    silent, unheld, delivering = plane.liveness.tracked()
    running = plane.running()
    pending = len(running.attempts.pending) if running is not None else 0
    suspects = len(running.attempts.suspects) if running is not None else 0
    clients = len(running.front.clients) if running is not None else 0
    return TrackedTables(
        len(plane.core.requests), pending, clients, suspects, len(plane.streams), len(plane.aborts.running),
        plane.aborts.marks(), silent, unheld, delivering,
    )


def _recent_turns(plane: ControlPlane) -> RecentTurns:
    return RecentTurns(tuple(TurnTiming(*turn) for turn in plane.metrics.recent_turns()))


_VIEWS: dict[StatusQuery, Callable[[ControlPlane], StatusView]] = {
    StatusQuery.DEPLOYMENT: _deployment, StatusQuery.IN_FLIGHT: _in_flight, StatusQuery.INTEGRITY: _integrity,
    StatusQuery.SERVICE: _service, StatusQuery.CALLS: _calls, StatusQuery.TRACKED: _tracked,
    StatusQuery.RECENT_TURNS: _recent_turns,
}
