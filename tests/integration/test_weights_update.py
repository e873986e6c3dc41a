"""Weights swap between rollouts on a running cluster: outputs follow the new weights, and KV made
with the old weights is never hit again (the key namespace moves with the version)."""

from __future__ import annotations

import pytest

from dualpath_ray.model.llama import DecoderModel
from dualpath_ray.model.weights import write_checkpoint
from tests.helpers import recompute_outputs, runtime_config, trajectories

pytestmark = pytest.mark.integration


def outputs_of(results):
    return {tid: [r.output_tokens for r in turns] for tid, turns in results.items()}


def test_update_weights_from_a_state_dict_and_a_checkpoint_directory(tmp_path, cluster_for):
    cfg = runtime_config()
    trajs = trajectories(count=3, turns=2)
    seeded = {seed: cfg.with_overrides(model={"seed": seed}) for seed in (11, 23)}
    cluster = cluster_for(cfg, "dualpath")
    before = cluster.run_trajectories(trajs)
    assert outputs_of(before) == recompute_outputs(cfg, trajs), "version 0 serves the configured weights"

    cluster.update_weights(1, DecoderModel(seeded[11].model).checkpoint_tensors())
    after_dict = cluster.run_trajectories(trajs)
    assert outputs_of(after_dict) == recompute_outputs(seeded[11], trajs), "a state dict swaps every engine"
    assert all(turns[0].hit_tokens == 0 for turns in after_dict.values()), (
        "the first turns' KV was stored under version 0 and must not be hit by version 1"
    )
    assert all(turns[1].hit_tokens > 0 for turns in after_dict.values()), "version 1 reuses its own KV"

    write_checkpoint(DecoderModel(seeded[23].model).checkpoint_tensors(), tmp_path / "v2", shards=2)
    cluster.update_weights(2, str(tmp_path / "v2"))
    after_dir = cluster.run_trajectories(trajs)
    assert outputs_of(after_dir) == recompute_outputs(seeded[23], trajs), "a sharded checkpoint swaps too"
    assert all(turns[0].hit_tokens == 0 for turns in after_dir.values()), "version 2 has its own namespace"
    assert cluster.health() == {}, "no engine failed across the swaps"
    with pytest.raises(ValueError, match="version must be an int"):
        cluster.update_weights(-1, str(tmp_path / "v2"))
