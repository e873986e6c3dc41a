"""Two steps of the GRPO job's loop (dualpath_ray/rl/loop.py, jobs/grpo_tool_agent.py) on an
embedded 1P1D cluster: the loss, the weight sync through the broadcast group, the KV namespace.
Not the learning curve: benchmarks/README.md, "GRPO on a tool task", has that run."""

from __future__ import annotations

import math

import pytest
import ray

from dualpath_ray.model.weights import weights_fingerprint
from dualpath_ray.rl.loop import GRPORun, GRPOSettings
from tests.helpers import runtime_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    with shared_cluster.deployed(runtime_config(transport="gloo", verify_kv=False), "dualpath") as c:
        yield c


def test_two_steps_train_sync_every_engine_and_move_the_namespace(cluster) -> None:
    # lr 3e-3: the 40-step warm-up then has the format, so groups differ and the loss has a gradient.
    settings = GRPOSettings(steps=2, prompts=4, group=4, lr=3e-3, warmup_steps=40, tool_s=0.02)
    run = GRPORun(cluster, settings)
    first_version = run.version
    run.warm_up()
    records = run.run(lambda record: None)

    assert [r.weight_version for r in records] == [first_version + 1, first_version + 2], (
        "the warm-up's sync published a version, and each step's rollout served the one before it"
    )
    for r in records:
        assert math.isfinite(r.loss) and abs(r.loss) < 1e-3, (
            f"on-policy, the first pass's loss is -mean(ratio x A) with ratio ~1 and A centred per group: {r.loss}"
        )
        assert r.groups_with_signal > 0 and r.grad_norm > 0, "some group's samples differed, and the loss has a gradient"
        assert r.logprob_gap["max"] <= 1e-4, (
            f"the rollout's log-probs are the trainer's for the weights it synced: {r.logprob_gap}"
        )
        ns = r.namespace
        assert ns["stale_version_turns"] == 0 and ns["old_version_hit_blocks"] == 0, f"no old version served or hit: {ns}"
        assert ns["unexplained_hit_blocks"] == 0, f"every hit block is one of this step's prompts: {ns}"
        assert ns["later_turns"] == ns["later_turns_hitting_earlier"] == 16, f"every turn 1 hit its turn 0's blocks: {ns}"
    assert records[1].namespace["old_version_blocks_offered"] > 0, (
        "the previous version stored blocks of step 2's prompts (the system prompt): the namespace move is what kept them out"
    )
    held = ray.get([engine.held_weights.remote() for engine in cluster.deployment.engines.values()])
    trainer = weights_fingerprint(run.policy.state())
    assert all(weights.version == run.version and weights.fingerprint == trainer and ready for weights, ready in held), (
        f"every engine holds the trainer's latest weights as version {run.version}: {held}"
    )
