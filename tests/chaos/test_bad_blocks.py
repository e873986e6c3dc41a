"""Corrupt and missing hit blocks on a real cluster and store: every one is detected at read,
the turn is retried from its longest valid prefix (or fails with its kind under policy fail),
outputs equal the fault-free recompute, and nothing is left leased."""

from __future__ import annotations

import pytest
import ray

from dualpath_ray.kv.index import block_keys
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.store import open_store
from dualpath_ray.workload.trace import Trajectory
from dualpath_ray.runtime.telemetry.status_views import StatusQuery
from tests.helpers import recompute_outputs, runtime_config, trajectories, verify_mismatches
from tests.shared_cluster import SharedCluster

pytestmark = [pytest.mark.integration, pytest.mark.chaos]


def first_turns(trajs: list[Trajectory]) -> list[Trajectory]:
    return [Trajectory(t.trajectory_id, t.turns[:1], t.arrival_s) for t in trajs]


def damage(cfg, root: str, trajs: list[Trajectory]) -> dict[str, str]:
    """Flip a payload byte of block 1 of even trajectories' first turns, delete it for odd ones."""
    layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
    store = open_store(cfg.store, layout, root=root)
    injected = {}
    for i, traj in enumerate(trajs):
        namespace = cfg.model.kv_namespace(block_size=cfg.store.block_size)
        key = block_keys(list(traj.turns[0].appended), layout.block_size, namespace)[1]
        path = store.path_of(key)
        if i % 2 == 0:
            raw = bytearray(path.read_bytes())
            raw[-1] ^= 0x5A
            path.write_bytes(bytes(raw))
            injected[traj.trajectory_id] = "corrupt"
        else:
            path.unlink()
            injected[traj.trajectory_id] = "missing"
    return injected


def test_bad_hit_blocks_are_detected_repaired_and_outputs_unchanged(shared_cluster: SharedCluster):
    cfg = runtime_config(verify_kv=True)
    trajs = trajectories(count=6, turns=3, first=300)
    with shared_cluster.deployed(cfg, "dualpath") as cluster:
        deployment = cluster.deployment
        warm = cluster.rollout(first_turns(trajs), progress=False)
        injected = damage(cfg, deployment.store_root, trajs)
        result = cluster.rollout(trajs, resume=warm, progress=False)
        calls = ray.get(deployment.scheduler.status.remote(StatusQuery.CALLS)).to_json()
        print(f"injected {len(injected)} bad blocks; retries {calls['retries']}, unindexed {calls['unindexed_blocks']}")
        assert not result.failures, f"every trajectory completes: {result.failures}"
        assert calls["retries"] == len(injected), "each bad block is detected exactly once (detected == injected)"
        assert result.outputs() == recompute_outputs(cfg, trajs), "outputs equal the fault-free recompute"
        assert verify_mismatches(cluster) == 0, "no bad block's bytes reached a decode engine (runtime.verify_kv)"
        retried = [r for turns in result.turn_results.values() for r in turns if r.attempt > 0]
        print("retried turns (attempt, hit tokens):", sorted((r.attempt, r.hit_tokens) for r in retried))
        assert len(retried) == len(injected), "one turn per damaged trajectory needed a second attempt"
        assert all(r.attempt == 1 and r.hit_tokens == cfg.store.block_size for r in retried), (
            "the retry hit exactly the valid prefix (block 0) and recomputed the rest"
        )
        assert all(free == capacity for free, _, _, capacity in cluster.pool_integrity().values()), (
            "every buffer pool is fully free after the run"
        )
        assert cluster.health() == {}, "no engine thread failed"


def test_policy_fail_ends_the_turn_with_its_kind_and_keeps_the_others(shared_cluster: SharedCluster):
    cfg = runtime_config(kv_failure_policy="fail")
    trajs = trajectories(count=2, turns=2, first=300)
    with shared_cluster.deployed(cfg, "basic") as cluster:
        deployment = cluster.deployment
        warm = cluster.rollout(first_turns(trajs), progress=False)
        damage(cfg, deployment.store_root, trajs[:1])
        result = cluster.rollout(trajs, resume=warm, progress=False)
        assert set(result.failures) == {trajs[0].trajectory_id}, "only the damaged trajectory fails"
        assert "kv_corrupt" in result.failures[trajs[0].trajectory_id], "the failure names its kind"
        assert all(free == capacity for free, _, _, capacity in cluster.pool_integrity().values()), (
            "a failed turn's extents are freed"
        )
