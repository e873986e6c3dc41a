"""What a death costs a rollout: JCT with one actor killed at a random point, against the same
rollout without faults, side by side on one machine (issue 9: runtime <= 1.5x fault-free).

    .venv/bin/python benchmarks/chaos_overhead.py --rounds 3 --json benchmarks/results/chaos_overhead.json

Each round runs every scenario once on a fresh embedded 1P1D cluster and store (profile compute,
so the model costs no CPU and the cluster's own work dominates), in the same order, so machine
noise hits all of them alike; the report gives each scenario's JCT / the fault-free JCT of its
round, and the median over rounds. Deaths happen 20-60% of the way into the fault-free JCT;
Ray restarts the victim (runtime.max_actor_restarts) and the rollout must lose nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray

from dualpath_ray.cluster import DualPathCluster
from dualpath_ray.config import DualPathConfig, parse_config
from dualpath_ray.demos.demo import demo_trajectories
from dualpath_ray.runtime.telemetry.status_views import StatusQuery


def config(transport: str, faults: list[dict[str, Any]] | None = None) -> DualPathConfig:
    return parse_config({
        "model": {"n_layer": 2, "max_context": 4096},
        "cluster": {"prefill_nodes": 1, "decode_nodes": 1, "gpus_per_node": 2, "hbm_tokens_per_engine": 32768,
                    "buffer_blocks_per_node": 1024, "cpus_per_node": 1},
        "store": {"block_size": 64},
        "emulation": {"enabled": False, "compute": "profile"},
        "runtime": {"transport": transport, "max_attempts": 8, "heartbeat_s": 0.2, "heartbeat_timeout_s": 1.5,
                    "transfer_timeout_s": 10.0, "request_timeout_s": 300.0},
        "faults": {"seed": 11, "faults": faults or []},
    }, source="<chaos benchmark>")


def kill_actor(name: str, times: int = 1) -> Callable[[Any, float, random.Random], None]:
    def kill(deployment: Any, fault_free_s: float, rng: random.Random) -> None:
        actors = {**deployment.engines, **deployment.readers, "scheduler": deployment.scheduler}
        for _ in range(times):
            time.sleep(rng.uniform(0.2, 0.6) * fault_free_s / times)
            ray.kill(actors[name], no_restart=False)
            if name == "scheduler":
                ray.get(deployment.scheduler.ready.remote(), timeout=120)
    kill.scheduler_kills = times if name == "scheduler" else 0  # type: ignore[attr-defined]
    return kill


SCENARIOS: dict[str, tuple[list[dict[str, Any]], Callable[[Any, float, random.Random], None] | None]] = {
    "fault-free": ([], None),
    "decode engine killed": ([], kill_actor("decode/d0/g1")),
    "prefill engine killed mid layer transfer": (
        [{"site": "layer_transfer", "mode": "kill", "actors": "prefill/p0/g0", "nth": 30}], None),
    "decode node's reader killed": ([], kill_actor("reader/d0")),
    "prefill node's reader killed": ([], kill_actor("reader/p0")),
    "scheduler killed 3 times": ([], kill_actor("scheduler", times=3)),
}


def restarts(calls: dict[str, int], monkey: Any) -> int:
    """Restarts the scheduler saw (an engine's or a reader's new incarnation); a killed scheduler
    is counted by its killer, since the counts restart with it."""
    seen = calls.get("restarted_engines", 0) + calls.get("restarted_readers", 0)
    return seen + (getattr(monkey, "scheduler_kills", 0))


def run_once(cfg: DualPathConfig, trajectories: list, monkey: Any, fault_free_s: float, seed: int) -> dict[str, Any]:
    cluster = DualPathCluster.start(cfg)
    try:
        deployment = cluster.deploy("dualpath")
        thread = None
        if monkey is not None:
            thread = threading.Thread(target=monkey, args=(deployment, fault_free_s, random.Random(seed)), daemon=True)
        started = time.monotonic()
        if thread is not None:
            thread.start()
        result = cluster.rollout(trajectories, progress=False)
        jct = time.monotonic() - started
        if thread is not None:
            thread.join(timeout=120)
        calls = ray.get(deployment.scheduler.status.remote(StatusQuery.CALLS)).to_json()
        return {"jct_s": jct, "failures": len(result.failures), "turns": result.table.num_rows,
                "retries": calls["retries"], "restarts": restarts(calls, monkey), "outputs": result.outputs()}
    finally:
        cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--agents", type=int, default=48)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--transport", default="gloo", choices=("gloo", "nixl"))
    parser.add_argument("--only", default="", help="comma-separated scenarios to run besides fault-free "
                        f"(default: all of {', '.join(SCENARIOS)})")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    chosen = {name for name in args.only.split(",") if name}
    if chosen - set(SCENARIOS):
        parser.error(f"--only: unknown scenarios {sorted(chosen - set(SCENARIOS))}; choose from {list(SCENARIOS)}")
    scenarios = {name: s for name, s in SCENARIOS.items() if name == "fault-free" or not chosen or name in chosen}
    trajectories = demo_trajectories(args.agents, args.turns, 1024, 64, 16, 512)
    rounds: list[dict[str, dict[str, Any]]] = []
    for index in range(args.rounds):
        figures: dict[str, dict[str, Any]] = {}
        for name, (faults, monkey) in scenarios.items():
            fault_free = figures.get("fault-free", {}).get("jct_s", 0.0)
            figures[name] = run_once(config(args.transport, faults), trajectories, monkey, fault_free, seed=index)
            print(f"round {index + 1} {name}: JCT {figures[name]['jct_s']:.1f} s, retries {figures[name]['retries']}, "
                  f"restarts {figures[name]['restarts']}, failures {figures[name]['failures']}", flush=True)
        reference_jct, reference_outputs = figures["fault-free"]["jct_s"], figures["fault-free"]["outputs"]
        for figure in figures.values():
            figure["ratio"] = figure["jct_s"] / reference_jct
            figure["outputs_identical"] = figure.pop("outputs") == reference_outputs
        rounds.append(figures)
    summary = {name: {"median_ratio": statistics.median(r[name]["ratio"] for r in rounds),
                      "all_identical": all(r[name]["outputs_identical"] for r in rounds),
                      "failures": sum(r[name]["failures"] for r in rounds),
                      "restarts": [r[name]["restarts"] for r in rounds]} for name in scenarios}
    for name, figure in summary.items():
        print(f"{name:42s} median JCT ratio {figure['median_ratio']:.2f}x, outputs identical {figure['all_identical']}, "
              f"failed trajectories {figure['failures']}, restarts per round {figure['restarts']}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": "benchmarks/chaos_overhead.py", "args": vars(args) | {"json": str(args.json)},
                                         "rounds": rounds, "summary": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
