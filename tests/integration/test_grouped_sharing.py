"""Grouped sampling on a real 1P1D cluster with in-flight sharing (scheduler.share_in_flight; the
tiny model computing for real, every assembled KV byte verified) behind a slow SNIC: G samples
of a prompt arrive together, one computes the prompt, and the other G - 1 wait for it and read it
from its decode node's memory (the reader's hot tier) over the CNIC as soon as it is there, since
reading it back through the 16 Mbit/s SNIC would be slower than computing it again. The shared
prompt is computed once per group, and the outputs are those of a single-process recompute (what
every run with sharing off gives: tests/integration/test_runtime.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import ray_test_env, recompute_outputs, verify_mismatches

ray_test_env()

import ray  # noqa: E402

from dualpath_ray.cluster import DualPathCluster  # noqa: E402
from dualpath_ray.config import DualPathConfig, parse_config  # noqa: E402
from dualpath_ray.model.latency import LayerModel  # noqa: E402
from dualpath_ray.model.profile import HardwareProfile, describe_model  # noqa: E402
from dualpath_ray.runtime.telemetry.status_views import StatusQuery  # noqa: E402
from dualpath_ray.workload.grouped import grouped_trajectories  # noqa: E402

pytestmark = pytest.mark.integration

# Exactly 10 blocks: a waiter reads all 10 (the last one whole, a partial-block hit) and computes
# the prompt's last token only.
PROMPTS, SAMPLES, FIRST = 2, 4, 640
GEN = 96  # the producer decodes long after its prefill: its waiters must not wait for that


def grouped_config(profile: Path) -> DualPathConfig:
    """1P1D, the tiny model, SNICs at 16 Mbit/s (3,906 KV tokens/s: the shared 640 tokens take
    0.16 s to read from the store) and CNICs at 8 Gbit/s; a latency profile on which computing
    them again takes about 0.07 s, so only the decode-node buffer makes waiting pay."""
    data = {
        "model": {"n_layer": 2, "max_context": 2048},
        "cluster": {"prefill_nodes": 1, "decode_nodes": 1, "gpus_per_node": 2, "snic_gbps": 0.016, "cnic_gbps": 8.0,
                    "hbm_tokens_per_engine": 8192, "buffer_blocks_per_node": 128, "cpus_per_node": 1},
        "store": {"block_size": 64},
        "scheduler": {"share_in_flight": True},
        "emulation": {"enabled": True, "compute": "model"},
        "runtime": {"transport": "gloo", "verify_kv": True},
    }
    cfg = parse_config(data, source="<tests>")
    HardwareProfile(LayerModel(0.1, 0.05, 0.0), cfg.model.n_layer, describe_model(cfg.model),
                    device="an accelerator faster than the SNIC", source="tests").save(profile)
    data["emulation"]["profile_path"] = str(profile)
    return parse_config(data, source="<tests>")


def test_grouped_samples_compute_their_prompt_once_per_group_and_read_it_from_the_producers_decode_node(
    tmp_path: Path,
) -> None:
    cfg = grouped_config(tmp_path / "profile.json")
    trajs = grouped_trajectories(prompts=PROMPTS, samples=SAMPLES, turns=1, first=FIRST, appended=16, gen=GEN,
                                 vocab=cfg.model.vocab_size)
    expected = recompute_outputs(cfg, trajs)
    cluster = DualPathCluster.start(cfg)
    try:
        deployment = cluster.deploy("dualpath")
        result = cluster.rollout(trajs, progress=False)
        assert not result.failures, f"every sample finishes: {result.failures}"
        calls = ray.get(deployment.scheduler.status.remote(StatusQuery.CALLS)).to_json()
        hot = {node: ray.get(reader.hot_counts.remote()) for node, reader in deployment.readers.items()}
        firsts = {tid: turns[0] for tid, turns in result.turn_results.items()}
        computed = {p: sum(r.prompt_tokens - r.hit_tokens for tid, r in firsts.items() if tid.startswith(f"p{p}-"))
                    for p in range(PROMPTS)}
        print(f"computed per group {computed}; waits {calls['prefix_waits']} (buffer {calls['buffer_waits']}), "
              f"shared {calls['shared_prefix_tokens']} tokens; hot tiers {hot}")
        waiters = PROMPTS * (SAMPLES - 1)
        assert computed == {p: FIRST + (SAMPLES - 1) for p in range(PROMPTS)}, (
            "each group computes its prompt once; each other sample only its last token"
        )
        assert calls["buffer_waits"] == waiters, "every waiter chose its producer's decode-node buffer over the store"
        assert calls["shared_prefix_tokens"] == waiters * (FIRST - 1), "each read the producer's 639 hit tokens"
        assert sum(c.get("served", 0) for c in hot.values()) == waiters * FIRST // 64, (
            "every shared block came from the decode node's memory, none through the SNIC"
        )
        for p in range(PROMPTS):
            group = [r for tid, r in firsts.items() if tid.startswith(f"p{p}-")]
            producer = next(r for r in group if r.hit_tokens == 0)
            producer_end = producer.ttft_s + (len(producer.output_tokens) - 1) * producer.tpot_s
            print(f"group {p}: producer's turn ends at {producer_end:.2f} s, its waiters' first tokens at "
                  f"{sorted(round(r.ttft_s, 2) for r in group if r is not producer)} s")
            assert max(r.ttft_s for r in group if r is not producer) < producer_end, (
                "waiters are released when the producer's prompt is on its decode node, not when its turn ends"
            )
        assert result.outputs() == expected, "outputs equal the single-process recompute (sharing off's outputs)"
        assert verify_mismatches(cluster) == 0, "no assembled KV differed from the store (or the recompute)"
        assert ray.get(deployment.scheduler.status.remote(StatusQuery.INTEGRITY)).requests == 0, "nothing is left held or queued"
    finally:
        cluster.shutdown()
