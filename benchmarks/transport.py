"""KV transport latency: NIXL and gloo reads/writes between two actors on two embedded Ray nodes.

    .venv/bin/python benchmarks/transport.py [--kinds nixl gloo] [--reps 30] [--json]

The initiator (node 2) times `read(...).wait()` and `write(...).wait()` of one region of each
size against the peer (node 1), interleaved per repetition with a single-process torch copy of
the same bytes inside the initiator (the reference). Reported: medians in ms, GB/s, and the
ratio copy time / transfer time (1.0 = as fast as a local copy). The fixed cost per transfer
is the 64 B median. `--split-bytes N` cuts each move into N-byte moves with gaps between them
(so coalescing cannot merge them back), to see whether several descriptors per transfer help.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

# An embedded, throwaway cluster on this machine: no token auth, no usage stats (as in the tests).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray
import torch
from ray.cluster_utils import Cluster

from dualpath_ray.runtime.transport.moves import Region
from dualpath_ray.runtime.transport.endpoint import TransportEndpoint, endpoint_actor_options
from dualpath_ray.runtime.transport.factory import make_transport
from dualpath_ray.runtime.transport.gloo_world import setup_gloo_world

SIZES = (64, 4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)
GOAL_FIXED_MS = 0.5
GOAL_4MIB_RATIO = 0.30
WARMUP = 3


@ray.remote(num_cpus=0, **endpoint_actor_options())
class BenchEndpoint(TransportEndpoint):
    """A pool "hbm" with room for the largest move twice (plus gaps when moves are split)."""

    def __init__(self, kind: str, name: str, namespace: str, pool_bytes: int) -> None:
        self.pool = torch.randint(0, 256, (pool_bytes,), dtype=torch.uint8)
        self.transport = self.attach_transport(make_transport(kind, name, namespace=namespace))
        self.transport.register("hbm", self.pool)
        self.transport.seal()

    def ready(self) -> int:
        return os.getpid()

    def measure(self, peer: str, sizes: list[int], reps: int, split_bytes: int) -> list[dict[str, Any]]:
        return [self._measure_size(peer, nbytes, reps, split_bytes) for nbytes in sizes]

    def _measure_size(self, peer: str, nbytes: int, reps: int, split_bytes: int) -> dict[str, Any]:
        pairs = split_moves(nbytes, split_bytes, len(self.pool) // 2)
        source, target = self.pool[:nbytes], self.pool[len(self.pool) // 2 :][:nbytes]
        times: dict[str, list[float]] = {"read": [], "write": [], "copy": []}
        for rep in range(WARMUP + reps):
            sample = {
                "read": self._timed(lambda: self.transport.read(peer, pairs).wait()),
                "write": self._timed(lambda: self.transport.write(peer, pairs).wait()),
                "copy": self._timed(lambda: target.copy_(source)),
            }
            if rep >= WARMUP:
                for key, value in sample.items():
                    times[key].append(value)
        medians = {key: statistics.median(values) for key, values in times.items()}
        return {"nbytes": nbytes, "descriptors": len(pairs), **{f"{k}_ms": v * 1e3 for k, v in medians.items()}}

    @staticmethod
    def _timed(step: Any) -> float:
        started = time.perf_counter()
        step()
        return time.perf_counter() - started

    def stats(self) -> dict[str, int]:
        return vars(self.transport.stats())


def split_moves(nbytes: int, split_bytes: int, half: int) -> list[tuple[Region, Region]]:
    """One move of nbytes, or pieces of split_bytes with a one-piece gap after each (no coalescing)."""
    if split_bytes <= 0 or nbytes <= split_bytes:
        return [(Region("hbm", 0, nbytes), Region("hbm", 0, nbytes))]
    pieces = []
    for index, start in enumerate(range(0, nbytes, split_bytes)):
        size = min(split_bytes, nbytes - start)
        offset = start + index * split_bytes  # the gap keeps neighbours apart
        assert offset + size <= half, "pool too small for the split layout"
        pieces.append((Region("hbm", offset, size), Region("hbm", offset, size)))
    return pieces


def run_kind(kind: str, sizes: list[int], reps: int, split_bytes: int) -> dict[str, Any]:
    namespace = f"bench-transport-{kind}"
    pool_bytes = 4 * max(sizes) + (1 << 20)
    peer = BenchEndpoint.options(name="reader/n1", namespace=namespace, resources={"node1": 0.01}).remote(
        kind, "reader/n1", namespace, pool_bytes
    )
    initiator = BenchEndpoint.options(name="decode/n2/g0", namespace=namespace, resources={"node2": 0.01}).remote(
        kind, "decode/n2/g0", namespace, pool_bytes
    )
    try:
        ray.get([peer.ready.remote(), initiator.ready.remote()])
        if kind == "gloo":
            setup_gloo_world([peer, initiator])
        rows = ray.get(initiator.measure.remote("reader/n1", sizes, reps, split_bytes))
        return {"rows": rows, "stats": ray.get(initiator.stats.remote())}
    finally:
        for handle in (peer, initiator):
            ray.kill(handle)


def derived(row: dict[str, Any]) -> dict[str, Any]:
    gbps = {op: row["nbytes"] / (row[f"{op}_ms"] * 1e-3) / 1e9 for op in ("read", "write", "copy")}
    ratio = {op: row["copy_ms"] / row[f"{op}_ms"] for op in ("read", "write")}
    return {**row, **{f"{k}_gbps": v for k, v in gbps.items()}, **{f"{k}_ratio": v for k, v in ratio.items()}}


def print_table(kind: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{kind}: medians")
    print(f"{'bytes':>10} {'desc':>5} {'read ms':>9} {'write ms':>9} {'copy ms':>9} "
          f"{'read GB/s':>10} {'write GB/s':>10} {'read ratio':>10} {'write ratio':>11}")
    for row in rows:
        print(f"{row['nbytes']:>10} {row['descriptors']:>5} {row['read_ms']:>9.4f} {row['write_ms']:>9.4f} "
              f"{row['copy_ms']:>9.4f} {row['read_gbps']:>10.2f} {row['write_gbps']:>10.2f} "
              f"{row['read_ratio']:>10.2f} {row['write_ratio']:>11.2f}")


def goals(kind: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_size = {row["nbytes"]: row for row in rows}
    verdict: dict[str, Any] = {}
    if 64 in by_size:
        fixed = max(by_size[64]["read_ms"], by_size[64]["write_ms"])
        verdict["fixed_ms"] = fixed
        verdict["fixed_goal_met"] = fixed <= GOAL_FIXED_MS if kind == "nixl" else None
    if 4 << 20 in by_size:
        ratio = min(by_size[4 << 20]["read_ratio"], by_size[4 << 20]["write_ratio"])
        verdict["ratio_4mib"] = ratio
        verdict["ratio_goal_met"] = ratio >= GOAL_4MIB_RATIO if kind == "nixl" else None
    return verdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", default=["nixl", "gloo"], choices=["nixl", "gloo"])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--split-bytes", type=int, default=0, help="cut each move into moves of this size")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = parser.parse_args()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "object_store_memory": 80 << 20},
    )
    report: dict[str, Any] = {"reps": args.reps, "split_bytes": args.split_bytes, "cpus": os.cpu_count()}
    try:
        for index in (1, 2):
            cluster.add_node(num_cpus=1, resources={f"node{index}": 1}, object_store_memory=80 << 20)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="bench-transport", log_to_driver=False)
        report["load_before"] = os.getloadavg()
        for kind in args.kinds:
            measured = run_kind(kind, args.sizes, args.reps, args.split_bytes)
            rows = [derived(row) for row in measured["rows"]]
            report[kind] = {"rows": rows, "goals": goals(kind, rows), "stats": measured["stats"]}
        report["load_after"] = os.getloadavg()
    finally:
        ray.shutdown()
        cluster.shutdown()
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for kind in args.kinds:
        print_table(kind, report[kind]["rows"])
        print(f"{kind} goals: {report[kind]['goals']}")
    print(f"load average before/after: {report['load_before']} / {report['load_after']}")


if __name__ == "__main__":
    main()
