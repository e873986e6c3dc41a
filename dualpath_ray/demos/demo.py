"""The Ray demo: the same trajectories through `basic` and `dualpath` on one embedded cluster.

Embedded defaults: a 1P1D cluster with 2 GPUs per node, a local directory store in a temporary
folder, the tiny model computing for real, and emulated SNICs slow enough that loading hit KV
dominates (storage-bound). Every number reported is measured on the run.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

from dualpath_ray.config import DualPathConfig, parse_config
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.cluster import DualPathCluster
from dualpath_ray.workload.trace import Trajectory, Turn
from dualpath_ray.protocol.messages import TurnResult

DEMO_CONFIG = {
    "model": {"n_layer": 4, "max_context": 4096},
    "cluster": {
        "prefill_nodes": 1, "decode_nodes": 1, "gpus_per_node": 2,
        "snic_gbps": 0.08, "cnic_gbps": 8.0, "hbm_tokens_per_engine": 16384,
        "buffer_blocks_per_node": 512, "cpus_per_node": 1,
    },
    "emulation": {"enabled": True, "compute": "model"},
}


def demo_config() -> DualPathConfig:
    return parse_config(DEMO_CONFIG, source="<demo defaults>")


def demo_trajectories(
    count: int = 8, turns: int = 10, first: int = 1536, appended: int = 32, gen: int = 8, vocab: int = 512, seed: int = 0
) -> list[Trajectory]:
    """Agent-like turns in the paper's shape: a long first context, then short appends, so every
    turn after the first hits >95% of its prompt in the store."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [
        Trajectory(
            f"agent{a}",
            tuple(
                Turn(tuple(int(x) for x in rng.integers(0, vocab, first if k == 0 else appended)), gen)
                for k in range(turns)
            ),
        )
        for a in range(count)
    ]


@dataclass
class ModeReport:
    jct_s: float
    snic_read_bytes: dict[str, int]
    snic_read_bytes_by_path: dict[str, int]
    snic_write_bytes: dict[str, int]
    requests_by_path: dict[str, int]
    hit_tokens: int
    aggregate_snic_bound_s: float


@dataclass
class DemoReport:
    modes: dict[str, ModeReport] = field(default_factory=dict)
    outputs_match: bool = True
    warnings: list[str] = field(default_factory=list)
    transport: str = ""
    workload: str = ""
    # Per mode, every turn's output tokens per trajectory in turn order: what outputs_match
    # compares, there for anyone to check against a recompute.
    outputs: dict[str, dict[str, list[list[int]]]] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {"modes": {m: asdict(r) for m, r in self.modes.items()}, "outputs_match": self.outputs_match,
                "outputs": self.outputs, "warnings": self.warnings, "transport": self.transport,
                "workload": self.workload}


def measure_mode(cfg: DualPathConfig, cluster: DualPathCluster, results: dict[str, list[TurnResult]], jct: float) -> ModeReport:
    """What one mode's run moved and how long it took; the bound is these turns' hit bytes over
    the sum of every node's SNIC rate."""
    layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
    counters = cluster.counters()
    turns = [r for rs in results.values() for r in rs]
    by_path = {"pe": 0, "de": 0}
    for r in turns:
        if r.hit_tokens:
            by_path[r.path] += 1
    hit_tokens = sum(r.hit_tokens for r in turns)
    snic_rate = cfg.cluster.snic_gbps * 1e9 / 8
    nodes = cfg.cluster.prefill_nodes + cfg.cluster.decode_nodes
    return ModeReport(
        jct_s=jct,
        snic_read_bytes={n: sum(c.snic_read.values()) for n, c in counters.items()},
        snic_read_bytes_by_path={p: sum(c.snic_read[p] for c in counters.values()) for p in ("pe", "de")},
        snic_write_bytes={n: c.snic_write for n, c in counters.items()},
        requests_by_path=by_path,
        hit_tokens=hit_tokens,
        aggregate_snic_bound_s=hit_tokens * layout.bytes_per_token / (snic_rate * nodes),
    )


def run_demo(cfg: DualPathConfig, trajectories: Sequence[Trajectory], modes: Sequence[str] = ("basic", "dualpath")) -> DemoReport:
    """Run each mode on a fresh store over the same trajectories and compare."""
    report = DemoReport(transport=cfg.runtime.transport, workload=describe_workload(trajectories))
    outputs: dict[str, dict[str, list[tuple[int, ...]]]] = {}
    cluster = DualPathCluster.start(cfg)
    try:
        for mode in modes:
            deployment = cluster.deploy(mode)
            report.warnings = deployment.warnings
            started = time.monotonic()
            results = cluster.run_trajectories(trajectories)
            jct = time.monotonic() - started
            failed = cluster.health()
            if failed:
                raise RuntimeError(f"{mode}: engine failures: {failed}")
            report.modes[mode] = measure_mode(cfg, cluster, results, jct)
            outputs[mode] = {t: [r.output_tokens for r in rs] for t, rs in results.items()}
        first = next(iter(outputs.values()))
        report.outputs_match = all(o == first for o in outputs.values())
        report.outputs = {m: {t: [list(o) for o in turns] for t, turns in out.items()} for m, out in outputs.items()}
    finally:
        cluster.shutdown()
    return report


def describe_workload(trajectories: Sequence[Trajectory]) -> str:
    turns = [t for tr in trajectories for t in tr.turns]
    first = [len(tr.turns[0].appended) for tr in trajectories if tr.turns]
    later = [len(t.appended) for tr in trajectories for t in tr.turns[1:]]
    shape = f"{len(trajectories)} trajectories, {len(turns)} turns"
    if first:
        shape += f", first prompt {max(first)} tokens"
    if later:
        shape += f", {max(later)} tokens appended per later turn"
    return shape


def format_report(report: DemoReport) -> str:
    lines = [f"workload: {report.workload} | KV transport: {report.transport}"]
    for mode, r in report.modes.items():
        reads = ", ".join(f"{n}={b / 1e6:.2f} MB" for n, b in r.snic_read_bytes.items())
        paths = ", ".join(f"{p}={b / 1e6:.2f} MB" for p, b in r.snic_read_bytes_by_path.items())
        lines.append(
            f"{mode:>9}: JCT {r.jct_s:6.2f} s | SNIC read per node: {reads} | per path: {paths} | "
            f"requests by path: {r.requests_by_path} | aggregate-SNIC bound {r.aggregate_snic_bound_s:.2f} s"
        )
    if "basic" in report.modes and "dualpath" in report.modes:
        speedup = report.modes["basic"].jct_s / report.modes["dualpath"].jct_s
        lines.append(f"Basic JCT / DualPath JCT = {speedup:.2f}x")
    lines.append(f"all outputs matched across modes: {report.outputs_match}")
    lines.extend(f"warning: {w}" for w in report.warnings)
    return "\n".join(lines)
