"""The agent-loop server (`rollout-server`, a named async actor): verl-style token-in/token-out.

`generate(request_id, prompt_ids, sampling_params) -> TokenOutput` serves many concurrent agent
loops; prefix reuse across turns comes from the content-addressed store, so any engine can
serve any turn. `update_weight_version(v)` changes the key namespace of all later requests, so
KV of an old policy is never served again; `reset_prefix_cache()` forgets every indexed block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

import ray

from dualpath_ray.api.validation import RequestError, make_spec, parse_sampling, validate_prompt
from dualpath_ray.config import DualPathConfig
from dualpath_ray.runtime.messages import TurnResult

SERVER_NAME = "rollout-server"


@dataclass(frozen=True)
class TokenOutput:
    """verl's TokenOutput shape: generated ids, their log-probs, and why generation stopped."""

    token_ids: list[int]
    log_probs: list[float] | None
    stop_reason: Literal["completed", "aborted"] | None
    extra_fields: dict[str, Any] = field(default_factory=dict)



@ray.remote(num_cpus=0, max_concurrency=4096)
class RolloutServer:
    """verl-style token-in/token-out server in front of the scheduler."""

    def __init__(self, cfg: DualPathConfig) -> None:
        self.cfg = cfg
        self.weight_version = cfg.model.weight_version
        self.scheduler = ray.get_actor("scheduler", namespace=cfg.runtime.namespace)

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], sampling_params: Mapping[str, Any] | None = None, **_: Any
    ) -> TokenOutput:
        sampling = parse_sampling(request_id, sampling_params, self.cfg.runtime.max_new_tokens)
        prompt = validate_prompt(request_id, prompt_ids, sampling.max_new_tokens, self.cfg.model)
        namespace = self.cfg.model.kv_namespace(self.weight_version)
        result: TurnResult = await self.scheduler.generate.remote(make_spec(request_id, prompt, sampling, namespace))
        if result.error:
            raise RuntimeError(f"request {request_id} failed: {result.error}")
        return TokenOutput(
            list(result.output_tokens), list(result.log_probs), "completed",
            {"hit_tokens": result.hit_tokens, "path": result.path, "prefill_engine": result.prefill_engine,
             "decode_engine": result.decode_engine, "ttft_s": result.ttft_s, "tpot_s": result.tpot_s,
             "weight_version": self.weight_version},
        )

    async def update_weight_version(self, version: int) -> int:
        if not isinstance(version, int) or version < 0:
            raise RequestError(f"weight version must be an int >= 0 (got {version!r})")
        self.weight_version = version
        return version

    async def reset_prefix_cache(self) -> None:
        await self.scheduler.reset_prefix_cache.remote()

    async def get_weight_version(self) -> int:
        return self.weight_version
