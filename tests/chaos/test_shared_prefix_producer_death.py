"""In-flight sharing on a real 1P1D cluster (scheduler.share_in_flight; the tiny model computing
for real, every assembled KV byte verified): G samples of a prompt arrive together, one computes
the prompt and the others wait for it. The prefill engine computing a producer is killed while
its waiters hold: they are released at once and compute, the producer is retried, and every
sample finishes with exactly the outputs of a single-process recompute.

The kill must land before the producer publishes its prompt (with the decode-node buffer, as soon
as its KV is on its decode node), or its waiters are released by the publish and the death tests
nothing. A status poll and a kill on a loaded host can take longer than a whole prefill, so the
victim's first layer transfer (its first task's: a producer's, the samples arrive together and
one of each prompt is placed on each idle engine) is held back by a delay fault far longer than
any poll: the producer is still prefilling, unpublished, when the kill lands, in every run."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.helpers import ray_test_env, recompute_outputs, verify_mismatches

ray_test_env()

import ray  # noqa: E402

from dualpath_ray.cluster import DualPathCluster  # noqa: E402
from dualpath_ray.config import DualPathConfig, parse_config  # noqa: E402
from dualpath_ray.model.latency import LayerModel  # noqa: E402
from dualpath_ray.model.profile import HardwareProfile, describe_model  # noqa: E402
from dualpath_ray.workload.grouped import grouped_trajectories  # noqa: E402
from dualpath_ray.runtime.telemetry.status_views import StatusQuery  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

VICTIM = "prefill/p0/g0"
STALL_S = 20.0  # far longer than a status poll and a kill take on a loaded host


def sharing_config(profile: Path) -> DualPathConfig:
    """1P1D, 2 GPUs per node, the tiny model; the latency profile of an accelerator on which a
    640-token prefill takes about 1.3 s, against which waiting for a producer pays."""
    data = {
        "model": {"n_layer": 2, "max_context": 2048},
        "cluster": {"prefill_nodes": 1, "decode_nodes": 1, "gpus_per_node": 2, "snic_gbps": 0.064, "cnic_gbps": 8.0,
                    "hbm_tokens_per_engine": 8192, "buffer_blocks_per_node": 128, "cpus_per_node": 1},
        "store": {"block_size": 64},
        "scheduler": {"share_in_flight": True},
        "emulation": {"enabled": True, "compute": "model"},
        "runtime": {"transport": "gloo", "verify_kv": True, "heartbeat_s": 0.2, "heartbeat_timeout_s": 2.0,
                    "max_attempts": 8},
        # The victim's first layer transfer waits (module doc): its producer cannot publish first.
        "faults": {"faults": [{"site": "layer_transfer", "mode": "delay", "actors": VICTIM, "nth": 1,
                               "delay_s": STALL_S}]},
    }
    cfg = parse_config(data, source="<tests>")
    HardwareProfile(LayerModel(0.1, 1.0, 0.0), cfg.model.n_layer, describe_model(cfg.model),
                    device="a slow accelerator", source="tests").save(profile)
    data["emulation"]["profile_path"] = str(profile)
    return parse_config(data, source="<tests>")


def test_a_killed_producer_releases_its_waiters_and_every_sample_finishes_identically(tmp_path: Path) -> None:
    cfg = sharing_config(tmp_path / "profile.json")
    trajs = grouped_trajectories(prompts=2, samples=4, turns=2, first=640, appended=40, gen=6, vocab=cfg.model.vocab_size)
    expected = recompute_outputs(cfg, trajs)
    cluster = DualPathCluster.start(cfg)
    try:
        deployment = cluster.deploy("dualpath")
        scheduler = deployment.scheduler
        box: dict = {}
        worker = threading.Thread(target=lambda: box.setdefault("result", cluster.rollout(trajs, progress=False)))
        worker.start()
        victim, deadline = None, time.monotonic() + 120
        while victim is None and time.monotonic() < deadline:
            live = ray.get(scheduler.status.remote(StatusQuery.IN_FLIGHT)).requests
            waiting = {rid.split("-s")[0] for rid, r in live.items() if r.state == "waiting_prefix"}
            producers = [r.prefill_engine for rid, r in live.items()
                         if r.state == "prefilling" and r.prefill_engine == VICTIM and rid.split("-s")[0] in waiting]
            victim = producers[0] if producers else None
            time.sleep(0.01)
        assert victim is not None, f"samples waited for a producer prefilling on {VICTIM}"
        ray.kill(deployment.engines[victim], no_restart=True)
        worker.join(timeout=300)
        assert not worker.is_alive(), "the rollout finishes (no waiter is left waiting for a dead producer)"
        result = box["result"]
        calls = ray.get(scheduler.status.remote(StatusQuery.CALLS)).to_json()
        print(f"killed {victim} under a producer; retries {calls['retries']}, dead engines {calls['dead_engines']}, "
              f"waits {calls['prefix_waits']}, released on failure {calls['released_on_failure']}, "
              f"prefix tokens shared {calls['shared_prefix_tokens']}")
        assert calls["released_on_failure"] >= 1, "the dead producer's waiters were released (they computed)"
        assert calls["waiting_prefix"] == 0, "no one is left waiting"
        assert not result.failures, f"every sample finishes: {result.failures}"
        assert result.outputs() == expected, "outputs equal the single-process recompute (waiters computed or read)"
        assert verify_mismatches(cluster) == 0, "no assembled KV differed from the store and a recompute"
        assert ray.get(scheduler.status.remote(StatusQuery.INTEGRITY)).requests == 0, "nothing is left held or queued"
    finally:
        cluster.shutdown()
