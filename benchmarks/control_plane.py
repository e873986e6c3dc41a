"""What the control plane costs: idle, per turn, and in actor calls, on the embedded cluster.

    .venv/bin/python benchmarks/control_plane.py                 # about 2 minutes
    .venv/bin/python benchmarks/control_plane.py --repeat 5 --json out.json

One run on the README demo's embedded 1P1D cluster (2 engines per node), in oracle mode (no
storage reads or KV transfers: what is left is the control plane and a tiny model's compute):

1. Idle cost, side by side: the CPU of every process of the Ray cluster (head, nodes' raylets,
   workers; read from /proc, this driver excluded) over `--idle-s` seconds with nothing deployed,
   then again with the deployment (scheduler, 2 readers, 4 engines) deployed and idle.
2. Throughput: `--trajectories` x `--turns` turns of `--first` + `--appended` tokens generating
   `--gen` token each, through `DualPathCluster.rollout` (a warm-up rollout first). Reported:
   turns per second, and CPU ms per turn of each actor kind (scheduler, reader, prefill, decode),
   of Ray's own processes and of this driver (the rollout's client), from process CPU time.
3. Actor calls per turn by kind, as counted by their senders: the client's submits and
   collects, the scheduler's task pushes and heartbeats, the engines' reports, handoffs and
   reader calls, the readers' queue reports.

Throughput runs `--repeat` times on the same deployment; medians are reported with every run.
The numbers depend on the machine: benchmarks/README.md says which one each was taken on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402

from dualpath_ray.cluster import DualPathCluster  # noqa: E402
from dualpath_ray.runtime.deploy.deployment import Deployment  # noqa: E402
from dualpath_ray.demos.demo import demo_config, demo_trajectories  # noqa: E402
from dualpath_ray.runtime.telemetry.status_views import StatusQuery  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def descendants(root: int) -> list[int]:
    """Every process below `root` (the embedded cluster's processes are this driver's)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                parent = int(fh.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        children.setdefault(parent, []).append(int(entry))
    found, stack = [], list(children.get(root, []))
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def cluster_cpu() -> dict[int, float]:
    return {pid: cpu_seconds(pid) for pid in descendants(os.getpid())}


def spent(before: dict[int, float], after: dict[int, float]) -> dict[int, float]:
    return {pid: after[pid] - before.get(pid, 0.0) for pid in after}


def actor_pids(deployment: Deployment) -> dict[str, int]:
    actors = {"scheduler": deployment.scheduler, **deployment.readers, **deployment.engines}
    return {name: ray.get(actor.__ray_call__.remote(lambda self: os.getpid())) for name, actor in actors.items()}


def kind_of(name: str) -> str:
    return name.split("/")[0]


def idle_cores(seconds: float) -> float:
    """Cores the cluster's processes used over `seconds` of idleness."""
    before = cluster_cpu()
    time.sleep(seconds)
    return sum(spent(before, cluster_cpu()).values()) / seconds


def calls_sent(cluster: DualPathCluster, client_calls: Counter[str]) -> Counter[str]:
    """Every actor call the run's actors and client made, by kind."""
    deployment = cluster.deployment
    assert deployment is not None
    sent: Counter[str] = Counter(client_calls)
    for stats in cluster.engine_stats().values():
        sent.update(stats.sent)
    for reader in deployment.readers.values():
        sent["reader_report"] += ray.get(reader.reports_sent.remote())
    counts = ray.get(deployment.scheduler.status.remote(StatusQuery.CALLS))
    sent["accept"] += counts.received.pushes
    sent["heartbeat"] += counts.received.heartbeats
    for method in ("cancel", "abort", "reclaim"):
        sent[method] += counts.sent.get(method, 0)
    return sent


def throughput_run(cluster: DualPathCluster, pids: dict[str, int], trajectories: list[Any]) -> dict[str, Any]:
    """One rollout: turns/s, CPU ms per turn by actor kind, calls per turn by kind."""
    before_calls = calls_sent(cluster, Counter())
    before_cpu = cluster_cpu()
    driver_before = time.process_time()
    started = time.monotonic()
    result = cluster.rollout(trajectories, progress=False)
    wall = time.monotonic() - started
    driver_s = time.process_time() - driver_before
    used = spent(before_cpu, cluster_cpu())
    client = Counter(result.client_calls)
    calls = calls_sent(cluster, client) - before_calls
    turns = result.table.num_rows
    if result.failures:
        raise RuntimeError(f"the rollout failed: {result.failures}")
    by_kind: Counter[str] = Counter()
    for name, pid in pids.items():
        by_kind[kind_of(name)] += used.get(pid, 0.0)
    ray_own = sum(used.values()) - sum(used.get(pid, 0.0) for pid in pids.values())
    per_turn_ms = {kind: 1000.0 * cpu / turns for kind, cpu in sorted(by_kind.items())}
    per_turn_ms["ray (raylets, gcs, other workers)"] = 1000.0 * ray_own / turns
    per_turn_ms["driver (client)"] = 1000.0 * driver_s / turns
    return {
        "turns": turns, "wall_s": wall, "turns_per_s": turns / wall, "cpu_ms_per_turn": per_turn_ms,
        "calls_per_turn": {kind: count / turns for kind, count in sorted(calls.items()) if count},
        "calls_per_turn_total": sum(calls.values()) / turns,
    }


def median_of(runs: list[dict[str, Any]], *path: str) -> float:
    values = []
    for run in runs:
        value: Any = run
        for key in path:
            value = value.get(key, 0.0)
        values.append(value)
    return statistics.median(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle-s", type=float, default=10.0, help="seconds of each idle measurement")
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--first", type=int, default=64, help="tokens of a trajectory's first prompt")
    parser.add_argument("--appended", type=int, default=8, help="tokens appended by every later turn")
    parser.add_argument("--gen", type=int, default=1, help="tokens generated per turn")
    parser.add_argument("--repeat", type=int, default=3, help="throughput runs (medians reported)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)

    cfg = demo_config().with_overrides(runtime={"mode": "oracle"})
    cluster = DualPathCluster.start(cfg)
    try:
        time.sleep(3.0)  # let the nodes' start-up work end
        bare = idle_cores(args.idle_s)
        deployment = cluster.deploy("oracle")
        pids = actor_pids(deployment)
        time.sleep(3.0)
        deployed = idle_cores(args.idle_s)
        trajectories = demo_trajectories(count=args.trajectories, turns=args.turns, first=args.first,
                                         appended=args.appended, gen=args.gen)
        cluster.rollout(demo_trajectories(count=8, turns=2, first=args.first, appended=args.appended, gen=args.gen,
                                          seed=1), progress=False)  # warm-up
        runs = [throughput_run(cluster, pids, trajectories) for _ in range(args.repeat)]
    finally:
        cluster.shutdown()
    report = {
        "machine": {"cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()},
        "workload": f"{args.trajectories} trajectories x {args.turns} turns, {args.first}+{args.appended} tokens, "
                    f"{args.gen} generated, oracle mode, embedded 1P1D (2 engines per node)",
        "idle_cores": {"nothing_deployed": bare, "deployed_idle": deployed, "deployed_above_ray": deployed - bare},
        "median": {
            "turns_per_s": median_of(runs, "turns_per_s"),
            "cpu_ms_per_turn": {k: median_of(runs, "cpu_ms_per_turn", k) for k in runs[0]["cpu_ms_per_turn"]},
            "calls_per_turn": {k: median_of(runs, "calls_per_turn", k) for k in runs[0]["calls_per_turn"]},
            "calls_per_turn_total": median_of(runs, "calls_per_turn_total"),
        },
        "runs": runs,
    }
    print_report(report)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


def print_report(report: dict[str, Any]) -> None:
    idle, median = report["idle_cores"], report["median"]
    print(f"workload: {report['workload']}")
    print(f"idle: nothing deployed {idle['nothing_deployed']:.3f} cores, deployed and idle "
          f"{idle['deployed_idle']:.3f} cores ({idle['deployed_above_ray']:+.3f} above Ray's own)")
    print(f"throughput: {median['turns_per_s']:.0f} turns/s (median; runs: "
          + ", ".join(f"{r['turns_per_s']:.0f}" for r in report["runs"]) + ")")
    print("CPU ms per turn: " + ", ".join(f"{k} {v:.2f}" for k, v in median["cpu_ms_per_turn"].items()))
    print(f"actor calls per turn: {median['calls_per_turn_total']:.2f} ("
          + ", ".join(f"{k} {v:.2f}" for k, v in median["calls_per_turn"].items()) + ")")


if __name__ == "__main__":
    sys.exit(main())
