"""PageCodec on the views vLLM 0.32 hands a connector on a GPU, built here on the CPU by vLLM's own
code, for each attention backend and each KV cache layout it may run under:

- the backend class's spec adjustments (v1/worker/utils.py `customize_attention_spec`) and the
  layouts it declares (v1/attention/backends/utils.py `get_supported_kv_cache_layouts`, the
  engine core's input when it resolves the model's layout);
- the KV cache placement of the engine core (v1/core/kv_cache_utils.py
  `get_kv_cache_config_from_groups`, under a default VllmConfig whose layout is set the way
  `resolve_kv_cache_layout` records it);
- the worker's allocation and per-layer views (v1/worker/utils.py `allocate_kv_cache`, what
  v1/worker/gpu_model_runner.py `initialize_kv_cache` passes to `register_kv_caches`).

The codec's reads and writes are checked against a literal per-token reference that takes K and V
out of a view exactly as the backends' kernels do (flash_attn.py `FlashAttentionImpl.forward`:
`key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)`, the same in
flashinfer.py, triton_attn.py and flex_attention.py), token by token; for the CPU backend as
cpu_attn.py splits a page (`kv_cache.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)`)
and its vector kernels address it (csrc/cpu/cpu_attn_vec.hpp `reshape_and_cache`: K element
(token t, dim i) at i * block_size + t of the head's K half, V row-major).
"""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import VllmConfig
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MLAAttentionSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache, customize_attention_spec

from dualpath_ray.runtime.vllm_engine.declared import declared_from
from dualpath_ray.runtime.vllm_engine.pages import CPU_AMX, PageCodec

H, D, B, N, L = 2, 32, 16, 6, 2  # KV heads, head dim, block size, blocks, layers
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(L)]

KV_BACKENDS = {
    "FLASH_ATTN": ("vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend"),
    "FLASHINFER": ("vllm.v1.attention.backends.flashinfer", "FlashInferBackend"),
    "TRITON_ATTN": ("vllm.v1.attention.backends.triton_attn", "TritonAttentionBackend"),
    "FLEX_ATTENTION": ("vllm.v1.attention.backends.flex_attention", "FlexAttentionBackend"),
    "CPU_ATTN": ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackend"),
}
MLA_BACKENDS = {
    "FLASHMLA": ("vllm.v1.attention.backends.mla.flashmla", "FlashMLABackend"),
    "TRITON_MLA": ("vllm.v1.attention.backends.mla.triton_mla", "TritonMLABackend"),
    "CUTLASS_MLA": ("vllm.v1.attention.backends.mla.cutlass_mla", "CutlassMLABackend"),
    "FLASH_ATTN_MLA": ("vllm.v1.attention.backends.mla.flashattn_mla", "FlashAttnMLABackend"),
    "FLASHINFER_MLA": ("vllm.v1.attention.backends.mla.flashinfer_mla", "FlashInferMLABackend"),
}


def backend_class(name: str, where: dict[str, tuple[str, str]]) -> type:
    """The installed vLLM's backend class; a skip naming why where its module needs a GPU stack
    to import (FlashInfer's package, CUDA kernels)."""
    module, cls = where[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except (ImportError, AssertionError, RuntimeError) as exc:
        pytest.skip(f"{name}: {module} does not import without a GPU stack ({type(exc).__name__}: {exc})")


def vllm_views(
    config: VllmConfig, backend: type, spec: AttentionSpec, layout: KVCacheLayout, kernel_block_size: int
) -> tuple[AttentionSpec, dict[str, torch.Tensor]]:
    """The backend's spec and the per-layer views vLLM's worker registers with a connector, over
    a backing buffer of random values (finite, so equality is bitwise)."""
    spec = customize_attention_spec(backend, spec)
    config.cache_config.kv_cache_layout = layout.name
    config.cache_config.num_gpu_blocks_override = N
    kv_cache_config = get_kv_cache_config_from_groups(config, [KVCacheGroupSpec(list(LAYERS), spec)], N * L * spec.page_size_bytes)
    views = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout, [kernel_block_size])
    raw_of(views).view(spec.dtype).normal_()
    return spec, views


def raw_of(views: dict[str, torch.Tensor]) -> torch.Tensor:
    """The one int8 backing buffer every layer view of `views` shares."""
    storage = next(iter(views.values())).untyped_storage()
    return torch.empty(0, dtype=torch.int8).set_(storage)


def kernel_caches(view: torch.Tensor, head_size: int, cpu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches [pages, tokens, H, D] as the backend's kernels address the view: the GPU
    backends' transpose(1, 2) split at head_size; the CPU backend's page split in halves, its K
    half [head_dim, tokens] per head (K element (t, i) at i * tokens + t), its V half row-major."""
    if not cpu:
        return view.transpose(1, 2).split(head_size, dim=-1)  # type: ignore[return-value]
    pages, heads, tokens, _ = view.shape
    key_half, value_half = view.view(pages, heads, 2 * tokens, head_size).chunk(2, dim=2)
    keys = key_half.reshape(pages, heads, tokens * head_size).unflatten(-1, (head_size, tokens))
    assert keys.data_ptr() == key_half.data_ptr() and keys._base is not None, "the K half is addressed in place"
    return keys.permute(0, 3, 1, 2), value_half.transpose(1, 2)


def literal_kv(view: torch.Tensor, block: int, slot: int, head_size: int, cpu: bool = False) -> torch.Tensor:
    """Token `slot` of vLLM block `block` as [2, H, D], taken out of the view as the kernels do
    (`kernel_caches`); kernel block b * r + slot // tokens where pages are kernel blocks."""
    key_cache, value_cache = kernel_caches(view, head_size, cpu)
    tokens = view.shape[2]
    page, row = block * (B // tokens) + slot // tokens, slot % tokens
    kv = torch.empty(2, view.shape[1], head_size, dtype=view.dtype)
    for h in range(view.shape[1]):
        kv[0, h] = key_cache[page, row, h]
        kv[1, h] = value_cache[page, row, h]
    return kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel_block_size", [B, B // 2])
@pytest.mark.parametrize("name", list(KV_BACKENDS))
def test_codec_reads_and_writes_the_views_vllm_registers(
    vllm_config: VllmConfig, name: str, kernel_block_size: int, dtype: torch.dtype
) -> None:
    """Every layout the backend declares (all of them where it declares none). Pages of half a
    block are the kernel blocks vLLM splits a block into for a backend with fixed kernel block
    sizes (FlashInfer's 16/32/64 under a block of 128), only where a block is one dense page of a
    layer (LBHNC, LBNHC): block-outer layouts keep whole blocks (v1/worker/utils.py
    `prepare_kernel_block_sizes`) and LHBNC cannot be split (v1/kv_cache_interface.py
    `create_kv_cache_views` refuses it)."""
    backend = backend_class(name, KV_BACKENDS)
    for layout in splittable_layouts(backend, kernel_block_size):
        check_layout(vllm_config, backend, name, layout, kernel_block_size, dtype)


def splittable_layouts(backend: type, kernel_block_size: int) -> list[KVCacheLayout]:
    """The layouts the backend declares that vLLM can build with pages of `kernel_block_size`
    tokens: all of them for whole blocks (B), only the layer- and block-compact ones for half a
    block (see the test above)."""
    return [
        x for x in get_supported_kv_cache_layouts([backend])
        if kernel_block_size == B or (x.is_layer_compact and x.is_block_compact)
    ]


def check_layout(
    vllm_config: VllmConfig, backend: type, name: str, layout: KVCacheLayout, kernel_block_size: int, dtype: torch.dtype
) -> None:
    spec, views = vllm_views(
        vllm_config, backend, FullAttentionSpec(block_size=B, num_kv_heads=H, head_size=D, dtype=dtype), layout, kernel_block_size
    )
    case = f"{name} {layout.name} {dtype} pages of {kernel_block_size}"
    declared = declared_from(backend, layout, spec)
    cpu = name == "CPU_ATTN"
    if cpu and declared.content == CPU_AMX:
        pytest.skip(f"{case}: vLLM's CPU attention would run its AMX kernels on this CPU, which the codec refuses")
    codecs = {PageCodec.detect(view, declared, H, D, B) for view in views.values()}
    assert codecs == {PageCodec(H, D, B, 0 if kernel_block_size == B else kernel_block_size, cpu)}, (
        f"{case}: every layer view is detected as [B, H, N, C] in pages of the kernel block size, K by dim on the CPU"
    )
    codec = codecs.pop()
    table, lo, hi = [4, 0, 5], 3, 45  # a request's vLLM blocks, out of order; tokens across all three
    layer = views[LAYERS[1]]
    got = codec.read(layer, table, lo, hi)
    for t in range(lo, hi):
        assert torch.equal(got[t - lo], literal_kv(layer, table[t // B], t % B, D, cpu)), (
            f"{case}: token {t} reads as the K and V the kernels see for it"
        )

    raw_before = raw_of(views).clone()
    kv = torch.randn(hi - lo, 2, H, D, dtype=dtype)
    codec.write(layer, table, lo, hi, kv)
    for t in range(lo, hi):
        assert torch.equal(literal_kv(layer, table[t // B], t % B, D, cpu), kv[t - lo]), (
            f"{case}: token {t} written is the K and V the kernels read for it"
        )
    # The same write through the kernels' own K and V caches, on the bytes as they were: the
    # codec changed exactly those bytes (nothing of other tokens, other layers, or padding).
    raw_of(views).copy_(raw_before)
    key_cache, value_cache = kernel_caches(layer, D, cpu)
    tokens = layer.shape[2]
    for t in range(lo, hi):
        block, slot = table[t // B], t % B
        page, row = block * (B // tokens) + slot // tokens, slot % tokens
        key_cache[page, row] = kv[t - lo, 0]
        value_cache[page, row] = kv[t - lo, 1]
    want = raw_of(views).clone()
    raw_of(views).copy_(raw_before)
    codec.write(layer, table, lo, hi, kv)
    assert torch.equal(raw_of(views), want), f"{case}: a write changes exactly the written tokens' K and V bytes"


def test_a_view_whose_axes_disagree_with_the_declared_layout_is_refused(vllm_config: VllmConfig) -> None:
    """With as many KV heads as tokens in a block the shape cannot tell [B, H, N, C] from
    [B, N, H, C]: the declared layout's strides do."""
    backend = backend_class("FLASH_ATTN", KV_BACKENDS)
    layout = KVCacheLayout.LBNHC
    spec, views = vllm_views(
        vllm_config, backend, FullAttentionSpec(block_size=B, num_kv_heads=B, head_size=D, dtype=torch.float32), layout, B
    )
    view = views[LAYERS[0]]
    declared = declared_from(backend, layout, spec)
    assert PageCodec.detect(view, declared, B, D, B) == PageCodec(B, D, B), "vLLM's own view is read"
    swapped = view.transpose(1, 2)
    assert swapped.shape == view.shape, "the swapped view has the very same shape"
    with pytest.raises(ValueError, match="does not follow its declared layout LBNHC"):
        PageCodec.detect(swapped, declared, B, D, B)


@pytest.mark.parametrize("name", list(MLA_BACKENDS))
def test_mla_backends_are_refused_naming_the_backend(vllm_config: VllmConfig, name: str) -> None:
    backend = backend_class(name, MLA_BACKENDS)
    layout = get_supported_kv_cache_layouts([backend])[0]
    kv_lora_rank, rope_dim = 512, 64
    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=kv_lora_rank + rope_dim, dtype=torch.bfloat16)
    spec, views = vllm_views(vllm_config, backend, spec, layout, 64)
    view = views[LAYERS[0]]
    assert tuple(view.shape) == (N, 1, 64, kv_lora_rank + rope_dim), (
        f"{name}: an MLA layer is one latent of kv_lora_rank + rope dims per token"
    )
    declared = declared_from(backend, layout, spec)
    with pytest.raises(ValueError, match=f"{name} is MLA"):
        PageCodec.detect(view, declared, 1, kv_lora_rank + rope_dim, 64)
