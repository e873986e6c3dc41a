"""The Scheduler actor's decisions: the shared rounds on its event loop, pushed to the engines.

Nothing pulls and nothing polls. When something happens that can change a decision (a turn is
submitted, one ends, a handoff lightens a prefill engine, an engine comes or goes), the rounds
(scheduling/rounds.py, the very code the simulator runs) ask the scheduler core for the groups
concerned, with reports made from the scheduler's own books of what each engine holds
(scheduling/engine_book.py) and what its readers last said. The tasks one moment decided are
pushed to each prefill engine in one `accept` call; decode engines are not called at all (the
prefill engine's handoff carries the request, and the decode engine reserves the pages the
scheduler counted for it when the handoff arrives).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import Any, Callable

from dualpath_ray.config import DualPathConfig
from dualpath_ray.faults.injector import FaultInjector
from dualpath_ray.faults.plan import CallPhase
from dualpath_ray.runtime.telemetry.actor_metrics import SchedulerMetrics
from dualpath_ray.runtime.telemetry.scheduler_counts import SchedulerCounts
from dualpath_ray.runtime.control.fanout import ClusterControl
from dualpath_ray.protocol.messages import PeerState, PrefillTask
from dualpath_ray.protocol.names import reader_name
from dualpath_ray.runtime.placement.topology import plan_nodes
from dualpath_ray.scheduling.liveness import Liveness
from dualpath_ray.scheduling.loads import EngineLoad
from dualpath_ray.scheduling.rounds import Outputs, Rounds
from dualpath_ray.scheduling.scheduler import SchedulerCore
from dualpath_ray.scheduling.staging import StageOrder
from dualpath_ray.protocol.types import Role

LOG = logging.getLogger("dualpath_ray.scheduler")


class LoopTimers:
    """`Timers` on the running asyncio loop and the monotonic clock. A callback due now runs
    after the callbacks already queued (call_soon), so a round sees its moment's events."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def now(self) -> float:
        return time.monotonic()

    def at(self, when: float, action: Callable[[Any], None], argument: Any) -> None:
        delay = when - time.monotonic()
        if delay > 0:
            self.loop.call_later(delay, action, argument)
        else:
            self.loop.call_soon(action, argument)


class ReaderStates:
    """What the scheduler knows of each node's storage reader (its heartbeat and reports)."""

    def __init__(self) -> None:
        self._states: dict[str, PeerState] = {}

    def state(self, node_id: str) -> PeerState:
        return self._states.get(node_id, PeerState.ALIVE)

    def set(self, node_id: str, state: PeerState) -> bool:
        """Record `state`; True when it changed."""
        changed = self.state(node_id) is not state
        self._states[node_id] = state
        return changed


class BookedGroup:
    """A node's engines as the rounds report them (a `GroupView`): loads from the scheduler's
    books (an engine out of service is left out, so nothing is placed on it), the reader's
    state from the heartbeat. Read queues reach the core when readers report them, so a report
    carries none (None: the core keeps its own count, which includes what it assigned since)."""

    def __init__(
        self, role: Role, node_id: str, engines: list[str], core: SchedulerCore, hbm_tokens: int, readers: ReaderStates,
    ) -> None:
        self.group_id = f"{role.value}/{node_id}"
        self.node_id = node_id
        self.role = role
        self.engines = engines
        self.core = core
        self.hbm_tokens = hbm_tokens
        self.readers = readers

    def loads(self) -> tuple[EngineLoad, ...]:
        out = self.core.out_of_service()
        dispatcher = self.core.dispatcher
        book = dispatcher.decode_book if self.role is Role.DECODE else dispatcher.prefill_book
        loads = []
        for engine in self.engines:
            if engine in out:
                continue
            tok = book.tok(engine)
            free = max(0, self.hbm_tokens - tok) if self.role is Role.DECODE else 0
            loads.append(EngineLoad(engine, self.node_id, book.seq(engine), tok, free))
        return tuple(loads)

    def read_q(self, now: float) -> int | None:
        return None

    def reader_state(self) -> PeerState:
        return self.readers.state(self.node_id)


class Decisions:
    """The runtime's rounds and the pushes of what they decide; the incarnation that took each
    push goes to `accepted`."""

    def __init__(
        self, cfg: DualPathConfig, core: SchedulerCore, control: ClusterControl, liveness: Liveness,
        readers: ReaderStates, faults: FaultInjector, calls: SchedulerCounts, metrics: SchedulerMetrics,
    ) -> None:
        self.control = control
        self.metrics = metrics
        self.liveness = liveness
        # (engine, incarnation) of each push an engine took, for the watchdog (Watchdog.heed): a
        # queue rather than a call back, so the rounds are built before the watchdog that
        # re-runs them and neither holds the other.
        self.accepted: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        self.faults = faults
        self.calls = calls
        self.loop = asyncio.get_running_loop()
        hbm_tokens = (cfg.cluster.hbm_tokens_per_engine // cfg.store.block_size) * cfg.store.block_size
        groups = {role: [] for role in Role}
        for spec in plan_nodes(cfg):
            role = Role(spec.role)
            groups[role].append(BookedGroup(role, spec.node_id, spec.engine_names(), core, hbm_tokens, readers))
        self.decode_group_of = {e: g.group_id for g in groups[Role.DECODE] for e in g.engines}
        self.rounds = Rounds(
            LoopTimers(self.loop), core, groups[Role.PREFILL], groups[Role.DECODE], 0.0,
            cfg.scheduler.report_interval_ms / 1000.0, core.settings.constants.beta_tokens,
            Outputs(on_tasks=self._queue, on_decided=metrics.decided if metrics.sink.enabled else None),
        )
        self._outgoing: defaultdict[str, list[PrefillTask]] = defaultdict(list)
        self._stage_orders: defaultdict[str, list[StageOrder]] = defaultdict(list)
        self._flush_due = False

    def _queue(self, tasks: list[PrefillTask], now: float) -> None:
        self.metrics.placed(tasks)
        for task in tasks:
            self._outgoing[task.prefill_engine].append(task)
        if not self._flush_due:
            self._flush_due = True
            self.loop.call_soon(self._flush)

    def stage_ahead(self, orders: list[StageOrder]) -> None:
        """Staging orders of finished turns (scheduling/staging.py), sent with this moment's tasks."""
        for order in orders:
            self._stage_orders[order.node_id].append(order)
        if not self._flush_due:
            self._flush_due = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Everything decided this moment leaves: one `accept` per prefill engine, one
        `stage_ahead` per reader."""
        self._flush_due = False
        stage_orders, self._stage_orders = self._stage_orders, defaultdict(list)
        for node, orders in stage_orders.items():
            self.control.stage_ahead(reader_name(node), orders)
        outgoing, self._outgoing = self._outgoing, defaultdict(list)
        for engine, tasks in outgoing.items():
            owners = [task.request.owner for task in tasks]
            self.liveness.sending(owners)
            self.calls.pushes += 1
            self.calls.pushed_tasks += len(tasks)
            self.loop.create_task(self._push(engine, tasks, owners))

    async def _push(self, engine: str, tasks: list[PrefillTask], owners: list[str]) -> None:
        """One push and its answer: the incarnation that took the tasks. Until it answers, the
        heartbeat does not judge these attempts; a push that fails leaves them to it (a dead
        engine's attempts are failed with it, a lost push's after the heartbeat grace)."""
        try:
            if self.faults.active and self.faults.fail_call("accept", CallPhase.REQUEST):
                raise RuntimeError(f"accept to {engine}: request lost (fault plan)")
            incarnation = await self.control.handle(engine).accept.remote(tasks)
            if self.faults.active and self.faults.fail_call("accept", CallPhase.RESPONSE):
                raise RuntimeError(f"accept to {engine}: reply lost (fault plan)")
        except Exception as exc:  # noqa: BLE001 - see the docstring
            self.calls.failed_pushes += 1
            LOG.warning("pushing %d tasks to %s failed: %r", len(tasks), engine, exc)
        else:
            self.accepted.put_nowait((engine, incarnation))
        finally:
            self.liveness.sent(owners)
