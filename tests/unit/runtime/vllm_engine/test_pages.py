"""PageCodec: token-major KV <-> a layer view of vLLM's pages, checked against a literal per-token
reference (no vLLM needed: the views are plain tensors; test_gpu_layouts.py builds them with vLLM's
own code for every backend and layout)."""

from __future__ import annotations

import pytest
import torch

from dualpath_ray.runtime.vllm_engine.pages import CPU_AMX, K_DIM_MAJOR, DeclaredPages, PageCodec

H, D, B, N = 2, 4, 8, 6  # KV heads, head dim, block size, pages


def cache_of(page_tokens: int = B) -> torch.Tensor:
    """A layer view [pages, H, tokens, K row + V row], N vLLM blocks of B tokens in pages of
    `page_tokens` (kernel blocks where smaller)."""
    return torch.randn(N * (B // page_tokens), H, page_tokens, 2 * D)


def literal_token(cache: torch.Tensor, block: int, slot: int) -> torch.Tensor:
    """One token's KV [2, H, D] read the slow way, straight from the view's definition: token
    `slot` of vLLM block `block` is in kernel page block * r + slot // tokens."""
    tokens = cache.shape[2]
    page, row = block * (B // tokens) + slot // tokens, slot % tokens
    kv = torch.empty(2, H, D)
    for h in range(H):
        for which in range(2):
            kv[which, h] = cache[page, h, row, which * D : (which + 1) * D]
    return kv


@pytest.mark.parametrize("page_tokens", [B, B // 2])
@pytest.mark.parametrize(("lo", "hi"), [(0, 24), (3, 5), (5, 21), (8, 16)])
def test_read_is_the_view_token_by_token(page_tokens: int, lo: int, hi: int) -> None:
    cache = cache_of(page_tokens)
    codec = PageCodec(H, D, B, page_tokens)
    table = [4, 0, 5]  # the request's pages, not in order
    got = codec.read(cache, table, lo, hi)
    for t in range(lo, hi):
        want = literal_token(cache, table[t // B], t % B)
        assert torch.equal(got[t - lo], want), f"token {t} (pages of {page_tokens}) reads as its K and V rows"


@pytest.mark.parametrize("page_tokens", [B, B // 2])
def test_write_changes_exactly_the_tokens_written(page_tokens: int) -> None:
    cache = cache_of(page_tokens)
    before = cache.clone()
    codec = PageCodec(H, D, B, page_tokens)
    table = [2, 3, 1]
    kv = torch.randn(11, 2, H, D)
    codec.write(cache, table, 6, 17, kv)
    assert torch.equal(codec.read(cache, table, 6, 17), kv), "what is written reads back bit for bit"
    for block in range(N):
        for slot in range(B):
            token = table.index(block) * B + slot if block in table else None
            if token is None or not 6 <= token < 17:
                assert torch.equal(literal_token(cache, block, slot), literal_token(before, block, slot)), (
                    f"block {block} slot {slot}, outside the written tokens, is untouched"
                )


def test_detect_from_the_shape_names_the_shape_it_cannot_place() -> None:
    assert PageCodec.detect(torch.empty(N, H, B, 2 * D), None, H, D, B) == PageCodec(H, D, B), (
        "a [blocks, H, block_size, 2D] view is vLLM's blocks"
    )
    assert PageCodec.detect(torch.empty(2 * N, H, B // 2, 2 * D), None, H, D, B) == PageCodec(H, D, B, B // 2), (
        "pages of a divisor of the block size are kernel blocks"
    )
    with pytest.raises(ValueError, match=r"\(6, 3, 8, 8\)"):
        PageCodec.detect(torch.empty(N, 3, B, 2 * D), None, H, D, B)
    with pytest.raises(ValueError, match=r"\(2, 6, 8, 2, 4\)"):
        PageCodec.detect(torch.empty(2, N, B, H, D), None, H, D, B)


def test_detect_refuses_what_vllm_declares_and_kv_cannot_be() -> None:
    view = torch.empty(N, H, B, 2 * D)
    plain = DeclaredPages("FLASH_ATTN", "LBHNC", (0, 1, 2, 3), False, False, H, D, D)
    assert PageCodec.detect(view, plain, H, D, B) == PageCodec(H, D, B), "a declared K/V view is read"
    refusals = {
        "is MLA": DeclaredPages("FLASHMLA", "LBHNC", (0, 1, 2, 3), True, False, 1, 576, 0),
        "quantized": DeclaredPages("FLASH_ATTN", "LBHNC", (0, 1, 2, 3), False, True, H, D, D),
        "declares 3 KV heads": DeclaredPages("FLASH_ATTN", "LBHNC", (0, 1, 2, 3), False, False, 3, D, D),
    }
    for reason, declared in refusals.items():
        with pytest.raises(ValueError, match=f"{declared.backend}.*{reason}"):
            PageCodec.detect(view, declared, H, D, B)


def test_cpu_attention_pages_are_read_k_by_dim_and_its_amx_pages_refused() -> None:
    """vLLM's CPU attention keeps a head's page as K [head_dim, tokens] then V [tokens,
    head_dim]: token t's K element i is element i * B + t of the head's page, its V row starts at
    B * D + t * D (csrc/cpu/cpu_attn_vec.hpp). Its AMX kernels pack the page otherwise: refused."""
    view = torch.arange(N * H * B * 2 * D, dtype=torch.float32).view(N, H, B, 2 * D)
    cpu = DeclaredPages("CPU_ATTN", "LBHNC", (0, 1, 2, 3), False, False, H, D, D, K_DIM_MAJOR)
    codec = PageCodec.detect(view, cpu, H, D, B)
    assert codec == PageCodec(H, D, B, 0, True), "the CPU backend's pages are read K by dim"
    kv = codec.read(view, [3], 0, B)
    page = view[3].reshape(H, -1)
    for t in (0, 5, B - 1):
        for h in range(H):
            assert torch.equal(kv[t, 0, h], page[h, torch.arange(D) * B + t]), f"token {t} head {h}: K by dim, column t"
            assert torch.equal(kv[t, 1, h], page[h, B * D + t * D : B * D + (t + 1) * D]), f"token {t} head {h}: V row t"
    amx = DeclaredPages("CPU_ATTN", "LBHNC", (0, 1, 2, 3), False, False, H, D, D, CPU_AMX)
    with pytest.raises(ValueError, match="CPU_ATTN runs its AMX kernels.*model.dtype"):
        PageCodec.detect(view, amx, H, D, B)


def test_ranges_outside_the_pages_are_refused() -> None:
    codec = PageCodec(H, D, B)
    with pytest.raises(ValueError, match="not inside 2 pages"):
        codec.read(cache_of(), [0, 1], 10, 17)
