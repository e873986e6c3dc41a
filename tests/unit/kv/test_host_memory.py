"""Host buffers say whether they are pinned and why not (kv/host_memory.py): a reader on a GPU
node whose GPUs were hidden from it must not fall back to unpinned memory silently. Pinning
itself needs CUDA: tests/gpu/test_pinned_pool.py."""

from __future__ import annotations

import os

import torch

from dualpath_ray.config import ModelConfig
from dualpath_ray.kv.host_memory import allocate_host_buffer, pinning_of
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.pool import BufferPool


def test_the_pinning_report_names_why_a_buffer_is_not_pinned() -> None:
    assert pinning_of(True, True, True, "0").pinned, "a pinned buffer is reported pinned"
    assert "pin_host_buffers is false" in pinning_of(False, False, True, None).detail, "not asked: says the setting"
    hidden = pinning_of(True, False, False, "")
    assert not hidden.pinned and "CUDA_VISIBLE_DEVICES is empty" in hidden.detail, (
        "GPUs hidden from the process (Ray's override on zero-GPU actors) are named as the reason"
    )
    assert "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO" in hidden.detail, "the report names the setting that hides them"
    assert "no CUDA device" in pinning_of(True, False, False, None).detail, "a CPU node says it has no CUDA"


def test_a_buffer_and_a_node_pool_carry_their_pinning_report() -> None:
    tensor, pinning = allocate_host_buffer((64,), pin=True)
    assert tensor.dtype == torch.uint8 and tensor.numel() == 64, "the buffer has the asked size"
    assert pinning.pinned == torch.cuda.is_available(), "pinned exactly where CUDA exists"
    pool = BufferPool(2, KVLayout.from_model(ModelConfig(), block_size=16), pin=True)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    assert pool.pinning == pinning_of(True, pool.pinned, torch.cuda.is_available(), visible), (
        "the pool keeps the report its reader shows in dualpath status"
    )
