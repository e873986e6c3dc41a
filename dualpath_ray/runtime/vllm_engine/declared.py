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

from dualpath_ray.runtime.vllm_engine.pages import CPU_AMX, K_DIM_MAJOR, TOKEN_ROWS, DeclaredPages

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
    name = backend.get_name()
    return DeclaredPages(
        backend=name,
        layout=layout.name,
        view_order=layout.layer_view_order,
        mla=bool(backend.is_mla()) or isinstance(spec, MLAAttentionSpec),
        quantized=spec.kv_quant_mode != KVQuantMode.NONE or packed,
        n_kv_head=spec.num_kv_heads,
        head_size=spec.head_size,
        head_size_v=spec.head_size_v,
        content=_cpu_content(spec) if name == "CPU_ATTN" else TOKEN_ROWS,
    )


def _cpu_content(spec: AttentionSpec) -> str:
    """How vLLM's CPU attention keeps a head's page (pages.py, the module doc): its AMX kernels
    where vLLM 0.32 picks them (cpu_attn.py `_get_attn_isa`: bf16, a block size that is a
    multiple of 32, a head size that is not only a multiple of 16, a CPU with AMX tiles), its
    vector kernels' K [head_dim, tokens] then V [tokens, head_dim] otherwise."""
    import torch

    vector16 = spec.head_size % 32 != 0 and spec.head_size % 16 == 0
    amx = (
        not vector16 and spec.dtype == torch.bfloat16 and spec.block_size % 32 == 0
        and bool(torch.cpu._is_amx_tile_supported())
    )
    return CPU_AMX if amx else K_DIM_MAJOR
