"""Every collaborator of the Scheduler actor (runtime/control/scheduler.py), built in one place,
each handed what it uses when it is made.

Two stages, because the decision rounds and everything that awaits on the actor's event loop
need that loop, which exists only once the actor serves its first call:

- `ControlPlane(...)`: what needs no loop, made with the actor: the scheduler core (its index
  rebuilt from the store), the books of aborts, adoptions and mailboxes, the fan-out to the
  engines, the weight ledger, the counts and metrics.
- `started()`, on the loop, once: the `Running` parts, in the order of what each needs: the
  decision rounds; the attempts (how an attempt ends: they free the rounds); the watchdog (it
  fails attempts and re-runs the rounds); the serving (it places attempts, awaits them and asks
  the watchdog to probe); the front desk (callers' turns, to the serving); then, for a
  restarted incarnation, what the engines hold (runtime/control/adoption.py); the rounds and the
  watchdog start; last the report channel, since a report handled before the holdings were
  learnt would race the adoption. Nothing is bound after it is made: the watchdog hears which
  incarnation took each push through the rounds' `accepted` queue, not a call back into it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Mapping

import ray

from dualpath_ray.config import DualPathConfig
from dualpath_ray.faults.injector import FaultInjector
from dualpath_ray.protocol.names import SCHEDULER
from dualpath_ray.runtime.control.aborts import Aborts
from dualpath_ray.runtime.control.adoption import Adoptions
from dualpath_ray.runtime.control.attempts import Attempts
from dualpath_ray.runtime.control.decisions import Decisions, ReaderStates
from dualpath_ray.runtime.control.fanout import ClusterControl
from dualpath_ray.runtime.control.front_desk import FrontDesk
from dualpath_ray.runtime.control.mailboxes import Mailboxes
from dualpath_ray.runtime.control.report_intake import ReportIntake
from dualpath_ray.runtime.control.scheduler_core import build_core
from dualpath_ray.runtime.control.serving import Serving
from dualpath_ray.runtime.control.streaming import TokenStreams
from dualpath_ray.runtime.control.watchdog import Watchdog
from dualpath_ray.runtime.control.weight_updates import WeightUpdates
from dualpath_ray.runtime.reporting.channel import ReportServer
from dualpath_ray.runtime.restarts.incarnations import was_restarted
from dualpath_ray.runtime.restarts.kept_state import IncarnationCounter
from dualpath_ray.runtime.telemetry.actor_metrics import SchedulerMetrics
from dualpath_ray.runtime.telemetry.scheduler_counts import SchedulerCounts
from dualpath_ray.scheduling.liveness import Liveness

# How long a client's `collect` waits for a first result before it answers with none (the
# client asks again while it has turns in flight).
COLLECT_WAIT_S = 10.0
# An incarnation's epoch is its number shifted by this: room for 2^40 servings each.
EPOCH_SERVING_BITS = 40


@dataclass(frozen=True)
class Running:
    """The parts made on the actor's event loop (see the module docstring)."""

    decisions: Decisions
    attempts: Attempts
    watchdog: Watchdog
    serving: Serving
    front: FrontDesk
    reports: ReportServer


class ControlPlane:
    """The Scheduler actor's collaborators. `routes` maps engine names to the actors that answer
    for them (the scale harness's simulated engines); empty in every deployment."""

    def __init__(self, cfg: DualPathConfig, store_root: str | None, mode: str, routes: Mapping[str, str] | None) -> None:
        # A new epoch per incarnation (Ray restarts the actor with the same arguments), from a
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
        self.mailboxes = Mailboxes(expiry_s=cfg.runtime.request_timeout_s + 4 * COLLECT_WAIT_S)
        self.calls = SchedulerCounts()
        runtime = cfg.runtime
        self.liveness = Liveness(
            runtime.heartbeat_timeout_s, time.monotonic, max(runtime.heartbeat_s, runtime.heartbeat_timeout_s / 3)
        )
        self.readers = ReaderStates()
        self.faults = FaultInjector(cfg.faults, SCHEDULER, self.restarted)
        self.metrics = SchedulerMetrics.start(cfg, mode, self.calls, self.core)
        self._starting: asyncio.Task[Running] | None = None

    async def started(self) -> Running:
        """The running parts; the first call (of any entry point) makes and starts them."""
        if self._starting is None:
            self._starting = asyncio.get_running_loop().create_task(self._start())
        return await asyncio.shield(self._starting)

    def running(self) -> Running | None:
        """The running parts if they have started (status views read what exists before)."""
        starting = self._starting
        if starting is None or not starting.done() or starting.cancelled() or starting.exception() is not None:
            return None
        return starting.result()

    async def _start(self) -> Running:
        cfg, core, calls = self.cfg, self.core, self.calls
        decisions = Decisions(cfg, core, self.control, self.liveness, self.readers, self.faults, calls, self.metrics)
        attempts = Attempts(
            core, decisions, self.control, self.liveness, self.aborts, self.adoptions, calls, self.metrics,
        )
        watchdog = Watchdog(
            cfg, core, self.control, self.liveness, self.adoptions, self.readers, calls, attempts.fail,
            decisions.rounds.everything_changed,
        )
        serving = Serving(cfg, core, attempts, decisions, watchdog, self.liveness, self.aborts, self.adoptions, calls)
        front = FrontDesk(core, serving, self.aborts, self.adoptions, self.mailboxes, calls)
        if self.restarted:
            await watchdog.learn_holdings()
        decisions.rounds.start()
        loop = asyncio.get_running_loop()
        loop.create_task(watchdog.run())
        loop.create_task(watchdog.heed(decisions.accepted))
        intake = ReportIntake(core, decisions, watchdog, attempts, self.streams, self.readers, calls)
        reports = await ReportServer.start(intake.received, ray.util.get_node_ip_address(), cfg.scheduler.report_port)
        return Running(decisions, attempts, watchdog, serving, front, reports)
