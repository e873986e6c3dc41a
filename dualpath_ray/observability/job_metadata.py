"""What a dualpath driver tells the Ray dashboard about itself.

A driver that starts or joins a cluster (`DualPathCluster.start` / `.connect`: `dualpath run`,
`dualpath demo`, a trainer, jobs/rollout.py) registers a Ray job; its JobConfig metadata shows in
the dashboard's Jobs view and in `ray list jobs`. Inside a `ray job submit`, Ray merges this with
the submission's own `--metadata-json`, which wins on equal keys.
"""

from __future__ import annotations

from typing import Any

from dualpath_ray.config import DualPathConfig

METADATA_PREFIX = "dualpath."


def driver_metadata(cfg: DualPathConfig) -> dict[str, str]:
    c = cfg.cluster
    return {
        f"{METADATA_PREFIX}namespace": cfg.runtime.namespace,
        f"{METADATA_PREFIX}topology": f"{c.prefill_nodes}P{c.decode_nodes}D x {c.gpus_per_node} GPUs",
        f"{METADATA_PREFIX}mode": str(cfg.runtime.mode),
        f"{METADATA_PREFIX}model": f"{cfg.model.model_id}@{cfg.model.weight_version}",
    }


def driver_job_config(cfg: DualPathConfig) -> Any:
    """A ray.job_config.JobConfig carrying `driver_metadata(cfg)`."""
    from ray.job_config import JobConfig

    return JobConfig(metadata=driver_metadata(cfg))
