"""The singleton Scheduler actor (`scheduler` in the dualpath namespace).

A thin async shell around the pure scheduler core. Callers submit turns in batches (`submit`,
from a `SchedulerClient`: api/client.py) and collect their results with one long-poll
(`collect`), or await one turn (`generate`, `generate_stream`). Decisions are event-driven and
pushed (runtime/control/decisions.py: the rounds the simulator runs too), engines tell it what a step
produced in one report (an EngineReport: handoffs taken, turns ended, streamed tokens), readers
tell it their read queues when they change (a ReaderReport), both on the report channel
(runtime/reporting/channel.py: a socket its event loop reads, not Ray calls), and the heartbeat watchdog
(runtime/control/watchdog.py) judges who is alive. The prefix index lives here (rebuilt from the store
at start) and learns every persisted block from the turn result before that result is
answered, so the next turn of a trajectory always sees its predecessor's blocks. An idle
scheduler makes no call and wakes for nothing. Each turn is served, attempt by attempt, by the
Serving it holds (runtime/control/serving.py); streamed tokens go through its TokenStreams
(runtime/control/streaming.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace
from typing import AsyncIterator, Mapping

import ray

from dualpath_ray.config import DualPathConfig
from dualpath_ray.faults.injector import FaultInjector
from dualpath_ray.protocol.messages import (
    Collected,
    ErrorKind,
    Refusal,
    RequestSpec,
    StreamDelta,
    TurnResult,
    failed_result,
)
from dualpath_ray.protocol.weights import TensorSpec, WeightSource
from dualpath_ray.runtime.restarts.kept_state import IncarnationCounter
from dualpath_ray.runtime.weights.ledger import Publication
from dualpath_ray.runtime.control.weight_updates import WeightUpdates
from dualpath_ray.protocol.names import SCHEDULER
from dualpath_ray.runtime.telemetry.scheduler_counts import SchedulerCounts
from dualpath_ray.runtime.telemetry.status_views import (
    CallCounts, ChannelRefusals, RequestView, ServiceView, ToolStagingCounts, TrackedTables,
)
from dualpath_ray.runtime.control.aborts import Aborts
from dualpath_ray.runtime.control.adoption import Adoptions
from dualpath_ray.runtime.control.decisions import Decisions, ReaderStates
from dualpath_ray.runtime.control.fanout import ClusterControl
from dualpath_ray.runtime.control.mailboxes import Mailboxes
from dualpath_ray.runtime.reporting.channel import ChannelAddress, ReportServer
from dualpath_ray.runtime.control.report_intake import ReportIntake
from dualpath_ray.runtime.control.scheduler_core import build_core
from dualpath_ray.runtime.control.serving import Serving
from dualpath_ray.runtime.control.streaming import TokenStreams
from dualpath_ray.runtime.control.watchdog import Watchdog
from dualpath_ray.runtime.restarts.incarnations import was_restarted
from dualpath_ray.runtime.telemetry.actor_metrics import SchedulerMetrics
from dualpath_ray.scheduling.liveness import Liveness

LOG = logging.getLogger("dualpath_ray.scheduler")
# How long a client's `collect` waits for a first result before it answers with none (the
# client asks again while it has turns in flight).
COLLECT_WAIT_S = 10.0
# An incarnation's epoch is its number shifted by this: room for 2^40 servings each.
EPOCH_SERVING_BITS = 40

@ray.remote(num_cpus=0, max_concurrency=4096)
class Scheduler:
    """Named, detached singleton. `routes` maps engine names to the actors that answer for them
    (the scale harness's simulated engines); empty in every deployment."""

    def __init__(
        self, cfg: DualPathConfig, store_root: str | None, mode: str, routes: Mapping[str, str] | None = None,
    ) -> None:
        # A new epoch per incarnation (Ray restarts this actor with the same arguments), from a
        # counter kept in the GCS: above every epoch of the incarnations before, whatever the
        # clocks do, with room for 2^EPOCH_SERVING_BITS servings each (RequestSpec.epoch).
        self.cfg = cfg
        incarnation = IncarnationCounter(cfg.runtime.namespace, SCHEDULER).begin()
        self.core = build_core(cfg, store_root, mode, epoch=incarnation << EPOCH_SERVING_BITS)
        self.restarted = was_restarted()
        self.adoptions = Adoptions(unclaimed_ttl_s=cfg.runtime.request_timeout_s)
        self.aborts = Aborts(cfg.runtime.session_ttl_s, time.monotonic)
        self.streams = TokenStreams()
        self.control = ClusterControl(cfg, routes)
        self.weight_updates = WeightUpdates(cfg, self.control, fresh=not self.restarted)
        self.asleep = False
        self.starting: asyncio.Task[None] | None = None
        self.clients: dict[str, str] = {}  # request id -> the client that submitted it (submit/collect)
        self.mailboxes = Mailboxes(expiry_s=cfg.runtime.request_timeout_s + 4 * COLLECT_WAIT_S)
        self.calls = SchedulerCounts()
        runtime = cfg.runtime
        self.liveness = Liveness(
            runtime.heartbeat_timeout_s, time.monotonic, max(runtime.heartbeat_s, runtime.heartbeat_timeout_s / 3)
        )
        self.readers = ReaderStates()
        self.faults = FaultInjector(cfg.faults, SCHEDULER, self.restarted)
        self.metrics = SchedulerMetrics.start(cfg, mode, self.calls, self.core)
        self.serving = Serving(
            cfg, self.core, self.control, self.liveness, self.aborts, self.adoptions, self.calls, self.metrics
        )
        # Both need the running event loop: made by the first call (see _started).
        self.decisions: Decisions | None = None
        self.watchdog: Watchdog | None = None
        self.reports: ReportServer | None = None

    def __repr__(self) -> str:
        # Ray prefixes this actor's log lines with it and shows it as the dashboard's repr name.
        return SCHEDULER

    async def ready(self) -> bool:
        await self._started()
        return True

    async def _started(self) -> None:
        """Every entry point awaits this: the decisions and the watchdog run, and a restarted
        incarnation has learnt what the engines hold (runtime/control/adoption.py) before it serves."""
        if self.starting is None:
            self.starting = asyncio.get_running_loop().create_task(self._start())
        await asyncio.shield(self.starting)

    async def _start(self) -> None:
        self.decisions = Decisions(
            self.cfg, self.core, self.control, self.liveness, self.readers, self._accepted, self.faults, self.calls,
            self.metrics,
        )
        self.watchdog = Watchdog(
            self.cfg, self.core, self.control, self.liveness, self.adoptions, self.readers, self.calls,
            self.serving.fail, self.decisions.rounds.everything_changed,
        )
        self.serving.bind(self.decisions, self.watchdog)
        if self.restarted:
            await self.watchdog.learn_holdings()
        self.decisions.rounds.start()
        asyncio.get_running_loop().create_task(self.watchdog.run())
        # Last: a report handled before the holdings were learnt would race the adoption.
        intake = ReportIntake(
            self.core, self.decisions, self.watchdog, self.serving, self.streams, self.readers, self.calls
        )
        self.reports = await ReportServer.start(intake.received, ray.util.get_node_ip_address(), self.cfg.scheduler.report_port)

    def _accepted(self, engine: str, incarnation: str) -> None:
        assert self.watchdog is not None
        self.watchdog.observe(engine, incarnation)

    async def reform_transport(self, requester: str) -> bool:
        """A restarted or broken gloo endpoint (`requester`) asks for a new world over every
        engine and reader (runtime/control/fanout.py). NIXL needs no world: True."""
        if self.cfg.runtime.transport != "gloo":
            return True
        formed = await self.control.reform_gloo_world(requester)
        self.calls.worlds_formed = self.control.worlds_formed
        return formed

    # --- between rollouts: sleep, wake, weights from a trainer ---------------------------

    async def sleep(self) -> int:
        """Put every engine to sleep (KV memory freed, weights off the accelerator; the store
        and the index are kept). Refused while a request is in flight; while asleep, generate
        is refused with a clear error. Returns the bytes freed."""
        await self._started()
        self._require_idle("sleep")
        self.asleep = True
        return await self.control.sleep()

    async def wake_up(self) -> None:
        """Wake every engine (memory allocated again, peers told to fetch its new addressing)."""
        await self._started()
        assert self.watchdog is not None
        for engine, incarnation in (await self.control.wake_up()).items():
            self.watchdog.incarnations.known[engine] = incarnation  # a wake, not a restart: nothing to fail
        self.asleep = False

    async def join_weight_group(self, host: str, port: int, group_name: str = "policy", timeout_s: float = 300.0) -> int:
        """Every engine joins a trainer's weight broadcast group (runtime/weights/sync.py) as
        ranks 1..N; the trainer joins as rank 0 beside this call. Returns the world size."""
        await self._started()
        return await self.control.join_weight_group(host, port, group_name, timeout_s)

    async def update_weights(self, version: int, source: WeightSource) -> int:
        """Every engine loads the weights of `source` as weight version `version`, then they are
        published (runtime/control/weight_updates.py). Refused while a request is in flight."""
        await self._started()
        self._require_idle("update_weights")
        await self.weight_updates.load(version, source)
        return version

    async def update_weights_from_group(self, version: int, manifest: list[TensorSpec]) -> int:
        """Every engine receives the trainer's broadcast of `manifest` (sent beside this call)
        and loads it as weight version `version`, published as update_weights does. Refused
        while a request is in flight."""
        await self._started()
        self._require_idle("update_weights_from_group")
        await self.weight_updates.receive(version, manifest)
        return version

    async def weights(self) -> Publication | None:
        """The weights every engine holds now (the ledger's current publication)."""
        return self.weight_updates.current()

    async def engine_names(self) -> list[str]:
        return list(self.control.engines)

    def _require_idle(self, what: str) -> None:
        if self.aborts.running or self.core.requests:
            raise RuntimeError(
                f"{what} with {len(self.aborts.running)} requests in flight; call it between rollouts "
                "(abort_all() first to stop them)"
            )

    async def mode(self) -> str:
        """The read-path mode this scheduler was deployed with."""
        return self.core.mode

    # --- turns: batched (submit + collect) and one at a time (generate) ------------------

    def _refusal(self, spec: RequestSpec) -> Refusal | None:
        if spec.request_id in self.aborts.running or spec.request_id in self.adoptions.waiting:
            return Refusal.DUPLICATE
        if self.asleep:
            return Refusal.ASLEEP
        return None

    async def submit(self, client: str, specs: list[RequestSpec]) -> tuple[int, list[Refusal | None]]:
        """Start serving a client's turns; their results wait for its `collect`. Returns this
        incarnation's epoch and, per turn, why it was refused (None: accepted). A turn the same
        client already submitted is accepted again without a second serving (a client resubmits
        what it had in flight when it sees that the scheduler restarted)."""
        await self._started()
        self.calls.submit += 1
        refusals: list[Refusal | None] = []
        for spec in specs:
            if self.clients.get(spec.request_id) == client:
                refusals.append(None)
                continue
            refusal = self._refusal(spec)
            refusals.append(refusal)
            if refusal is None:
                self.clients[spec.request_id] = client
                asyncio.get_running_loop().create_task(self._serve_for(client, spec))
        return self.core.epoch, refusals

    async def _serve_for(self, client: str, spec: RequestSpec) -> None:
        try:
            result = await self.serving.generate(spec)
        except Exception as exc:  # noqa: BLE001 - a bug must reach the caller, not hang it
            LOG.exception("serving %s failed", spec.request_id)
            result = failed_result(spec, SCHEDULER, exc, ErrorKind.INTERNAL)
        finally:
            self.clients.pop(spec.request_id, None)
        self.mailboxes.deliver(client, result)

    async def collect(self, client: str, epoch: int | None, wait_s: float = COLLECT_WAIT_S) -> Collected:
        """The client's finished turns, as soon as there is one (or none after wait_s). A client
        that knew another epoch is answered at once: this incarnation restarted and does not
        know what it submitted before (the client submits it again)."""
        await self._started()
        self.calls.collect += 1
        if epoch is not None and epoch != self.core.epoch:
            return Collected(self.core.epoch)
        results = await self.mailboxes.collect(client, wait_s)
        return Collected(self.core.epoch, tuple(results))

    async def generate(self, spec: RequestSpec) -> TurnResult:
        """Serve one turn: its result, or a failed result with an ErrorKind once its retries or
        its deadline (runtime.request_timeout_s) are used up. Never waits forever."""
        await self._started()
        refusal = self._refusal(spec)
        if refusal is not None:
            raise refusal.error(spec.request_id)
        return await self.serving.generate(spec)

    async def generate_stream(self, spec: RequestSpec) -> AsyncIterator[StreamDelta | TurnResult]:
        """`generate`, streamed (a Ray streaming generator): the output tokens as the decode
        engine samples them, as StreamDeltas in order with no token twice, then the TurnResult.
        A retried attempt streams from its first token again; sampling is seeded by (seed,
        position), so its tokens equal the ones already sent and only new positions go out. A
        chunk lost on the way is made up from the final result."""
        # Closed with this generator (a reader that stops reading): its queue goes and the
        # serving is cancelled at once, not when the garbage collector finds it.
        async with contextlib.aclosing(self.streams.serve(spec, self.generate)) as stream:
            async for item in stream:
                yield item

    # --- what engines and readers tell -------------------------------------------------------

    async def report_channel(self) -> ChannelAddress:
        """Where this incarnation reads engines' and readers' reports (runtime/reporting/channel.py),
        and the secret a sender proves: handed out only through this (authenticated) Ray call."""
        await self._started()
        assert self.reports is not None and self.reports.address is not None
        return self.reports.address

    # --- aborts -------------------------------------------------------------------------

    async def abort(self, request_id: str) -> bool:
        """Stop one request now: its caller gets a result with stop reason `aborted` (no
        output), every engine holding its attempt drops it even mid-decode (its extents and
        pages freed, nothing more of it persisted), and it is not retried. False when no
        request of that id is in flight."""
        await self._started()
        return self.serving.abort(request_id)

    async def abort_prefix(self, prefix: str) -> int:
        """Abort a whole trajectory (its request ids start with `prefix`, e.g. "traj7/"): every
        turn of it in flight now, and every later one until `clear_aborts([prefix])`. Returns how
        many were in flight."""
        await self._started()
        return sum(self.serving.abort(rid) for rid in self.aborts.abort_prefix(prefix))

    async def abort_all(self) -> int:
        """Abort every request in flight (later ones run as usual); returns how many."""
        await self._started()
        return sum(self.serving.abort(rid) for rid in sorted(self.aborts.running))

    async def clear_aborts(self, prefixes: list[str] | None = None) -> None:
        """Let the requests of these aborted trajectories (all, with None) run again."""
        self.aborts.clear(prefixes)

    # --- views --------------------------------------------------------------------------

    async def in_flight(self) -> dict[str, RequestView]:
        """Each live request: its state, attempt and the engines it holds (for `status` and tests)."""
        return {
            rid: RequestView(e.state.value, e.spec.attempt if e.spec is not None else 0, e.prefill_engine, e.decode_engine)
            for rid, e in self.core.requests.items()
        }

    async def check_integrity(self) -> int:
        """The dispatcher's queue and book invariants (raises naming what is wrong); returns the
        number of requests in flight, which is 0 once every caller has its answer."""
        self.core.dispatcher.check_integrity()
        return len(self.core.requests)

    async def service_view(self) -> ServiceView:
        """Who is out of service and why (for `status` and tests)."""
        core = self.core
        known = self.watchdog.incarnations.known if self.watchdog is not None else {}
        return ServiceView(
            tuple(sorted(core.dead)), tuple(sorted(core.presumed_dead)), tuple(sorted(core.unready)),
            tuple(sorted(core.readers_dead)), tuple(sorted(core.readers_unavailable)),
            tuple(sorted(core.dispatcher.no_pe_reads)), dict(known),
        )

    async def call_counts(self) -> CallCounts:
        """How often each entry point ran (submits, collects, engine and reader reports, task
        pushes, heartbeats, turns), retries and their causes, and the store's evictions."""
        core, channel, stats = self.core, self.reports, self.core.staging.stats
        rounds = self.decisions.rounds.stats if self.decisions is not None else None
        return CallCounts(
            received=replace(self.calls), sent=dict(self.control.sent),
            evicted_blocks=core.eviction.stats.evicted_blocks if core.eviction is not None else 0,
            indexed_blocks=len(core.index), unpublished_blocks=core.unpublished_blocks, readmitted=core.readmitted,
            adopted=self.adoptions.adopted, adoptions_dropped=self.adoptions.dropped, restarted=bool(self.restarted),
            mailboxes=len(self.mailboxes), dropped_results=self.mailboxes.dropped, queue_full=self.serving.refused,
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

    async def tracked(self) -> TrackedTables:
        """Sizes of every per-request table this actor keeps, and the aborted trajectories' marks
        (a soak test checks they return to their starting size once the turns are done and the
        marks idle for runtime.session_ttl_s)."""
        silent, unheld, delivering = self.liveness.tracked()
        return TrackedTables(
            len(self.core.requests), len(self.serving.pending), len(self.clients), len(self.serving.suspects),
            len(self.streams), len(self.aborts.running), self.aborts.marks(), silent, unheld, delivering,
        )

    async def recent_turns(self) -> list[tuple[float, float, float, str]]:
        """(finished at, ttft_s, tpot_s, path) of the latest served turns, for `dualpath status`."""
        return self.metrics.recent_turns()

    async def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()
