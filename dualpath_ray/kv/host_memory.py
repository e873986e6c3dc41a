"""Host buffers that the DMA engines of GPUs and NICs can use directly: allocated once, pinned.

A node's staging buffer is allocated once for the process's life. Where CUDA is present it is
page-locked in place with cudaHostRegister rather than allocated through torch's pinned
allocator, which rounds every allocation up to a power of two (an 80 GB buffer would take 128 GB)
and keeps freed blocks cached. Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone for actors that ask for
no GPU (ray issue 54868), so a node's reader actor sees the node's GPUs and can pin; on a machine
without CUDA nothing is pinned (torch raises on pin_memory there).
"""

from __future__ import annotations

import torch


def pinning_available() -> bool:
    return torch.cuda.is_available()


def allocate_host_buffer(shape: tuple[int, ...], pin: bool) -> tuple[torch.Tensor, bool]:
    """A uint8 host tensor of `shape`; pinned in place when asked and CUDA exists. Returns
    (tensor, pinned)."""
    tensor = torch.empty(shape, dtype=torch.uint8)
    if not (pin and pinning_available()) or tensor.numel() == 0:
        return tensor, False
    status = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)
    if int(status) != 0:
        raise RuntimeError(
            f"cudaHostRegister of a {tensor.numel()} byte host buffer failed (cudaError {int(status)}); "
            "lower cluster.buffer_blocks_per_node or set cluster.pin_host_buffers: false"
        )
    return tensor, True


def release_host_buffer(tensor: torch.Tensor, pinned: bool) -> None:
    """Undo the pinning of a buffer from allocate_host_buffer (before the tensor is dropped)."""
    if pinned:
        torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
