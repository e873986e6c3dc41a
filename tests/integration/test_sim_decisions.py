"""The simulator and the runtime make the same scheduling decisions on the same small trace.

Both run 8 two-turn agents on 1P1D (2 engines per node): the first turns untimed (their blocks
persisted), then all second turns at once, each hitting its first turn's blocks. What is compared
is every second turn's (decode engine, prefill engine, read path) and hit tokens.

Why these decisions do not depend on the runtime's timing: the runtime and the simulator run the
same rounds (scheduling/rounds.py) around the same core. The eight second turns leave the
rollout's client in one `submit` call (api/client.py: one event-loop pass, one call), the
scheduler queues them in that order before its next round runs, and that one round places all
of them on the decode engines (they fit their HBM) and then on the prefill engines (each stays
under beta), with the read queues the readers last reported, all empty after the untimed phase;
the simulator's agents submit them at one instant, in the same order. The read path then
alternates as the dispatcher counts each assigned request's hits in the queue it chose.
"""

from __future__ import annotations

import pytest

from tests.helpers import ray_test_env, runtime_config, trajectories

ray_test_env()

from dualpath_ray.api.rollout import RolloutResult  # noqa: E402
from dualpath_ray.cluster import DualPathCluster  # noqa: E402
from dualpath_ray.sim.settings import SimOptions  # noqa: E402
from dualpath_ray.sim.simulator import simulate  # noqa: E402
from dualpath_ray.sim.workload import from_trajectories  # noqa: E402
from dualpath_ray.workload.trace import Trajectory  # noqa: E402

pytestmark = pytest.mark.integration

AGENTS = 8


def decisions_of(result: RolloutResult) -> dict[str, tuple[str, str, str, int]]:
    return {r.request_id: (r.decode_engine, r.prefill_engine, str(r.path), r.hit_tokens)
            for turns in result.turn_results.values() for r in turns}


@pytest.mark.timeout(180)
def test_runtime_and_simulator_decide_alike():
    cfg = runtime_config(transport="gloo", verify_kv=False).with_overrides(cluster={"hbm_tokens_per_engine": 8192})
    agents = trajectories(count=AGENTS, turns=2, first=300, appended=40, gen=6)
    first_turns = [Trajectory(t.trajectory_id, t.turns[:1]) for t in agents]
    cluster = DualPathCluster.start(cfg)
    try:
        cluster.deploy("dualpath")
        warm = cluster.rollout(first_turns, progress=False)
        timed = cluster.rollout(agents, resume=warm, progress=False)
    finally:
        cluster.shutdown()
    assert not timed.failures, timed.failures
    assert timed.client_calls["submit"] == 1, "the eight second turns left the rollout's client in one submit call"
    runtime = decisions_of(timed)

    sim = simulate(cfg, from_trajectories(agents), "dualpath", SimOptions(warmup_turns=1, record_decisions=True, quota_scope="layer"))
    hits = {t.trajectory_id: (300 + 6 - 1) // 64 * 64 for t in agents}
    simulated = {rid: (de, pe, path, hits[rid.split("/")[0]]) for rid, de, pe, path in sim.decisions}

    assert len(runtime) == AGENTS, "every second turn was served once"
    assert {d[2] for d in runtime.values()} == {"pe", "de"}, "both read paths carry second turns"
    assert {d[1] for d in runtime.values()} == {"prefill/p0/g0", "prefill/p0/g1"}, "both prefill engines take work"
    assert simulated == runtime, (
        "the simulator's scheduler core decided every second turn as the runtime's did"
    )
