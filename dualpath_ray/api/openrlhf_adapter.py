"""OpenRLHF adapter: a batch `generate` and OpenRLHF's vLLM engine actor shape.

Followed: OpenRLHF v0.9.0, `LLMRayActor` (openrlhf/trainer/ray/vllm_engine.py): `add_requests(
sampling_params, prompt_token_ids)` then `get_responses()` (vLLM `RequestOutput`s, read by
openrlhf/trainer/ppo_utils/experience_maker.py as `.prompt_token_ids`, `.outputs[0].token_ids`
and `.outputs[0].logprobs[i][token].logprob`), `reset_prefix_cache()`, `sleep(level)`,
`wake_up()`, and the weight group's `init_process_group(master_address, master_port,
rank_offset, world_size, group_name, backend, use_ray)`.

The whole DualPath cluster is one OpenRLHF "engine" whose tensor-parallel size is its engine
count: the trainer's weight group is rank 0 plus ranks 1..N (`weight_group_world_size()`).
Weights travel as one manifest-ordered broadcast (`update_weights_from_group`) rather than
OpenRLHF's per-parameter `update_weight` calls (docs/rl.md says why).

A batch is a one-turn rollout per sample through the scheduler (`rollout_async`, what
`DualPathCluster.rollout` runs), each sample with its own seed: `seeds[i]`, or the sampling
seed + i, so n samples of one prompt differ (with a shared seed they would be identical).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import ray

from dualpath_ray.api.rollout import rollout_async
from dualpath_ray.api.validation import RequestError, parse_sampling_request, validate_prompt
from dualpath_ray.config import DualPathConfig
from dualpath_ray.protocol.messages import TurnResult
from dualpath_ray.protocol.names import SCHEDULER
from dualpath_ray.workload.trace import Trajectory, Turn

# vLLM SamplingParams attributes that map onto this sampler (others must be at their defaults).
_SAMPLING_ATTRIBUTES = (
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop_token_ids", "logprobs", "n",
)


@dataclass(frozen=True)
class Logprob:
    """vLLM's Logprob: what OpenRLHF reads as `logprobs[i][token].logprob`."""

    logprob: float


@dataclass(frozen=True)
class CompletionOutput:
    """vLLM's CompletionOutput fields that OpenRLHF reads."""

    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    finish_reason: str  # "stop" | "length" | "abort"

    @property
    def log_probs(self) -> list[float] | None:
        """The sampled tokens' log-probs as a flat list."""
        return None if self.logprobs is None else [step[t].logprob for step, t in zip(self.logprobs, self.token_ids)]


@dataclass(frozen=True)
class RequestOutput:
    """vLLM's RequestOutput fields that OpenRLHF reads, plus how the sample was served."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    seed: int
    hit_tokens: int
    weight_version: int


def sampling_dict(sampling_params: Any) -> dict[str, Any]:
    """A dict of sampling keys from a dict or a vLLM-SamplingParams-like object."""
    if sampling_params is None:
        return {}
    if isinstance(sampling_params, Mapping):
        return dict(sampling_params)
    return {name: getattr(sampling_params, name) for name in _SAMPLING_ATTRIBUTES if hasattr(sampling_params, name)}


def sample_seeds(count: int, base: int, seeds: Sequence[int] | None) -> list[int]:
    """Each sample's seed: the caller's list, or base + index."""
    if seeds is None:
        return [base + i for i in range(count)]
    if len(seeds) != count or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise RequestError(f"seeds must be {count} ints, one per prompt (got {seeds!r})", "seeds")
    return list(seeds)


def completion_of(result: TurnResult, want_log_probs: bool) -> CompletionOutput:
    tokens = [int(t) for t in result.output_tokens]
    logprobs = [{t: Logprob(float(lp))} for t, lp in zip(tokens, result.log_probs)] if want_log_probs else None
    reason = str(result.stop_reason)
    return CompletionOutput(
        index=0, token_ids=tokens, logprobs=logprobs,
        cumulative_logprob=float(sum(result.log_probs)) if want_log_probs else None,
        finish_reason="stop" if reason == "stop" else ("abort" if reason == "aborted" else "length"),
    )


@ray.remote(num_cpus=0, max_concurrency=64)
class OpenRLHFEngine:
    """OpenRLHF's engine actor over a DualPath deployment (see the module docstring)."""

    def __init__(self, cfg: DualPathConfig) -> None:
        from dualpath_ray.api.server import SERVER_NAME

        self.cfg = cfg
        namespace = cfg.runtime.namespace
        self.scheduler = ray.get_actor(SCHEDULER, namespace=namespace)
        self.server = ray.get_actor(SERVER_NAME, namespace=namespace)
        self.responses: asyncio.Queue[list[RequestOutput]] = asyncio.Queue()

    async def generate(
        self, prompts: Sequence[Sequence[int]], sampling_params: Any = None, seeds: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt (token id lists), in order, each sampled with its own seed;
        log-probs of the sampled tokens unless `logprobs` is None/False."""
        batch = f"orlhf-{uuid.uuid4().hex[:12]}"
        parsed = parse_sampling_request(batch, sampling_dict(sampling_params), self.cfg.runtime.max_new_tokens)
        if not isinstance(prompts, Sequence) or isinstance(prompts, (str, bytes)) or not prompts:
            raise RequestError("prompts must be a non-empty list of token id lists", "prompts")
        per_sample = sample_seeds(len(prompts), parsed.params.seed, seeds)
        for i, prompt in enumerate(prompts):
            validate_prompt(f"{batch}-{i} (prompts[{i}])", prompt, parsed.params.max_new_tokens, self.cfg.model)
        trajectories = [
            Trajectory(f"{batch}-{i}", (Turn(tuple(int(t) for t in prompt), parsed.params.max_new_tokens),))
            for i, prompt in enumerate(prompts)
        ]
        sampling = {
            t.trajectory_id: replace(parsed.params, seed=seed)
            for t, seed in zip(trajectories, per_sample)
        }
        version = await self.server.get_weight_version.remote()
        result = await rollout_async(self.scheduler, self.cfg, trajectories, progress=False,
                                     weight_version=version, sampling=sampling)
        if result.failures:
            first = sorted(result.failures)[0]
            raise RuntimeError(f"{len(result.failures)} samples failed; {first}: {result.failures[first]}")
        return [
            RequestOutput(t.trajectory_id, list(t.turns[0].appended), [completion_of(turns[0], parsed.want_log_probs)]
                          if turns else [], seed, turns[0].hit_tokens if turns else 0, version)
            for t, seed, turns in zip(trajectories, per_sample, (result.turn_results[t.trajectory_id] for t in trajectories))
        ]

    async def add_requests(self, sampling_params: Any, prompt_token_ids: Sequence[Sequence[int]]) -> None:
        """OpenRLHF: generate for these prompts; `get_responses` returns the outputs."""
        self.responses.put_nowait(await self.generate(prompt_token_ids, sampling_params))

    async def get_responses(self) -> list[RequestOutput]:
        """The outputs of the oldest `add_requests` not yet collected (waits for it)."""
        return await self.responses.get()

    async def reset_prefix_cache(self) -> None:
        await self.server.reset_prefix_cache.remote()

    async def sleep(self, level: int = 1) -> int:
        return int(await self.server.sleep.remote(level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.server.wake_up.remote(tags)

    async def weight_group_world_size(self) -> int:
        return int(await self.server.weight_group_world_size.remote())

    async def init_process_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
        backend: str = "gloo", use_ray: bool = False,
    ) -> int:
        """Join the trainer's weight group (the trainer is rank 0; it joins beside this call).
        The cluster's engines are ranks rank_offset.. in order; OpenRLHF's ray.util.collective
        path (`use_ray`) is not supported: the group is torch.distributed's."""
        expected = await self.weight_group_world_size()
        if rank_offset != 1 or world_size != expected:
            raise RequestError(
                f"this cluster joins as ranks 1..{expected - 1}: pass rank_offset=1 and world_size={expected} "
                f"(got {rank_offset}, {world_size})", "world_size",
            )
        if use_ray or backend not in ("gloo", "nccl"):
            raise RequestError(f"weight groups here are torch.distributed gloo/nccl (got backend={backend!r}, "
                               f"use_ray={use_ray!r})", "backend")
        return int(await self.server.join_weight_group.remote(master_address, master_port, group_name))

    async def update_weights_from_group(self, version: int, manifest: list[Any]) -> int:
        """Receive the trainer's broadcast of `manifest` (sent beside this call) on every engine,
        then serve weight version `version`."""
        return int(await self.server.update_weights_from_group.remote(version, manifest))

    async def get_weight_version(self) -> int:
        return int(await self.server.get_weight_version.remote())


def create_openrlhf_engine(cluster: Any) -> Any:
    """The OpenRLHF engine actor of a deployed `DualPathCluster` (its rollout-server started)."""
    cluster.server()
    return OpenRLHFEngine.options(namespace=cluster.cfg.runtime.namespace).remote(cluster.cfg)
