"""PageCodec: token-major KV <-> vLLM's page layouts, checked against a literal per-token
reference of each layout (no vLLM needed: the layouts are plain tensors)."""

from __future__ import annotations

import pytest
import torch

from dualpath_ray.runtime.vllm_engine.pages import PageCodec

H, D, B, N = 2, 4, 8, 6  # KV heads, head dim, block size, pages


def cache_of(layout: str) -> torch.Tensor:
    shapes = {"head_major": (N, H, B, 2 * D), "kv_first": (2, N, B, H, D), "blocks_first": (N, 2, B, H, D)}
    return torch.randn(shapes[layout])


def literal_token(cache: torch.Tensor, layout: str, page: int, slot: int) -> torch.Tensor:
    """One token's KV [2, H, D] read the slow way, straight from the layout's definition."""
    kv = torch.empty(2, H, D)
    for h in range(H):
        for which in range(2):
            if layout == "head_major":
                kv[which, h] = cache[page, h, slot, which * D : (which + 1) * D]
            elif layout == "kv_first":
                kv[which, h] = cache[which, page, slot, h]
            else:
                kv[which, h] = cache[page, which, slot, h]
    return kv


@pytest.mark.parametrize("layout", ["head_major", "kv_first", "blocks_first"])
@pytest.mark.parametrize(("lo", "hi"), [(0, 24), (3, 5), (5, 21), (8, 16)])
def test_read_is_the_layout_token_by_token(layout: str, lo: int, hi: int) -> None:
    cache = cache_of(layout)
    codec = PageCodec(layout, H, D, B)
    table = [4, 0, 5]  # the request's pages, not in order
    got = codec.read(cache, table, lo, hi)
    for t in range(lo, hi):
        want = literal_token(cache, layout, table[t // B], t % B)
        assert torch.equal(got[t - lo], want), f"token {t} of a {layout} cache reads as its K and V rows"


@pytest.mark.parametrize("layout", ["head_major", "kv_first", "blocks_first"])
def test_write_changes_exactly_the_tokens_written(layout: str) -> None:
    cache = cache_of(layout)
    before = cache.clone()
    codec = PageCodec(layout, H, D, B)
    table = [2, 3, 1]
    kv = torch.randn(11, 2, H, D)
    codec.write(cache, table, 6, 17, kv)
    assert torch.equal(codec.read(cache, table, 6, 17), kv), "what is written reads back bit for bit"
    for page in range(N):
        for slot in range(B):
            token = table.index(page) * B + slot if page in table else None
            if token is None or not 6 <= token < 17:
                assert torch.equal(literal_token(cache, layout, page, slot), literal_token(before, layout, page, slot)), (
                    f"page {page} slot {slot}, outside the written tokens, is untouched"
                )


def test_detect_names_the_shape_it_cannot_place() -> None:
    assert PageCodec.detect(torch.empty(N, H, B, 2 * D), H, D, B, on_cpu=True).layout == "head_major"
    assert PageCodec.detect(torch.empty(2, N, B, H, D), H, D, B, on_cpu=False).layout == "kv_first"
    assert PageCodec.detect(torch.empty(N, 2, B, H, D), H, D, B, on_cpu=False).layout == "blocks_first"
    with pytest.raises(ValueError, match=r"\(6, 3, 8, 8\)"):
        PageCodec.detect(torch.empty(N, 3, B, 2 * D), H, D, B, on_cpu=True)


def test_ranges_outside_the_pages_are_refused() -> None:
    codec = PageCodec("kv_first", H, D, B)
    with pytest.raises(ValueError, match="not inside 2 pages"):
        codec.read(cache_of("kv_first"), [0, 1], 10, 17)
