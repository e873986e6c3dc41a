"""When a layer's computed KV may be sent: an event recorded after the layer's compute and
waited on before its transfer is posted.

On CUDA the forward of a layer only queues kernels; the host returns before they ran. A transport
that reads the window's HBM itself (nixl or verbs with GPUDirect RDMA, `runtime.hbm_moves:
transport`) would then send whatever the slot held before: nothing else orders the compute before
the NIC's read (with `runtime.kv_digests` on, the digest's copy to the host happened to). So the
pipeline records a CUDA event on the compute stream after each layer and the host waits on it
before posting that layer's write. On the CPU the forward has run when it returns, and the event
is a no-op.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch


class KVReady(Protocol):
    """Marks the point in the compute stream after which one layer's KV is complete."""

    def record(self) -> None:
        """Called right after the layer's compute was issued."""

    def wait(self) -> None:
        """Blocks the host until everything issued before `record` has finished."""


class HostKVReady:
    """The CPU: the compute ran synchronously on this thread, so its KV is complete already."""

    def record(self) -> None:
        return None

    def wait(self) -> None:
        return None


class CudaKVReady:
    """A CUDA event on the current stream (the one the layer's kernels were issued on)."""

    def __init__(self) -> None:
        self._event = torch.cuda.Event()

    def record(self) -> None:
        self._event.record()

    def wait(self) -> None:
        self._event.synchronize()


def kv_ready_for(device: torch.device) -> Callable[[], KVReady]:
    """A factory of one event per layer for a window on `device`."""
    return CudaKVReady if device.type == "cuda" else HostKVReady
