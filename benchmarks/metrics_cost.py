"""Metrics cost: the bench's DualPath JCT with runtime.metrics on vs off, side by side in one run.

    .venv/bin/python benchmarks/metrics_cost.py --config cluster_configs/bench-1p1d.yaml   # about 8 min

The workload and protocol of benchmarks/demo_jct.py (8 agents x 9 turns, 2,048-token initial
context, first turns untimed, each run on a fresh store), in dualpath mode only, run `--repeats`
times with metrics on and as many with metrics off on one embedded cluster, interleaved
(on, off, off, on, on, off, ...) so that drift of the machine falls on both alike. Prints every
JCT, the median of each setting and median(on) / median(off).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from dualpath_ray.cluster import DualPathCluster
from dualpath_ray.config import DualPathConfig, load_config
from dualpath_ray.demos.demo import demo_trajectories
from dualpath_ray.workload.trace import Trajectory


def first_turns(trajectories: list[Trajectory]) -> list[Trajectory]:
    return [Trajectory(t.trajectory_id, t.turns[:1], t.arrival_s) for t in trajectories]


def order(repeats: int) -> list[bool]:
    """Metrics on/off per run: pairs alternating which setting goes first (ABBA...)."""
    runs = []
    for pair in range(repeats):
        runs += [True, False] if pair % 2 == 0 else [False, True]
    return runs


def timed_jct(cluster: DualPathCluster, cfg: DualPathConfig, trajectories: list[Trajectory]) -> float:
    cluster.deploy("dualpath", cfg=cfg)
    warm = cluster.rollout(first_turns(trajectories), progress=False)
    started = time.monotonic()
    result = cluster.rollout(trajectories, resume=warm, progress=False)
    jct = time.monotonic() - started
    assert not result.failures, result.failures
    return jct


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="cluster_configs/bench-1p1d.yaml")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each setting (default 3)")
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--turns", type=int, default=9)
    parser.add_argument("--first", type=int, default=2048, help="tokens of the initial context")
    parser.add_argument("--appended", type=int, default=16)
    parser.add_argument("--gen", type=int, default=8)
    args = parser.parse_args()
    base = load_config(args.config)
    configs = {setting: base.with_overrides(runtime={"metrics": setting}) for setting in (True, False)}
    trajectories = demo_trajectories(args.agents, args.turns, args.first, args.appended, args.gen, base.model.vocab_size)
    jcts: dict[bool, list[float]] = {True: [], False: []}
    cluster = DualPathCluster.start(base)
    try:
        for setting in order(args.repeats):
            jct = timed_jct(cluster, configs[setting], trajectories)
            jcts[setting].append(jct)
            print(f"metrics {'on ' if setting else 'off'}: JCT {jct:.2f} s", flush=True)
    finally:
        cluster.shutdown()
    on, off = statistics.median(jcts[True]), statistics.median(jcts[False])
    print(json.dumps({"metrics_on_s": jcts[True], "metrics_off_s": jcts[False], "median_on_s": on,
                      "median_off_s": off, "ratio_on_off": on / off}, indent=2))
    print(f"median JCT with metrics on / off = {on:.2f} / {off:.2f} s = {on / off:.4f} (goal <= 1.03)")


if __name__ == "__main__":
    main()
