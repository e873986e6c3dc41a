"""Sixteen concurrent first turns of max_context tokens with nothing stored, on the Ray runtime,
in basic and dualpath mode, the tiny model computing for real: no request fails, every block is
persisted, every KV byte checks, and the outputs are what a single-process recompute gives."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import ray_test_env, recompute_outputs, runtime_config

ray_test_env()

from dualpath_ray.cluster import DualPathCluster  # noqa: E402
from dualpath_ray.workload.trace import Trajectory, Turn  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
GEN = 4


def first_turns(cfg, count: int) -> list[Trajectory]:
    rng = np.random.default_rng(11)
    length = cfg.model.max_context - GEN
    return [
        Trajectory(f"long{i}", (Turn(tuple(int(t) for t in rng.integers(0, cfg.model.vocab_size, length)), GEN),))
        for i in range(count)
    ]


def test_sixteen_first_turns_of_max_context_in_both_modes() -> None:
    cfg = runtime_config().with_overrides(
        cluster={"hbm_tokens_per_engine": 8 * 2048, "buffer_blocks_per_node": 256},
        runtime={"max_persists_in_flight": 4},
    )
    trajectories = first_turns(cfg, 16)
    expected = recompute_outputs(cfg, trajectories)
    cluster = DualPathCluster.start(cfg)
    try:
        for mode in ("basic", "dualpath"):
            cluster.deploy(mode)
            result = cluster.rollout(trajectories, progress=False)
            assert result.failures == {}, f"{mode}: no first turn may fail: {result.failures}"
            assert result.outputs() == expected, f"{mode}: the outputs are what a single-process recompute gives"
            turns = [r for rs in result.turn_results.values() for r in rs]
            full_blocks = (cfg.model.max_context - 1) // cfg.store.block_size
            assert all(len(r.persisted) == full_blocks for r in turns), f"{mode}: every full block is persisted"
            assert all(r.kv_mismatches == 0 and r.kv_bytes_verified > 0 for r in turns), f"{mode}: KV is exact"
            assert cluster.integrity_report()["verify_mismatches"] == 0, (
                f"{mode}: no attempt's KV differed from the store and a recompute, retried or not"
            )
            pools = cluster.pool_integrity()
            assert all(free == cap for free, _, _, cap in pools.values()), f"{mode}: buffers are free after: {pools}"
            pages = cluster.page_integrity()
            assert all(free == cap and reserved == 0 for free, _, reserved, cap in pages.values()), (
                f"{mode}: decode pages are free after: {pages}"
            )
            assert cluster.health() == {}, f"{mode}: no engine thread failed"
    finally:
        cluster.shutdown()
