"""A prefill node's storage reader killed mid-rollout (dualpath mode): its hits are read through
the decode node instead, every trajectory completes with the fault-free outputs."""

from __future__ import annotations

import time

import pytest

from tests.chaos.test_engine_death import rollout_killing_actor
from tests.helpers import ray_test_env, recompute_outputs, runtime_config, trajectories

ray_test_env()

import ray  # noqa: E402

from dualpath_ray.cluster import DualPathCluster  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.chaos]


def test_a_dead_prefill_reader_is_routed_around_through_the_de_path():
    cfg = runtime_config(heartbeat_s=0.2, heartbeat_timeout_s=2.0, transfer_timeout_s=10.0)
    trajs = trajectories(count=8, turns=4)
    cluster = DualPathCluster.start(cfg)
    try:
        deployment = cluster.deploy("dualpath")
        result, killed_at = rollout_killing_actor(cluster, trajs, deployment.readers["reader/p0"], after_turns=8)
        calls = ray.get(deployment.scheduler.call_counts.remote())
        late = [r for turns in result.turn_results.values() for r in turns if r.attempt > 0 or r.path == "de"]
        print(f"reader/p0 killed after {killed_at} turns; retries {calls['retries']}, dead readers {calls['dead_readers']}")
        assert not result.failures, f"0 lost trajectories: {result.failures}"
        assert result.outputs() == recompute_outputs(cfg, trajs), "outputs equal the fault-free recompute"
        assert calls["dead_readers"] == 1, "the scheduler saw the reader die once"
        assert late, "turns after the death were served (through the DE path)"
        # A transfer from the dead reader that was in flight fails only at its timeout, and the
        # prefill engine frees that attempt's extents then: the pool is checked with a timeout.
        deadline = time.monotonic() + 3 * cfg.runtime.transfer_timeout_s
        while (pool := ray.get(deployment.readers["reader/d0"].pool_integrity.remote()))[0] != pool[3]:
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        print(f"reader/d0 pool (free, leased, in flight, capacity): {pool}")
        assert pool[0] == pool[3], f"every slot of the surviving reader's pool is free again: {pool}"
    finally:
        cluster.deployment.readers.pop("reader/p0", None)
        cluster.shutdown()
