"""Agents: each trajectory's turns, sent one at a time as the runtime's rollout sends them.

Turn k+1 is submitted when turn k's result is back, after turn k+1's tool latency; its prompt is
the whole context so far (every earlier appended and generated token) plus what it appends
(api/rollout.py). A turn followed by one after a tool latency carries that latency as its hint
that the session continues (`RequestSpec.expect_next_turn_s`, what the rollout passes on from its
trace), which tool-time staging acts on (scheduling/staging.py, sim/staged.py). With `warmup_turns`, every trajectory first runs that many turns, and the
timed phase starts when the last of them is done, all trajectories resuming at once (as
benchmarks/demo_jct.py's untimed first turns and resumed rollout do).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from dualpath_ray.config import ConfigError
from dualpath_ray.protocol.messages import RequestSpec, SamplingParams
from dualpath_ray.sim.events import EventLoop
from dualpath_ray.sim.index import SimPrompt
from dualpath_ray.sim.workload import SimTrajectory, Workload

NAMESPACE = "sim"


@dataclass(eq=False)
class Agent:
    trajectory: SimTrajectory
    turn: int = 0
    context: int = 0  # tokens before this turn's appended ones
    prompt: int = 0  # this turn's prompt
    finished_at: float = -1.0


@dataclass
class AgentStats:
    timed_from: float = 0.0  # the timed phase's start
    finished: int = 0
    jct_s: list[float] = field(default_factory=list)  # per trajectory, timed phase only
    last_finish: float = 0.0


def next_turn_hint(trajectory: SimTrajectory, turn: int) -> float | None:
    """The tool latency before turn `turn` + 1 when there is such a turn and it waits for a tool
    (> 0), else None: no hint, nothing staged."""
    following = turn + 1
    if following >= trajectory.turns:
        return None
    latency = float(trajectory.tool_latency_s[following])
    return latency if latency > 0 else None


class Agents:
    def __init__(
        self, loop: EventLoop, workload: Workload, submit: Callable[[RequestSpec, Agent], None], warmup_turns: int,
        max_context: int,
    ) -> None:
        self.loop = loop
        self.submit = submit
        self.warmup_turns = warmup_turns
        self.agents = [Agent(t) for t in workload.trajectories]
        self.stats = AgentStats()
        self.by_request: dict[str, Agent] = {}
        self._warming = 0
        self._check_context(max_context)

    def _check_context(self, max_context: int) -> None:
        for agent in self.agents:
            t = agent.trajectory
            final = int(t.appended.sum() + t.gen.sum())
            if final > max_context:
                raise ConfigError(
                    f"model.max_context ({max_context}) is below trajectory {t.trajectory_id}'s context of {final} "
                    "tokens; raise model.max_context (and cluster.prefill_hbm_tokens, which must be at least that)"
                )

    def start(self) -> None:
        warm = self.warmup_turns > 0
        for agent in self.agents:
            if warm:
                self._warming += 1
            self.loop.at(0.0 if warm else agent.trajectory.arrival_s, self._send, agent)

    def timed(self, agent: Agent) -> bool:
        """Whether the agent's current turn belongs to the timed phase."""
        return agent.turn >= self.warmup_turns

    def _send(self, agent: Agent) -> None:
        t = agent.trajectory
        k = agent.turn
        agent.prompt = agent.context + int(t.appended[k])
        prompt = SimPrompt(agent.prompt, t.chain, t.keys)
        spec = RequestSpec(
            f"{t.trajectory_id}/t{k}", 0, prompt, SamplingParams(max_new_tokens=int(t.gen[k])),  # type: ignore[arg-type]
            NAMESPACE, self.loop.now, expect_next_turn_s=next_turn_hint(t, k),
        )
        self.submit(spec, agent)

    def turn_done(self, agent: Agent) -> None:
        """Its current turn's result is back: send the next one (after its tool latency), or end."""
        now = self.loop.now
        t = agent.trajectory
        agent.context = agent.prompt + int(t.gen[agent.turn])
        agent.turn += 1
        if agent.turn == self.warmup_turns:
            self._warming -= 1
            if self._warming == 0:
                self._resume_all()
            return
        if agent.turn >= t.turns:
            self._end(agent, now)
            return
        self.loop.at(now + float(t.tool_latency_s[agent.turn]), self._send, agent)

    def _resume_all(self) -> None:
        now = self.loop.now
        self.stats.timed_from = now
        for agent in self.agents:
            if agent.turn >= agent.trajectory.turns:
                self._end(agent, now)
            else:
                self.loop.at(now + float(agent.trajectory.tool_latency_s[agent.turn]), self._send, agent)

    def _end(self, agent: Agent, now: float) -> None:
        agent.finished_at = now
        start = self.stats.timed_from if self.warmup_turns else agent.trajectory.arrival_s
        self.stats.finished += 1
        self.stats.jct_s.append(now - start)
        self.stats.last_finish = max(self.stats.last_finish, now)
