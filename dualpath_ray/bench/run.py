"""`dualpath bench`: one workload through `basic`, `dualpath` and `oracle` on the Ray runtime.

One embedded cluster serves every run. Each (round, mode) run gets a fresh deployment on a fresh
store; the modes are interleaved round by round (round 1: basic, dualpath, oracle; round 2: ...)
so that drift of the machine falls on all of them alike, and the report gives medians over the
rounds next to every round's own figures (dualpath_ray.bench.report).

What is timed. The first `warmup_turns` turns of every trajectory (by default its first one,
the long initial context) run untimed and are persisted, as at the start of an agent session
whose context is already stored; the timed phase then replays the remaining turns, resumed
from them, so the JCT is the steady state of a multi-turn agent workload in which every turn
hits the store. JCT is the wall time of that phase (driver clock); TTFT and TPOT are the timed
turns' own (TurnResult: TTFT from the driver's submit to the prefill engine sampling the first
token, TPOT the decode time per later token); byte figures are the runtime's exact counters
(DualPathCluster.counters()) after the timed phase minus before it.

SNIC traffic and prefill compute over time: while the timed phase runs, driver threads sample
every reader's exact SNIC read counter and every prefill engine's cumulative compute seconds
every `sample_interval_s` (dualpath_ray.bench.sampler), giving per-node bytes over time for the
high-load window, the SNIC balance and the plot, and per-engine compute time for the
attention-time balance over the same window (definitions in dualpath_ray.bench.figures and
dualpath_ray.bench.compute_balance).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from dualpath_ray.analysis.snic_window import SnicSeries, high_load_window, snic_balance, window_bytes
from dualpath_ray.bench.compute_balance import ComputeSeries, attention_balance
from dualpath_ray.bench.figures import percentiles, run_order
from dualpath_ray.bench.report import BenchReport, ModeRun, Topology, summarise
from dualpath_ray.bench.sampler import CounterSampler, prefill_compute_reads, snic_reads
from dualpath_ray.cluster import DualPathCluster
from dualpath_ray.config import DualPathConfig
from dualpath_ray.demos.demo import describe_workload
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.protocol.counters import PATHS, NodeCounters
from dualpath_ray.protocol.messages import TurnResult
from dualpath_ray.protocol.types import Role
from dualpath_ray.workload.trace import Trajectory

SAMPLE_INTERVAL_S = 0.25

Outputs = dict[str, list[tuple[int, ...]]]


@dataclass(frozen=True)
class BenchWorkload:
    """The trajectories, and how many leading turns of each run untimed."""

    trajectories: list[Trajectory]
    warmup_turns: int = 1

    def warmup(self) -> list[Trajectory]:
        return [Trajectory(t.trajectory_id, t.turns[: self.warmup_turns], t.arrival_s) for t in self.trajectories]

    def timed_description(self) -> str:
        if self.warmup_turns == 0:
            return "every turn"
        return (f"turns {self.warmup_turns + 1}.. of each trajectory, after its first {self.warmup_turns} "
                "ran untimed on the same fresh store")


def counter_delta(before: Mapping[str, NodeCounters], after: Mapping[str, NodeCounters]) -> dict[str, NodeCounters]:
    """Per node, what the counters gained between two snapshots."""
    delta = {}
    for node, late in after.items():
        early = before[node]
        delta[node] = NodeCounters(
            snic_read={p: late.snic_read[p] - early.snic_read[p] for p in PATHS},
            snic_write=late.snic_write - early.snic_write,
            cnic_in={p: late.cnic_in[p] - early.cnic_in[p] for p in PATHS},
            cnic_out={p: late.cnic_out[p] - early.cnic_out[p] for p in PATHS},
            store_read_s=late.store_read_s - early.store_read_s,
        )
    return delta


def measure_run(
    round_index: int, mode: str, jct_s: float, results: Mapping[str, Sequence[TurnResult]],
    delta: Mapping[str, NodeCounters], series: SnicSeries, bytes_per_token: int,
    compute: ComputeSeries,
) -> ModeRun:
    """One run's figures from its timed turns, counter deltas and sampled series."""
    turns = [r for rs in results.values() for r in rs]
    firsts = [rs[0] for rs in results.values() if rs]
    window = high_load_window(series)
    balance = attention_balance(compute, (window.start_s, window.end_s) if window else None)
    return ModeRun(
        round=round_index, mode=mode, jct_s=jct_s, turns=len(turns),
        hit_bytes=sum(r.hit_tokens for r in turns) * bytes_per_token,
        recomputed_hit_bytes=sum(r.recomputed_tokens for r in turns) * bytes_per_token,
        ttft_s=percentiles([r.ttft_s for r in turns]),
        tpot_s=percentiles([r.tpot_s for r in turns if len(r.output_tokens) > 1]),
        snic_read_bytes={n: sum(c.snic_read.values()) for n, c in delta.items()},
        snic_read_bytes_by_path={p: sum(c.snic_read[p] for c in delta.values()) for p in PATHS},
        snic_write_bytes={n: c.snic_write for n, c in delta.items()},
        store_read_gbps={n: store_read_gbps(c) for n, c in delta.items()},
        requests_by_path={p: Counter(str(r.path) for r in turns if r.hit_tokens).get(p, 0) for p in PATHS},
        snic_balance=snic_balance(window_bytes(series, window)) if window else None,
        high_load_window_s=(window.start_s, window.end_s) if window else None,
        series=series,
        computed_prompt_tokens=sum(r.prompt_tokens - r.hit_tokens for r in turns),
        first_turn_computed_tokens=sum(r.prompt_tokens - r.hit_tokens for r in firsts),
        first_turn_ttft_s=percentiles([r.ttft_s for r in firsts]),
        attention_balance=balance.balance, prefill_compute_s=balance.engine_compute_s,
        attention_span=balance.over, compute_series=compute,
    )


def store_read_gbps(delta: NodeCounters) -> float | None:
    """GB/s (1e9 bytes) a node's reader read at while it had a hit read in flight; None if it read nothing."""
    read = sum(delta.snic_read.values())
    return read / delta.store_read_s / 1e9 if read and delta.store_read_s > 0 else None


def _check(cluster: DualPathCluster, mode: str, failures: Mapping[str, str]) -> None:
    if failures:
        raise RuntimeError(f"bench {mode}: trajectories failed: {dict(failures)}")
    broken = cluster.health()
    if broken:
        raise RuntimeError(f"bench {mode}: engine failures: {broken}")


def run_mode(
    cluster: DualPathCluster, round_index: int, mode: str, workload: BenchWorkload, interval_s: float
) -> tuple[ModeRun, Outputs]:
    """Deploy `mode` on a fresh store, run the warm-up untimed, then time the rest."""
    layout = KVLayout.from_model(cluster.cfg.model, cluster.cfg.store.block_size)
    with tempfile.TemporaryDirectory(prefix="dualpath-bench-store-") as root:
        deployment = cluster.deploy(mode, store_root=root)
        try:
            warm = None
            if workload.warmup_turns:
                warm = cluster.rollout(workload.warmup(), progress=False)
                _check(cluster, mode, warm.failures)
            before = cluster.counters()
            readers = {spec.node_id: deployment.readers[spec.reader_name] for spec in cluster.nodes}
            prefill = {name: deployment.engines[name] for spec in cluster.nodes if spec.role is Role.PREFILL
                       for name in spec.engine_names()}
            started = time.monotonic()
            # Two threads: a vLLM engine answers between its steps, which must not delay the SNIC samples.
            with CounterSampler("snic", list(readers), snic_reads(readers), interval_s, started) as sampler, \
                    CounterSampler("compute", list(prefill), prefill_compute_reads(prefill), interval_s, started) as computes:
                result = cluster.rollout(workload.trajectories, resume=warm, progress=False)
                jct_s = time.monotonic() - started
            _check(cluster, mode, result.failures)
            delta = counter_delta(before, cluster.counters())
        finally:
            cluster.teardown()  # the actors let go of the store before its folder goes
    outputs = result.outputs()
    series = SnicSeries(sampler.t_s, sampler.values)
    compute = ComputeSeries(computes.t_s, computes.values)
    run = measure_run(round_index, mode, jct_s, result.turn_results, delta, series, layout.bytes_per_token, compute)
    run = dataclasses.replace(run, outputs={t: [list(o) for o in turns] for t, turns in outputs.items()})
    return run, outputs


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages ([] where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def run_bench(
    cfg: DualPathConfig, workload: BenchWorkload, modes: Sequence[str], repeat: int, *,
    config_source: str = "<embedded>", interval_s: float = SAMPLE_INTERVAL_S,
    progress: Callable[[str], None] | None = None,
) -> BenchReport:
    """Every mode in every round on one embedded cluster; the summarised report."""
    runs: list[ModeRun] = []
    outputs: list[Outputs] = []
    machine: dict[str, object] = {"cpus": os.cpu_count(), "loadavg_before": load_average()}
    cluster = DualPathCluster.start(cfg)
    try:
        for round_index, mode in run_order(modes, repeat):
            run, out = run_mode(cluster, round_index, mode, workload, interval_s)
            runs.append(run)
            outputs.append(out)
            if progress is not None:
                progress(f"round {round_index}/{repeat} {mode}: JCT {run.jct_s:.2f} s, "
                         f"SNIC read {sum(run.snic_read_bytes.values()) / 1e6:.1f} MB")
    finally:
        cluster.shutdown()
    machine["loadavg_after"] = load_average()
    report = BenchReport(
        config=config_source, workload=describe_workload(workload.trajectories), timed=workload.timed_description(),
        transport=cfg.runtime.transport, repeat=repeat, runs=runs,
        outputs_match=all(o == outputs[0] for o in outputs), machine=machine,
    )
    topology = Topology(cfg.cluster.prefill_nodes, cfg.cluster.decode_nodes, cfg.cluster.snic_gbps * 1e9 / 8)
    return summarise(report, topology)
