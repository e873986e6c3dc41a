"""DualPath's vLLM KV connector: how vLLM's paged KV cache is loaded from, and saved to, the
memory dualpath_ray's engines move KV through.

vLLM builds this class twice (`kv_transfer_config.kv_connector_module_path` names this module):
once for its scheduler (role SCHEDULER) and once for its worker (role WORKER). With the engine
in process (host.py, VllmHost) both live in the engine actor, and the host binds the worker's
instance to the `StepKV` of the step it is about to run (runtime/vllm_engine/steps.py): which tokens of
which request come from where before each layer, and go where after it. This class only
translates vLLM's hooks into those calls; it decides nothing.

Scheduler side
- `get_num_new_matched_tokens(request, num_computed)`: the request's external tokens, from its
  `kv_transfer_params["external_tokens"]` (VllmHost.add sets it: the hit or earlier-chunk tokens a
  prefill chunk reads, the tokens whose KV a decode sequence already has). Loaded synchronously
  (False): the layers wait for them inside the forward, never a step of their own.
- `update_state_after_alloc`: nothing to remember; the block ids come with the scheduler output.
- `build_connector_meta(scheduler_output)`: every request of the step as a `ScheduledKV` (our key,
  all its block ids, tokens already computed, tokens scheduled now).
- `request_finished`: forget its blocks; vLLM frees them at once (nothing is saved after the end).

Worker side
- `register_kv_caches`: the layers in model order and their page codec (runtime/vllm_engine/pages.py).
- `start_load_kv`, or whichever hook of the step comes first: the step's requests to the bound
  StepKV (`begin`).
- `wait_for_layer_load(layer)`: StepKV.before_layer: the layer's past KV is in vLLM's pages when
  it returns (a prefill batch waits here for the layer's transfer to land).
- `save_kv_layer(layer, kv_layer)`: StepKV.after_layer: the KV this layer computed leaves vLLM's
  pages for the engine's memory (the prefill window slot the pipeline sends, decode pages).
- `wait_for_save`: StepKV.end.
- `get_block_ids_with_load_errors`: a load error fails the step inside the engine actor (the core
  fails the batch's attempts and the scheduler retries them, the same recompute policy as the
  native engines), so no block is ever reported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from dualpath_ray.runtime.vllm_engine.pages import PageCodec
from dualpath_ray.runtime.vllm_engine.step_kv import EXTERNAL_TOKENS, KEY, ScheduledKV, StepKV, layer_index

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

class StepMeta(KVConnectorMetadata):
    def __init__(self, requests: list[ScheduledKV]) -> None:
        self.requests = requests


class DualPathConnector(KVConnectorBase_V1):
    """See the module doc. Its worker-side instance is bound to a StepKV for each step."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        # Scheduler side: each running request's key, external tokens and block ids so far.
        self._requests: dict[str, tuple[str, int, list[int]]] = {}
        # Worker side: the layers in model order, their codec, and the step being run.
        self.layers: list[torch.Tensor] = []
        self._index: dict[str, int] = {}
        self.codec: PageCodec | None = None
        self.step: StepKV | None = None
        self._begun = False

    # --- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        external = int(params.get(EXTERNAL_TOKENS, 0))
        self._requests.setdefault(request.request_id, (str(params.get(KEY, request.request_id)), external, []))
        return max(0, external - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        requests: list[ScheduledKV] = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            key, external, blocks = self._requests.setdefault(new.req_id, (new.req_id, 0, []))
            blocks[:] = list(new.block_ids[0])
            requests.append(ScheduledKV(key, tuple(blocks), new.num_computed_tokens, scheduled[new.req_id], external))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            key, _, blocks = self._requests.setdefault(req_id, (req_id, 0, []))
            added = cached.new_block_ids[i]
            if added is not None:
                blocks.extend(added[0])
            requests.append(ScheduledKV(key, tuple(blocks), cached.num_computed_tokens[i], scheduled[req_id], 0))
        return StepMeta(requests)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        return False, None

    # --- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.platforms import current_platform

        order = sorted(kv_caches, key=layer_index)
        self.layers = [kv_caches[name] for name in order]
        self._index = {name: i for i, name in enumerate(order)}
        model = self._vllm_config.model_config
        self.codec = PageCodec.detect(
            self.layers[0], model.get_num_kv_heads(self._vllm_config.parallel_config), model.get_head_size(),
            self.block_size, current_platform.is_cpu(),
        )

    def bind(self, step: StepKV | None) -> None:
        """The StepKV of the step about to run (None once it ran)."""
        self.step = step
        self._begun = False

    def _begin(self) -> StepKV | None:
        """Hand the step's requests to the StepKV once, at the first hook of the step: vLLM calls
        start_load_kv before the forward only when the step has loads it counts as synchronous,
        and after it otherwise, while the layer hooks always run inside it."""
        if self.step is None or self._begun:
            return self.step
        assert self.codec is not None, "register_kv_caches runs before any step"
        meta = self._get_connector_metadata()
        assert isinstance(meta, StepMeta)
        self._begun = True
        self.step.begin(meta.requests, self.layers, self.codec)
        return self.step

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.step is None:
            raise RuntimeError("a vLLM step ran with no StepKV bound (steps run through VllmHost.run)")
        self._begin()

    def wait_for_layer_load(self, layer_name: str) -> None:
        step = self._begin()
        if step is not None:
            step.before_layer(self._index[layer_name])

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        step = self._begin()
        if step is not None:
            step.after_layer(self._index[layer_name])

    def wait_for_save(self) -> None:
        step = self._begin()
        if step is not None:
            step.end()
