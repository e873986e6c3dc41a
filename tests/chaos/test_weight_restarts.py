"""Weights updated, then engines killed and restarted by Ray (issue 31, item 1): a restarted
engine comes back with its config's weights, so until it has caught up with the published ones
it must take no work (runtime/engine/held_weights.py, weights_catch_up.py). On a real 1P1D
cluster running the real model: the rollout's outputs equal a single-process recompute with
the new weights, and every block stored under the new version's namespace holds the new
weights' KV (read back and compared with a recompute)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from tests.helpers import ray_test_env, recompute_outputs, runtime_config, trajectories

ray_test_env()

import ray  # noqa: E402

from dualpath_ray.cluster import DualPathCluster  # noqa: E402
from dualpath_ray.kv.index import block_keys  # noqa: E402
from dualpath_ray.kv.layout import KVLayout  # noqa: E402
from dualpath_ray.kv.store import open_store  # noqa: E402
from dualpath_ray.model.llama import DecoderModel  # noqa: E402
from dualpath_ray.runtime.decode.verify import TOLERANCES  # noqa: E402
from dualpath_ray.runtime.compute.engine_compute import ModelCompute  # noqa: E402
from dualpath_ray.runtime.telemetry.status_views import StatusQuery  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.chaos]


def stored_kv_mismatches(cfg, new_cfg, version: int, store_root: str, contexts: list[list[int]]) -> tuple[int, int]:
    """(blocks of these contexts stored under `version`'s namespace, those whose KV differs from
    the new weights' recompute beyond float noise)."""
    layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
    store = open_store(cfg.store, layout, root=store_root)
    compute = ModelCompute(new_cfg, layout, torch.device("cpu"))
    host = layout.empty_full_block()
    rtol, atol = TOLERANCES[layout.torch_dtype]
    stored = wrong = 0
    for context in contexts:
        prompt = np.asarray(context, dtype=np.int64)
        keys = block_keys(prompt, layout.block_size, cfg.kv_namespace(version))
        expected = torch.empty((len(keys) + 1, *layout.full_block_shape), dtype=torch.uint8)
        compute.fill_pages(prompt, 0, len(prompt), expected, list(range(expected.shape[0])))
        for block, key in enumerate(keys):
            if not store.contains(key):
                continue
            stored += 1
            store.get_into(key, host)
            got, want = host.view(layout.torch_dtype).float(), expected[block].view(layout.torch_dtype).float()
            wrong += not torch.allclose(got, want, rtol=rtol, atol=atol)
    return stored, wrong


def test_engines_restarted_after_a_weight_update_serve_only_the_new_weights() -> None:
    cfg = runtime_config(heartbeat_s=0.2, heartbeat_timeout_s=2.0)
    new_cfg = cfg.with_overrides(model={"seed": 11})  # the trainer's new policy: other weights
    trajs = trajectories(count=6, turns=3)
    expected = recompute_outputs(new_cfg, trajs)
    assert expected != recompute_outputs(cfg, trajs), "the two policies answer differently (the test can see it)"
    cluster = DualPathCluster.start(cfg)
    try:
        deployment = cluster.deploy("dualpath")
        cluster.update_weights(1, DecoderModel(new_cfg.model).checkpoint_tensors())
        victims = ["prefill/p0/g0", "decode/d0/g0"]
        for victim in victims:
            ray.kill(deployment.engines[victim], no_restart=False)
        result = cluster.rollout(trajs, progress=False)
        calls = ray.get(deployment.scheduler.status.remote(StatusQuery.CALLS)).to_json()
        held = {v: ray.get(deployment.engines[v].held_weights.remote(), timeout=60) for v in victims}
        print(f"restarted engines' weights {held}; retries {calls['retries']}, "
              f"unready engines seen {calls['unready_engines']}, restarts seen {calls['restarted_engines']}")
        assert not result.failures, f"no trajectory lost: {result.failures}"
        assert result.outputs() == expected, "every token is the new weights' (equal to a single-process recompute)"
        assert all(weights.version == 1 and ready for weights, ready in held.values()), (
            "each restarted engine caught up with the published version and is ready"
        )
        contexts = []
        for traj in trajs:
            context: list[int] = []
            for turn, out in zip(traj.turns, result.outputs()[traj.trajectory_id]):
                context += list(turn.appended) + list(out)
            contexts.append(context)
        stored, wrong = stored_kv_mismatches(cfg, new_cfg, 1, deployment.store_root, contexts)
        assert stored > 0, "the rollout stored blocks under the new version's namespace"
        assert wrong == 0, f"{wrong} of {stored} blocks under version 1's namespace hold KV of other weights"
    finally:
        cluster.shutdown()


def test_a_version_number_is_never_published_with_other_weights() -> None:
    cfg = runtime_config()
    one = DecoderModel(cfg.with_overrides(model={"seed": 11}).model).checkpoint_tensors()
    other = DecoderModel(cfg.with_overrides(model={"seed": 12}).model).checkpoint_tensors()
    trajs = trajectories(count=2, turns=1)
    cluster = DualPathCluster.start(cfg)
    try:
        deployment = cluster.deploy("dualpath")
        cluster.update_weights(1, one)
        started = time.monotonic()
        with pytest.raises(Exception, match="published before with other weights"):
            cluster.update_weights(1, other)
        print(f"refused in {time.monotonic() - started:.1f} s")
        cluster.update_weights(1, one)  # the same weights again (a resent update): accepted
        result = cluster.rollout(trajs, progress=False)
        assert result.outputs() == recompute_outputs(cfg.with_overrides(model={"seed": 11}), trajs), (
            "the refused update loaded nothing: the engines still serve version 1's own weights"
        )
        published = ray.get(deployment.scheduler.status.remote(StatusQuery.DEPLOYMENT)).weights
        assert published.weights.version == 1, "version 1 stays published"
    finally:
        cluster.shutdown()
