"""One embedded Ray cluster shared by the integration and chaos test modules that ask for it.

Starting an embedded cluster (a Ray head and one `ray start`-like node per configured node) and
stopping it costs seconds on every test that does it, while most of them run the same 1P1D shape
(`runtime_config()`'s cluster section) and only deploy a different config on it. A deployment,
not the cluster, is what a test owns: `DualPathCluster.deploy(cfg=...)` replaces the previous
one on a running cluster, each deployment gets a fresh store, fresh actors and a fresh weight
ledger (runtime/weights/ledger.py starts anew with a deployment's first scheduler), so
tests sharing the cluster share nothing a test checks.

The cluster is started for the cluster section and namespace of the first config deployed on it
(`ray.init` binds the driver to one namespace; `deploy` refuses a config whose cluster section
differs, since the Ray nodes were planned from it). A config with another cluster section or
namespace stops it and starts one for that config: sharing never deploys a config on nodes
planned for a different one.

A driver holds one Ray connection at a time, so the shared cluster is started when a test first
asks for it (`cluster_for` or `shared_cluster`, tests/conftest.py) and stopped before any module
that starts a cluster of its own (or a `ray start` cluster) runs, then started again when asked.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from dualpath_ray.cluster import DualPathCluster
from dualpath_ray.config import DualPathConfig
from tests.helpers import ray_test_env


class SharedCluster:
    """The session's shared embedded cluster, started lazily, one deployment at a time."""

    def __init__(self) -> None:
        self.cluster: DualPathCluster | None = None
        # The config it was started with: a deployment may change the driver's cfg, never its nodes or namespace.
        self.started: DualPathConfig | None = None
        self.starts = 0  # how many times it was started (once per cluster section, unless modules of their own came between)

    def deploy(self, cfg: DualPathConfig, mode: str | None = None, store_root: str | None = None) -> DualPathCluster:
        """The shared cluster with `cfg` deployed in `mode` (cfg's runtime.mode when None) on
        `store_root` (as `DualPathCluster.deploy` picks it when None: cfg's, else a fresh one). A
        cluster started for another cluster section or namespace, or whose processes died, is
        stopped and one for `cfg` started in its place."""
        if self.cluster is not None and not self.fits(cfg):
            self.close()
        if self.cluster is None:
            ray_test_env()
            self.cluster = DualPathCluster.start(cfg)
            self.started = cfg
            self.starts += 1
        self.cluster.deploy(mode, store_root, cfg=cfg)
        return self.cluster

    def fits(self, cfg: DualPathConfig) -> bool:
        """Whether `cfg` can be deployed on the running cluster: the same cluster section (the
        nodes were planned from it) and namespace (the driver's Ray connection is bound to it),
        and every process of the cluster still alive."""
        assert self.cluster is not None and self.started is not None
        started = self.started
        return (cfg.cluster == started.cluster and cfg.runtime.namespace == started.runtime.namespace
                and self.cluster.embedded_alive())

    @contextmanager
    def deployed(
        self, cfg: DualPathConfig, mode: str | None = None, store_root: str | None = None,
    ) -> Iterator[DualPathCluster]:
        """`deploy`, and `end_deployment` when the block ends: a module-scoped fixture's
        deployment. A deployment that failed part way may have left actors, so the cluster is
        stopped then, as a test's own cluster was."""
        try:
            cluster = self.deploy(cfg, mode, store_root)
        except BaseException:
            self.close()
            raise
        try:
            yield cluster
        finally:
            self.end_deployment()

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
            self.started = None
