"""One simulation: a cluster of simulated nodes and engines around the runtime's scheduler core.

`simulate(cfg, workload, mode)` builds the P/D topology of `cfg` (the same config tree as the
runtime), runs every trajectory of `workload` to its end and returns a `SimResult`. Only the
engines, readers, NICs and DRAM are simulated (sim/prefill.py, sim/decode.py, sim/nodes.py);
every scheduling decision is the scheduler core's, asked when the runtime's rounds ask it
(scheduling/rounds.py, sim/driver.py), and every engine time and KV size is model/cost.py's.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import NamedTuple, Sequence

from dualpath_ray.config import DualPathConfig
from dualpath_ray.protocol.messages import DecodeReservation, PersistedBlock, PrefillTask, RequestSpec, TurnResult
from dualpath_ray.model.cost import prefill_forward_ms
from dualpath_ray.scheduling.core_settings import CoreSettings, compute_path_model, sharing_model
from dualpath_ray.scheduling.scheduler import SchedulerCore
from dualpath_ray.protocol.types import READ_SIDES, Mode, Role, StopReason
from dualpath_ray.sim.agents import Agent, Agents
from dualpath_ray.sim.decode import SimDecodeEngine, SimDecodeJob, SimDecodeStats
from dualpath_ray.scheduling.rounds import Outputs
from dualpath_ray.sim.driver import SimGroup, sim_rounds
from dualpath_ray.sim.events import EventLoop
from dualpath_ray.sim.index import ChainIndex, TreeIndex
from dualpath_ray.sim.nodes import SimNode, engine_ids, node_ids
from dualpath_ray.sim.prefill import SimPrefillEngine, SimPrefillJob, SimPrefillStats, PrefillUnit
from dualpath_ray.sim.results import (
    SimResult, TurnLog, engine_totals_balance, high_load_balance, snic_series, summary, weighted_balance, weighted_fill,
)
from dualpath_ray.sim.settings import SimOptions, settings_for
from dualpath_ray.sim.round_robin import RoundRobinPaths
from dualpath_ray.sim.staged import StagedReads
from dualpath_ray.sim.staging import Stager
from dualpath_ray.sim.workload import Workload, block_key


class Published(NamedTuple):
    """A published block as SchedulerCore.finish reads it (PersistedBlock's fields), cheaper to make."""

    key: int
    parent: int | None


class Simulation:
    def __init__(self, cfg: DualPathConfig, workload: Workload, mode: Mode | str, options: SimOptions) -> None:
        self.cfg = cfg
        self.workload = workload
        self.settings = settings = settings_for(cfg, mode, options)
        self.loop = loop = EventLoop()
        self.core = self._core()
        cluster = cfg.cluster
        self.prefill_nodes = [SimNode(n, Role.PREFILL, settings) for n in node_ids(Role.PREFILL, cluster.prefill_nodes)]
        self.decode_nodes = [SimNode(n, Role.DECODE, settings) for n in node_ids(Role.DECODE, cluster.decode_nodes)]
        self.prefill_stats, self.decode_stats = SimPrefillStats(), SimDecodeStats()
        self.prefill_engines: dict[str, SimPrefillEngine] = {}
        self.units: dict[str, PrefillUnit] = {}
        prefill_groups = [self._prefill_node(node) for node in self.prefill_nodes]
        self.decode_engines: dict[str, SimDecodeEngine] = {}
        self.decode_groups: dict[str, SimGroup] = {}
        stored = self._prompt_stored if self.core.dispatcher.sharing is not None else None
        for node in self.decode_nodes:
            engines = [SimDecodeEngine(e, node, settings, loop, self._finished, self.decode_stats, stored)
                       for e in engine_ids(Role.DECODE, node.node_id, cluster.gpus_per_node)]
            self.decode_engines.update({e.engine_id: e for e in engines})
            group = SimGroup(f"{Role.DECODE}/{node.node_id}", node, engines)
            self.decode_groups.update({e.engine_id: group for e in engines})
        self.driver = sim_rounds(
            loop, self.core, prefill_groups, list(dict.fromkeys(self.decode_groups.values())), options.pull_delay_s,
            settings.report_interval_s, settings.constants.beta_tokens, Outputs(self._reserve, self._assign),
        )
        # Tool-time staging (scheduler.stage_tool_time): the decode nodes' readers act on the core's orders.
        self.staged = StagedReads(loop, settings, self.decode_nodes) if settings.staging.enabled else None
        self.stager = Stager(loop, settings, self._kick, self.driver.read_queue_changed, self.staged)
        self.agents = Agents(loop, workload, self._submit, options.warmup_turns, cfg.model.max_context)
        self.log = TurnLog()
        self._reserved_at: dict[str, float] = {}  # request id -> when its decode reservation was made

    def _core(self) -> SchedulerCore:
        settings = self.settings
        index = TreeIndex(settings.block_size) if self.workload.tree else ChainIndex(settings.block_size)
        cost = settings.cost
        def prefill_s(cached: int, new: int) -> float:
            return prefill_forward_ms(cost, [(cached, new)]) / 1000.0

        compute_path = compute_path_model(self.cfg, settings.constants, prefill_s)
        core_settings = CoreSettings(settings.mode, settings.block_size, settings.constants, read_split=settings.read_split,
                                     decode_groups=self.cfg.cluster.decode_nodes, staging=settings.staging,
                                     compute_path=compute_path, bind_hits=self.cfg.scheduler.bind_hits,
                                     share_in_flight=sharing_model(self.cfg, settings.constants, prefill_s),
                                     early_prompt_publish=True, partial_block_hits=self.cfg.partial_block_hits)
        loop = self.loop
        core = SchedulerCore(core_settings, index, clock=lambda: loop.now)  # type: ignore[arg-type]
        if settings.options.path_choice == "round_robin":
            core.dispatcher = RoundRobinPaths(settings.constants, settings.mode, settings.read_split, compute_path,
                                              core.binder, core.dispatcher.sharing)
        return core

    def _prefill_node(self, node: SimNode) -> SimGroup:
        engines = [SimPrefillEngine(e, node, self.settings)
                   for e in engine_ids(Role.PREFILL, node.node_id, self.cfg.cluster.gpus_per_node)]
        self.prefill_engines.update({e.engine_id: e for e in engines})
        members = [engines] if self.settings.lockstep_prefill else [[e] for e in engines]
        for unit_engines in members:
            unit = PrefillUnit(unit_engines, self.loop, self.settings, self._hand_off, self.prefill_stats)
            self.units.update({e.engine_id: unit for e in unit_engines})
        return SimGroup(f"{Role.PREFILL}/{node.node_id}", node, engines)

    # --- requests in and out -------------------------------------------------------------

    def _submit(self, spec: RequestSpec, agent: Agent) -> None:
        self.agents.by_request[spec.request_id] = agent
        self.driver.submit(spec)

    def _reserve(self, reservation: DecodeReservation) -> None:
        self._reserved_at[reservation.request_id] = self.loop.now
        self.decode_engines[reservation.decode_engine].accept(reservation)

    def _assign(self, tasks: Sequence[PrefillTask], now: float) -> None:
        for task in tasks:
            pe_blocks = task.pe_blocks  # the dispatcher's: all hits (PE), none (DE) or a share (split)
            de_blocks = len(task.hit_keys) - pe_blocks  # a partial hit's last block is read whole
            decode = self.decode_engines[task.decode_engine]
            job = SimPrefillJob(
                task, len(task.request.prompt), task.hit_tokens, pe_blocks, de_blocks, decode, decode.node, decode.links,
                reserved_at=self._reserved_at.pop(task.request_id, now), assigned_at=now,
            )
            engine = self.prefill_engines[task.prefill_engine]
            engine.add(job)
            self._log_decision(task)
            self.stager.stage(job, engine.node, now)

    def _measured(self, agent: Agent, submitted_at: float) -> bool:
        options = self.settings.options
        return self.agents.timed(agent) and options.measure_from_s <= submitted_at < options.measure_until_s

    def _log_decision(self, task: PrefillTask) -> None:
        agent = self.agents.by_request[task.request_id]
        if not self._measured(agent, task.request.submitted_at):
            return
        if task.hit_tokens:
            self.log.by_path[task.path.value] += 1
        if self.settings.options.record_decisions:
            self.log.decisions.append((task.request_id, task.decode_engine, task.prefill_engine, task.path.value))

    def _kick(self, engine_id: str, now: float) -> None:
        self.units[engine_id].kick(now)

    def _hand_off(self, job: SimPrefillJob, engine: SimPrefillEngine, now: float) -> None:
        if job.pe_blocks and not job.task.oracle:
            engine.node.buffer.release(now, job.pe_blocks)
        job.decode_engine.hand_off(job, now)  # type: ignore[attr-defined]
        self.driver.handed_off(job.request_id)

    def _prompt_stored(self, request_id: str) -> None:
        self.driver.prompt_persisted(request_id)

    def _finished(self, engine: SimDecodeEngine, decode: SimDecodeJob, now: float) -> None:
        job = decode.job
        assert job is not None
        agent = self.agents.by_request.pop(job.request_id)
        gen = job.task.request.sampling.max_new_tokens
        tpot = (now - job.first_token_at) / (gen - 1) if gen > 1 else 0.0
        ttft = job.first_token_at - job.task.request.submitted_at
        result = TurnResult(
            request_id=job.request_id, attempt=0, output_tokens=(), log_probs=(), stop_reason=StopReason.LENGTH,
            prompt_tokens=job.prompt, hit_tokens=job.task.hit_tokens, path=job.task.path,
            prefill_engine=job.task.prefill_engine, decode_engine=engine.engine_id, ttft_s=ttft, tpot_s=tpot,
            persisted=self._persisted(agent, job.task.stored_tokens, job.prompt + gen - 1),
        )
        self.driver.finish(result, self.decode_groups[engine.engine_id].group_id)
        if self.staged is not None:
            for order in self.core.take_stage_orders():
                self.staged.order(order, now)
        if self._measured(agent, job.task.request.submitted_at):
            self.log.ttft_s.append(ttft)
            if gen > 1:
                self.log.tpot_s.append(tpot)
            self.log.prompt_tokens += job.prompt
            self._log_ttft_parts(job)
            self.log.hit_tokens += job.task.hit_tokens
        delay = self.settings.options.result_delay_s
        if delay > 0:
            self.loop.at(now + delay, self.agents.turn_done, agent)
        else:
            self.agents.turn_done(agent)

    def _log_ttft_parts(self, job: SimPrefillJob) -> None:
        parts = self.log.ttft_parts
        parts["decode_wait"] += job.reserved_at - job.task.request.submitted_at
        parts["prefill_wait"] += job.assigned_at - job.reserved_at
        parts["staging"] += job.staged_at - job.assigned_at
        parts["prefill"] += job.first_token_at - job.staged_at

    def _sharing(self) -> dict[str, float]:
        sharing = self.core.dispatcher.sharing
        wait_s = sum(sharing.stats.wait_s.values()) if sharing is not None else 0.0
        return {**self.core.sharing_counts(), **({"wait_s": wait_s} if sharing is not None else {})}

    def _persisted(self, agent: Agent, hit_tokens: int, kv_tokens: int) -> tuple[PersistedBlock, ...]:
        """The blocks this turn published: every full block of its KV after its hits."""
        size, tree, trajectory = self.settings.block_size, self.workload.tree, agent.trajectory
        first, end = hit_tokens // size, kv_tokens // size
        parent = block_key(trajectory, first - 1, tree) if first else None
        blocks = []
        for position in range(first, end):
            key = block_key(trajectory, position, tree)
            blocks.append(Published(key, parent))
            parent = key
        return tuple(blocks)  # type: ignore[return-value]

    # --- the run ---------------------------------------------------------------------------

    def run(self) -> SimResult:
        started = time.perf_counter()
        self.driver.start()
        self.agents.start()
        self.loop.run(self.settings.options.until_s)
        if self.staged is not None:
            self.staged.close(self.loop.now)
        wall = time.perf_counter() - started
        return self._result(wall)

    def _result(self, wall_s: float) -> SimResult:
        stats = self.agents.stats
        end = self.loop.now
        timed_from = stats.timed_from
        jct = stats.last_finish - timed_from if stats.finished else end - timed_from
        nodes = self.prefill_nodes + self.decode_nodes
        driver = self.driver.stats
        simulated = max(end, 1e-9)
        prefill = self.prefill_stats
        series = snic_series({n.node_id: n.snic_windows.bytes_by_window for n in nodes},
                             self.settings.options.snic_window_s, timed_from, end)
        balance, window = high_load_balance(series)
        origin = int(timed_from / self.settings.options.snic_window_s) * self.settings.options.snic_window_s
        loaded = (window.start_s + origin, window.end_s + origin) if window else None
        span = loaded or (timed_from, end)
        busy = prefill.busy_s / max(1e-9, end * len(set(self.units.values())))
        return SimResult(
            mode=self.settings.mode.value, jct_s=jct, trajectories=stats.finished, turns=len(self.log.ttft_s),
            ttft_s=summary(self.log.ttft_s), tpot_s=summary(self.log.tpot_s), ttft_parts_s=self.log.ttft_parts_mean(),
            requests_by_path=dict(self.log.by_path),
            hit_rate=self.log.hit_tokens / self.log.prompt_tokens if self.log.prompt_tokens else 0.0,
            recomputed_hit_tokens=self.core.dispatcher.recomputed_hit_tokens,
            sharing=self._sharing(),
            snic_read_bytes={n.node_id: n.snic_read.bytes_total for n in nodes},
            snic_read_bytes_by_path={p.value: sum(n.read_bytes_by_path[p] for n in nodes) for p in READ_SIDES},
            snic_write_bytes={n.node_id: n.snic_write.bytes_total for n in nodes},
            snic_balance=balance, snic_window_s=loaded,
            attention_balance=weighted_balance(prefill.balance, *span),
            attention_balance_all=weighted_balance(prefill.balance, 0.0, end),
            attention_fill=weighted_fill(prefill.balance, *span),
            attention_balance_full_rounds=weighted_balance(prefill.balance, *span, min_fill=0.9),
            attention_engine_totals=engine_totals_balance(
                [[e.engine_id for e in unit.engines] for unit in set(self.units.values())], prefill.engine_ms,
                *(int(t / self.settings.options.snic_window_s) for t in span)),
            alpha_tokens=self.settings.constants.alpha_tokens, beta_tokens=self.settings.constants.beta_tokens,
            scheduler_cpu_s=driver.cpu_s, scheduler_cpu_per_sim_s=driver.cpu_s / simulated,
            scheduler_calls={"calls": driver.calls, "decode_pulls": driver.decode_pulls,
                             "prefill_pulls": driver.prefill_pulls},
            simulated_s=end, events=self.loop.events, wall_s=wall_s,
            engines={"prefill_busy": busy, "prefill_rounds": prefill.rounds, "prefill_chunks": prefill.chunks,
                     "decode_steps": self.decode_stats.steps, "decode_max_batch": self.decode_stats.max_batch},
            quota_scope=str(self.settings.options.quota_scope),
            decisions=self.log.decisions, staging=self._staging(),
            trajectory_jct_s={a.trajectory.trajectory_id: a.finished_at - (timed_from if self.agents.warmup_turns else a.trajectory.arrival_s)
                              for a in self.agents.agents if a.finished_at >= 0} if len(self.agents.agents) <= 4096 else {},
        )

    def _staging(self) -> dict[str, int]:
        """Tool-time staging's counters: the readers' (sim/staged.py), the core's book's
        (`claimed` at submit) and placements that could not honour a claim (`placed_elsewhere`)."""
        if self.staged is None:
            return {}
        book = self.core.staging.stats
        return {**asdict(self.staged.counters), "claimed": book.claimed, "claimed_blocks": book.claimed_blocks,
                "placed_elsewhere": self.core.dispatcher.staged_missed}


def simulate(
    cfg: DualPathConfig, workload: Workload, mode: Mode | str | None = None, options: SimOptions = SimOptions()
) -> SimResult:
    """Run `workload` on the simulated cluster of `cfg` in `mode` (default: runtime.mode)."""
    return Simulation(cfg, workload, mode if mode is not None else cfg.runtime.mode, options).run()
