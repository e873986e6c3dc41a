"""What RL trainers need from the runtime, on an embedded 1P1D cluster: tokens streamed as they
are sampled, and aborting a request mid-decode (its caller answered at once, its pages and
extents freed)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import ray

from dualpath_ray.api.validation import make_spec
from dualpath_ray.cluster import DualPathCluster
from dualpath_ray.protocol.messages import SamplingParams, StreamDelta, TurnResult
from dualpath_ray.protocol.types import StopReason
from dualpath_ray.protocol.aborts import AbortTarget
from dualpath_ray.runtime.telemetry.status_views import StatusQuery
from tests.helpers import runtime_config

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    with shared_cluster.deployed(runtime_config(transport="gloo", verify_kv=False), "dualpath") as c:
        yield c


def spec_of(cluster: DualPathCluster, request_id: str, tokens: int, new: int, seed: int = 0):
    prompt = np.random.default_rng(seed).integers(0, 512, tokens)
    namespace = cluster.cfg.model.kv_namespace(block_size=cluster.cfg.store.block_size)
    return make_spec(request_id, prompt, SamplingParams(max_new_tokens=new), namespace)


async def collect_stream(scheduler, spec) -> tuple[list[tuple[float, StreamDelta]], TurnResult]:
    deltas, result = [], None
    async for ref in scheduler.generate_stream.remote(spec):
        item = await ref
        if isinstance(item, StreamDelta):
            deltas.append((time.monotonic(), item))
        else:
            result = (time.monotonic(), item)
    assert result is not None, "a stream ends with the turn's result"
    return deltas, result


def test_tokens_stream_as_they_are_sampled_and_add_up_to_the_result(cluster: DualPathCluster) -> None:
    scheduler = cluster.deployment.scheduler
    deltas, (done_at, result) = asyncio.run(collect_stream(scheduler, spec_of(cluster, "stream-1", 150, 24)))
    streamed = [t for _, d in deltas for t in d.tokens]
    assert result.error is None and len(result.output_tokens) == 24, "the turn is served"
    assert streamed == list(result.output_tokens), "the deltas, in order, are exactly the output tokens"
    assert [d.start for _, d in deltas] == [sum(len(x.tokens) for _, x in deltas[:i]) for i in range(len(deltas))], (
        "every delta starts where the previous one ended: no gap, no token twice"
    )
    assert len(deltas) > 1 and deltas[0][0] < done_at, "tokens arrive before the turn finishes (real streaming)"
    plain = ray.get(scheduler.generate.remote(spec_of(cluster, "stream-2", 150, 24)))
    assert plain.output_tokens == result.output_tokens, "streaming changes nothing in what is generated"


def test_an_abort_mid_decode_answers_the_caller_and_frees_everything(cluster: DualPathCluster) -> None:
    scheduler = cluster.deployment.scheduler

    # As many new tokens as the context holds (seconds of decoding even on a quiet machine), and
    # the abort goes out at the first delta: on a loaded 2-core CI runner the deltas can reach the
    # driver late, and a short request could be done before its third delta was read.
    longest = cluster.cfg.model.max_context - 150 - 8

    async def run() -> tuple[TurnResult, bool, list[StreamDelta]]:
        got: list[StreamDelta] = []
        stream = scheduler.generate_stream.remote(spec_of(cluster, "abort-1", 150, longest, seed=3))
        result = None
        async for ref in stream:
            item = await ref
            if isinstance(item, StreamDelta):
                got.append(item)
                if len(got) == 1:
                    aborted = await scheduler.abort.remote(AbortTarget.request("abort-1"))
            else:
                result = item
        return result, aborted, got

    result, aborted, got = asyncio.run(run())
    assert aborted, "the request was in flight, so the abort took it"
    assert result.stop_reason is StopReason.ABORTED and result.error is None, "the caller gets 'aborted', not an error"
    assert sum(len(d.tokens) for d in got) < longest, "decoding stopped before max_new_tokens"
    assert not ray.get(scheduler.abort.remote(AbortTarget.request("abort-1"))), "aborting a request that is no longer in flight is a no-op"
    while True:  # until everything is free: the test's timeout ends a wait for a leak
        pools, pages = cluster.pool_integrity(), cluster.page_integrity()
        if all(f == c for f, _, _, c in pools.values()) and all(f == c and r == 0 for f, _, r, c in pages.values()):
            break
        time.sleep(0.1)
    assert all(f == c for f, _, _, c in pools.values()), f"every buffer extent of the aborted request is free: {pools}"
    assert all(f == c and r == 0 for f, _, r, c in pages.values()), f"its decode pages are free: {pages}"
    assert ray.get(scheduler.status.remote(StatusQuery.INTEGRITY)).requests == 0, "the scheduler holds nothing of it"


def test_sleep_frees_engine_memory_and_wake_restores_it_with_the_store_kept(cluster: DualPathCluster) -> None:
    scheduler = cluster.deployment.scheduler
    before = ray.get(scheduler.generate.remote(spec_of(cluster, "sleep-1", 200, 6, seed=11)))
    freed = cluster.sleep()
    assert freed > 0, "sleeping frees the engines' KV memory"
    with pytest.raises(ray.exceptions.RayTaskError, match="asleep"):
        ray.get(scheduler.generate.remote(spec_of(cluster, "sleep-2", 200, 6, seed=11)))
    cluster.wake_up()
    after = ray.get(scheduler.generate.remote(spec_of(cluster, "sleep-3", 200, 6, seed=11)))
    assert after.error is None and after.output_tokens == before.output_tokens, "the same weights serve after waking"
    assert after.hit_tokens == 192, "the store and the index were kept: the prompt's 3 full blocks are hits"


def test_weights_broadcast_by_a_trainer_change_outputs_and_move_the_key_namespace(cluster: DualPathCluster) -> None:
    from dualpath_ray.model.llama import DecoderModel

    scheduler = cluster.deployment.scheduler
    old = ray.get(scheduler.generate.remote(spec_of(cluster, "sync-0", 200, 6, seed=21)))
    assert old.error is None
    trained = cluster.cfg.model.model_copy(update={"seed": 4242})
    state = DecoderModel(trained).state_dict()
    sender = cluster.attach_weight_sender(group_name="test-policy", timeout_s=60.0)
    assert cluster.update_weights_from_group(sender, 1, state) == 1
    new = ray.get(scheduler.generate.remote(spec_of(cluster, "sync-1", 200, 6, seed=21)))
    prompt = np.random.default_rng(21).integers(0, 512, 200)
    expected = tuple(DecoderModel(trained).greedy_generate([int(t) for t in prompt], 6).token_ids)
    assert new.output_tokens == expected, "the engines compute with the broadcast weights"
    assert new.output_tokens != old.output_tokens, "the outputs changed with the weights"
    assert new.hit_tokens == 0, "no block of the old weight version is hit under the new one"
