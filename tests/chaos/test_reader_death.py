"""A storage reader killed mid-rollout. A prefill node's (dualpath mode): its hits are read
through the decode node instead. A decode node's (1P2D): that node's engines are out (every KV
reaches a decode engine through its node's buffer) and the other decode node serves the rest.
Either way every trajectory completes with the fault-free outputs and the pools left are free."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator

import pytest

from tests.chaos.test_engine_death import rollout_killing_actor
from tests.helpers import ray_test_env, recompute_outputs, runtime_config, trajectories, verify_mismatches

ray_test_env()

import ray  # noqa: E402

from dualpath_ray.cluster import DualPathCluster  # noqa: E402
from dualpath_ray.config import DualPathConfig  # noqa: E402
from dualpath_ray.runtime.telemetry.status_views import StatusQuery  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.chaos]


def settled_pool(reader, timeout_s: float) -> tuple[int, int, int, int]:
    """A reader's pool once every slot is free, or as it stands after timeout_s: a transfer from
    a dead reader that was in flight fails only at its timeout, and frees its extents then."""
    deadline = time.monotonic() + timeout_s
    while (pool := ray.get(reader.pool_integrity.remote()))[0] != pool[3] and time.monotonic() < deadline:
        time.sleep(0.2)
    return pool


@contextmanager
def rollout_killing_reader(cfg: DualPathConfig, trajs, reader: str) -> Iterator[tuple[Any, Any, int, dict[str, int]]]:
    """A dualpath rollout on a fresh cluster with `reader` killed after 8 turns: (deployment,
    result, turns finished at the kill, the scheduler's call counts with the decode engines'
    `verify_mismatches` added)."""
    cluster = DualPathCluster.start(cfg)
    try:
        deployment = cluster.deploy("dualpath")
        result, killed_at = rollout_killing_actor(cluster, trajs, deployment.readers[reader], after_turns=8)
        calls = ray.get(deployment.scheduler.status.remote(StatusQuery.CALLS)).to_json()
        yield deployment, result, killed_at, {**calls, "verify_mismatches": verify_mismatches(cluster)}
    finally:
        cluster.deployment.readers.pop(reader, None)
        cluster.shutdown()


def test_a_dead_decode_reader_takes_its_node_out_and_the_other_decode_node_serves():
    cfg = runtime_config(heartbeat_s=0.2, heartbeat_timeout_s=2.0, transfer_timeout_s=10.0).with_overrides(
        cluster={"decode_nodes": 2}
    )
    trajs = trajectories(count=8, turns=4)
    with rollout_killing_reader(cfg, trajs, "reader/d0") as (deployment, result, killed_at, calls):
        on_d1 = [r for turns in result.turn_results.values() for r in turns[2:] if r.decode_engine.startswith("decode/d1/")]
        print(f"reader/d0 killed after {killed_at} turns; retries {calls['retries']}, dead readers "
              f"{calls['dead_readers']}, dead engines {calls['dead_engines']}, later turns on d1: {len(on_d1)}")
        assert not result.failures, f"0 lost trajectories: {result.failures}"
        assert result.outputs() == recompute_outputs(cfg, trajs), "outputs equal the fault-free recompute"
        assert calls["verify_mismatches"] == 0, "no half-read block reached a decode engine (runtime.verify_kv)"
        assert calls["dead_readers"] == 1, "the scheduler saw the reader die once"
        assert on_d1, "turns after the death were decoded on the other decode node"
        for name in ("reader/p0", "reader/d1"):
            pool = settled_pool(deployment.readers[name], 3 * cfg.runtime.transfer_timeout_s)
            assert pool[0] == pool[3], f"every slot of {name}'s pool is free again: {pool}"


def test_a_dead_prefill_reader_is_routed_around_through_the_de_path():
    cfg = runtime_config(heartbeat_s=0.2, heartbeat_timeout_s=2.0, transfer_timeout_s=10.0)
    trajs = trajectories(count=8, turns=4)
    with rollout_killing_reader(cfg, trajs, "reader/p0") as (deployment, result, killed_at, calls):
        late = [r for turns in result.turn_results.values() for r in turns if r.attempt > 0 or r.path == "de"]
        print(f"reader/p0 killed after {killed_at} turns; retries {calls['retries']}, dead readers {calls['dead_readers']}")
        assert not result.failures, f"0 lost trajectories: {result.failures}"
        assert result.outputs() == recompute_outputs(cfg, trajs), "outputs equal the fault-free recompute"
        assert calls["verify_mismatches"] == 0, "no half-read block reached a decode engine (runtime.verify_kv)"
        assert calls["dead_readers"] == 1, "the scheduler saw the reader die once"
        assert late, "turns after the death were served (through the DE path)"
        pool = settled_pool(deployment.readers["reader/d0"], 3 * cfg.runtime.transfer_timeout_s)
        print(f"reader/d0 pool (free, leased, in flight, capacity): {pool}")
        assert pool[0] == pool[3], f"every slot of the surviving reader's pool is free again: {pool}"
