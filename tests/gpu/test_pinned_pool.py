"""GPU-only checks: the host staging buffer is pinned where an accelerator exists, and Layer
Blocks copy to device memory and back byte for byte."""

from __future__ import annotations

import pytest
import torch

from dualpath_ray.config import ModelConfig
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.pool import BufferPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)"),
]


def test_pool_is_pinned_and_layer_blocks_round_trip_through_the_device():
    layout = KVLayout.from_model(ModelConfig(), block_size=64)
    pool = BufferPool(4, layout)
    assert pool.pinned and pool.buffer.is_pinned(), "with an accelerator the staging buffer is pinned"
    assert pool.pinning.detail.startswith("pinned"), f"its reader reports it pinned: {pool.pinning.detail}"
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8))
    extent = pool.lease("r", 2)
    views = [pool.full_block(slot)[1] for slot in extent.slots]
    device = [v.to("cuda", non_blocking=True) for v in views]
    torch.cuda.synchronize()
    assert all(torch.equal(d.cpu(), v) for d, v in zip(device, views)), "H2D of Layer Blocks is byte-exact"
