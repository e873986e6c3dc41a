"""A store with room for half the working set: the rollout completes with the fault-free
outputs, evicted blocks are misses (recomputed), the index never exceeds the capacity, and
reset_prefix_cache leaves no block file behind."""

from __future__ import annotations

from typing import Any

import pytest
import ray

from dualpath_ray.kv.janitor import JanitorStats
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.store import open_store
from dualpath_ray.runtime.telemetry.status_views import StatusQuery
from tests.helpers import recompute_outputs, runtime_config, trajectories, verify_mismatches
from tests.shared_cluster import SharedCluster

pytestmark = [pytest.mark.integration, pytest.mark.chaos]


def settle_store(scheduler: ray.actor.ActorHandle) -> JanitorStats:
    """Wait in the Scheduler actor until its store's janitor (kv/janitor.py) has deleted what it
    was handed; what it did. (It blocks the actor's event loop meanwhile: the deployment is idle.)"""

    def settled(actor: Any) -> JanitorStats:  # the Scheduler actor's instance
        janitor = actor.plane.core.eviction.deleter  # its ControlPlane (runtime/control/plane.py)
        assert janitor.wait_idle(60), "the store's janitor finishes its work"
        return janitor.stats

    return ray.get(scheduler.__ray_call__.remote(settled))


def test_a_store_at_half_the_working_set_completes_with_identical_outputs(shared_cluster: SharedCluster):
    base = runtime_config()
    layout = KVLayout.from_model(base.model, base.store.block_size)
    trajs = trajectories(count=8, turns=4)
    working_set = sum(
        (sum(len(t.appended) + t.gen_len for t in traj.turns)) // layout.block_size for traj in trajs
    )
    capacity_blocks = working_set // 2
    cfg = base.with_overrides(store={"capacity_bytes": capacity_blocks * layout.full_block_bytes})
    with shared_cluster.deployed(cfg, "dualpath") as cluster:
        deployment = cluster.deployment
        result = cluster.rollout(trajs, progress=False)
        calls = ray.get(deployment.scheduler.status.remote(StatusQuery.CALLS)).to_json()
        summary = result.summary()
        deleted = settle_store(deployment.scheduler)  # evicted files go on the janitor's thread
        store = open_store(cfg.store, layout, root=deployment.store_root)
        stored = sum(1 for _ in store.keys())
        print(f"working set {working_set} blocks, capacity {capacity_blocks}: evicted {calls['evicted_blocks']}, "
              f"indexed {calls['indexed_blocks']}, stored {stored}, retries {calls['retries']}, "
              f"hit rate {summary['hit_rate']:.3f}; janitor {deleted}")
        assert not result.failures, f"an evicted block is a miss, never an error: {result.failures}"
        assert result.outputs() == recompute_outputs(cfg, trajs), "outputs equal the fault-free recompute"
        assert verify_mismatches(cluster) == 0, "no evicted block's bytes reached a decode engine (runtime.verify_kv)"
        assert calls["evicted_blocks"] > 0, "half the working set does not fit: blocks were evicted"
        assert calls["indexed_blocks"] <= capacity_blocks, "the index stays within the capacity"
        # A block whose file time is within a clock tick of its eviction may have been put again
        # after it (a writer about to report it): the janitor keeps it for its sweep. The turns
        # here finish within milliseconds of each other, so a few are.
        assert stored <= capacity_blocks + deleted.kept_fresh, "evicted blocks are deleted from the store too"
        assert deleted.dropped_batches == deleted.failed == 0, "every eviction's deletes were done"
        assert 0 < summary["hit_rate"], "the blocks that fit are still hit"
        indexed = ray.get(deployment.scheduler.__ray_call__.remote(lambda actor: actor.plane.core.index.keys()))
        ray.get(deployment.scheduler.reset_prefix_cache.remote())
        janitor = settle_store(deployment.scheduler)
        left = [key for key in indexed if store.contains(key)]
        assert indexed and not left, f"reset_prefix_cache deletes every block the index held ({janitor})"
