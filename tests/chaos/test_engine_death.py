"""Engines killed in the middle of a rollout on a real 1P1D cluster: every trajectory still
completes with the fault-free outputs, the dead engine's requests are retried elsewhere, its
peers keep taking work, nothing stays leased."""

from __future__ import annotations

import threading
import time

import pytest

from tests.helpers import ray_test_env, recompute_outputs, runtime_config, trajectories, verify_mismatches

ray_test_env()

import ray  # noqa: E402

from dualpath_ray.cluster import DualPathCluster  # noqa: E402
from dualpath_ray.runtime.telemetry.status_views import StatusQuery  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.chaos]


def rollout_killing(cluster: DualPathCluster, trajs, victim: str, after_turns: int):
    """Run the rollout on a thread; kill engine `victim` once `after_turns` turns finished."""
    return rollout_killing_actor(cluster, trajs, cluster.deployment.engines[victim], after_turns)


def rollout_killing_actor(cluster: DualPathCluster, trajs, actor, after_turns: int):
    """Run the rollout on a thread; kill `actor` once `after_turns` turns have finished."""
    box = {}
    worker = threading.Thread(target=lambda: box.setdefault("result", cluster.rollout(trajs, progress=False)))
    scheduler = cluster.deployment.scheduler
    worker.start()
    deadline = time.monotonic() + 120
    while ray.get(scheduler.status.remote(StatusQuery.CALLS)).received.complete < after_turns and time.monotonic() < deadline:
        time.sleep(0.05)
    ray.kill(actor, no_restart=True)
    killed_at = ray.get(scheduler.status.remote(StatusQuery.CALLS)).received.complete
    worker.join(timeout=300)
    assert not worker.is_alive(), f"the rollout finishes (never hangs on a dead engine); {hang_report(scheduler)}"
    return box["result"], killed_at


def hang_report(scheduler) -> str:
    """What the scheduler holds when a rollout did not finish: each live request's state and
    engines, who is out of service, its tables' sizes (what a hang's diagnosis starts from)."""
    views = {query.value: scheduler.status.remote(query) for query in (
        StatusQuery.IN_FLIGHT, StatusQuery.SERVICE, StatusQuery.TRACKED, StatusQuery.CALLS)}
    return "; ".join(f"{name}: {ray.get(ref, timeout=30)}" for name, ref in views.items())


@pytest.mark.parametrize("victim", ["decode/d0/g1", "decode/d0/g0", "prefill/p0/g0"])
def test_a_killed_engine_loses_no_trajectory_and_changes_no_output(victim: str):
    cfg = runtime_config(heartbeat_s=0.2, heartbeat_timeout_s=2.0)
    trajs = trajectories(count=8, turns=4)
    expected = recompute_outputs(cfg, trajs)
    cluster = DualPathCluster.start(cfg)
    try:
        deployment = cluster.deploy("dualpath")
        started = time.monotonic()
        result, killed_at = rollout_killing(cluster, trajs, victim, after_turns=6)
        elapsed = time.monotonic() - started
        calls = ray.get(deployment.scheduler.status.remote(StatusQuery.CALLS)).to_json()
        turns = sum(len(t) for t in result.turn_results.values())
        print(f"{victim} killed after {killed_at} turns; {turns} turns in {elapsed:.1f} s; "
              f"retries {calls['retries']}, dead engines seen {calls['dead_engines']}, stale results {calls['stale_results']}")
        assert not result.failures, f"0 lost trajectories: {result.failures}"
        assert result.outputs() == expected, "outputs equal the fault-free recompute (0 duplicated, 0 changed)"
        assert verify_mismatches(cluster) == 0, "no KV a dead engine left half-written reached a live decode engine"
        assert turns == sum(len(t.turns) for t in trajs), "every turn is reported exactly once"
        assert all(free == capacity for free, _, _, capacity in cluster.pool_integrity().values()), (
            "every reader's buffer pool is fully free (the dead engine's extents reclaimed)"
        )
    finally:
        cluster.shutdown()
