"""The scheduler's heartbeat watchdog: which engines and readers are alive, and what their
deaths, silences and restarts cost.

While requests are in flight it watches the engines that hold some and the readers of their
nodes; with nothing in flight it sleeps until something is submitted. An engine or reader is
heard from whenever it reports (a step's report, a read-queue report) or answers (a task push, a
heartbeat). Every runtime.heartbeat_s it asks what they hold (`holds`; readers: `queue_report`)
only those it has not heard from since the last beat (and those presumed dead, to take them
back); every `sweep_s` (a third of heartbeat_timeout_s, at least heartbeat_s) it asks all of them,
and only then judges attempts: the pure `Liveness` (scheduling/liveness.py) owns every deadline,
and the watchdog acts on its verdicts. A busy engine reports every few steps, so at scale most
heartbeats are saved (48P96D: 1,152 engines).

- An engine Ray reports dead or restarting, or one silent for heartbeat_timeout_s, is dead: its
  attempts fail with PEER_DIED (their callers retry them elsewhere) and its extents are
  reclaimed once its death is certain. One only presumed dead that answers again is taken back.
- A new incarnation (in any answer, report or push reply) proves the old process gone: what
  depended on it is failed and reclaimed, and it takes work again.
- A reader that does not answer is routed around (see SchedulerCore.note_report).
- An attempt no live engine holds for the grace is failed the same way (scheduling/liveness.py).
- A restarted scheduler first learns what the engines hold (runtime/control/adoption.py).

A composed object (runtime/control/plane.py builds it): it is handed what it uses and the two
actions it needs back, `fail(spec, by, why)` (Attempts.fail: ends an attempt with PEER_DIED) and
`changed()` (the rounds' everything_changed: every group must be asked again, an engine or reader
came or went).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import ray.exceptions

from dualpath_ray.config import DualPathConfig
from dualpath_ray.protocol.names import SCHEDULER, is_reader, reader_name, reader_node
from dualpath_ray.runtime.telemetry.scheduler_counts import SchedulerCounts
from dualpath_ray.runtime.control.adoption import Adoptions
from dualpath_ray.runtime.control.fanout import ClusterControl
from dualpath_ray.runtime.control.decisions import ReaderStates
from dualpath_ray.protocol.messages import EngineHoldings, GroupReport, Holding, PeerState, RequestSpec
from dualpath_ray.runtime.restarts.incarnations import IncarnationTracker, peer_state_of
from dualpath_ray.runtime.placement.topology import plan_nodes
from dualpath_ray.scheduling.liveness import Liveness
from dualpath_ray.scheduling.loads import EngineLoad
from dualpath_ray.scheduling.scheduler import SchedulerCore
from dualpath_ray.protocol.types import Role

Fail = Callable[[RequestSpec, str, str], None]
LOG = logging.getLogger("dualpath_ray.scheduler")
MAX_UNRECLAIMED = 65536  # per engine (see Watchdog.unreclaimed)


class Watchdog:
    def __init__(
        self, cfg: DualPathConfig, core: SchedulerCore, control: ClusterControl, liveness: Liveness,
        adoptions: Adoptions, readers: ReaderStates, calls: SchedulerCounts, fail: Fail, changed: Callable[[], None],
    ) -> None:
        self.cfg = cfg
        self.core = core
        self.control = control
        self.liveness = liveness
        self.adoptions = adoptions
        self.readers = readers
        self.calls = calls
        self.fail = fail
        self.changed = changed
        self.incarnations = IncarnationTracker()
        # Attempts failed because their engine went silent: their extents are reclaimed only
        # once the death is certain (Ray reports it, or the engine comes back as a new process);
        # forgotten if it answers again as the same process (its own cancels free them). At most
        # MAX_UNRECLAIMED per engine, the oldest dropped: an engine silent for that many
        # attempts holds far fewer extents (its buffers are a few hundred blocks).
        self.unreclaimed: dict[str, dict[str, None]] = {}
        nodes = plan_nodes(cfg)
        self.node_of = {engine: spec.node_id for spec in nodes for engine in spec.engine_names()}
        self.role_of = {spec.node_id: Role(spec.role) for spec in nodes}
        self.engines_of = {spec.node_id: spec.engine_names() for spec in nodes}
        self.reader_of = {spec.node_id: spec.reader_name for spec in nodes}
        self.work = asyncio.Event()  # set while requests may be in flight: the watch runs

    # --- the loop -----------------------------------------------------------------------

    async def run(self) -> None:
        runtime = self.cfg.runtime
        while True:
            if not self._watching():
                self.work.clear()
                await self.work.wait()  # nothing in flight: sleep until something is submitted
            await asyncio.sleep(runtime.heartbeat_s)
            await self.beat()

    async def heed(self, accepted: asyncio.Queue[tuple[str, str]]) -> None:
        """The incarnation that took each task push (Decisions.accepted), as it comes: an answer
        like any other, which may prove a restart. One that raises (a bug) is logged and never
        stops the answers after it."""
        while True:
            engine, incarnation = await accepted.get()
            try:
                self.observe(engine, incarnation)
            except Exception:  # noqa: BLE001 - see the docstring
                LOG.exception("the answer of %s to a push (incarnation %s) could not be handled", engine, incarnation)

    def _watching(self) -> bool:
        return bool(self.core.requests or self.adoptions.holders or self.core.presumed_dead
                    or self.core.readers_unavailable)

    def heard_from(self, name: str, same_process: bool) -> None:
        """`name` reported or answered: it is alive (a presumed-dead engine is taken back).
        `same_process`: the incarnation that answered is the one known before."""
        self.liveness.answered(name)
        if not is_reader(name):
            self._readmit(name, same_process)

    async def beat(self) -> None:
        """One heartbeat round: on a sweep, every engine in use (and those presumed dead, to
        take them back when they answer) and the readers of their nodes; otherwise only those
        not heard from since the last beat. Attempts are judged on sweeps only (they need what
        every engine holds)."""
        timeout_s = self.cfg.runtime.heartbeat_timeout_s
        in_use = (self.core.dispatcher.engines_in_use() | self.adoptions.engines()) - self.core.dead
        readers = {self.reader_of[self.node_of[e]] for e in in_use}
        always = (self.core.presumed_dead - self.core.dead) | {self.reader_of[n] for n in self.core.readers_unavailable}
        plan = self.liveness.plan(in_use | readers, always)
        engines = sorted(name for name in plan.ask if not is_reader(name))
        nodes = sorted(reader_node(name) for name in plan.ask if is_reader(name))
        held, silent = await self._ask_all(engines, nodes, timeout_s)
        if plan.sweep:
            self._judge(held, silent, timeout_s)

    async def probe(self, names: set[str]) -> None:
        """Ask these engines and readers now (the peers of an attempt that failed because one
        of them died), so that its retry is placed knowing which are gone; a silent one is left
        to the heartbeat."""
        names = names - {reader_name(n) for n in self.core.readers_dead} - self.core.dead
        engines = sorted(name for name in names if not is_reader(name))
        nodes = sorted(reader_node(name) for name in names if is_reader(name))
        await self._ask_all(engines, nodes, self.cfg.runtime.heartbeat_timeout_s)

    async def _ask_all(
        self, engines: list[str], nodes: list[str], timeout_s: float,
    ) -> tuple[dict[str, dict[str, Holding]], set[str]]:
        """Ask and act on the answers: (what each engine that answered holds, those silent)."""
        answers, queues = await asyncio.gather(
            asyncio.gather(*(self._holds(e, timeout_s) for e in engines)),
            asyncio.gather(*(self._queue(n, timeout_s) for n in nodes)),
        )
        self.calls.heartbeats += len(engines) + len(nodes)
        for node, (answer, state) in zip(nodes, queues):
            self._reader_seen(node, answer, state)
        held: dict[str, dict[str, Holding]] = {}
        silent: set[str] = set()
        for engine, (answer, state) in zip(engines, answers):
            if answer is not None:
                self.observe(engine, answer.incarnation)
                self.engine_ready(engine, answer.ready)
                held[engine] = answer.held
            elif engine in self.core.presumed_dead:
                if state is PeerState.DEAD:
                    self._confirm_death(engine)
            elif state in (PeerState.DEAD, PeerState.RESTARTING) or self.liveness.missed(engine):
                # Ray restarting it means its process died: its attempts are lost, so they are
                # retried at once; its extents are reclaimed once the new incarnation shows.
                self.liveness.forget_engine(engine)
                self.engine_died(engine, confirmed=state is PeerState.DEAD)
            else:
                silent.add(engine)
        return held, silent

    def _confirm_death(self, engine: str) -> None:
        """An engine presumed dead from its silence that Ray now reports gone for good: it never
        comes back, and the extents its failed attempts leased are reclaimed."""
        self.core.engine_died(engine, confirmed=True)
        self._reclaim(list(self.unreclaimed.pop(engine, {})))

    def _judge(self, held: dict[str, dict[str, Holding]], silent: set[str], timeout_s: float) -> None:
        """With what every engine in use holds: lost attempts failed, lost handoff notes made
        up, adoptable requests no engine names dropped, stale holdings cancelled."""
        verdicts = self.liveness.check(self.core.requests.values(), held, silent)
        made_up = [rid for rid in verdicts.handed_off if self.core.handed_off(rid)]  # lost handoff notes
        for spec in verdicts.lost:
            self.calls.lost_assignments += 1
            LOG.warning("attempt %s is held by no live engine: failed, retried", spec.owner)
            self.fail(spec, SCHEDULER, "no live engine holds this attempt")
        # What a lost attempt leased is reclaimed too: the process that staged it is gone without
        # the scheduler seeing it hold the attempt (a killed engine's tasks whose push it never saw
        # fail), and no live engine names it, so nothing will move KV into its extents or free them.
        self._reclaim([spec.owner for spec in verdicts.lost])
        self.adoptions.check(held, silent, self.liveness.clock(), timeout_s)
        for engine, owner in self.core.stale_holdings(held):
            self.calls.stale_holdings += 1
            self.control.cancel(engine, owner)
        if made_up:
            self.changed()  # those prefill engines are lighter

    async def _holds(self, engine: str, timeout_s: float) -> tuple[EngineHoldings | None, PeerState]:
        """What `engine` holds (None when it does not answer), and what its silence says: gone
        for good (DEAD), restarting, or only silent (hung, its worker loop died, the answer lost)."""
        return await self._ask(engine, lambda handle: handle.holds.remote(engine), timeout_s)

    async def _queue(self, node: str, timeout_s: float) -> tuple[tuple[str, int] | None, PeerState]:
        return await self._ask(self.reader_of[node], lambda handle: handle.queue_report.remote(), timeout_s)

    async def _ask(self, name: str, call: Callable[[Any], Any], timeout_s: float) -> tuple[Any, PeerState]:
        try:
            handle = self.control.handle(name)
        except ValueError:
            return None, PeerState.DEAD
        try:
            answer = await asyncio.wait_for(asyncio.wrap_future(call(handle).future()), timeout_s)
        except ray.exceptions.RayActorError as exc:
            return None, peer_state_of(exc)
        except Exception:  # noqa: BLE001 - hung, its worker loop died, or the answer was lost
            return None, PeerState.SILENT
        return answer, PeerState.ALIVE

    # --- adoption after a restart of the scheduler --------------------------------------

    async def learn_holdings(self) -> None:
        """Before a restarted scheduler serves: what every engine holds of the dead
        incarnation's attempts; those not handed off yet are cancelled (runtime/control/adoption.py)."""
        engines = self.control.engines
        answers = await asyncio.gather(*(self._holds(e, self.cfg.runtime.heartbeat_timeout_s) for e in engines))
        for engine, (answer, _) in zip(engines, answers):
            if answer is not None:
                self.incarnations.observe(engine, answer.incarnation)
                self.core.engine_readiness(engine, answer.ready)
            for owner in self.adoptions.learn(engine, answer.held if answer is not None else {}):
                self.control.cancel(engine, owner)
        self.calls.adoptable = len(self.adoptions.holders)

    # --- engines ------------------------------------------------------------------------

    def engine_died(self, engine: str, confirmed: bool) -> None:
        self.calls.dead_engines += 1
        self.calls.presumed_dead += not confirmed
        owners = []
        for spec in self.core.engine_died(engine, confirmed):
            self.fail(spec, engine, f"engine {engine} died")
            owners.append(spec.owner)
        if confirmed:
            self._reclaim(owners + list(self.unreclaimed.pop(engine, {})))
        else:
            # Not from an engine that only stopped answering: it may still move KV into the
            # extents, and a slot freed under a transfer would damage its next owner's KV.
            kept = self.unreclaimed.setdefault(engine, {})
            kept.update(dict.fromkeys(owners))
            while len(kept) > MAX_UNRECLAIMED:
                del kept[next(iter(kept))]
        self.changed()

    def engine_ready(self, engine: str, ready: bool) -> None:
        """Whether `engine` holds the published weights and takes work (a restarted engine
        catching up does not: runtime/engine/held_weights.py); a change asks every group again."""
        if self.core.engine_readiness(engine, ready):
            self.calls.unready_engines += not ready
            self.changed()

    def _readmit(self, engine: str, same_process: bool) -> None:
        """An engine presumed dead answered: a loaded host is slow, not dead (its earlier
        attempts were failed already; the heartbeat cancels what they still hold)."""
        if self.core.readmit(engine):
            if same_process:
                # It frees what its failed attempts leased when their cancels come. (A new
                # process's answer reclaims them instead: see observe.)
                self.unreclaimed.pop(engine, None)
            self.changed()

    def woke(self, engine: str, incarnation: str) -> None:
        """`engine` woke from sleep as `incarnation` (its addressing renewed): a wake, not a
        restart, so nothing that depended on it is failed."""
        self.incarnations.known[engine] = incarnation

    def observe(self, name: str, incarnation: str) -> None:
        """A new incarnation of an engine or reader proves its old process gone: fail (and so
        retry) what depended on it, reclaim what its attempts leased, and let it work again."""
        restarted = self.incarnations.observe(name, incarnation)
        self.heard_from(name, same_process=not restarted)
        if not restarted:
            return
        if is_reader(name):
            node = reader_node(name)
            self.calls.restarted_readers += 1
            self.readers.set(node, PeerState.ALIVE)
            for spec in self.core.reader_restarted(node):
                self.fail(spec, name, "storage reader restarted")
            self.changed()
            return
        self.calls.restarted_engines += 1
        self.liveness.forget_engine(name)
        owners = []
        for spec in self.core.engine_restarted(name):
            self.fail(spec, name, f"engine {name} restarted")
            owners.append(spec.owner)
        self._reclaim(owners + list(self.unreclaimed.pop(name, {})))
        self.changed()

    def _reclaim(self, owners: list[str]) -> None:
        """Take back the extents lent to these attempts, whose engine is certainly gone."""
        for owner in owners:
            for reader in self.reader_of.values():
                self.control.reclaim(reader, owner)

    # --- readers ------------------------------------------------------------------------

    def _reader_seen(self, node: str, answer: tuple[str, int] | None, state: PeerState) -> None:
        """A reader's heartbeat answer: its incarnation and read queue, or why it was silent."""
        if answer is not None:
            incarnation, read_q = answer
            self.observe(self.reader_of[node], incarnation)
            self.core.dispatcher.report_read_q(node, read_q)
        self.reader_state(node, state)

    def reader_state(self, node: str, state: PeerState) -> None:
        """Act on what is known of a node's reader (see SchedulerCore.note_report)."""
        if state is PeerState.DEAD and node not in self.core.readers_dead:
            self.calls.dead_readers += 1
        elif state in (PeerState.SILENT, PeerState.RESTARTING):
            self.calls.reader_unavailable += 1
        changed = self.readers.set(node, state)
        role = self.role_of[node]
        report = GroupReport(f"{role.value}/{node}", node, self._loads_of(node), None, state)
        for spec in self.core.note_report(role, report):
            self.fail(spec, self.reader_of[node], "storage reader died")
        if changed:
            self.changed()

    def _loads_of(self, node: str) -> tuple[EngineLoad, ...]:
        """The node's engines in service (what a reader's death fails, on a decode node)."""
        out = self.core.out_of_service()
        return tuple(EngineLoad(e, node, 0, 0) for e in self.engines_of[node] if e not in out)
