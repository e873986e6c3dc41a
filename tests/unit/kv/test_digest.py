"""Token digests: the fast chunked sums give exactly the plain int64 formula's values."""

from __future__ import annotations

import pytest
import torch

from dualpath_ray.kv.digest import token_digests

MIX = 1_000_003


def reference_digests(rows: torch.Tensor) -> torch.Tensor:
    values = rows.to(torch.int64)
    weights = torch.arange(1, rows.shape[-1] + 1, dtype=torch.int64)
    return values.sum(dim=-1) + (values * weights).sum(dim=-1) * MIX


@pytest.mark.parametrize("width", [1, 7, 100, 256, 362, 576, 1152, 4096, 4099])
def test_digests_equal_the_int64_formula_for_every_row_width(width: int) -> None:
    generator = torch.Generator().manual_seed(width)
    rows = torch.randint(0, 256, (3, 5, width), dtype=torch.uint8, generator=generator)
    rows[0, 0] = 255  # the largest sums a row can have
    assert torch.equal(token_digests(rows), reference_digests(rows)), (
        f"width {width}: digests must not depend on how the sums are computed (every hop compares them)"
    )


def test_any_single_flipped_byte_changes_its_tokens_digest() -> None:
    rows = torch.randint(0, 256, (2, 1152), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    before = token_digests(rows)
    for position in (0, 1, 255, 256, 1151):
        damaged = rows.clone()
        damaged[1, position] ^= 0x01
        after = token_digests(damaged)
        assert after[0] == before[0], "an untouched token keeps its digest"
        assert after[1] != before[1], f"a flipped byte at {position} must change its token's digest"
