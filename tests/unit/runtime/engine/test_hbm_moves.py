"""`runtime.hbm_moves` (runtime/engine/hbm_moves.py) without a GPU: the cuda_copy staging logic is the
same for any device, so CPU pools are staged here ("cpu" in staged_devices) and every byte checked;
on a GPU machine tests/gpu/device_check.py runs both modes through the whole runtime."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from dualpath_ray.kv.host_memory import HostPinning
from dualpath_ray.runtime.engine.hbm_moves import HbmMoves, merged_ranges
from dualpath_ray.runtime.engine.ports import Ready
from dualpath_ray.runtime.transport.moves import Region, TransportError
from dualpath_ray.runtime.transport.factory import make_transport

ME = "decode/d0/g0"


def staged_engine() -> tuple[HbmMoves, torch.Tensor, torch.Tensor]:
    """A transport with a host "buffer" and an engine pool "hbm" staged through a host mirror."""
    transport = make_transport("gloo", ME, namespace="dualpath")
    moves = HbmMoves("cuda_copy", transport, staged_devices=frozenset({"cpu"}))
    buffer = torch.arange(256, dtype=torch.int32).view(torch.uint8)[:512].clone()
    hbm = torch.zeros(512, dtype=torch.uint8)
    transport.register("buffer", buffer)
    moves.register("hbm", hbm)
    transport.seal()
    return moves, buffer, hbm


def test_transport_mode_registers_engine_pools_directly() -> None:
    transport = make_transport("gloo", ME, namespace="dualpath")
    moves = HbmMoves("transport", transport)
    pool = torch.zeros(64, dtype=torch.uint8)
    moves.register("hbm", pool)
    transport.seal()
    assert transport.view(Region("hbm", 0, 8)).data_ptr() == pool.data_ptr(), "the transport addresses the pool itself"
    assert moves.transport_port() is transport, "the core uses the transport unchanged"
    with pytest.raises(TransportError, match="unknown mode"):
        HbmMoves("dma", transport)


def test_cuda_copy_read_lands_in_the_mirror_then_in_the_pool() -> None:
    moves, buffer, hbm = staged_engine()
    pairs = [(Region("hbm", 0, 16), Region("buffer", 64, 16)), (Region("hbm", 16, 16), Region("buffer", 200, 16))]
    pending = moves.transport_port().read(ME, pairs)
    assert pending.done() and pending.wait() == 32, "the staged read completes and reports its bytes"
    assert torch.equal(hbm[:16], buffer[64:80]) and torch.equal(hbm[16:32], buffer[200:216]), (
        "the bytes reached the engine's own pool, not only the mirror"
    )
    assert moves.stats.h2d_bytes == 32 and moves.stats.copies == 1, "one copy for the two adjacent local ranges"
    assert torch.equal(moves.view(Region("hbm", 0, 32)), hbm[:32]), "view() shows the engine's pool"


def test_cuda_copy_write_copies_the_pool_out_before_sending() -> None:
    moves, buffer, hbm = staged_engine()
    hbm[100:140] = torch.arange(40, dtype=torch.uint8)
    moves.transport_port().write(ME, [(Region("hbm", 100, 40), Region("buffer", 0, 40))]).wait()
    assert torch.equal(buffer[:40], hbm[100:140]), "what was computed in the pool is what is sent"
    assert moves.stats.d2h_bytes == 40, "one D2H of the written range"


class _Readers:
    """A ReaderPort stand-in that records what the mirror held when a page pull was asked."""

    def __init__(self, moves: HbmMoves) -> None:
        self.moves = moves
        self.seen: list[bytes] = []

    def persist_pages(self, node_id: str, owner: str, blocks: Sequence[tuple[int, Any]], paged: Any = None) -> Ready[int]:
        mirror = self.moves.transport.view(Region("hbm", 64, 64))
        self.seen.append(mirror.numpy().tobytes())
        return Ready(len(blocks))


def test_a_page_pull_finds_the_page_in_the_mirror() -> None:
    moves, _, hbm = staged_engine()
    readers = _Readers(moves)
    port = moves.readers_port(readers, page_bytes=64, pool="hbm")  # type: ignore[arg-type]
    hbm[64:128] = 7
    assert port.persist_pages("d0", "r#0", [(1, "block")]).wait() == 1, "the call reaches the reader"
    assert readers.seen == [bytes([7]) * 64], "page 1 was copied to the mirror before the reader was asked"


class _RecordingPinning(HostPinning):
    """Pins nothing; records each pin and unpin with the address and the bytes alive there then."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, int]] = []

    def pin(self, tensor: torch.Tensor) -> bool:
        self.events.append(("pin", tensor.data_ptr(), tensor.untyped_storage().nbytes()))
        return True

    def unpin(self, tensor: torch.Tensor, pinned: bool) -> None:
        if pinned:
            self.events.append(("unpin", tensor.data_ptr(), tensor.untyped_storage().nbytes()))


def test_sleep_frees_the_pool_and_its_mirror_and_wake_pins_the_new_mirror() -> None:
    transport = make_transport("gloo", ME, namespace="dualpath")
    pinning = _RecordingPinning()
    moves = HbmMoves("cuda_copy", transport, staged_devices=frozenset({"cpu"}), pinning=pinning)
    buffer = torch.arange(256, dtype=torch.int32).view(torch.uint8)[:512].clone()
    hbm = torch.full((512,), 5, dtype=torch.uint8)
    transport.register("buffer", buffer)
    moves.register("hbm", hbm)
    transport.seal()
    (_, mirror_at, mirror_bytes), = pinning.events
    freed = moves.release_memory()
    assert hbm.untyped_storage().nbytes() == 0, "sleep frees the engine's own pool (HBM on a GPU), not only its mirror"
    assert pinning.events[1] == ("unpin", mirror_at, mirror_bytes), (
        "the mirror is unpinned at its old address while its memory still exists, before it is freed"
    )
    assert freed == 2 * 512 + 512, "the bytes freed count the pool, its mirror and the directly registered buffer"
    assert moves.mirrors_pinned() == {"hbm": False}, "a sleeping engine's mirror is not pinned"
    moves.restore_memory()
    assert hbm.untyped_storage().nbytes() == 512 and not bool(hbm.any()), "wake gives the pool zeroed memory again"
    assert pinning.events[2][0] == "pin" and pinning.events[2][2] == 512, "the reallocated mirror is pinned again"
    assert moves.mirrors_pinned() == {"hbm": True}, "the woken engine reports its mirror pinned"
    buffer[64:80] = torch.arange(1, 17, dtype=torch.uint8)
    moves.transport_port().read(ME, [(Region("hbm", 0, 16), Region("buffer", 64, 16))]).wait()
    assert torch.equal(hbm[:16], buffer[64:80]), "after wake a read lands in the restored pool through the new mirror"


def test_sleep_in_transport_mode_frees_the_registered_pool_itself() -> None:
    transport = make_transport("gloo", ME, namespace="dualpath")
    moves = HbmMoves("transport", transport)
    pool = torch.ones(64, dtype=torch.uint8)
    moves.register("hbm", pool)
    transport.seal()
    assert moves.release_memory() == 64 and pool.untyped_storage().nbytes() == 0, "the pool's memory is freed"
    assert moves.release_memory() == 0, "a second sleep frees nothing more"
    moves.restore_memory()
    assert pool.untyped_storage().nbytes() == 64 and not bool(pool.any()), "wake restores it zeroed"


def test_sleep_keeps_a_pool_the_engine_does_not_own() -> None:
    """A compute's own KV pages (vLLM's, registered so prompts land in them) are the compute's to
    free: sleep deregisters them but keeps their bytes (vLLM's prefix cache still names them)."""
    transport = make_transport("gloo", ME, namespace="dualpath")
    moves = HbmMoves("transport", transport)
    ours, vllms = torch.ones(64, dtype=torch.uint8), torch.full((32,), 7, dtype=torch.uint8)
    moves.register("hbm", ours)
    moves.register("compute_kv", vllms, owned=False)
    transport.seal()
    assert moves.release_memory() == 64, "only the engine's own pool is freed"
    assert vllms.untyped_storage().nbytes() == 32 and bool((vllms == 7).all()), "the compute's pages keep their bytes"
    moves.restore_memory()
    assert bool((vllms == 7).all()) and transport.view(Region("compute_kv", 0, 32)).numel() == 32, (
        "after wake the compute's pages are registered again, unchanged"
    )


def test_merged_ranges_union_overlapping_and_adjacent_regions_per_pool() -> None:
    regions = [Region("a", 10, 5), Region("a", 0, 10), Region("b", 0, 4), Region("a", 12, 10), Region("a", 40, 1)]
    assert merged_ranges(regions) == {"a": [(0, 22), (40, 41)], "b": [(0, 4)]}, "sorted unions per pool"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)")
def test_cuda_copy_moves_bytes_into_and_out_of_gpu_memory() -> None:
    transport = make_transport("gloo", ME, namespace="dualpath")
    moves = HbmMoves("cuda_copy", transport)
    buffer = torch.randint(0, 256, (1024,), dtype=torch.uint8)
    hbm = torch.zeros(1024, dtype=torch.uint8, device="cuda")
    transport.register("buffer", buffer)
    moves.register("hbm", hbm)
    transport.seal()
    moves.transport_port().read(ME, [(Region("hbm", 0, 256), Region("buffer", 512, 256))]).wait()
    assert torch.equal(hbm[:256].cpu(), buffer[512:768]), "H2D after the read: the bytes are in GPU memory"
    hbm[256:512] = 9
    moves.transport_port().write(ME, [(Region("hbm", 256, 256), Region("buffer", 0, 256))]).wait()
    assert bool((buffer[:256] == 9).all()), "D2H before the write: what the GPU holds is what is sent"
    direct = HbmMoves("transport", make_transport("gloo", "prefill/p0/g0", namespace="dualpath"))
    with pytest.raises(TransportError, match="use runtime.hbm_moves: cuda_copy"):
        direct.register("window", torch.zeros(8, dtype=torch.uint8, device="cuda"))
