"""What `dualpath bench` reports: each mode's run in each round, medians over rounds, bounds.

Pure (no Ray): dualpath_ray.bench.run measures the runs, this module summarises and renders them.
The JSON keys are a contract (benchmarks/README.md, tests/integration/test_bench.py):
`modes` (mode -> median figures, JCT as `jct_s`), `bounds` (mode -> {`io_s`, `compute_s`}),
`speedup` (basic JCT / dualpath JCT, medians), `runs` (every (round, mode) run's own figures).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dualpath_ray.bench.figures import (
    Bounds,
    Percentiles,
    io_bound_s,
    median,
    median_by_key,
    median_count,
    median_optional,
)
from dualpath_ray.analysis.snic_window import SnicSeries
from dualpath_ray.bench.compute_balance import ComputeSeries


@dataclass(frozen=True)
class ModeRun:
    """One mode's timed phase in one round. Byte figures are the runtime's exact counters
    (DualPathCluster.counters()) after the timed phase minus before it."""

    round: int
    mode: str
    jct_s: float
    turns: int
    hit_bytes: int  # hit tokens of the timed turns x KV bytes per token
    ttft_s: Percentiles
    tpot_s: Percentiles
    snic_read_bytes: dict[str, int]  # per node
    snic_read_bytes_by_path: dict[str, int]
    snic_write_bytes: dict[str, int]  # per node (persisted blocks)
    # Per node: hit bytes read / seconds with a hit read in flight (NodeCounters.store_read_s),
    # the reader's own rate end to end (lease, read, verify, SNIC counters); None: read nothing.
    store_read_gbps: dict[str, float | None]
    requests_by_path: dict[str, int]  # timed turns with hits, by the path the scheduler named
    snic_balance: float | None
    high_load_window_s: tuple[float, float] | None
    series: SnicSeries
    # Every turn's output tokens (warm-up included), per trajectory in turn order: what the
    # modes' outputs_match compares, there for anyone to check against a recompute.
    outputs: dict[str, list[list[int]]] = field(default_factory=dict)
    # Stored tokens of the timed turns computed instead of read (scheduler.compute_path) x KV
    # bytes per token: hit_bytes counts what was read, this what the compute path saved reading.
    recomputed_hit_bytes: int = 0
    # Prompt tokens the prefill engines computed (prompt minus what was read) in the timed turns,
    # and in each trajectory's first timed turn alone, with that turn's TTFT (grouped sampling:
    # the turn whose prompt G samples share).
    computed_prompt_tokens: int = 0
    first_turn_computed_tokens: int = 0
    first_turn_ttft_s: Percentiles | None = None
    # Attention-time balance (dualpath_ray/bench/compute_balance.py): max / mean over the prefill
    # engines of prefill_compute_s, each engine's compute seconds over `attention_span` (the SNIC
    # high-load window, or the timed phase where there is none); None where no engine computed.
    attention_balance: float | None = None
    prefill_compute_s: dict[str, float] = field(default_factory=dict)
    attention_span: str | None = None
    compute_series: ComputeSeries = field(default_factory=lambda: ComputeSeries([], {}))

    def to_json(self) -> dict[str, object]:
        return {
            "round": self.round, "mode": self.mode, "jct_s": self.jct_s, "turns": self.turns,
            "hit_bytes": self.hit_bytes, "recomputed_hit_bytes": self.recomputed_hit_bytes,
            "computed_prompt_tokens": self.computed_prompt_tokens,
            "first_turn_computed_tokens": self.first_turn_computed_tokens,
            "first_turn_ttft_s": self.first_turn_ttft_s.to_json() if self.first_turn_ttft_s else None,
            "ttft_s": self.ttft_s.to_json(), "tpot_s": self.tpot_s.to_json(),
            "snic_read_bytes": self.snic_read_bytes, "snic_read_bytes_by_path": self.snic_read_bytes_by_path,
            "snic_write_bytes": self.snic_write_bytes, "store_read_gbps": self.store_read_gbps,
            "requests_by_path": self.requests_by_path, "snic_balance": self.snic_balance,
            "high_load_window_s": list(self.high_load_window_s) if self.high_load_window_s else None,
            "snic_series": self.series.to_json(), "attention_balance": self.attention_balance,
            "prefill_compute_s": self.prefill_compute_s, "attention_span": self.attention_span,
            "compute_series": self.compute_series.to_json(), "outputs": self.outputs,
        }


@dataclass(frozen=True)
class ModeSummary:
    """A mode's medians over its rounds (each percentile: the median of the rounds' values;
    counts: the lower middle round's, see median_count)."""

    jct_s: float
    jct_rounds_s: list[float]
    turns: int
    hit_bytes: int
    ttft_s: Percentiles
    tpot_s: Percentiles
    snic_read_bytes: dict[str, int]
    snic_read_bytes_by_path: dict[str, int]
    snic_write_bytes: dict[str, int]
    store_read_gbps: dict[str, float | None]  # per node, the median over rounds that read
    requests_by_path: dict[str, int]
    snic_balance: float | None
    jct_over_io_bound: float | None
    recomputed_hit_bytes: int = 0
    attention_balance: float | None = None  # the median over the rounds that have one

    def to_json(self) -> dict[str, object]:
        return {
            "jct_s": self.jct_s, "jct_rounds_s": self.jct_rounds_s, "turns": self.turns, "hit_bytes": self.hit_bytes,
            "recomputed_hit_bytes": self.recomputed_hit_bytes,
            "ttft_s": self.ttft_s.to_json(), "tpot_s": self.tpot_s.to_json(),
            "snic_read_bytes": self.snic_read_bytes, "snic_read_bytes_by_path": self.snic_read_bytes_by_path,
            "snic_write_bytes": self.snic_write_bytes, "store_read_gbps": self.store_read_gbps,
            "requests_by_path": self.requests_by_path,
            "snic_balance": self.snic_balance, "attention_balance": self.attention_balance,
            "jct_over_io_bound": self.jct_over_io_bound,
        }


@dataclass(frozen=True)
class Topology:
    """What the bounds need of the cluster: node counts and the per-node SNIC read rate."""

    prefill_nodes: int
    decode_nodes: int
    snic_bytes_s: float


@dataclass
class BenchReport:
    config: str
    workload: str
    timed: str
    transport: str
    repeat: int
    runs: list[ModeRun]
    outputs_match: bool
    modes: dict[str, ModeSummary] = field(default_factory=dict)
    bounds: dict[str, Bounds] = field(default_factory=dict)
    speedup: float | None = None
    machine: dict[str, object] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {
            "config": self.config, "workload": self.workload, "timed": self.timed, "transport": self.transport,
            "repeat": self.repeat, "modes": {m: s.to_json() for m, s in self.modes.items()},
            "bounds": {m: b.to_json() for m, b in self.bounds.items()}, "speedup": self.speedup,
            "outputs_match": self.outputs_match, "machine": self.machine,
            "runs": [run.to_json() for run in self.runs],
        }


def summarise_mode(runs: Sequence[ModeRun], io_s: float) -> ModeSummary:
    jct = median([r.jct_s for r in runs])
    return ModeSummary(
        jct_s=jct,
        jct_rounds_s=[r.jct_s for r in runs],
        turns=runs[0].turns,
        hit_bytes=median_count([r.hit_bytes for r in runs]),
        recomputed_hit_bytes=median_count([r.recomputed_hit_bytes for r in runs]),
        ttft_s=Percentiles(median_optional([r.ttft_s.p50 for r in runs]), median_optional([r.ttft_s.p99 for r in runs])),
        tpot_s=Percentiles(median_optional([r.tpot_s.p50 for r in runs]), median_optional([r.tpot_s.p99 for r in runs])),
        snic_read_bytes=median_by_key([r.snic_read_bytes for r in runs]),
        snic_read_bytes_by_path=median_by_key([r.snic_read_bytes_by_path for r in runs]),
        snic_write_bytes=median_by_key([r.snic_write_bytes for r in runs]),
        store_read_gbps={n: median_optional([r.store_read_gbps.get(n) for r in runs]) for n in runs[0].store_read_gbps},
        requests_by_path=median_by_key([r.requests_by_path for r in runs]),
        snic_balance=median_optional([r.snic_balance for r in runs]),
        attention_balance=median_optional([r.attention_balance for r in runs]),
        jct_over_io_bound=jct / io_s if io_s > 0 else None,
    )


def summarise(report: BenchReport, topology: Topology) -> BenchReport:
    """Fill the report's medians, bounds and speedup from its runs."""
    by_mode: dict[str, list[ModeRun]] = {}
    for run in report.runs:
        by_mode.setdefault(run.mode, []).append(run)
    oracle = median([r.jct_s for r in by_mode["oracle"]]) if "oracle" in by_mode else None
    for mode, runs in by_mode.items():
        hit_bytes = median_count([r.hit_bytes for r in runs])
        io_s = io_bound_s(mode, hit_bytes, topology.snic_bytes_s, topology.prefill_nodes, topology.decode_nodes)
        report.bounds[mode] = Bounds(io_s, oracle)
        report.modes[mode] = summarise_mode(runs, io_s)
    if "basic" in report.modes and "dualpath" in report.modes:
        report.speedup = report.modes["basic"].jct_s / report.modes["dualpath"].jct_s
    return report


ATTENTION_BALANCE_DEFINITION = (
    "attention balance: max / mean over the prefill engines of each one's compute seconds (native: its layers' "
    "compute; vLLM: inside engine.step()) in the SNIC high-load window, or the timed phase without one "
    "(paper: Max/Avg attention time 1.06)"
)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def _mb(per_node: dict[str, float]) -> str:
    return ", ".join(f"{node} {b / 1e6:.1f}" for node, b in per_node.items())


def format_text(report: BenchReport) -> str:
    """The report as lines a person reads (medians over the rounds)."""
    lines = [
        f"workload: {report.workload} | timed: {report.timed}",
        f"config: {report.config} | transport: {report.transport} | rounds: {report.repeat}",
    ]
    for mode, s in report.modes.items():
        bounds = report.bounds[mode]
        balance = "-" if s.snic_balance is None else f"{s.snic_balance:.2f}"
        attention = "-" if s.attention_balance is None else f"{s.attention_balance:.3f}"
        compute = "-" if bounds.compute_s is None else f"{bounds.compute_s:.2f}"
        lines.append(
            f"{mode:>9}: JCT {s.jct_s:7.2f} s | TTFT p50/p99 {_ms(s.ttft_s.p50)}/{_ms(s.ttft_s.p99)} ms | "
            f"TPOT p50/p99 {_ms(s.tpot_s.p50)}/{_ms(s.tpot_s.p99)} ms | SNIC read MB {_mb(s.snic_read_bytes)} | "
            f"balance {balance} | attention balance {attention} | requests by path {s.requests_by_path} | "
            f"bounds: I/O {bounds.io_s:.2f} s, compute {compute} s"
        )
    if report.speedup is not None:
        lines.append(f"Basic JCT / DualPath JCT = {report.speedup:.2f}x")
    dual = report.modes.get("dualpath")
    if dual is not None and dual.jct_over_io_bound is not None:
        lines.append(f"DualPath JCT / its I/O bound = {dual.jct_over_io_bound:.3f}")
    lines.append(f"outputs identical across modes and rounds: {report.outputs_match}")
    lines.append(ATTENTION_BALANCE_DEFINITION)
    return "\n".join(lines)
