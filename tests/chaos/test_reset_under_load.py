"""An abort with reset_prefix_cache (what verl's abort does by default) while other turns run
(issue 31, item 4): the turns in flight then persist blocks whose parents have just left the
index. Such an orphan chain is simply not published; it never costs another message of the
same report. Before, its ValueError escaped the report's handling after the frame was
acknowledged, and every result in that frame was lost until the heartbeat found those attempts
held by no engine and retried them (or, without a heartbeat answer, their deadline)."""

from __future__ import annotations

import threading
import time

import pytest
import ray

from dualpath_ray.runtime.telemetry.status_views import StatusQuery
from tests.helpers import recompute_outputs, runtime_config, trajectories
from tests.shared_cluster import SharedCluster

pytestmark = [pytest.mark.integration, pytest.mark.chaos]


def test_resets_and_an_abort_while_turns_run_lose_no_other_turn(shared_cluster: SharedCluster) -> None:
    cfg = runtime_config(request_timeout_s=90.0)
    trajs = trajectories(count=8, turns=5, gen=12)
    victim = trajs[0].trajectory_id
    expected = recompute_outputs(cfg, trajs)
    with shared_cluster.deployed(cfg, "dualpath") as cluster:
        deployment = cluster.deployment
        scheduler = deployment.scheduler
        box: dict = {}
        worker = threading.Thread(target=lambda: box.setdefault("result", cluster.rollout(trajs, progress=False)))
        started = time.monotonic()
        worker.start()
        while ray.get(scheduler.status.remote(StatusQuery.CALLS)).received.complete < 8 and worker.is_alive():
            time.sleep(0.05)
        cluster.abort_trajectory(victim)
        resets = 0
        while worker.is_alive() and resets < 40:
            ray.get(scheduler.reset_prefix_cache.remote())  # while turns of later rounds are in flight
            resets += 1
            time.sleep(0.1)
        worker.join(timeout=240)
        assert not worker.is_alive(), "the rollout ends"
        result = box["result"]
        calls = ray.get(scheduler.status.remote(StatusQuery.CALLS)).to_json()
        print(f"{resets} resets; rollout {time.monotonic() - started:.1f} s; report errors {calls.get('report_errors')}, "
              f"timeouts {calls['timeouts']}, retries {calls['retries']}, orphaned blocks {calls.get('unpublished_blocks')}")
        assert not result.failures, f"no turn lost to a reset of the index: {result.failures}"
        assert calls["timeouts"] == 0, "no turn waited for its deadline"
        # Before, the results of a report whose block raised were lost with it: the heartbeat found
        # their attempts held by no engine and retried them (7 retries, 18.9 s against 2.9 s here).
        assert calls["lost_assignments"] == 0 and calls["retries"] == 0, "no result was lost, none retried"
        assert calls.get("unpublished_blocks", 0) > 0, (
            "some turn in flight persisted a chain a reset had orphaned (the case under test happened)"
        )
        assert calls.get("report_errors") == 0, "no part of any report raised"
        outputs = result.outputs()
        for traj in trajs:
            if traj.trajectory_id == victim:
                continue
            assert outputs[traj.trajectory_id] == expected[traj.trajectory_id], (
                f"{traj.trajectory_id}: the real model's outputs equal the single-process recompute"
            )
        assert ray.get(scheduler.status.remote(StatusQuery.INTEGRITY)).requests == 0, "the scheduler holds no request afterwards"
