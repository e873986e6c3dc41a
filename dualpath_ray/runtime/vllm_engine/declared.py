"""What vLLM declares about a layer's KV pages, read from its config (worker side, once the KV
cache is allocated): the layer's attention backend class, the model-wide KVCacheLayout the engine
core resolved, and the layer's KV cache spec. The connector hands it to PageCodec.detect
(pages.py), which checks the registered view against it instead of guessing from the shape.

vLLM 0.32 has no per-backend `get_kv_cache_shape` / `get_kv_cache_stride_order` any more: every
backend's view has the logical shape [B, H, N, C] (v1/kv_cache_interface.py
`create_kv_cache_views`) and a backend states only which stride orders its kernels take
(`AttentionBackend.supported_kv_cache_layouts()`); the one in force is
`CacheConfig.get_resolved_kv_cache_layout()`, the same call the worker allocates with
(v1/worker/gpu_model_runner.py `initialize_kv_cache_tensors`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from dualpath_ray.runtime.vllm_engine.pages import DeclaredPages

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import AttentionBackend
    from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig
    from vllm.v1.kv_cache_layout import KVCacheLayout

LOG = logging.getLogger("dualpath_ray.vllm")


def declared_pages(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, layer_name: str) -> DeclaredPages | None:
    """What vLLM declares for `layer_name`'s pages, or None (logged) where this vLLM's config does
    not say it the way 0.32 does: PageCodec.detect then falls back to the view's shape."""
    try:
        return _read(vllm_config, kv_cache_config, layer_name)
    except (AttributeError, LookupError, ImportError, StopIteration, ValueError) as exc:
        LOG.warning("cannot read vLLM's declared KV layout of %s (%r): detecting it from the view's shape", layer_name, exc)
        return None


def _read(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, layer_name: str) -> DeclaredPages:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    layout = vllm_config.cache_config.get_resolved_kv_cache_layout()  # ValueError while unresolved
    backend = vllm_config.compilation_config.static_forward_context[layer_name].get_attn_backend()
    if kv_cache_config is None:
        raise LookupError("vLLM built the connector without its KVCacheConfig")
    group = next(g for g in kv_cache_config.kv_cache_groups if layer_name in g.layer_names)
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = spec.kv_cache_specs[layer_name]
    return declared_from(backend, layout, spec)


def declared_from(backend: type[AttentionBackend], layout: KVCacheLayout, spec: AttentionSpec) -> DeclaredPages:
    """DeclaredPages of an attention backend class, a KVCacheLayout and an AttentionSpec."""
    from vllm.v1.kv_cache_interface import KVQuantMode, MLAAttentionSpec

    # Packed content (per-token-head scales, head slots other than the KV heads, several tokens
    # per stored state) is not K and V of the model dtype, whatever kv_quant_mode says.
    packed = spec.state_content_bytes is not None or spec.num_head_slots is not None or spec.tokens_per_state != 1
    return DeclaredPages(
        backend=backend.get_name(),
        layout=layout.name,
        view_order=layout.layer_view_order,
        mla=bool(backend.is_mla()) or isinstance(spec, MLAAttentionSpec),
        quantized=spec.kv_quant_mode != KVQuantMode.NONE or packed,
        n_kv_head=spec.num_kv_heads,
        head_size=spec.head_size,
        head_size_v=spec.head_size_v,
    )
