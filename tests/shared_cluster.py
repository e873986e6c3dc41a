"""One embedded Ray cluster shared by the integration and chaos test modules that ask for it.

Starting an embedded cluster (a Ray head and one `ray start`-like node per configured node) and
stopping it costs seconds on every test that does it, while most of them run the same 1P1D shape
(`runtime_config()`'s cluster section) and only deploy a different config on it. A deployment,
not the cluster, is what a test owns: `DualPathCluster.deploy(cfg=...)` replaces the previous
one on a running cluster, each deployment gets a fresh store, fresh actors and a fresh weight
ledger (runtime/weights/ledger.py starts anew with a deployment's first scheduler), so
tests sharing the cluster share nothing a test checks.

A driver holds one Ray connection at a time, so the shared cluster is started when a test first
asks for it (`cluster_for`, tests/conftest.py) and stopped before any module that starts a
cluster of its own (or a `ray start` cluster) runs, then started again when asked.
"""

from __future__ import annotations

from dualpath_ray.cluster import DualPathCluster
from dualpath_ray.config import DualPathConfig
from tests.helpers import ray_test_env, runtime_config


class SharedCluster:
    """The session's shared embedded cluster, started lazily, one deployment at a time."""

    def __init__(self) -> None:
        self.cluster: DualPathCluster | None = None
        self.starts = 0  # how many times it was started (once, unless modules of their own came between)

    def deploy(self, cfg: DualPathConfig, mode: str | None = None) -> DualPathCluster:
        """The shared cluster with `cfg` deployed in `mode` (cfg's runtime.mode when None); `cfg`
        must keep runtime_config()'s cluster section (deploy says so otherwise)."""
        if self.cluster is None:
            ray_test_env()
            self.cluster = DualPathCluster.start(runtime_config())
            self.starts += 1
        self.cluster.deploy(mode, cfg=cfg)
        return self.cluster

    def end_deployment(self) -> None:
        """Tear the current deployment down; the cluster stays up for the next test. A cluster
        whose processes died (a test that killed one) is stopped instead, to be started anew."""
        if self.cluster is None:
            return
        if not self.cluster.embedded_alive():
            self.close()
            return
        self.cluster.teardown()

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
