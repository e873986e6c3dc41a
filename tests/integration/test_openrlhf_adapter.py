"""OpenRLHF adapter on an embedded 1P1D cluster: the batch generate with per-sample seeds and
log-probs, OpenRLHF v0.9.0's add_requests / get_responses and engine control, and a weight
update through the trainer's broadcast group (the trainer is this test process, rank 0)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import ray

from dualpath_ray.api.openrlhf_adapter import create_openrlhf_engine
from dualpath_ray.api.validation import RequestError
from dualpath_ray.model.llama import DecoderModel
from dualpath_ray.runtime.weights.sync import WeightSender, manifest_of
from dualpath_ray.workload.trace import Trajectory, Turn
from tests.helpers import recompute_outputs, runtime_config

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def setup(shared_cluster):
    with shared_cluster.deployed(runtime_config(transport="gloo", verify_kv=False), "dualpath") as cluster:
        yield cluster, create_openrlhf_engine(cluster)


def prompts(count: int, seed: int = 3, tokens: int = 100) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(0, 512, tokens)] for _ in range(count)]


def greedy_reference(cfg, batch: list[list[int]], new: int) -> list[list[int]]:
    trajs = [Trajectory(f"r{i}", (Turn(tuple(p), new),)) for i, p in enumerate(batch)]
    ref = recompute_outputs(cfg, trajs)
    return [list(ref[f"r{i}"][0]) for i in range(len(batch))]


def test_batch_generate_greedy_matches_a_recompute_with_log_probs(setup) -> None:
    cluster, engine = setup
    batch = prompts(4)
    outputs = ray.get(engine.generate.remote(batch, {"max_tokens": 6, "temperature": 0.0}))
    assert [o.prompt_token_ids for o in outputs] == batch, "one output per prompt, in order"
    assert [o.outputs[0].token_ids for o in outputs] == greedy_reference(cluster.cfg, batch, 6), (
        "greedy tokens equal a single-process recompute"
    )
    for o in outputs:
        steps = o.outputs[0].logprobs
        assert [list(step) for step in steps] == [[t] for t in o.outputs[0].token_ids], (
            "vLLM's logprobs shape: one {sampled token: Logprob} per step"
        )
        assert all(math.isfinite(lp) and lp <= 0 for lp in o.outputs[0].log_probs), "log-probs are log-probabilities"


def test_per_sample_seeds_make_samples_of_one_prompt_differ_and_repeat(setup) -> None:
    _, engine = setup
    same = prompts(1)[0]
    params = {"max_tokens": 8, "temperature": 1.0}
    first = ray.get(engine.generate.remote([same] * 4, params))
    again = ray.get(engine.generate.remote([same] * 4, params, seeds=[o.seed for o in first]))
    tokens = [tuple(o.outputs[0].token_ids) for o in first]
    assert [o.seed for o in first] == [0, 1, 2, 3], "default seeds: the sampling seed + the sample's index"
    assert len(set(tokens)) > 1, "samples of one prompt with their own seeds differ"
    assert [tuple(o.outputs[0].token_ids) for o in again] == tokens, "the same seeds give the same samples"
    with pytest.raises(RequestError, match="seeds"):
        ray.get(engine.generate.remote([same] * 2, params, seeds=[1]))


def test_add_requests_get_responses_and_engine_control(setup) -> None:
    _, engine = setup

    class VllmLikeParams:  # the attributes of a vLLM SamplingParams that OpenRLHF builds
        temperature, top_p, top_k, max_tokens, seed, logprobs, n = 0.0, 1.0, -1, 5, None, None, 1

    batch = prompts(3, seed=9)
    ray.get(engine.add_requests.remote(VllmLikeParams(), batch))
    responses = ray.get(engine.get_responses.remote())
    assert [len(r.outputs[0].token_ids) for r in responses] == [5, 5, 5], "get_responses returns the batch's outputs"
    assert all(r.outputs[0].logprobs is None for r in responses), "no log-probs when logprobs is None (vLLM)"
    ray.get(engine.sleep.remote())
    ray.get(engine.wake_up.remote())
    ray.get(engine.reset_prefix_cache.remote())
    after = ray.get(engine.generate.remote(batch, VllmLikeParams()))
    assert [r.outputs[0].token_ids for r in after] == [r.outputs[0].token_ids for r in responses], (
        "after sleep, wake and a cache reset the same weights serve the same tokens"
    )
    assert all(r.hit_tokens == 0 for r in after), "the reset prefix cache hits nothing"


def test_weights_from_the_trainers_broadcast_group(setup) -> None:
    cluster, engine = setup
    world = ray.get(engine.weight_group_world_size.remote())
    sender = WeightSender.listen(world, host="127.0.0.1", group_name="openrlhf")
    joined = engine.init_process_group.remote("127.0.0.1", sender.port, 1, world, "openrlhf", "gloo", False)
    sender.connect()
    assert ray.get(joined) == world, "every engine joined the trainer's group"
    batch = prompts(2, seed=11, tokens=140)
    before = ray.get(engine.generate.remote(batch, {"max_tokens": 5, "temperature": 0.0}))
    new_cfg = cluster.cfg.with_overrides(model={"seed": 77})
    state = DecoderModel(new_cfg.model).checkpoint_tensors()
    received = engine.update_weights_from_group.remote(1, manifest_of(state))
    sender.send(state)
    assert ray.get(received) == 1, "the engines loaded the broadcast as version 1"
    after = ray.get(engine.generate.remote(batch, {"max_tokens": 5, "temperature": 0.0}))
    assert [o.outputs[0].token_ids for o in after] == greedy_reference(new_cfg, batch, 5), (
        "outputs come from the broadcast weights"
    )
    assert [o.outputs[0].token_ids for o in after] != [o.outputs[0].token_ids for o in before], "the weights changed"
    assert all(o.hit_tokens == 0 and o.weight_version == 1 for o in after), (
        "version 1's namespace: no block of version 0 is hit"
    )
    with pytest.raises(RequestError, match="rank_offset=1"):
        ray.get(engine.init_process_group.remote("127.0.0.1", sender.port, 2, world, "openrlhf", "gloo", False))
