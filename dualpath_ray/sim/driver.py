"""The scheduler side of a simulation: the runtime's SchedulerCore, asked by the runtime's rounds.

Every decision (hit lookup, decode placement, prefill placement, read path) is the scheduler
core's (scheduling/scheduler.py), and *when* each group is asked is decided by the very rounds
the runtime's Scheduler actor runs (scheduling/rounds.py): a decode round on every submit and
finished turn, a prefill round on every placement and handoff, a group's report refreshed at
most `scheduler.report_interval_ms` after its loads or read queue changed. The simulator only
supplies the clock (its event loop) and the reports (its simulated engines and nodes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from dualpath_ray.protocol.messages import PeerState
from dualpath_ray.scheduling.loads import EngineLoad
from dualpath_ray.scheduling.rounds import EventTimers, Outputs, Rounds
from dualpath_ray.scheduling.scheduler import SchedulerCore
from dualpath_ray.sim.decode import SimDecodeEngine
from dualpath_ray.sim.events import EventLoop
from dualpath_ray.sim.nodes import SimNode
from dualpath_ray.sim.prefill import SimPrefillEngine


@dataclass(eq=False)
class SimGroup:
    """A simulated node's engines, as the rounds report them (a `GroupView`)."""

    group_id: str
    node: SimNode
    engines: Sequence[SimPrefillEngine] | Sequence[SimDecodeEngine]

    @property
    def node_id(self) -> str:
        return self.node.node_id

    def loads(self) -> tuple[EngineLoad, ...]:
        return tuple(e.load() for e in self.engines)

    def read_q(self, now: float) -> int:
        return self.node.read_queue.tokens(now)

    def reader_state(self) -> PeerState:
        return PeerState.ALIVE


def sim_rounds(
    loop: EventLoop, core: SchedulerCore, prefill: list[SimGroup], decode: list[SimGroup],
    pull_delay_s: float, report_interval_s: float, beta: int, outputs: Outputs,
) -> Rounds:
    return Rounds(EventTimers(loop), core, prefill, decode, pull_delay_s, report_interval_s, beta, outputs)
