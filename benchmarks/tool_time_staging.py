"""TTFT of the turns that follow tool time, with tool-time staging and without, on a local
emulated 1P1D cluster (scheduling/staging.py; benchmarks/README.md, "Tool-time staging").

    .venv/bin/python benchmarks/tool_time_staging.py [--repeats 3] [--agents 4] [--turns 4]
        [--context 1024] [--appended 64] [--tool-s 3.0] [--config cluster_configs/bench-1p1d.yaml] [--json]

One cluster (the storage-bound bench-1p1d config: SNICs emulated at 16 Mbit/s, so reading a
turn's hit KV takes about half a second per thousand tokens) serves the same agentic rollout in
dualpath mode with scheduler.stage_tool_time off and on, alternating round by round, each on a
fresh store. Every turn after the first follows `--tool-s` of tool time, which the rollout passes
on as the hint. Reported per mode: the median over rounds of the hinted turns' TTFT p50 (and
mean), the ratio off / on, whether the outputs are identical across every run, the readers'
staged / used / expired / cancelled blocks, and the pools once the rollout ended (staged extents
included: nothing may stay leased).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]


def workload(agents: int, turns: int, context: int, appended: int, gen: int, tool_s: float) -> list[Any]:
    import numpy as np

    from dualpath_ray.workload.trace import Trajectory, Turn

    rng = np.random.default_rng(11)
    trajs = []
    for agent in range(agents):
        steps = tuple(
            Turn(tuple(int(x) for x in rng.integers(0, 512, context if k == 0 else appended)), gen, tool_s if k else 0.0)
            for k in range(turns)
        )
        trajs.append(Trajectory(f"agent{agent}", steps, arrival_s=0.25 * agent))
    return trajs


def run_once(cluster: Any, cfg: Any, staging: bool, trajs: list[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One rollout on a fresh store: its figures, and its outputs."""
    import ray

    from dualpath_ray.runtime.telemetry.status_views import StatusQuery
    from tests.helpers import settled_pools

    run_cfg = cfg.with_overrides(scheduler={"stage_tool_time": staging})
    with tempfile.TemporaryDirectory(prefix="dualpath-staging-bench-") as root:
        deployment = cluster.deploy("dualpath", store_root=root, cfg=run_cfg)
        try:
            started = time.monotonic()
            result = cluster.rollout(trajs, progress=False)
            jct_s = time.monotonic() - started
            if result.failures:
                raise RuntimeError(f"trajectories failed: {result.failures}")
            hinted = [r.ttft_s for turns in result.turn_results.values() for r in turns[1:]]
            staged = {name: ray.get(actor.staging_counts.remote()) for name, actor in deployment.readers.items()}
            calls = ray.get(deployment.scheduler.status.remote(StatusQuery.CALLS)).to_json()
            pools = settled_pools(cluster, 3 * cfg.scheduler.stage_margin_s + 10.0)
        finally:
            cluster.teardown()
    totals: dict[str, int] = {}
    for counts in staged.values():
        for key, value in counts.as_dict().items():
            totals[key] = totals.get(key, 0) + value
    figures = {
        "staging": staging, "jct_s": jct_s, "hinted_turns": len(hinted),
        "ttft_p50_s": statistics.median(hinted), "ttft_mean_s": statistics.fmean(hinted),
        "reader_staging": totals, "stage_claims": calls.get("stage_claims", 0),
        "stage_missed": calls.get("stage_missed", 0),
        "pools_free": all(free == capacity for free, _, _, capacity in pools.values()),
    }
    return figures, result.outputs()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "cluster_configs" / "bench-1p1d.yaml"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--context", type=int, default=1024, help="first turn's prompt tokens")
    parser.add_argument("--appended", type=int, default=64, help="tokens each later turn appends (the tool output)")
    parser.add_argument("--gen", type=int, default=16)
    parser.add_argument("--tool-s", type=float, default=3.0, help="tool time before every turn after the first")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()

    from dualpath_ray.cluster import DualPathCluster
    from dualpath_ray.config import load_config

    cfg = load_config(args.config)
    trajs = workload(args.agents, args.turns, args.context, args.appended, args.gen, args.tool_s)
    cluster = DualPathCluster.start(cfg)
    runs: list[dict[str, Any]] = []
    outputs = []
    try:
        for round_index in range(args.repeats):
            order = (False, True) if round_index % 2 == 0 else (True, False)
            for staging in order:
                figures, out = run_once(cluster, cfg, staging, trajs)
                figures["round"] = round_index
                runs.append(figures)
                outputs.append(out)
                print(f"round {round_index} staging={'on ' if staging else 'off'}: hinted-turn TTFT p50 "
                      f"{figures['ttft_p50_s']:.3f} s, mean {figures['ttft_mean_s']:.3f} s, JCT {figures['jct_s']:.1f} s, "
                      f"readers {figures['reader_staging']}, pools free {figures['pools_free']}", file=sys.stderr)
    finally:
        cluster.shutdown()
    by_mode = {mode: [r for r in runs if r["staging"] is (mode == "on")] for mode in ("off", "on")}
    summary = {
        mode: {"ttft_p50_s": statistics.median(r["ttft_p50_s"] for r in rs),
               "ttft_mean_s": statistics.median(r["ttft_mean_s"] for r in rs),
               "jct_s": statistics.median(r["jct_s"] for r in rs)}
        for mode, rs in by_mode.items()
    }
    report = {
        "command": " ".join(["benchmarks/tool_time_staging.py", *sys.argv[1:]]),
        "config": Path(args.config).name, "agents": args.agents, "turns": args.turns, "context": args.context,
        "appended": args.appended, "gen": args.gen, "tool_s": args.tool_s, "repeats": args.repeats,
        "summary": summary,
        "ttft_p50_off_over_on": summary["off"]["ttft_p50_s"] / summary["on"]["ttft_p50_s"],
        "outputs_identical": all(out == outputs[0] for out in outputs),
        "used_blocks_every_staged_run": min(r["reader_staging"].get("used", 0) for r in by_mode["on"]),
        "pools_free_every_run": all(r["pools_free"] for r in runs),
        "runs": runs,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for mode, figures in summary.items():
            print(f"staging {mode:>3}: hinted-turn TTFT p50 {figures['ttft_p50_s']:.3f} s, mean "
                  f"{figures['ttft_mean_s']:.3f} s, JCT {figures['jct_s']:.1f} s (medians of {args.repeats} rounds)")
        print(f"TTFT p50 off / on: {report['ttft_p50_off_over_on']:.2f}x; outputs identical: "
              f"{report['outputs_identical']}; staged blocks used in every staged run: "
              f"{report['used_blocks_every_staged_run']}; pools free after every run: {report['pools_free_every_run']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
