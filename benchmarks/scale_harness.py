"""The real Scheduler actor at the paper's 48P96D: the turns/s it sustains and the CPU it takes.

    .venv/bin/python benchmarks/scale_harness.py                       # about 2 minutes
    .venv/bin/python benchmarks/scale_harness.py --agents 1500 --measure-s 60 --json out.json

The scheduler under test is the deployment's own Scheduler actor (runtime/control/scheduler.py), with
its rounds, books, heartbeat watchdog, client mailboxes, report channel and Ray calls. Everything around it is
simulated, in two processes, so that one 2-core machine can drive a 1,152-GPU cluster:

- **engines and readers** (`SimulatedNodes`, one Ray actor answering for all 48 prefill and 96
  decode nodes of 8 engines, and their 144 readers; the scheduler reaches them through its
  `routes`): a prefill engine takes the tasks pushed to it (`accept`), "prefills" them as one
  batch for `--prefill-ms`, hands each request to its decode engine and notes the handoffs in
  one report; the decode engine "decodes" for `--decode-ms` and reports the result at the end
  of a step (`--step-ms`), with the blocks the turn persisted (real chained block keys, so later
  turns hit). Each engine reports for itself, once per step with something to say, exactly as a
  real engine does: no call is merged across engines. Readers tell the scheduler their read
  queues (hit tokens of the requests prefilling on their side) when they change, at most every
  `scheduler.report_interval_ms`. Engines and readers answer the scheduler's heartbeats.
- **callers** (this driver): `--agents` agent loops sharing one `SchedulerClient`, each sending
  its next turn when the last one's result is back: its context grows by the turn's output and
  `--appended` tokens, from `--first` tokens up to `--max-len`, then a new trajectory starts.

After `--warmup-s`, for `--measure-s` seconds: turns finished per second, the CPU seconds of the
scheduler's process (/proc) per turn and in cores, the same for the two simulating processes,
and the scheduler's calls per turn by kind. The machine's two cores run all three processes, so
the rate is what this machine allows, not the scheduler's ceiling: the CPU per turn is the
figure that scales (x 2,500 turns/s = the cores the paper's rate would take).

The store at capacity (`--cases not-full,full --repeat 3`, alternating, each on a fresh Ray
session): both cases give the memory store a capacity of `--store-blocks` Full Blocks (so the
scheduler keeps its LRU order in both); `full` first seeds the scheduler's index with that many
blocks (chains of `SEED_DEPTH`, inserted into the running actor's index, the way a rebuilt index
starts: cheap, no store writes), so every finished turn evicts about as many blocks as it
published. `default` is the harness as it was: no capacity, nothing ordered or evicted.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import json
import os
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import ray  # noqa: E402

from dualpath_ray.api.client import SchedulerClient  # noqa: E402
from dualpath_ray.api.validation import make_spec  # noqa: E402
from dualpath_ray.config import DualPathConfig, parse_config  # noqa: E402
from dualpath_ray.kv.index import next_block_key  # noqa: E402
from dualpath_ray.kv.layout import KVLayout  # noqa: E402
from dualpath_ray.protocol.messages import (  # noqa: E402
    EngineHoldings, EngineReport, Holding, PersistedBlock, PrefillTask, ReaderReport, SamplingParams, TurnResult,
    newest_holdings,
)
from dualpath_ray.protocol.names import SCHEDULER, reader_name  # noqa: E402
from dualpath_ray.runtime.reporting.channel import ChannelAddress  # noqa: E402
from dualpath_ray.runtime.reporting.client import ReportClient  # noqa: E402
from dualpath_ray.runtime.control.scheduler import Scheduler  # noqa: E402
from dualpath_ray.runtime.placement.topology import plan_nodes  # noqa: E402
from dualpath_ray.protocol.types import ReadPath, StopReason  # noqa: E402
from dualpath_ray.runtime.telemetry.status_views import StatusQuery  # noqa: E402

NAMESPACE = "dualpath-scale"
SIM = "sim-nodes"
INCARNATION = "simulated"
# A prefill engine reports its batch's handoffs once their calls are delivered: about this long
# after the batch ends.
HANDOFF_REPORT_S = 0.002
# Blocks per seeded chain of the `full` case (a 4K-token context of 64-token blocks).
SEED_DEPTH = 64
CASES = ("default", "not-full", "full")


def paper_config(args: argparse.Namespace, case: str = "default") -> DualPathConfig:
    """48P96D of 8 engines per node, decode HBM for many long contexts, the memory store (with a
    capacity of --store-blocks in the not-full and full cases)."""
    cfg = parse_config({
        "model": {"max_context": args.max_len + 64},
        "cluster": {"prefill_nodes": 48, "decode_nodes": 96, "gpus_per_node": 8,
                    "hbm_tokens_per_engine": 1 << 20, "prefill_hbm_tokens": args.max_len + 64,
                    "snic_gbps": 400.0, "cnic_gbps": 400.0},
        "store": {"backend": "memory", "block_size": 64},
        "emulation": {"enabled": False},
        "runtime": {"namespace": NAMESPACE, "heartbeat_s": args.heartbeat_s, "metrics": False},
    }, source="<scale harness>")
    if case == "default":
        return cfg
    block_bytes = KVLayout.from_model(cfg.model, cfg.store.block_size).full_block_bytes
    return cfg.with_overrides(store={"capacity_bytes": args.store_blocks * block_bytes})


def seed_index(actor: Any, blocks: int) -> int:
    """Runs in the Scheduler actor: index `blocks` blocks in chains of SEED_DEPTH, as a store full
    of earlier trajectories' contexts (keys from a counter: valid, never a real prompt's)."""
    index = actor.plane.core.index
    for first in range(0, blocks, SEED_DEPTH):
        parent = None
        for i in range(first, min(blocks, first + SEED_DEPTH)):
            key = f"f{i:031x}"
            index.insert_block(key, parent)
            parent = key
    return len(index)


@dataclass
class Timing:
    prefill_s: float
    decode_s: float
    step_s: float
    report_interval_s: float


@dataclass
class _Engine:
    """A simulated engine: what it holds, and what its next step's report will say."""

    name: str
    held: dict[str, Holding] = field(default_factory=dict)
    noted: dict[str, Holding] = field(default_factory=dict)
    results: list[TurnResult] = field(default_factory=list)
    flush_due: bool = False


@ray.remote(num_cpus=0, max_concurrency=8)
class SimulatedNodes:
    """Every engine and reader of the cluster, answering the scheduler as the real ones do."""

    def __init__(self, cfg: DualPathConfig, timing: Timing, output_seed: int) -> None:
        self.cfg = cfg
        self.timing = timing
        self.block = cfg.store.block_size
        self.scheduler = ray.get_actor(SCHEDULER, namespace=NAMESPACE)
        self.engines = {name: _Engine(name) for spec in plan_nodes(cfg) for name in spec.engine_names()}
        self.read_q: Counter[str] = Counter()
        self.reported_q: dict[str, int] = {}
        self.report_due: set[str] = set()
        self.rng = np.random.default_rng(output_seed)
        self.calls: Counter[str] = Counter()
        self.channels: dict[str, ReportClient] = {}
        self._events: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._sequence = itertools.count()
        self._cond = threading.Condition()
        threading.Thread(target=self._run, name="sim", daemon=True).start()

    # --- what the scheduler calls ---------------------------------------------------------

    def accept(self, tasks: list[PrefillTask]) -> str:
        with self._cond:
            self.calls["accept"] += 1
            now = time.monotonic()
            for task in tasks:
                self.engines[task.prefill_engine].held[task.request_id] = Holding.of(task.request, False)
                side = task.prefill_node if task.path is ReadPath.PE else task.decode_node
                self.read_q[side] += task.hit_tokens
                self._queue_reader_report(side, now)
                self._at(now + self.timing.prefill_s, self._handed_off, (task, side))
        return INCARNATION

    def holds(self, engine: str) -> EngineHoldings:
        with self._cond:
            self.calls["holds"] += 1
            return EngineHoldings(INCARNATION, newest_holdings(self.engines[engine].held.items()))

    def queue_report(self) -> tuple[str, int]:
        self.calls["queue_report"] += 1
        return INCARNATION, 0

    def cancel(self, owner: str) -> None:
        self.calls["cancel"] += 1

    def abort(self, owner: str) -> None:
        self.calls["abort"] += 1

    def reclaim(self, owner: str) -> None:
        self.calls["reclaim"] += 1

    def call_counts(self) -> dict[str, int]:
        return dict(self.calls)

    def pid(self) -> int:
        return os.getpid()

    # --- the simulation -------------------------------------------------------------------

    def _at(self, when: float, action: Callable[[Any], None], argument: Any) -> None:
        heapq.heappush(self._events, (when, next(self._sequence), action, argument))
        self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._events or self._events[0][0] > time.monotonic():
                    self._cond.wait(self._events[0][0] - time.monotonic() if self._events else None)
                _, _, action, argument = heapq.heappop(self._events)
                action(argument)

    def _handed_off(self, item: tuple[PrefillTask, str]) -> None:
        task, side = item
        now = time.monotonic()
        self.read_q[side] -= task.hit_tokens
        self._queue_reader_report(side, now)
        prefill = self.engines[task.prefill_engine]
        del prefill.held[task.request_id]
        holding = Holding.of(task.request, True)
        self.engines[task.decode_engine].held[task.request_id] = holding
        prefill.noted[task.request_id] = holding  # its batch's handoffs leave in one report
        self._flush_soon(prefill, now, delay_s=HANDOFF_REPORT_S)
        self._at(now + self.timing.decode_s, self._decoded, task)

    def _decoded(self, task: PrefillTask) -> None:
        decode = self.engines[task.decode_engine]
        decode.results.append(self._result(task))
        self._flush_soon(decode, time.monotonic())

    def _flush_soon(self, engine: _Engine, now: float, delay_s: float | None = None) -> None:
        if not engine.flush_due:
            engine.flush_due = True
            self._at(now + (self.timing.step_s if delay_s is None else delay_s), self._flush, engine)

    def _flush(self, engine: _Engine) -> None:
        """The engine's step ends: one report with its handoffs taken and turns ended."""
        engine.flush_due = False
        noted, results = engine.noted, engine.results
        engine.noted, engine.results = {}, []
        for result in results:
            engine.held.pop(result.request_id, None)
        self.calls["report"] += 1
        self._channel(engine.name).send(EngineReport(engine.name, INCARNATION, noted, tuple(results)))

    def _queue_reader_report(self, node: str, now: float) -> None:
        if node not in self.report_due:
            self.report_due.add(node)
            self._at(now + self.timing.report_interval_s, self._reader_report, node)

    def _reader_report(self, node: str) -> None:
        self.report_due.discard(node)
        tokens = self.read_q[node]
        if self.reported_q.get(node) == tokens:
            return
        self.reported_q[node] = tokens
        self.calls["reader_report"] += 1
        reader = reader_name(node)
        self._channel(reader).send(ReaderReport(node, reader, INCARNATION, tokens))

    def _channel(self, sender: str) -> ReportClient:
        """The sender's own report channel to the scheduler, as each real engine and reader has."""
        channel = self.channels.get(sender)
        if channel is None:
            channel = self.channels[sender] = ReportClient(self._resolve, name=sender)
        return channel

    def _resolve(self) -> ChannelAddress:
        address: ChannelAddress = ray.get(self.scheduler.report_channel.remote())
        return address

    def _result(self, task: PrefillTask) -> TurnResult:
        """What the decode engine reports: its output and the full blocks the turn persisted
        (keys chained from the last hit block, as next_block_key extends them)."""
        spec = task.request
        gen = spec.sampling.max_new_tokens
        output = tuple(int(t) for t in self.rng.integers(0, self.cfg.model.vocab_size, gen))
        tokens = np.concatenate([spec.prompt, np.asarray(output[:-1], dtype=np.int64)])
        persisted, parent = [], task.hit_keys[-1] if task.hit_keys else None
        for block in range(task.hit_tokens // self.block, len(tokens) // self.block):
            key = next_block_key(parent, tokens[block * self.block : (block + 1) * self.block], spec.namespace)
            persisted.append(PersistedBlock(key, parent))
            parent = key
        return TurnResult(
            request_id=spec.request_id, attempt=spec.attempt, output_tokens=output, log_probs=(0.0,) * gen,
            stop_reason=StopReason.LENGTH, prompt_tokens=len(spec.prompt), hit_tokens=task.hit_tokens, path=task.path,
            prefill_engine=task.prefill_engine, decode_engine=task.decode_engine, ttft_s=0.0, tpot_s=0.0,
            persisted=tuple(persisted), epoch=spec.epoch,
        )


# --- callers ----------------------------------------------------------------------------------


@dataclass
class Tally:
    finished: int = 0
    failed: int = 0
    hit_tokens: int = 0
    prompt_tokens: int = 0


async def agent(index: int, client: SchedulerClient, cfg: DualPathConfig, args: argparse.Namespace, tally: Tally,
                stop: asyncio.Event) -> None:
    rng = np.random.default_rng(10_000 + index)
    vocab = cfg.model.vocab_size
    namespace = cfg.model.kv_namespace(block_size=cfg.store.block_size)
    for trajectory in itertools.count():
        context = rng.integers(0, vocab, args.first).astype(np.int64)
        for turn in itertools.count():
            if stop.is_set():
                return
            spec = make_spec(f"a{index}.{trajectory}/t{turn}", context, SamplingParams(max_new_tokens=args.gen), namespace)
            result = await client.generate(spec)
            if result.error:
                tally.failed += 1
                break
            tally.finished += 1
            tally.hit_tokens += result.hit_tokens
            tally.prompt_tokens += result.prompt_tokens
            appended = rng.integers(0, vocab, args.appended)
            context = np.concatenate([context, np.asarray(result.output_tokens, dtype=np.int64), appended])
            if len(context) + args.gen > args.max_len:
                break


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(args: argparse.Namespace, cfg: DualPathConfig, scheduler: Any, pids: dict[str, int],
                sim: Any) -> dict[str, Any]:
    client = SchedulerClient(scheduler, name="harness-callers")
    tally, stop = Tally(), asyncio.Event()
    agents = [asyncio.create_task(agent(i, client, cfg, args, tally, stop)) for i in range(args.agents)]
    await asyncio.sleep(args.warmup_s)
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    calls0 = (await scheduler.status.remote(StatusQuery.CALLS)).to_json()
    sim0 = await sim.call_counts.remote()
    turns0, t0 = tally.finished, time.monotonic()
    await asyncio.sleep(args.measure_s)
    elapsed = time.monotonic() - t0
    turns = tally.finished - turns0
    cpu = {name: cpu_seconds(pid) - cpu0[name] for name, pid in pids.items()}
    calls1 = (await scheduler.status.remote(StatusQuery.CALLS)).to_json()
    sim1 = await sim.call_counts.remote()
    stop.set()
    await asyncio.gather(*agents, return_exceptions=True)
    incoming = {k: calls1.get(k, 0) - calls0.get(k, 0) for k in ("submit", "collect", "report", "reader_report")}
    outgoing = {k: calls1.get(k, 0) - calls0.get(k, 0) for k in ("pushes", "heartbeats")}
    return {
        "turns": turns, "seconds": elapsed, "turns_per_s": turns / elapsed, "failed_turns": tally.failed,
        "hit_rate": tally.hit_tokens / max(1, tally.prompt_tokens),
        "evicted_blocks_per_turn": (calls1["evicted_blocks"] - calls0["evicted_blocks"]) / max(1, turns),
        "indexed_blocks": calls1["indexed_blocks"],
        "cpu_cores": {name: used / elapsed for name, used in cpu.items()},
        "cpu_ms_per_turn": {name: 1000.0 * used / max(1, turns) for name, used in cpu.items()},
        "scheduler_calls_per_turn": {k: v / max(1, turns) for k, v in {**incoming, **outgoing}.items()},
        "simulated_engine_calls": {k: sim1.get(k, 0) - sim0.get(k, 0) for k in sim1},
    }


def run_case(args: argparse.Namespace, case: str) -> dict[str, Any]:
    """One measurement on a fresh Ray session: the harness's figures for `case` (CASES)."""
    cfg = paper_config(args, case)
    # address="local": a new Ray instance every case, never one left over from the one before
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace=NAMESPACE, log_to_driver=True)
    try:
        nodes = plan_nodes(cfg)
        routes = {name: SIM for spec in nodes for name in [*spec.engine_names(), spec.reader_name]}
        scheduler = Scheduler.options(name=SCHEDULER, namespace=NAMESPACE).remote(cfg, None, "dualpath", routes)
        ray.get(scheduler.__ray_ready__.remote())
        timing = Timing(args.prefill_ms / 1000, args.decode_ms / 1000, args.step_ms / 1000,
                        cfg.scheduler.report_interval_ms / 1000)
        sim = SimulatedNodes.options(name=SIM, namespace=NAMESPACE).remote(cfg, timing, 7)
        ray.get(scheduler.ready.remote())
        seeded = 0
        if case == "full":
            started = time.monotonic()
            seeded = ray.get(scheduler.__ray_call__.remote(seed_index, args.store_blocks))
            print(f"  seeded {seeded:,} indexed blocks in {time.monotonic() - started:.1f} s", flush=True)
        pids = {"scheduler": ray.get(scheduler.__ray_call__.remote(lambda self: os.getpid())),
                "simulated engines and readers": ray.get(sim.pid.remote()), "callers (driver)": os.getpid()}
        figures = asyncio.run(drive(args, cfg, scheduler, pids, sim))
    finally:
        ray.shutdown()
    return {"case": case, "seeded_blocks": seeded, **figures}


def print_figures(figures: dict[str, Any], agents: int) -> None:
    print(f"48P96D (1,152 engines), {agents} agents, {figures['case']}: {figures['turns_per_s']:.0f} turns/s "
          f"(hit rate {figures['hit_rate']:.2f}, {figures['failed_turns']} failed, "
          f"{figures['evicted_blocks_per_turn']:.2f} blocks evicted per turn, {figures['indexed_blocks']:,} indexed)")
    for name, cores in figures["cpu_cores"].items():
        print(f"  {name}: {cores:.2f} cores, {figures['cpu_ms_per_turn'][name]:.3f} ms CPU per turn")
    print("  scheduler calls per turn: " + ", ".join(f"{k} {v:.2f}" for k, v in figures["scheduler_calls_per_turn"].items()))
    print(f"  scheduler CPU x 2,500 turns/s = {figures['cpu_ms_per_turn']['scheduler'] * 2.5:.2f} cores", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=1000, help="concurrent agents (trajectories in flight)")
    parser.add_argument("--first", type=int, default=2048, help="tokens of a trajectory's first prompt")
    parser.add_argument("--appended", type=int, default=256, help="tokens each later turn appends")
    parser.add_argument("--gen", type=int, default=16, help="tokens generated per turn")
    parser.add_argument("--max-len", type=int, default=16384, help="a trajectory ends at this context")
    parser.add_argument("--prefill-ms", type=float, default=50.0)
    parser.add_argument("--decode-ms", type=float, default=200.0)
    parser.add_argument("--step-ms", type=float, default=20.0, help="a simulated engine's step (one report per step)")
    parser.add_argument("--heartbeat-s", type=float, default=1.0, help="runtime.heartbeat_s of the scheduler")
    parser.add_argument("--warmup-s", type=float, default=30.0)
    parser.add_argument("--measure-s", type=float, default=40.0)
    parser.add_argument("--cases", default="default",
                        help=f"comma-separated, run in this order: {', '.join(CASES)} (see the docstring)")
    parser.add_argument("--store-blocks", type=int, default=1_000_000,
                        help="the store's capacity in Full Blocks in the not-full and full cases (full seeds this many)")
    parser.add_argument("--repeat", type=int, default=1, help="run the cases this many times, alternating; medians")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    cases = [case.strip() for case in args.cases.split(",") if case.strip()]
    unknown = sorted(set(cases) - set(CASES))
    if unknown or not cases:
        parser.error(f"--cases: unknown {unknown or 'none given'}; choose from {', '.join(CASES)}")

    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeat):
        for case in cases:
            print(f"run {repeat + 1}/{args.repeat}, {case}", flush=True)
            figures = run_case(args, case)
            print_figures(figures, args.agents)
            runs.append(figures)
    medians = {}
    for case in cases:
        mine = [run for run in runs if run["case"] == case]
        medians[case] = {
            "scheduler_cpu_ms_per_turn": statistics.median(run["cpu_ms_per_turn"]["scheduler"] for run in mine),
            "turns_per_s": statistics.median(run["turns_per_s"] for run in mine),
            "evicted_blocks_per_turn": statistics.median(run["evicted_blocks_per_turn"] for run in mine),
        }
        print(f"median of {len(mine)}, {case}: scheduler {medians[case]['scheduler_cpu_ms_per_turn']:.3f} ms CPU "
              f"per turn, {medians[case]['turns_per_s']:.0f} turns/s, "
              f"{medians[case]['evicted_blocks_per_turn']:.2f} evicted per turn")
    if "full" in medians and "not-full" in medians:
        ratio = medians["full"]["scheduler_cpu_ms_per_turn"] / medians["not-full"]["scheduler_cpu_ms_per_turn"]
        print(f"store full / not full, scheduler CPU per turn: {ratio:.3f} (goal <= 1.10)")
    last = runs[-1]
    report = {
        "cluster": "48P96D, 8 engines per node (384 prefill, 768 decode engines), 144 readers",
        "workload": vars(args),
        **last,
        "scheduler_cores_at_2500_turns_per_s": last["cpu_ms_per_turn"]["scheduler"] * 2.5,
        "runs": runs if len(runs) > 1 else [],
        "medians": medians,
    }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
