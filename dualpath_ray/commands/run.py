"""`dualpath run --config X --trace T --mode M --out results.parquet`: replay a trace.

Without `--address` an embedded local cluster with the configured topology is started; with
one (or inside a Ray job, `--address auto`) the run uses that cluster, whose nodes must carry the
role labels and slot resources (cluster_configs/ shows how). Writes the per-turn results as
Parquet and, with `--summary`, a JSON summary; a trajectory that fails is reported there (and
the exit code is 1) while the others' results are kept.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dualpath_ray.config import DualPathConfig, load_config


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=None, help="YAML config (default: embedded defaults)")
    parser.add_argument("--trace", type=Path, required=True, help="trajectory trace Parquet (docs/trace-format.md)")
    parser.add_argument("--mode", choices=("dualpath", "basic", "oracle"), default=None, help="default: runtime.mode")
    parser.add_argument("--out", type=Path, required=True, help="results Parquet, one row per turn")
    parser.add_argument("--summary", type=Path, default=None, help="summary JSON")
    parser.add_argument("--address", default=None, help="a running Ray cluster ('auto' inside a job)")
    parser.add_argument(
        "--replace", action="store_true",
        help="kill actors another deployment left in runtime.namespace instead of refusing to start",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help="replay a trace on the cluster", description=__doc__)
    add_run_arguments(parser)
    parser.set_defaults(func=main)


def fault_figures(cluster: Any) -> dict[str, Any]:
    """Under a fault plan: what was injected (site:mode -> [injected, events]) and what the KV
    checks caught, so a chaos run shows its faults next to its outcome."""
    report = cluster.integrity_report()
    return {
        "injected": {label: [count.injected, count.events] for label, count in sorted(cluster.fault_counts().items())},
        "detected": {k: (len(v) if isinstance(v, set) else v) for k, v in report.items()},
    }


def run_trace(
    cfg: DualPathConfig, trace: Path, mode: str | None, out: Path, summary_path: Path | None,
    address: str | None, metadata: dict[str, Any] | None = None, replace_existing: bool = False,
) -> dict[str, Any]:
    """Replay a trace and write its results; returns the summary (also written if asked)."""
    from dualpath_ray.cluster import DualPathCluster
    from dualpath_ray.workload.trace import read_trace

    trajectories = read_trace(trace, cfg.model.vocab_size)
    # Absolute before joining the cluster: inside a Ray job, joining replaces the job's working
    # directory (the process's cwd) with a fresh copy at the same path, so relative paths would
    # resolve into the removed one; anything made in it before is gone too.
    out = out.absolute()
    summary_path = summary_path.absolute() if summary_path is not None else None
    cluster = DualPathCluster.connect(cfg, address) if address else DualPathCluster.start(cfg)
    try:
        deployment = cluster.deploy(mode, replace_existing=replace_existing)
        result = cluster.rollout(trajectories)
        out.parent.mkdir(parents=True, exist_ok=True)
        result.write_parquet(str(out))
        summary = {**result.summary(), "mode": deployment.mode, "warnings": deployment.warnings,
                   "metadata": metadata or {}, "results": str(out)}
        if cfg.faults.faults:
            summary["faults"] = fault_figures(cluster)
    finally:
        if address:
            cluster.teardown()
        else:
            cluster.shutdown()
    if summary_path is not None:
        summary_path.parent.mkdir(parents=True, exist_ok=True)
        summary_path.write_text(json.dumps(summary, indent=2))
    return summary


def main(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    summary = run_trace(cfg, args.trace, args.mode, args.out, args.summary, args.address, replace_existing=args.replace)
    print(json.dumps({k: summary[k] for k in ("trajectories", "turns", "failed_trajectories", "jct_s", "hit_rate")}))
    if summary["failed_trajectories"]:
        print(f"dualpath run: {len(summary['failed_trajectories'])} trajectories failed: {summary['failures']}", file=sys.stderr)
        return 1
    return 0
