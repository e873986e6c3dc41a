"""The RL-facing API on an embedded 1P1D cluster: concurrent verl-style agent loops, weight
versions, prefix-cache reset, per-request validation, and per-trajectory failure isolation."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest

from dualpath_ray.api import RequestError
from dualpath_ray.model.llama import DecoderModel
from dualpath_ray.workload.trace import Trajectory, Turn
from tests.helpers import runtime_config, trajectories

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    cfg = runtime_config(transport="gloo", verify_kv=False)
    cfg = cfg.with_overrides(cluster={"snic_gbps": 1.0})
    with shared_cluster.deployed(cfg, "dualpath") as c:
        yield c


async def agent_loop(server, agent: int, turns: int, rng: np.random.Generator, version_change_at: int | None):
    """One agent: the prompt grows by its output plus an 80-token tool observation (over a
    block) each turn, so every turn has at least one more full block stored than the last."""
    context = [int(x) for x in rng.integers(0, 512, 150)]
    hits = []
    for turn in range(turns):
        if version_change_at is not None and turn == version_change_at:
            hits.append("version")
        out = await server.generate.remote(f"agent{agent}-t{turn}", context, {"max_tokens": 5})
        hits.append(out.extra_fields["hit_tokens"])
        assert out.stop_reason == "completed" and len(out.token_ids) == 5, "each turn generates max_tokens"
        assert len(out.log_probs) == 5, "one log-prob per generated token"
        context = context + list(out.token_ids) + [int(x) for x in rng.integers(0, 512, 80)]
    return hits


def test_sixteen_concurrent_agent_loops_reuse_their_prefix(cluster):
    server = cluster.server()

    async def run():
        rngs = [np.random.default_rng(100 + a) for a in range(16)]
        return await asyncio.gather(*(agent_loop(server, a, 4, rngs[a], None) for a in range(16)))

    for agent, hits in enumerate(asyncio.run(run())):
        assert hits[0] == 0, f"agent {agent}: the first turn has nothing stored"
        assert all(b > a for a, b in zip(hits, hits[1:])), f"agent {agent}: hit tokens grow turn by turn: {hits}"


def test_weight_version_change_makes_the_next_turn_miss(cluster):
    import ray

    server = cluster.server()
    rng = np.random.default_rng(5)
    context = [int(x) for x in rng.integers(0, 512, 200)]
    first = ray.get(server.generate.remote("wv-0", context, {"max_tokens": 4}))
    context = context + list(first.token_ids) + [1, 2, 3]
    reused = ray.get(server.generate.remote("wv-1", context, {"max_tokens": 4}))
    assert reused.extra_fields["hit_tokens"] > 0, "same policy: the turn reuses the stored prefix"
    with pytest.raises(RequestError, match="not the one the engines hold"):
        # A version the engines do not hold: every engine would refuse its requests.
        ray.get(server.update_weight_version.remote(7))
    same_weights = DecoderModel(cluster.cfg.model).checkpoint_tensors()  # a new version, the same tensors
    ray.get(server.update_weights.remote(7, same_weights))
    after = ray.get(server.generate.remote("wv-2", context, {"max_tokens": 4}))
    assert after.extra_fields["hit_tokens"] == 0, "KV of an old policy is never served after an update"
    assert after.extra_fields["weight_version"] == 7, "the server reports the version it served with"
    again = ray.get(server.generate.remote("wv-3", context + list(after.token_ids), {"max_tokens": 4}))
    assert again.extra_fields["hit_tokens"] > 0, "the new policy's own blocks are reused"
    ray.get(server.reset_prefix_cache.remote())
    reset = ray.get(server.generate.remote("wv-4", context + list(after.token_ids), {"max_tokens": 4}))
    assert reset.extra_fields["hit_tokens"] == 0, "after reset_prefix_cache nothing is hit"


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ([1, 2, 600], {"max_tokens": 2}, "prompt_ids[2]"),
        ([], {"max_tokens": 2}, "empty"),
        ([1] * 2047, {"max_tokens": 8}, "context"),
        ([1, 2, 3], {"temperature": -1}, "temperature"),
        ([1, 2, 3], {"top_p": 0}, "top_p"),
        ([1, 2, 3], {"max_tokens": 0}, "max_tokens"),
        ([1, 2, 3], {"beam_width": 2}, "unknown"),
        ([1, 2, 3], {"seed": "x"}, "seed"),
    ],
)
def test_bad_requests_fail_alone_with_a_clear_error(cluster, prompt, params, field):
    import ray

    server = cluster.server()
    good = server.generate.remote("ok-" + field, [5, 6, 7, 8], {"max_tokens": 2})
    with pytest.raises(RequestError, match=re.escape(field)):
        ray.get(server.generate.remote("bad-" + field, prompt, params))
    assert len(ray.get(good).token_ids) == 2, "a valid request sent alongside a bad one is served"


def test_rollout_reports_a_failed_trajectory_and_finishes_the_others(cluster):
    trajs = trajectories(count=3, turns=2)
    bad = Trajectory("bad", (Turn((1, 2, 3), 4), Turn((9999,), 4)))
    result = cluster.rollout([*trajs, bad], progress=False)
    assert set(result.failures) == {"bad"}, "only the trajectory with an out-of-vocabulary token fails"
    assert "outside the vocabulary" in result.failures["bad"], "the failure says what was wrong"
    table = result.table.to_pylist()
    assert {(r["trajectory_id"], r["turn"]) for r in table} >= {(t.trajectory_id, k) for t in trajs for k in range(2)}, (
        "every turn of the good trajectories is present"
    )
    assert ("bad", 0) in {(r["trajectory_id"], r["turn"]) for r in table}, "the bad trajectory keeps its good first turn"
    resumed = cluster.rollout([*trajs, Trajectory("bad", (bad.turns[0], Turn((7,), 4)))], resume=result, progress=False)
    assert resumed.failures == {}, "resuming with the turn fixed completes every trajectory"
    before = result.outputs()
    after = resumed.outputs()
    assert all(after[t.trajectory_id] == before[t.trajectory_id] for t in trajs), "completed turns are kept, not rerun"
    assert len(after["bad"]) == 2 and after["bad"][0] == before["bad"][0], "resume continues from the first missing turn"


def test_an_unsatisfiable_topology_is_a_clear_error_not_a_hang(cluster):
    # Not a hang: a wait that never ends is failed by the test's timeout (tests/integration/conftest.py).
    from dualpath_ray.runtime.placement.topology import (
        TopologyError,
        create_role_groups,
    )

    cfg = cluster.cfg.with_overrides(cluster={"prefill_nodes": 2}, runtime={"namespace": "dualpath-probe"})
    with pytest.raises(TopologyError, match=r"2 prefill node\(s\).*has 1 alive node"):
        create_role_groups(cfg, timeout_s=3.0)
