"""Host buffers that the DMA engines of GPUs and NICs can use directly: allocated once, pinned.

A node's staging buffer is allocated once for the process's life. Where CUDA is present it is
page-locked in place with cudaHostRegister rather than allocated through torch's pinned
allocator, which rounds every allocation up to a power of two (an 80 GB buffer would take 128 GB)
and keeps freed blocks cached. Memory pinned in place must be unpinned (cudaHostUnregister)
before it is freed, and memory allocated again must be pinned again: `HostPinning` does both, and
the engines' sleep/wake (runtime/engine/hbm_moves.py) goes through it.

A reader actor asks Ray for no GPU. Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone for such actors
(ray issue 54868) unless RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1, which hides every GPU from them
(CUDA_VISIBLE_DEVICES=""); the deployment sets it to 0 for readers (runtime/placement/topology.py),
so on a GPU node the reader sees the node's GPUs and pins. Where nothing can be pinned (no CUDA:
torch raises on pin_memory there) the buffer is plain memory, and `Pinning.detail` says why, which
the reader reports (`dualpath status`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


def pinning_available() -> bool:
    return torch.cuda.is_available()


@dataclass(frozen=True)
class Pinning:
    """Whether a host buffer is page-locked, and why (not)."""

    pinned: bool
    detail: str


def pinning_of(asked: bool, pinned: bool, cuda_available: bool, visible_devices: str | None) -> Pinning:
    """How a buffer's pinning is reported: pinned, not asked for, or the reason CUDA was missing
    (GPUs hidden from the process, or none at all)."""
    if pinned:
        return Pinning(True, "pinned (cudaHostRegister)")
    if not asked:
        return Pinning(False, "not pinned: cluster.pin_host_buffers is false")
    if not cuda_available and visible_devices is not None and not visible_devices.strip():
        return Pinning(False, "not pinned: CUDA_VISIBLE_DEVICES is empty in this process, so no GPU is visible "
                              "(is RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1 set where Ray started?)")
    if not cuda_available:
        return Pinning(False, "not pinned: no CUDA device in this process (a CPU node, or torch without CUDA)")
    return Pinning(False, "not pinned: the buffer is empty")


class HostPinning:
    """Pins host tensors in place and unpins them; every method is a no-op without CUDA."""

    def pin(self, tensor: torch.Tensor) -> bool:
        """Page-lock the tensor's memory in place; False where CUDA is absent or it is empty."""
        if not pinning_available() or tensor.numel() == 0:
            return False
        nbytes = tensor.numel() * tensor.element_size()
        status = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
        if int(status) != 0:
            raise RuntimeError(
                f"cudaHostRegister of a {nbytes} byte host buffer failed (cudaError {int(status)}); "
                "lower cluster.buffer_blocks_per_node or set cluster.pin_host_buffers: false"
            )
        return True

    def unpin(self, tensor: torch.Tensor, pinned: bool) -> None:
        """Undo `pin` (before the memory is freed or resized: a freed range left registered
        stays locked and poisons a later registration of the same addresses)."""
        if pinned:
            torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


def allocate_host_buffer(
    shape: tuple[int, ...], pin: bool, pinning: HostPinning | None = None, alignment: int = 1
) -> tuple[torch.Tensor, Pinning]:
    """A uint8 host tensor of `shape` starting at an address that is a multiple of `alignment`
    (a power of two); pinned in place when asked and CUDA exists. Returns (tensor, how it is
    pinned).

    An alignment over torch's own (64 bytes) is met by allocating alignment - 1 bytes more and
    viewing the tensor from the first aligned address: a store reads into the buffer's slots
    with O_DIRECT (kv/direct_io.py), which needs 4096."""
    if alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    nbytes = 1
    for dim in shape:
        nbytes *= dim
    raw = torch.empty(nbytes + alignment - 1, dtype=torch.uint8)
    start = -raw.data_ptr() % alignment
    tensor = raw[start : start + nbytes].view(shape)
    pinned = (pinning or HostPinning()).pin(tensor) if pin else False
    return tensor, pinning_of(pin, pinned, pinning_available(), os.environ.get("CUDA_VISIBLE_DEVICES"))


def release_host_buffer(tensor: torch.Tensor, pinned: bool) -> None:
    """Undo the pinning of a buffer from allocate_host_buffer (before the tensor is dropped)."""
    HostPinning().unpin(tensor, pinned)
