"""Tool-time staging on a real 1P1D cluster (scheduling/staging.py, kv/staged.py): a
rollout whose trace has tool latency stages each next turn's KV on the decode node while the tool
runs, the next turn uses the staged extent, the outputs equal the fault-free recompute's, and
nothing stays leased; a session that says it continues but never returns costs one extent, freed
when its order expires."""

from __future__ import annotations

import pytest

import ray

from dualpath_ray.cluster import DualPathCluster
from dualpath_ray.kv.staged import StagingCounts
from dualpath_ray.runtime.telemetry.status_views import StatusQuery
from tests.helpers import recompute_outputs, runtime_config, settled_pools, trajectories

pytestmark = [pytest.mark.integration]

TOOL_S = 1.5


def reader_staging(cluster: DualPathCluster) -> dict[str, StagingCounts]:
    readers = cluster.deployment.readers
    return {name: ray.get(actor.staging_counts.remote()) for name, actor in readers.items()}


def test_a_rollout_with_tool_time_stages_each_next_turn_and_uses_it(cluster_for) -> None:
    cfg = runtime_config(heartbeat_s=0.2).with_overrides(scheduler={"stage_margin_s": 1.0, "stage_slack": 0.0})
    trajs = trajectories(count=4, turns=3, tool_s=TOOL_S)
    cluster = cluster_for(cfg, "dualpath")
    deployment = cluster.deployment
    result = cluster.rollout(trajs, progress=False)
    calls = ray.get(deployment.scheduler.status.remote(StatusQuery.CALLS)).to_json()
    staging = reader_staging(cluster)
    pools = settled_pools(cluster, 10.0)
    print(f"scheduler: {({k: v for k, v in calls.items() if k.startswith('stage')})}; readers: {staging}")
    assert not result.failures, f"every trajectory completes: {result.failures}"
    assert result.outputs() == recompute_outputs(cfg, trajs), "outputs equal the fault-free recompute"
    hinted = 4 * 2  # every turn but the last of each trajectory is followed by tool time
    assert calls["stage_orders"] == hinted, "each hinted turn's context was ordered staged"
    assert calls["stage_claims"] > 0, "next turns claimed their staged chains"
    used = sum(counts.used for counts in staging.values())
    assert used > 0, f"the readers handed staged blocks to next turns: {staging}"
    later = [r for turns in result.turn_results.values() for r in turns[1:]]
    assert all(r.path == "de" for r in later if r.hit_tokens), "staged turns read their hits on the DE path"
    assert all(free == capacity for free, _, _, capacity in pools.values()), f"nothing stays leased: {pools}"
    assert ray.get(deployment.scheduler.status.remote(StatusQuery.INTEGRITY)).requests == 0, "no request is left at the scheduler"


def test_a_session_that_never_returns_costs_one_extent_until_it_expires(cluster_for) -> None:
    cfg = runtime_config(heartbeat_s=0.2).with_overrides(scheduler={"stage_margin_s": 0.5, "stage_slack": 0.0})
    cluster = cluster_for(cfg, "dualpath")
    server = cluster.server()
    prompt = list(range(1, 300))
    ray.get(server.generate.remote("once", prompt, {"max_tokens": 4, "temperature": 0.0}))
    first = ray.get(server.generate.remote("twice", prompt + [7, 8], {"max_tokens": 4, "temperature": 0.0},
                                           None, 1.0))
    assert first.token_ids, "the hinted turn is served as any other"
    held = max(capacity - free for free, _, _, capacity in cluster.pool_integrity().values())
    pools = settled_pools(cluster, 10.0)
    staging = reader_staging(cluster)
    calls = ray.get(cluster.deployment.scheduler.status.remote(StatusQuery.CALLS)).to_json()
    print(f"blocks held right after the hinted turn: {held}; readers: {staging}")
    assert calls["stage_orders"] == 1, "the hinted turn's context was ordered staged, once"
    expired = sum(counts.expired for counts in staging.values())
    assert expired == calls["stage_order_blocks"] > 0, "that one extent, unclaimed, expired whole"
    assert sum(counts.used for counts in staging.values()) == 0, "nothing claimed it"
    assert all(free == capacity for free, _, _, capacity in pools.values()), f"and its extent was freed: {pools}"
