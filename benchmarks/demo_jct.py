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

from dualpath_ray.config import load_config
from dualpath_ray.demo import demo_trajectories
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.runtime.cluster import DualPathCluster
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
    layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
    trajectories = demo_trajectories(args.agents, args.turns, args.first, args.appended, args.gen, cfg.model.vocab_size)
    rate = cfg.cluster.snic_gbps * 1e9 / 8
    nodes = cfg.cluster.prefill_nodes + cfg.cluster.decode_nodes
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
            timed = [r for rs in result.turn_results.values() for r in rs]
            hit_bytes = sum(r.hit_tokens for r in timed) * layout.bytes_per_token
            counters = cluster.counters()
            report[mode] = {
                "jct_s": round(jct, 2),
                "bound_s": round(hit_bytes / (rate * nodes), 2),
                "hit_bytes": hit_bytes,
                "snic_read_bytes": {n: sum(c.snic_read.values()) for n, c in counters.items()},
                "snic_write_bytes": {n: c.snic_write for n, c in counters.items()},
                "requests_by_path": {p: sum(r.path == p for r in timed) for p in ("pe", "de")},
            }
            outputs[mode] = result.outputs()
    finally:
        cluster.shutdown()
    basic, dual = report["basic"], report["dualpath"]
    print(json.dumps(report, indent=2))
    print(f"Basic JCT / DualPath JCT = {basic['jct_s'] / dual['jct_s']:.2f}x; "
          f"DualPath JCT / bound = {dual['jct_s'] / dual['bound_s']:.3f}; outputs match: {outputs['basic'] == outputs['dualpath']}")


if __name__ == "__main__":
    main()
