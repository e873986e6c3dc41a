"""What a simulation reports: JCT, latencies, SNIC traffic and balance, decisions, costs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from dualpath_ray.analysis.snic_window import HighLoadWindow, SnicSeries, high_load_window, window_bytes
from dualpath_ray.analysis.snic_window import snic_balance as bench_balance
from dualpath_ray.protocol.types import ReadPath


def summary(values: Sequence[float]) -> dict[str, float]:
    """mean, p50 and p99 of a list (zeros when empty)."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    array = np.asarray(values, dtype=np.float64)
    return {
        "mean": float(array.mean()), "p50": float(np.percentile(array, 50)), "p99": float(np.percentile(array, 99)),
    }


def snic_series(windows: dict[str, dict[int, int]], window_s: float, start_s: float, end_s: float) -> SnicSeries:
    """Cumulative SNIC read bytes per node at every window edge from start_s to end_s: the form
    `dualpath bench` samples the runtime's counters in."""
    first, last = int(start_s / window_s), int(end_s / window_s) + 1
    edges = [window_s * k for k in range(first, last + 1)]
    read_bytes = {}
    for node, by_window in windows.items():
        total, cumulative = 0, []
        for index in range(first, last + 1):
            cumulative.append(total)
            total += by_window.get(index, 0)
        read_bytes[node] = cumulative
    return SnicSeries([t - edges[0] for t in edges], read_bytes)


def high_load_balance(series: SnicSeries) -> tuple[float | None, HighLoadWindow | None]:
    """SNIC balance (max / mean bytes across every node's SNIC) inside the high-load window,
    both defined as `dualpath bench` defines them (dualpath_ray/bench/figures.py), so the
    simulator's figure and the runtime's are the same measure (paper: round-robin 1.53, the
    scheduler 1.18)."""
    window = high_load_window(series)
    if window is None:
        return None, None
    return bench_balance(window_bytes(series, window)), window


def weighted_balance(
    rounds: Sequence[tuple[float, float, float, float]], start_s: float, end_s: float, min_fill: float = 0.0
) -> float | None:
    """Max/Avg of the prefill engines' layer times, weighted by round length, over the rounds
    that start in [start_s, end_s] with at least `min_fill` of a full round's work; None without
    such rounds."""
    return _length_weighted(
        [(length, ratio) for start, length, ratio, fill in rounds if start_s <= start <= end_s and fill >= min_fill]
    )


def weighted_fill(rounds: Sequence[tuple[float, float, float, float]], start_s: float, end_s: float) -> float | None:
    """How full the rounds starting in [start_s, end_s] were (the engines' summed layer time over
    a round of full quotas), weighted by round length; None without such rounds."""
    return _length_weighted([(length, fill) for start, length, _, fill in rounds if start_s <= start <= end_s])


def _length_weighted(pairs: Sequence[tuple[float, float]]) -> float | None:
    """Mean of the values of (round length, value) pairs, weighted by length; None if no time."""
    total = sum(length for length, _ in pairs)
    return sum(length * value for length, value in pairs) / total if total > 0 else None


def engine_totals_balance(
    units: Sequence[Sequence[str]], engine_ms: dict[str, dict[int, float]], first_window: int, last_window: int
) -> float | None:
    """Max/Avg across each unit's engines of their summed layer time in windows
    [first_window, last_window], the worst unit's; None without multi-engine units or work."""
    worst = None
    for engines in units:
        totals = [sum(ms for w, ms in engine_ms.get(e, {}).items() if first_window <= w <= last_window) for e in engines]
        mean = sum(totals) / len(totals)
        if len(engines) > 1 and mean > 0:
            worst = max(worst or 0.0, max(totals) / mean)
    return worst


TTFT_PARTS = ("decode_wait", "prefill_wait", "staging", "prefill")
"""A turn's TTFT in four consecutive parts: from submit to its decode HBM reservation, from there
to its prefill engine, from there until its hit KV is staged (extents leased, hits read), and from
there to its first token (waiting for rounds, computing)."""


@dataclass
class TurnLog:
    """Per finished turn of the timed phase (lists, so 4M turns stay cheap)."""

    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    by_path: dict[str, int] = field(default_factory=lambda: {path.value: 0 for path in ReadPath})
    prompt_tokens: int = 0
    hit_tokens: int = 0
    # Summed over the timed turns: where TTFT went (see TTFT_PARTS).
    ttft_parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TTFT_PARTS, 0.0))
    decisions: list[tuple[str, str, str, str]] = field(default_factory=list)

    def ttft_parts_mean(self) -> dict[str, float]:
        turns = len(self.ttft_s)
        return {part: total / turns if turns else 0.0 for part, total in self.ttft_parts.items()}


@dataclass
class SimResult:
    mode: str
    jct_s: float
    trajectories: int
    turns: int
    ttft_s: dict[str, float]
    tpot_s: dict[str, float]
    ttft_parts_s: dict[str, float]  # mean seconds of each of TTFT_PARTS over the timed turns
    requests_by_path: dict[str, int]
    hit_rate: float
    snic_read_bytes: dict[str, int]
    snic_read_bytes_by_path: dict[str, int]
    snic_write_bytes: dict[str, int]
    snic_balance: float | None  # in the high-load window (dualpath bench's definition)
    snic_window_s: tuple[float, float] | None  # that window, simulated seconds
    attention_balance: float | None  # Max/Avg across data-parallel peers, rounds in that window
    attention_balance_all: float | None  # the same over every round of the run
    # Rounds in the window: how full they were (1 = every engine at its quota), the per-round
    # balance of the rounds at least 90% full, and Max/Avg of each engine's summed attention time
    # over the whole window (the worst node's): whether the imbalance is per round or per engine.
    attention_fill: float | None
    attention_balance_full_rounds: float | None
    attention_engine_totals: float | None
    alpha_tokens: int
    beta_tokens: int
    scheduler_cpu_s: float
    scheduler_cpu_per_sim_s: float
    scheduler_calls: dict[str, int]
    simulated_s: float
    events: int
    wall_s: float
    engines: dict[str, float]
    quota_scope: str = "forward"  # what the compute quota bounded (SimOptions.quota_scope, resolved)
    decisions: list[tuple[str, str, str, str]] = field(default_factory=list)
    trajectory_jct_s: dict[str, float] = field(default_factory=dict)
    # Tool-time staging (sim/staged.py, StagingCounters, plus the core's claims); {} when it is off.
    staging: dict[str, int] = field(default_factory=dict)
    # Hit tokens the compute path placed to be computed instead of read (scheduler.compute_path).
    recomputed_hit_tokens: int = 0
    # Late binding and in-flight sharing (scheduling/binding.py, scheduling/sharing.py): hit tokens
    # found at placement beyond submit's; prefix tokens shared in flight, waits and their seconds.
    sharing: dict[str, float] = field(default_factory=dict)

    def to_json(self, decisions: bool = False) -> dict[str, Any]:
        data = asdict(self)
        if not decisions:
            data.pop("decisions")
        return data

    def staging_line(self) -> str:
        """Tool-time staging's counters in one line (`dualpath sim`)."""
        s = self.staging
        if not s:
            return "tool-time staging: off (scheduler.stage_tool_time false, or not dualpath mode)"
        return (f"tool-time staging: {s['orders']} orders ({s['ordered_blocks']} blocks), {s['skipped']} skipped, "
                f"{s['staged_blocks']} blocks staged, {s['used']} used ({s['used_blocks']} blocks, {s['promoted']} "
                f"still reading), {s['expired']} expired, {s['cancelled']} cancelled, {s['missed']} missed")

    def headline(self) -> str:
        balance = f"{self.snic_balance:.2f}" if self.snic_balance is not None else "n/a"
        return (
            f"{self.mode}: JCT {self.jct_s:.2f} s, {self.turns} turns, TTFT p50 {self.ttft_s['p50']:.3f} s "
            f"p99 {self.ttft_s['p99']:.3f} s, TPOT p50 {self.tpot_s['p50'] * 1000:.1f} ms "
            f"p99 {self.tpot_s['p99'] * 1000:.1f} ms, requests pe/de {self.requests_by_path['pe']}/"
            f"{self.requests_by_path['de']}, SNIC balance {balance}"
        )
