"""Abort under load on a real 1P1D cluster (the tiny model computing for real, every assembled KV
byte verified): 100 trajectories, a random half aborted in the middle of a turn. The aborted ones
stop (listed in `aborted`, nothing failed), the others produce exactly what a run without aborts
produces, which is what a single-process recompute gives, and every pool, page and queue is free
afterwards."""

from __future__ import annotations

import random
import threading
import time

import pytest

from tests.chaos.test_fault_plan import fault_config
from tests.helpers import ray_test_env, recompute_outputs, settled_pools, trajectories
from tests.ledger import Ledger

ray_test_env()

import ray  # noqa: E402

from dualpath_ray.cluster import DualPathCluster  # noqa: E402
from dualpath_ray.runtime.telemetry.status_views import StatusQuery  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.chaos]


def test_aborting_half_the_trajectories_mid_turn_frees_everything_and_changes_no_other_output() -> None:
    cfg = fault_config()
    trajs = trajectories(count=100, turns=4, first=150, appended=40, gen=24)
    victims = sorted(random.Random(5).sample([t.trajectory_id for t in trajs], 50))
    cluster = DualPathCluster.start(cfg)
    try:
        cluster.deploy("dualpath")
        reference = cluster.rollout(trajs, progress=False)
        assert not reference.failures and not reference.aborted, "the run without aborts completes"
        assert reference.outputs() == recompute_outputs(cfg, trajs), (
            "the run without aborts serves what a single-process recompute gives"
        )
        cluster.deploy("dualpath")  # a fresh store: the aborted run hits what a first run hits
        scheduler = cluster.deployment.scheduler
        box: dict = {}
        worker = threading.Thread(target=lambda: box.setdefault("result", cluster.rollout(trajs, progress=False)))
        worker.start()
        deadline = time.monotonic() + 120
        while ray.get(scheduler.status.remote(StatusQuery.CALLS)).received.complete < 100 and time.monotonic() < deadline:
            time.sleep(0.05)
        in_flight = sum(cluster.abort_trajectory(victim) for victim in victims)
        worker.join(timeout=300)
        assert not worker.is_alive(), "the rollout ends (aborted trajectories stop, the others finish)"
        result = box["result"]
        calls = ray.get(scheduler.status.remote(StatusQuery.CALLS)).to_json()
        pools = settled_pools(cluster, cfg.runtime.transfer_timeout_s)
        pages = cluster.page_integrity()
        queued = ray.get(scheduler.status.remote(StatusQuery.INTEGRITY)).requests
        print(f"aborted {len(victims)} trajectories after {calls['complete'] - in_flight}+ turns, {in_flight} turns "
              f"in flight at the abort; aborted results {calls.get('aborted', 0)}; pools {pools}; pages {pages}")
        assert not result.failures, f"an abort is not a failure: {result.failures}"
        assert sorted(result.aborted) == victims, "exactly the aborted trajectories stopped"
        assert in_flight > 0, "some turns were aborted in the middle (in flight at the abort)"
        survivors = Ledger.of(result).keyed()
        expected = {k: v for k, v in Ledger.of(reference).keyed().items() if k[0] not in victims}
        assert {k: v[0].digest for k, v in survivors.items() if k[0] not in victims} == {
            k: v[0].digest for k, v in expected.items()
        }, "every trajectory not aborted produced exactly the outputs of the run without aborts"
        for victim in victims:
            turns = [k[1] for k in survivors if k[0] == victim]
            assert turns == list(range(len(turns))) and len(turns) < 4, f"{victim}: its turns before the abort only"
        assert all(free == cap for free, _, _, cap in pools.values()), f"every buffer pool is free: {pools}"
        assert all(free == cap and reserved == 0 for free, _, reserved, cap in pages.values()), (
            f"every decode engine's pages are free: {pages}"
        )
        assert queued == 0, "the scheduler holds no request and its queues are consistent"
        resumed = cluster.rollout(trajs, resume=result, progress=False)
        assert not resumed.failures and not resumed.aborted, "rolling the aborted trajectories out again resumes them"
        assert resumed.outputs() == reference.outputs(), "the resumed rollout ends where the run without aborts did"
        verified = cluster.integrity_report()["verify_mismatches"]
        assert verified == 0, (
            f"no attempt's assembled KV differed from the store and a recompute (runtime.verify_kv): {verified}"
        )
    finally:
        cluster.shutdown()
