"""Basic vs DualPath JCT on a storage-bound 1P1D config, against the aggregate-SNIC bound.

    .venv/bin/python benchmarks/demo_jct.py --config cluster_configs/bench-1p1d.yaml

Each mode gets a fresh store. The first turn of every trajectory (its long initial context, as
at the start of an agent session) is run and persisted untimed; the timed phase replays the
remaining turns, resumed from it, so the measured JCT is the steady state of a multi-turn agent
workload. The bound is the timed phase's hit bytes / (sum of all nodes' SNIC rates): no schedule
can load those bytes faster.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

from dualpath_ray.config import load_config
from dualpath_ray.demo import demo_trajectories, measure_mode
from dualpath_ray.cluster import DualPathCluster
from dualpath_ray.workload.trace import Trajectory


def first_turns(trajectories: list[Trajectory]) -> list[Trajectory]:
    return [Trajectory(t.trajectory_id, t.turns[:1], t.arrival_s) for t in trajectories]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="cluster_configs/bench-1p1d.yaml")
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--turns", type=int, default=9)
    parser.add_argument("--first", type=int, default=2048, help="tokens of the initial context")
    parser.add_argument("--appended", type=int, default=16)
    parser.add_argument("--gen", type=int, default=8)
    args = parser.parse_args()
    cfg = load_config(args.config)
    trajectories = demo_trajectories(args.agents, args.turns, args.first, args.appended, args.gen, cfg.model.vocab_size)
    report: dict[str, dict[str, object]] = {}
    outputs = {}
    cluster = DualPathCluster.start(cfg)
    try:
        for mode in ("basic", "dualpath"):
            cluster.deploy(mode)
            warm = cluster.rollout(first_turns(trajectories), progress=False)
            started = time.monotonic()
            result = cluster.rollout(trajectories, resume=warm, progress=False)
            jct = time.monotonic() - started
            assert not result.failures, result.failures
            report[mode] = asdict(measure_mode(cfg, cluster, result.turn_results, jct))
            outputs[mode] = result.outputs()
    finally:
        cluster.shutdown()
    basic, dual = report["basic"], report["dualpath"]
    print(json.dumps(report, indent=2))
    print(f"Basic JCT / DualPath JCT = {basic['jct_s'] / dual['jct_s']:.2f}x; "
          f"DualPath JCT / bound = {dual['jct_s'] / dual['aggregate_snic_bound_s']:.3f}; "
          f"outputs match: {outputs['basic'] == outputs['dualpath']}")


if __name__ == "__main__":
    main()
