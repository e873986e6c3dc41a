"""A persistent store across a change of KV layout (float32 -> bfloat16 KV): the new layout's
keys are its own, so the blocks of the old one are misses, never reads that fail, and the new
layout reuses its own blocks."""

from __future__ import annotations

import pytest

from tests.helpers import runtime_config, trajectories

pytestmark = pytest.mark.integration


def test_a_layout_change_on_a_persistent_store_is_all_misses_and_no_failures(tmp_path, cluster_for):
    cfg = runtime_config().with_overrides(store={"root": str(tmp_path / "store"), "backend": "local_dir"})
    changed = cfg.with_overrides(model={"dtype": "bfloat16"})
    trajs = trajectories(count=2, turns=2)
    cluster = cluster_for(cfg, "dualpath")
    before = cluster.rollout(trajs, progress=False)
    assert not before.failures, f"the first layout's run completes: {before.failures}"

    cluster.deploy("dualpath", cfg=changed)
    after = cluster.rollout(trajs, progress=False)
    assert not after.failures, f"no turn fails after the layout change: {after.failures}"
    first_turns = {tid: turns[0].hit_tokens for tid, turns in after.turn_results.items()}
    assert set(first_turns.values()) == {0}, f"no block of the old layout is hit: {first_turns}"
    assert all(turns[1].hit_tokens > 0 for turns in after.turn_results.values()), (
        "the new layout persists its own blocks and the next turn hits them"
    )
    assert cluster.health() == {}, "no engine thread failed"
