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
  forward, never a step of their own; asynchronously (True) where the request names its KV's
  source (below).
- `update_state_after_alloc(request, blocks, loading)`: the tokens the request's coming step loads.
- `build_connector_meta(scheduler_output)`: every request of the step as a `ScheduledKV` (our
  key, its page list, tokens computed, scheduled now, and loaded first); a request vLLM resumed
  after preempting it gets its new page list (vLLM's `resumed_req_ids` contract) and loads again;
  the requests the step preempted (`preempted_req_ids`) ride along, and the worker side keeps
  them as `preempted` for the step's caller (a decode sequence's pages are not its own until it
  resumes: compute.py) and counts them (`preemptions`).
- `request_finished`: forget it; vLLM frees its pages at once (nothing is saved after the end).

Worker side
- `register_kv_caches`: the layers in model order and their page codec (runtime/vllm_engine/pages.py).
  vLLM 0.32 hands every attention backend's layer as a 4-D view with the logical axes
  [blocks, KV heads, tokens, K and V], strided by the model's resolved KVCacheLayout (HND, NHD,
  block-outer), possibly in kernel blocks smaller than vLLM's. Each layer is checked against what
  vLLM declares for it (declared.py: its backend class, the resolved layout, its KV cache spec);
  MLA backends and quantized caches are refused there, naming the backend.
  The layers' block-layer addressing in vLLM's one backing buffer (block_layers.py,
  BlockLayerMap) is built there too: where a transport lands a store block-layer in a page.
- `start_load_kv`, or whichever hook of the step comes first: the step's requests to the bound
  StepKV (`begin`).
- `wait_for_layer_load(layer)`: StepKV.before_layer: the layer's past KV is in vLLM's pages when
  it returns (a prefill batch waits here for the layer's transfer to land).
- `save_kv_layer(layer, kv_layer)`: StepKV.after_layer: the KV this layer computed leaves vLLM's
  pages for the engine's memory (the prefill window slot the pipeline sends, decode pages).
- `wait_for_save`: StepKV.end.
- `get_block_ids_with_load_errors`: a synchronous load's error fails the step inside the engine
  actor (the core fails the batch's attempts and the scheduler retries them, the same recompute
  policy as the native engines); an asynchronous load's failed blocks are reported here.

Asynchronous loads (async_loads.py): a request whose kv_transfer_params name its KV's source
(`SOURCE`) is answered (tokens, True): vLLM allocates its pages and holds it in
WAITING_FOR_REMOTE_KVS; `update_state_after_alloc` plans the load, `build_connector_meta`
carries it to the worker side, which lands it straight in vLLM's pages through the transport
bound with `bind_transport` and reports it in `get_finished` (failed blocks in
`get_block_ids_with_load_errors`; vLLM's kv_load_failure_policy is "recompute", host.py). A
request added with `HOLD` keeps its pages past its end (`request_finished` returns True, its
output names them) until `release`, reported in `get_finished` as sent.

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

from dualpath_ray.runtime.vllm_engine.async_loads import AsyncLoad, AsyncLoads
from dualpath_ray.runtime.vllm_engine.block_layers import BlockLayerMap, backing_buffer
from dualpath_ray.runtime.vllm_engine.declared import declared_pages
from dualpath_ray.runtime.vllm_engine.pages import PageCodec
from dualpath_ray.runtime.vllm_engine.request_book import RequestBook
from dualpath_ray.runtime.vllm_engine.step_kv import (
    EXTERNAL_TOKENS,
    HELD_BLOCKS,
    HELD_ID,
    HOLD,
    KEY,
    SOURCE,
    KVSource,
    ScheduledKV,
    StepKV,
    layer_index,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

class StepMeta(KVConnectorMetadata):
    def __init__(self, requests: list[ScheduledKV], loads: list[AsyncLoad], preempted: frozenset[str]) -> None:
        self.requests = requests
        self.loads = loads  # asynchronous loads to start (async_loads.py)
        self.preempted = preempted  # vLLM ids of the requests this step's scheduling preempted


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
        self._local_hits: dict[str, int] = {}  # scheduler side: vLLM's prefix-cache hit of each request
        self._new_loads: list[AsyncLoad] = []  # scheduler side: asynchronous loads for the next step
        self._sourced: set[str] = set()  # scheduler side: requests whose source was loaded from once
        # Scheduler side: requests whose asynchronous load was planned and not yet reported ended.
        self._receiving: set[str] = set()
        # Worker side: the layers in model order, their codec, and the step being run.
        self.layers: list[torch.Tensor] = []
        self._index: dict[str, int] = {}
        self.codec: PageCodec | None = None
        self.block_map: BlockLayerMap | None = None
        self.kv_buffer: torch.Tensor | None = None  # vLLM's backing buffer, flat uint8: a transport pool
        self.loads: AsyncLoads | None = None  # worker side: asynchronous loads in flight
        self.step: StepKV | None = None
        self._begun = False
        # Tokens vLLM's own prefix cache served to the requests it scheduled (no load moved them).
        self.local_hit_tokens = 0
        self._loaded_async: dict[str, int] = {}  # worker side: our key -> tokens its asynchronous load moved
        # Worker side: vLLM ids of the requests the last step preempted (their pages are freed,
        # and may be another request's by the next step), and how many it preempted in all.
        self.preempted: frozenset[str] = frozenset()
        self.preemptions = 0

    # --- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        key = str(params.get(KEY, request.request_id))
        if request.request_id in self._sourced:
            # Its source was read once: a failed load is computed (vLLM asks again after it), and
            # a preempted request finds the landed blocks in vLLM's prefix cache or computes them.
            return 0, False
        tokens = self.book.matched(request.request_id, key, int(params.get(EXTERNAL_TOKENS, 0)), num_computed_tokens)
        self._local_hits[request.request_id] = num_computed_tokens
        # A request naming its KV's source loads it between steps (async_loads.py); the others
        # load inside the step that computes them, layer by layer (the StepKV).
        return tokens, bool(tokens) and params.get(SOURCE) is not None

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        source = (request.kv_transfer_params or {}).get(SOURCE)
        if source is None or not num_external_tokens:
            self.book.allocated(request.request_id, num_external_tokens)
            return
        # Loaded before vLLM schedules the request: no step loads any of it again.
        self.book.allocated(request.request_id, 0)
        self._sourced.add(request.request_id)
        self._receiving.add(request.request_id)
        lo = self._local_hits.get(request.request_id, 0)
        peer, pool, offsets, pages = source
        self._new_loads.append(AsyncLoad(
            request.request_id, str(request.kv_transfer_params[KEY]),
            KVSource(str(peer), str(pool), tuple(int(o) for o in offsets), bool(pages)),
            tuple(blocks.get_block_ids()[0]), lo, lo + num_external_tokens,
        ))

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
        loads, self._new_loads = self._new_loads, []
        return StepMeta(requests, loads, frozenset(scheduler_output.preempted_req_ids or ()))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.book.finished(request.request_id)
        self._local_hits.pop(request.request_id, None)
        self._sourced.discard(request.request_id)
        # vLLM itself keeps the pages of a request still waiting for its KV until get_finished
        # reports the load ended (its WAITING_FOR_REMOTE_KVS contract), then frees them: such a
        # request is not held too (a second free would be one too many; nothing of it can be
        # read yet). A held request's pages stay until the worker side is told they were read
        # (release), as sent; the worker side tells the two apart the same way between steps
        # (AsyncLoads.receiving, VllmHost.free_held).
        receiving = request.request_id in self._receiving
        self._receiving.discard(request.request_id)
        if (request.kv_transfer_params or {}).get(HOLD) and not receiving:
            return True, {HELD_BLOCKS: list(block_ids), HELD_ID: request.request_id}
        return False, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Scheduler side: the worker side's report of a step; loads it reports ended are no
        longer in flight."""
        super().update_connector_output(connector_output)
        self._receiving.difference_update(connector_output.finished_recving or ())

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
        # Where each block-layer lies in vLLM's one backing buffer: the addressing a transport
        # needs to land a store block-layer straight in the pages (block_layers.py).
        self.block_map = BlockLayerMap.of(self.layers, self.codec)
        self.kv_buffer = backing_buffer(self.layers[0])
        self.loads = AsyncLoads(self.block_map, self.kv_buffer, len(self.layers))

    def bind_transport(self, transport: Any, pool: str) -> None:
        """The transport vLLM's backing buffer (`kv_buffer`) is registered with, as `pool`:
        what asynchronous loads land through."""
        if self.loads is None:
            raise RuntimeError("bind_transport before vLLM registered its KV caches")
        self.loads.bind(transport, pool)

    def bind(self, step: StepKV | None) -> None:
        """The StepKV of the step about to run (None once it ran)."""
        self.step = step
        self._begun = False
        if step is not None:
            self.preempted = frozenset()  # a step that schedules nothing preempts nothing

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
        self.preempted = meta.preempted
        self.preemptions += len(meta.preempted)
        # A request that loaded asynchronously counts its loaded tokens as computed when it is
        # first scheduled: only what vLLM's cache held before its load is a hit.
        self.local_hit_tokens += sum(
            max(0, r.load_from - self._loaded_async.pop(r.key, 0)) for r in meta.requests if r.first
        )
        self.step.begin(meta.requests, self.layers, self.codec)
        if meta.loads:
            assert self.loads is not None
            self._loaded_async.update({load.key: load.hi - load.lo for load in meta.loads})
            self.loads.start(meta.loads)
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

    def release(self, request_id: str) -> None:
        """The held request's pages (vLLM's request id) were read: vLLM may free them."""
        if self.loads is None:
            raise RuntimeError("release before vLLM registered its KV caches")
        self.loads.release(request_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(held requests released, requests whose asynchronous loads ended)."""
        if self.loads is None:
            return None, None
        return self.loads.released() or None, self.loads.finished() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks of asynchronous loads that failed, reported with their requests' end in
        `get_finished`; a synchronous load's error fails the step instead (see the module doc)."""
        return self.loads.load_errors() if self.loads is not None else set()
