"""A deployment never silently reuses actors another deployment left in its namespace."""

from __future__ import annotations

import pytest

import ray

from dualpath_ray.runtime.deploy.deployment import DeploymentConflictError
from dualpath_ray.runtime.telemetry.status_views import StatusQuery
from tests.helpers import runtime_config, trajectories

pytestmark = pytest.mark.integration


def test_leftover_actors_are_refused_by_name_then_replaced_when_asked(cluster_for):
    cluster = cluster_for(runtime_config(), "basic")
    # A driver that crashed forgets its deployment; its detached scheduler lives on.
    cluster.deployment = None
    with pytest.raises(DeploymentConflictError, match="scheduler") as refused:
        cluster.deploy("dualpath")
    assert "replace_existing=True" in str(refused.value), "the error names the way out"
    mode = cluster.deploy("dualpath", replace_existing=True).mode
    assert mode == "dualpath", "replacing kills the leftovers and deploys the new run"
    modes = ray.get(cluster.deployment.scheduler.status.remote(StatusQuery.DEPLOYMENT)).mode
    assert modes == "dualpath", "the live scheduler is the new deployment's, not the leftover"
    results = cluster.run_trajectories(trajectories(count=2, turns=2))
    assert all(len(turns) == 2 for turns in results.values()), "the replacement deployment serves"
