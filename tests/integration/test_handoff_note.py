"""A decode engine tells the scheduler when it takes a handoff (a one-way note batched per step),
so the scheduler's request state follows the data plane: a turn shows "decoding" while it
decodes, not only once a heartbeat has seen it there, and from then on its prefill engine's
death no longer concerns it. Before the note, the state waited for the next heartbeat
(runtime.heartbeat_s), and a short decode went prefilling -> done without ever decoding."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import ray

from dualpath_ray.workload.trace import Trajectory, Turn
from dualpath_ray.runtime.telemetry.status_views import StatusQuery
from tests.helpers import runtime_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
PROMPT = 200


def test_the_scheduler_sees_a_turn_decoding_before_any_heartbeat(cluster_for) -> None:
    # No heartbeat runs during the turn (the first is an hour away, far past the test's timeout),
    # so only the decode engine's note can mark it decoding.
    cfg = runtime_config(heartbeat_s=3600.0, heartbeat_timeout_s=7200.0)
    rng = np.random.default_rng(5)
    prompt = tuple(int(t) for t in rng.integers(0, cfg.model.vocab_size, PROMPT))
    trajectory = Trajectory("note", (Turn(prompt, cfg.model.max_context - PROMPT - 8),))
    cluster = cluster_for(cfg, "dualpath")
    deployment = cluster.deployment
    outcome: dict[str, object] = {}
    rolling = threading.Thread(target=lambda: outcome.update(result=cluster.rollout([trajectory], progress=False)))
    heartbeats = ray.get(deployment.scheduler.status.remote(StatusQuery.CALLS)).received.heartbeats
    rolling.start()
    states: list[str] = []
    while rolling.is_alive():
        entry = ray.get(deployment.scheduler.status.remote(StatusQuery.IN_FLIGHT)).requests.get("note/t0")
        if entry is not None and (not states or states[-1] != entry.state):
            states.append(entry.state)
        time.sleep(0.02)
    rolling.join()
    result = outcome["result"]
    assert result.failures == {}, f"the turn succeeded: {result.failures}"  # type: ignore[attr-defined]
    assert ray.get(deployment.scheduler.status.remote(StatusQuery.CALLS)).received.heartbeats == heartbeats, (
        "the scheduler asked no engine for a heartbeat during the turn, as this test needs"
    )
    assert "decoding" in states, f"the scheduler saw the turn decoding while it decoded; states seen: {states}"
    assert states.index("decoding") == len(states) - 1, f"decoding is the last state before done: {states}"
