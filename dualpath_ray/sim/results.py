"""What a simulation reports: JCT, latencies, SNIC traffic and balance, decisions, costs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from dualpath_ray.scheduling.types import ReadPath


def summary(values: Sequence[float]) -> dict[str, float]:
    """mean, p50 and p99 of a list (zeros when empty)."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    array = np.asarray(values, dtype=np.float64)
    return {
        "mean": float(array.mean()), "p50": float(np.percentile(array, 50)), "p99": float(np.percentile(array, 99)),
    }


def snic_balance(windows: Sequence[dict[int, int]], window_s: float, end_s: float) -> float | None:
    """Mean over whole windows with traffic of max / mean bytes read across all SNICs (paper:
    round-robin 1.53, the scheduler 1.18). None when no whole window had traffic."""
    last = int(end_s / window_s)  # the window still open at the end is left out
    ratios = []
    for index in range(last):
        per_node = [w.get(index, 0) for w in windows]
        mean = sum(per_node) / len(per_node)
        if mean > 0:
            ratios.append(max(per_node) / mean)
    return float(np.mean(ratios)) if ratios else None


@dataclass
class TurnLog:
    """Per finished turn of the timed phase (lists, so 4M turns stay cheap)."""

    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    by_path: dict[str, int] = field(default_factory=lambda: {path.value: 0 for path in ReadPath})
    prompt_tokens: int = 0
    hit_tokens: int = 0
    decisions: list[tuple[str, str, str, str]] = field(default_factory=list)


@dataclass
class SimResult:
    mode: str
    jct_s: float
    trajectories: int
    turns: int
    ttft_s: dict[str, float]
    tpot_s: dict[str, float]
    requests_by_path: dict[str, int]
    hit_rate: float
    snic_read_bytes: dict[str, int]
    snic_read_bytes_by_path: dict[str, int]
    snic_write_bytes: dict[str, int]
    snic_balance: float | None
    attention_balance: float | None
    alpha_tokens: int
    beta_tokens: int
    scheduler_cpu_s: float
    scheduler_cpu_per_sim_s: float
    scheduler_calls: dict[str, int]
    simulated_s: float
    events: int
    wall_s: float
    engines: dict[str, float]
    decisions: list[tuple[str, str, str, str]] = field(default_factory=list)
    trajectory_jct_s: dict[str, float] = field(default_factory=dict)

    def to_json(self, decisions: bool = False) -> dict[str, Any]:
        data = asdict(self)
        if not decisions:
            data.pop("decisions")
        return data

    def headline(self) -> str:
        balance = f"{self.snic_balance:.2f}" if self.snic_balance is not None else "n/a"
        return (
            f"{self.mode}: JCT {self.jct_s:.2f} s, {self.turns} turns, TTFT p50 {self.ttft_s['p50']:.3f} s "
            f"p99 {self.ttft_s['p99']:.3f} s, TPOT p50 {self.tpot_s['p50'] * 1000:.1f} ms "
            f"p99 {self.tpot_s['p99'] * 1000:.1f} ms, requests pe/de {self.requests_by_path['pe']}/"
            f"{self.requests_by_path['de']}, SNIC balance {balance}"
        )
