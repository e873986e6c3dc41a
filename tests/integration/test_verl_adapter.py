"""verl adapter: conformance of the `rollout-server` to verl 0.9.1's rollout-server interface,
and verl's own classes driving it on an embedded 1P1D cluster.

The interface is transcribed below from verl 0.9.1 (PyPI; source
verl/workers/rollout/vllm_rollout/vllm_async_server.py `vLLMHttpServer`, the calls of
verl/workers/rollout/replica.py `RolloutReplica` and verl/workers/rollout/llm_server.py
`LLMServerClient`; checked against verl-project/verl main at 1dda039). Where verl is installed
(the `verl` extra; CI's `test` extra leaves it out, see pyproject.toml), the transcription is
checked against verl's own classes and verl's `LLMServerClient`, load balancer and
`RolloutReplica` drive the server.
"""

from __future__ import annotations

import asyncio
import inspect

import numpy as np
import pytest
import ray

from dualpath_ray.api.server import RolloutServer, TokenOutput
from dualpath_ray.model.llama import DecoderModel
from dualpath_ray.workload.trace import Trajectory, Turn
from dualpath_ray.runtime.telemetry.status_views import StatusQuery
from tests.helpers import recompute_outputs, runtime_config

pytestmark = pytest.mark.integration

# verl 0.9.1's TokenOutput fields and defaults (replica.py).
VERL_TOKEN_OUTPUT = {"token_ids": ..., "log_probs": None, "routed_experts": None, "stop_reason": None,
                     "num_preempted": None, "extra_fields": {}}
# verl 0.9.1's server-actor methods with the parameter names vLLMHttpServer declares.
VERL_SERVER_METHODS = {
    "generate": ["prompt_ids", "sampling_params", "request_id", "image_data", "video_data", "audio_data",
                 "mm_processor_kwargs", "priority", "kv_transfer_params"],
    "wake_up": ["tags"], "sleep": [], "clear_kv_cache": [], "release_kv_cache": [], "resume_kv_cache": [],
    "start_profile": ["kwargs"], "stop_profile": [], "set_global_steps": ["global_steps"],
    "wait_for_requests_to_drain": [], "abort_all_requests": ["reset_prefix_cache", "reject_request"],
    "resume_engine_generation": [], "open_submission_gate": [], "resume_generation": [],
    "abort_request": ["request_id", "reset_prefix_cache"], "get_server_address": [],
}
# Every call verl 0.9.1 makes on a server handle, as it makes it.
VERL_CALLS = [
    ("generate", (), {"request_id": "r", "prompt_ids": [1, 2], "sampling_params": {"temperature": 1.0},
                      "image_data": None, "video_data": None}),  # LLMServerClient.generate
    ("generate", (), {"request_id": "r", "prompt_ids": [1, 2], "sampling_params": {}, "image_data": None,
                      "video_data": None, "priority": 1}),  # with a priority
    ("wake_up", (), {}), ("sleep", (), {}),  # RolloutReplica.wake_up / sleep
    ("abort_all_requests", (), {}), ("abort_all_requests", (), {"reject_request": True}),  # vLLMReplica
    ("resume_generation", (), {}), ("resume_engine_generation", (), {}), ("open_submission_gate", (), {}),
    ("abort_request", ("rid",), {}), ("clear_kv_cache", (), {}), ("release_kv_cache", (), {}),
    ("resume_kv_cache", (), {}), ("start_profile", (), {"profile_step": 1}), ("stop_profile", (), {}),
    ("set_global_steps", (3,), {}), ("wait_for_requests_to_drain", (), {}), ("get_server_address", (), {}),
]
# verl's agent loop's sampling_params (verl/experimental/agent_loop/agent_loop.py).
AGENT_LOOP_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


def server_class() -> type:
    return RolloutServer.__ray_metadata__.modified_class.__mro__[1]


def test_the_server_has_every_verl_method_and_accepts_every_verl_call() -> None:
    cls = server_class()
    for name in VERL_SERVER_METHODS:
        assert inspect.iscoroutinefunction(getattr(cls, name, None)), f"{name} is an async method of the server"
    for name, args, kwargs in VERL_CALLS:
        inspect.signature(getattr(cls, name)).bind(None, *args, **kwargs)  # raises if verl's call does not fit
    fields = {name: (... if f.is_required() else f.default) for name, f in TokenOutput.model_fields.items()}
    assert fields == VERL_TOKEN_OUTPUT, "TokenOutput has verl's fields and defaults"


def vllm_server_methods() -> dict[str, list[str]]:
    """Method -> parameter names of the installed verl's vLLMHttpServer, from its source."""
    import ast
    import importlib.util
    from pathlib import Path

    package = Path(importlib.util.find_spec("verl").origin).parent
    tree = ast.parse((package / "workers/rollout/vllm_rollout/vllm_async_server.py").read_text())
    server = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "vLLMHttpServer")
    methods = {}
    for node in server.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            names = [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs] if a.arg != "self"]
            methods[node.name] = names + ([args.kwarg.arg] if args.kwarg else [])
    return methods


def test_the_transcription_matches_installed_verl() -> None:
    pytest.importorskip("verl")
    from verl.workers.rollout.replica import RolloutReplica
    from verl.workers.rollout.replica import TokenOutput as VerlTokenOutput

    declared = vllm_server_methods()  # its module imports vllm, so it is read, not imported
    for name, params in VERL_SERVER_METHODS.items():
        assert declared.get(name) == params, f"verl's vLLMHttpServer.{name} declares {declared.get(name)}"
    ours = {n: (f.annotation, f.default) for n, f in TokenOutput.model_fields.items()}
    theirs = {n: (f.annotation, f.default) for n, f in VerlTokenOutput.model_fields.items()}
    assert ours.keys() == theirs.keys() and all(ours[n][1] == theirs[n][1] for n in ours), "TokenOutput matches verl's"
    from dualpath_ray.api.verl_adapter import dualpath_replica_class

    replica = dualpath_replica_class()
    assert issubclass(replica, RolloutReplica) and not inspect.isabstract(replica), "a concrete verl RolloutReplica"


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    with shared_cluster.deployed(runtime_config(transport="gloo", verify_kv=False), "dualpath") as c:
        c.server()
        yield c


def prompt(seed: int, tokens: int = 150) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, 512, tokens)]


def test_verl_client_generates_through_its_load_balancer(cluster) -> None:
    pytest.importorskip("verl")
    from omegaconf import OmegaConf
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import GlobalRequestLoadBalancer

    from dualpath_ray.api.verl_adapter import dualpath_replica_class
    from verl.workers.config import RolloutConfig

    replica = dualpath_replica_class()(replica_rank=0, config=RolloutConfig(name="vllm"), model_config=None)
    asyncio.run(replica.init_standalone())
    assert replica.server_handle is not None and replica.servers == [replica.server_handle], (
        "the replica's server is the deployment's rollout-server"
    )
    balancer = ray.remote(GlobalRequestLoadBalancer).remote(servers={"dualpath-0": replica.server_handle})
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm", "full_determinism": False}}})
    client = LLMServerClient(config, balancer)
    ray.get(replica.server_handle.set_global_steps.remote(5))
    trajectory = Trajectory("verl-0", (Turn(tuple(prompt(1)), 6),))

    async def run() -> tuple:
        greedy = await client.generate("sess-1", prompt_ids=prompt(1), sampling_params={**AGENT_LOOP_SAMPLING,
                                       "temperature": 0, "max_tokens": 6})
        sampled = await client.generate("sess-1", prompt_ids=prompt(1), sampling_params={**AGENT_LOOP_SAMPLING,
                                        "max_tokens": 6, "logprobs": False})
        return greedy, sampled

    greedy, sampled = asyncio.run(run())
    assert greedy.token_ids == list(recompute_outputs(cluster.cfg, [trajectory])["verl-0"][0]), (
        "verl's client gets the greedy tokens a recompute of the model gives"
    )
    assert greedy.stop_reason == "completed" and len(greedy.log_probs) == 6, "log-probs when verl asks for them"
    assert sampled.log_probs is None and len(sampled.token_ids) == 6, "none when it does not (vLLM's logprobs key)"
    assert greedy.extra_fields["min_global_steps"] == 5, "verl's client sees the global steps the server was given"


async def decoding(cluster, count: int, timeout_s: float = 60.0) -> None:
    """Wait until `count` requests are decoding, as the decode engines themselves hold them (KV
    handed off), so an abort lands mid-decode. The decode engines are asked rather than the
    scheduler's `in_flight`: the tiny model decodes a whole 1,900-token turn in about 2 s, and
    this is the source the scheduler's state follows (test_handoff_note.py checks that it does)."""
    engines = {name: handle for name, handle in cluster.deployment.engines.items() if name.startswith("decode/")}
    deadline = asyncio.get_running_loop().time() + timeout_s
    handed: set[str] = set()
    while asyncio.get_running_loop().time() < deadline:
        holdings = await asyncio.gather(*(engine.holds.remote(name) for name, engine in engines.items()))
        handed = {rid for answer in holdings for rid, held in answer.held.items() if held.handed_off}
        if len(handed) >= count:
            return
        await asyncio.sleep(0.02)
    states = (await cluster.deployment.scheduler.status.remote(StatusQuery.IN_FLIGHT)).requests
    raise TimeoutError(f"{count} requests were not decoding within {timeout_s} s; decoding: {sorted(handed)}; "
                       f"the scheduler's in flight: {states}")


def test_abort_request_and_abort_all_requests_free_everything(cluster) -> None:
    server = cluster.server()
    tokens = cluster.cfg.model.max_context - 150 - 8  # as many as the context holds: seconds of decoding

    async def run() -> tuple:
        long = server.generate.remote("verl-long", prompt(2), {"max_tokens": tokens})
        await decoding(cluster, 1)
        single = await server.abort_request.remote("verl-long", reset_prefix_cache=False)
        first = await long
        many = [server.generate.remote(f"verl-many-{i}", prompt(10 + i), {"max_tokens": tokens}) for i in range(3)]
        await decoding(cluster, 3)
        report = await server.abort_all_requests.remote(reset_prefix_cache=False)
        parked = server.generate.remote("verl-parked", prompt(20), {"max_tokens": 3})
        await asyncio.sleep(0.5)
        waited = not (await asyncio.wait([asyncio.wrap_future(parked.future())], timeout=0.1))[0]
        await server.resume_generation.remote()
        return single, first, [await r for r in many], report, waited, await parked

    single, first, many, report, waited, parked = asyncio.run(run())
    assert single["aborted"] and first.stop_reason == "aborted", "abort_request stops one request: stop_reason aborted"
    assert len(first.token_ids) < tokens, "it stopped before max_tokens"
    assert report["aborted_count"] == 3 and all(o.stop_reason == "aborted" for o in many), "abort_all stops every one"
    assert waited and parked.stop_reason == "completed", "a request behind the closed gate waits, then runs on resume"
    assert not ray.get(server.abort_request.remote("verl-long"))["aborted"], "an id no longer in flight is not found"
    pools, pages = cluster.pool_integrity(), cluster.page_integrity()
    assert all(f == c for f, _, _, c in pools.values()), f"every buffer extent is free: {pools}"
    assert all(f == c and r == 0 for f, _, r, c in pages.values()), f"every decode page is free: {pages}"


def test_sleep_wake_update_weights_and_cache_reset(cluster) -> None:
    server = cluster.server()
    context = prompt(30, 200)
    before = ray.get(server.generate.remote("w-0", context, {"max_tokens": 4}))
    assert ray.get(server.sleep.remote()) >= 0, "verl's sleep releases the engines' memory"
    with pytest.raises(ray.exceptions.RayTaskError, match="asleep"):
        ray.get(server.generate.remote("w-asleep", context, {"max_tokens": 4}))
    ray.get(server.wake_up.remote())
    again = ray.get(server.generate.remote("w-1", context, {"max_tokens": 4}))
    assert again.token_ids == before.token_ids and again.extra_fields["hit_tokens"] > 0, (
        "after wake the same weights serve, and the store and index were kept"
    )
    new_cfg = cluster.cfg.with_overrides(model={"seed": 41})
    ray.get(server.update_weights.remote(3, DecoderModel(new_cfg.model).checkpoint_tensors()))
    after = ray.get(server.generate.remote("w-2", context, {"max_tokens": 4}))
    expected = recompute_outputs(new_cfg, [Trajectory("w", (Turn(tuple(context), 4),))])["w"][0]
    assert after.token_ids == list(expected), "update_weights swaps every engine's weights"
    assert after.extra_fields["hit_tokens"] == 0 and after.extra_fields["weight_version"] == 3, (
        "the new version's namespace: no block of the old weights is hit"
    )
    ray.get(server.clear_kv_cache.remote())
    cleared = ray.get(server.generate.remote("w-3", context, {"max_tokens": 4}))
    assert cleared.extra_fields["hit_tokens"] == 0, "clear_kv_cache forgets every indexed block"
