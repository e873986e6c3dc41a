"""GPU-only: sleep with `runtime.hbm_moves: cuda_copy` frees the HBM pool and its pinned mirror
(unpinned first), and wake gives back both, the mirror pinned again (runtime/engine/hbm_moves.py)."""

from __future__ import annotations

import pytest
import torch

from dualpath_ray.runtime.engine.hbm_moves import HbmMoves
from dualpath_ray.runtime.transport.factory import make_transport
from dualpath_ray.runtime.transport.moves import Region

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)"),
]

ME = "decode/d0/g0"
POOL_BYTES = 256 << 20


def test_sleep_frees_hbm_and_the_mirror_and_wake_restores_them_pinned() -> None:
    transport = make_transport("gloo", ME, namespace="dualpath")
    moves = HbmMoves("cuda_copy", transport)
    buffer = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    hbm = torch.zeros(POOL_BYTES, dtype=torch.uint8, device="cuda")
    transport.register("buffer", buffer)
    moves.register("hbm", hbm)
    transport.seal()
    mirror = transport.view(Region("hbm", 0, 16))
    assert mirror.is_pinned() and moves.mirrors_pinned() == {"hbm": True}, "the mirror starts pinned"
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    freed = moves.release_memory()
    free_asleep = torch.cuda.mem_get_info()[0]
    assert freed >= 2 * POOL_BYTES, f"sleep counts the HBM pool and its mirror ({freed} bytes)"
    assert free_asleep - free_before >= POOL_BYTES * 0.95, (
        f"sleep gives the pool's HBM back to the driver: free {free_before} -> {free_asleep}"
    )
    moves.restore_memory()
    assert torch.cuda.mem_get_info()[0] <= free_asleep - POOL_BYTES * 0.95, "wake allocates the pool's HBM again"
    assert transport.view(Region("hbm", 0, 16)).is_pinned() and moves.mirrors_pinned() == {"hbm": True}, (
        "the reallocated mirror is pinned again (it was unpinned before being freed, so pinning it succeeds)"
    )
    moves.transport_port().read(ME, [(Region("hbm", 4096, 1024), Region("buffer", 1024, 1024))]).wait()
    assert torch.equal(hbm[4096:5120].cpu(), buffer[1024:2048]), "after wake reads land in HBM byte for byte"
    assert moves.release_memory() >= 2 * POOL_BYTES, "a second sleep frees the woken memory again"
