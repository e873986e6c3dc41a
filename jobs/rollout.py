"""Ray job entrypoint: replay a trace on the cluster this job is attached to.

    ray job submit --working-dir . --metadata-json '{"trainer_run_id": "run-42"}' -- \
        python jobs/rollout.py --config cluster_configs/local-1p1d.yaml \
        --trace trace.parquet --out results/results.parquet --summary results/summary.json

The job's metadata (e.g. the trainer's run id) is copied into the summary JSON; `--trainer-run-id`
overrides it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# Run as a script from a job's working directory: import the package shipped beside it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dualpath_ray.commands.run import add_run_arguments, run_trace
from dualpath_ray.cli import user_errors
from dualpath_ray.config import load_config


def job_metadata() -> dict[str, object]:
    """The submitting client's metadata of this Ray job (empty outside a job)."""
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return {}
    return dict(json.loads(raw).get("metadata", {}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser)
    parser.add_argument("--trainer-run-id", default=None, help="recorded in the summary (default: job metadata)")
    parser.set_defaults(address="auto")
    args = parser.parse_args(argv)
    metadata = job_metadata()
    if args.trainer_run_id:
        metadata["trainer_run_id"] = args.trainer_run_id
    try:
        cfg = load_config(args.config)
        summary = run_trace(
            cfg, args.trace, args.mode, args.out, args.summary, args.address, metadata, replace_existing=args.replace
        )
    except user_errors() as exc:
        print(f"rollout: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({k: summary[k] for k in ("trajectories", "turns", "failed_trajectories", "jct_s")}))
    return 1 if summary["failed_trajectories"] else 0


if __name__ == "__main__":
    sys.exit(main())
