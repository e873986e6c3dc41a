"""GPU-only: the prefill pipeline's event (runtime/prefill/kv_ready.py) holds the host until
the layer's queued kernels have run, so a transport that reads HBM outside the compute stream
(GPUDirect RDMA) finds the layer's KV written."""

from __future__ import annotations

import pytest
import torch

from dualpath_ray.runtime.prefill.kv_ready import CudaKVReady, kv_ready_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)"),
]


def test_waiting_on_the_event_means_the_layers_kernels_have_written_the_slot() -> None:
    assert kv_ready_for(torch.device("cuda", 0)) is CudaKVReady, "a CUDA window gets CUDA events"
    slot = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # a slow layer: the host returns long before the GPU is done
    slot.fill_(7)
    event = CudaKVReady()
    event.record()
    assert not torch.cuda.current_stream().query(), "the compute is still queued when the host posts"
    event.wait()
    assert torch.cuda.current_stream().query(), "after the wait every kernel before the event has run"
    reader = torch.cuda.Stream()  # reads outside the compute stream, as a NIC does
    host = torch.empty(slot.shape, dtype=torch.uint8, pin_memory=True)
    with torch.cuda.stream(reader):
        host.copy_(slot, non_blocking=True)
    reader.synchronize()
    assert bool((host == 7).all()), "what a reader outside the stream sees is the layer's KV"
