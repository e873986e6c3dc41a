"""DualPath's vLLM KV connector: how vLLM's paged KV cache is loaded from, and saved to, the
memory dualpath_ray's engines move KV through.

vLLM builds this class twice (`kv_transfer_config.kv_connector_module_path` names this module):
once for its scheduler (role SCHEDULER) and once for its worker (role WORKER). With the engine
in process (host.py, VllmHost) both live in the engine actor, and the host binds the worker's
instance to the `StepKV` of the step it is about to run (runtime/vllm_engine/steps.py): which tokens of
which request come from where before each layer, and go where after it. This class only
translates vLLM's hooks into those calls; it decides nothing.

Scheduler side (the bookkeeping is runtime/vllm_engine/request_book.py's RequestBook, pure)
- `get_num_new_matched_tokens(request, local_hits)`: of the request's external tokens (its
  `kv_transfer_params["external_tokens"]`, set by VllmHost.add: the hit or earlier-chunk tokens a
  prefill chunk reads, the tokens whose KV a decode sequence already has), those vLLM's own
  prefix cache does not hold. Loaded synchronously (False): the layers wait for them inside the
  forward, never a step of their own.
- `update_state_after_alloc(request, blocks, loading)`: the tokens the request's coming step loads.
- `build_connector_meta(scheduler_output)`: every request of the step as a `ScheduledKV` (our
  key, its page list, tokens computed, scheduled now, and loaded first); a request vLLM resumed
  after preempting it gets its new page list (vLLM's `resumed_req_ids` contract) and loads again.
- `request_finished`: forget it; vLLM frees its pages at once (nothing is saved after the end).

Worker side
- `register_kv_caches`: the layers in model order and their page codec (runtime/vllm_engine/pages.py).
  vLLM 0.32 hands every attention backend's layer as a 4-D view with the logical axes
  [blocks, KV heads, tokens, K and V], strided by the model's resolved KVCacheLayout (HND, NHD,
  block-outer), possibly in kernel blocks smaller than vLLM's. Each layer is checked against what
  vLLM declares for it (declared.py: its backend class, the resolved layout, its KV cache spec);
  MLA backends and quantized caches are refused there, naming the backend.
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

CUDA graphs
- `requires_piecewise_for_cudagraph` is True: vLLM calls wait_for_layer_load and save_kv_layer
  around each attention op (model_executor/layers/attention/kv_transfer_utils.py,
  `maybe_transfer_kv_layer`), and those are Python: a FULL CUDA graph replays the forward's kernels
  without them, so a replayed step would attend over pages nobody loaded and save nothing, silently.
  vLLM then runs PIECEWISE graphs (config/vllm.py overrides FULL modes for such a connector): the
  attention ops run eagerly between the captured pieces, so the hooks run in every step, in order,
  and the pipeline's waits and copies happen where the layer needs them. With
  `engine.vllm_enforce_eager` vLLM captures no graph at all.
- `get_required_kvcache_layout` stays None: the codec reads every layout vLLM may resolve.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from dualpath_ray.runtime.vllm_engine.declared import declared_pages
from dualpath_ray.runtime.vllm_engine.pages import PageCodec
from dualpath_ray.runtime.vllm_engine.request_book import RequestBook
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

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Always: the layer hooks move KV inside the forward (see the module doc, CUDA graphs)."""
        return True

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
        if len(groups) > 1:
            # Every KV byte this backend moves is one full-attention layer's token-major KV in one
            # page table; a hybrid model's other groups (sliding window, mamba state) would need
            # their own tables and formats.
            raise ValueError(
                f"model {vllm_config.model_config.model}: vLLM gives it {len(groups)} KV cache groups (a hybrid "
                "attention model); the DualPath connector moves one group of full-attention layers only"
            )
        self.block_size = vllm_config.cache_config.block_size
        self.book = RequestBook()  # scheduler side: what each request loads, and its pages
        # Worker side: the layers in model order, their codec, and the step being run.
        self.layers: list[torch.Tensor] = []
        self._index: dict[str, int] = {}
        self.codec: PageCodec | None = None
        self.step: StepKV | None = None
        self._begun = False
        # Tokens vLLM's own prefix cache served to the requests it scheduled (no load moved them).
        self.local_hit_tokens = 0

    # --- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        key = str(params.get(KEY, request.request_id))
        return self.book.matched(request.request_id, key, int(params.get(EXTERNAL_TOKENS, 0)), num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        self.book.allocated(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        scheduled = scheduler_output.num_scheduled_tokens
        requests = [
            self.book.new_request(new.req_id, new.block_ids[0], new.num_computed_tokens, scheduled[new.req_id])
            for new in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            added = cached.new_block_ids[i]
            requests.append(self.book.cached_request(
                req_id, added[0] if added is not None else None, cached.num_computed_tokens[i], scheduled[req_id],
                resumed=req_id in cached.resumed_req_ids,
            ))
        return StepMeta(requests)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.book.finished(request.request_id)
        return False, None

    # --- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        order = sorted(kv_caches, key=layer_index)
        self.layers = [kv_caches[name] for name in order]
        self._index = {name: i for i, name in enumerate(order)}
        model = self._vllm_config.model_config
        n_kv_head, head_dim = model.get_num_kv_heads(self._vllm_config.parallel_config), model.get_head_size()
        # Every layer is checked against what vLLM declares for it: one codec moves every layer,
        # so layers whose views differ are refused here (several cache groups already are, in __init__).
        codecs = {
            name: PageCodec.detect(
                kv_caches[name], declared_pages(self._vllm_config, self._kv_cache_config, name),
                n_kv_head, head_dim, self.block_size,
            )
            for name in order
        }
        if len(set(codecs.values())) > 1:
            raise ValueError(f"vLLM's KV cache layers differ in page geometry ({codecs}); one codec moves every layer")
        self.codec = codecs[order[0]]

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
        self.local_hit_tokens += sum(r.load_from for r in meta.requests if r.first)
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
