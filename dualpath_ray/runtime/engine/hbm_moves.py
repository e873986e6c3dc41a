"""How layer blocks move into and out of a GPU engine's HBM (`runtime.hbm_moves`).

An engine's KV memory (a prefill engine's layer window, a decode engine's pages) is a pool the
KV transport addresses. Every move into or out of it goes through the engine's transport port
(the prefill pipeline's layer reads and writes, the decode engine's prompt load) or is pulled by
its node's reader (a filled page, D2H for persistence). Two ways to do those moves on a GPU:

* ``transport`` (the paper's CNIC-centric rule, section 5): the HBM pool itself is registered
  with the transport, so every move, the node-local H2D/D2H included, is an RDMA operation of
  the GPU's paired compute NIC (GPUDirect RDMA with nixl or verbs), which the NIC's QoS
  arbitrates with the model's collectives. gloo cannot register GPU memory.
* ``cuda_copy``: the transport registers a pinned host mirror of each HBM pool instead, at the
  same offsets, so peers address it exactly as before. After a read into the mirror landed the
  engine copies its regions to HBM; before a write, and before its reader pulls pages, it copies
  them from HBM. Copies are synchronous on the current CUDA stream, so they follow the compute
  that produced the bytes and precede the compute that uses them. Works with every transport;
  costs host memory the size of the pools and a cudaMemcpy per contiguous range.

Sleep and wake (`release_memory`, `restore_memory`) free and reallocate what the engine's KV
really occupies: the registered pools themselves in ``transport`` mode; in ``cuda_copy`` both the
HBM pool and its host mirror, the mirror unpinned before its memory goes (memory freed while
still registered stays locked) and pinned again once reallocated, so a woken engine's copies are
as fast as before.

On a CPU engine the pools are host memory already and both modes register them directly.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dualpath_ray.kv.paged_block_layers import PagedBlockLayers
from dualpath_ray.kv.host_memory import HostPinning, allocate_host_buffer
from dualpath_ray.protocol.types import ReadPath
from dualpath_ray.protocol.messages import ExtentGrant, PersistedBlock, StagedRead
from dualpath_ray.runtime.engine.ports import Pending, ReaderPort
from dualpath_ray.runtime.transport.base import Transport
from dualpath_ray.runtime.transport.moves import Move, Region, TransportError

HBM_MOVES = ("transport", "cuda_copy")
_STAGED_DEVICES = {"transport": frozenset(), "cuda_copy": frozenset({"cuda"})}


@dataclass
class HbmCopyStats:
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    copies: int = 0  # cudaMemcpy calls (one per contiguous range)


@dataclass
class _Mirror:
    device: torch.Tensor  # uint8 1-D view of the engine's pool
    host: torch.Tensor  # uint8 1-D pinned mirror the transport registered under the same name
    pinned: bool  # whether `host` is page-locked now


def free_storage(tensor: torch.Tensor) -> int:
    """Shrink a tensor's storage (every view of it too) to nothing; returns the bytes freed."""
    nbytes = tensor.untyped_storage().nbytes()
    tensor.untyped_storage().resize_(0)
    return nbytes


def allocate_storage(tensor: torch.Tensor, nbytes: int) -> None:
    """Give a storage freed by `free_storage` `nbytes` of zeroed memory again."""
    tensor.untyped_storage().resize_(nbytes)
    tensor.zero_()


def merged_ranges(regions: Iterable[Region]) -> dict[str, list[tuple[int, int]]]:
    """Per pool, the sorted union of the regions' byte ranges [start, end)."""
    by_pool: dict[str, list[tuple[int, int]]] = {}
    for region in sorted(regions, key=lambda r: (r.pool, r.offset)):
        ranges = by_pool.setdefault(region.pool, [])
        if ranges and region.offset <= ranges[-1][1]:
            ranges[-1] = (ranges[-1][0], max(ranges[-1][1], region.end))
        else:
            ranges.append((region.offset, region.end))
    return by_pool


class HbmMoves:
    """The engine's view of its KV pools for moves: what the transport registers, the transport
    port its core uses, and the reader port (persistence pulls pages). One per engine."""

    def __init__(
        self, mode: str, transport: Transport, staged_devices: frozenset[str] | None = None,
        pinning: HostPinning | None = None,
    ) -> None:
        if mode not in HBM_MOVES:
            raise TransportError(f"runtime.hbm_moves: unknown mode {mode!r}; use one of {HBM_MOVES}")
        self.mode = mode
        self.transport = transport
        # Which device types get a host mirror; tests stage "cpu" pools to check the logic.
        self.staged = _STAGED_DEVICES[mode] if staged_devices is None else staged_devices
        self._mirrors: dict[str, _Mirror] = {}
        self._unowned: set[str] = set()
        self._pinning = pinning or HostPinning()
        self._lock = threading.Lock()
        self.stats = HbmCopyStats()

    def register(self, name: str, pool: torch.Tensor, owned: bool = True) -> None:
        """Register an engine pool with the transport, itself or through its host mirror. A pool
        not `owned` (a compute's own KV pages: vLLM's, which its own sleep mode frees) is never
        freed or reallocated by sleep and wake, only deregistered and registered again."""
        if not owned:
            self._unowned.add(name)
        if pool.device.type not in self.staged:
            if pool.device.type == "cuda" and self.transport.kind == "gloo":
                raise TransportError(
                    f"register {name!r}: runtime.hbm_moves is transport, but gloo cannot move GPU memory; "
                    "use runtime.hbm_moves: cuda_copy, or runtime.transport: nixl or verbs"
                )
            self.transport.register(name, pool)
            return
        device = pool.reshape(-1).view(torch.uint8)
        host, pinning = allocate_host_buffer((device.numel(),), pin=True, pinning=self._pinning)
        self.transport.register(name, host)
        self._mirrors[name] = _Mirror(device, host, pinning.pinned)

    def mirrors_pinned(self) -> dict[str, bool]:
        """Pool -> whether its host mirror is page-locked now (engine stats; empty: no mirror)."""
        return {name: mirror.pinned for name, mirror in self._mirrors.items()}

    # ---- sleep and wake ----------------------------------------------------------------
    def release_memory(self) -> int:
        """Free the memory of every KV pool (HBM and host mirror alike); returns the bytes freed.
        No transfer may be in flight."""
        freed = self.transport.release_memory(self._free)
        if any(m.device.device.type == "cuda" for m in self._mirrors.values()):
            torch.cuda.empty_cache()  # hand the freed HBM back to the driver, not to torch's cache
        return freed

    def restore_memory(self) -> None:
        """Allocate every pool again (zeroed), mirrors pinned again; the transport publishes the
        new addressing under a new incarnation."""
        self.transport.restore_memory(self._allocate)

    def _free(self, name: str, registered: torch.Tensor) -> int:
        if name in self._unowned:
            return 0
        mirror = self._mirrors.get(name)
        if mirror is None:
            return free_storage(registered)
        self._pinning.unpin(mirror.host, mirror.pinned)
        mirror.pinned = False
        return free_storage(mirror.host) + free_storage(mirror.device)

    def _allocate(self, name: str, registered: torch.Tensor, nbytes: int) -> None:
        if name in self._unowned:
            return
        mirror = self._mirrors.get(name)
        allocate_storage(registered, nbytes)
        if mirror is not None:
            allocate_storage(mirror.device, mirror.device.numel())
            mirror.pinned = self._pinning.pin(mirror.host)

    def view(self, region: Region) -> torch.Tensor:
        """uint8 view of a local region in the engine's own memory (HBM, not the mirror)."""
        mirror = self._mirrors.get(region.pool)
        if mirror is None:
            return self.transport.view(region)
        self.transport.view(region)  # the bounds check
        return mirror.device[region.offset : region.end]

    # ---- copies ------------------------------------------------------------------------
    def to_device(self, regions: Iterable[Region]) -> None:
        """Mirror -> HBM for these regions (after the transport landed them in the mirror)."""
        self._copy(regions, into_device=True)

    def to_host(self, regions: Iterable[Region]) -> None:
        """HBM -> mirror for these regions (before the transport or a reader reads them)."""
        self._copy(regions, into_device=False)

    def _copy(self, regions: Iterable[Region], into_device: bool) -> None:
        staged = [region for region in regions if region.pool in self._mirrors]
        for pool, ranges in merged_ranges(staged).items():
            mirror = self._mirrors[pool]
            for start, end in ranges:
                if into_device:
                    mirror.device[start:end].copy_(mirror.host[start:end])
                else:
                    mirror.host[start:end].copy_(mirror.device[start:end])
                with self._lock:
                    self.stats.copies += 1
                    if into_device:
                        self.stats.h2d_bytes += end - start
                    else:
                        self.stats.d2h_bytes += end - start

    # ---- ports -------------------------------------------------------------------------
    def transport_port(self) -> Any:
        """The TransportPort the engine's core uses: the transport itself unless pools are staged."""
        return _StagedTransport(self) if self.staged else self.transport

    def readers_port(self, readers: ReaderPort, page_bytes: int, pool: str) -> Any:
        """The ReaderPort the decode core uses: a page pull is preceded by its D2H to the mirror."""
        return _StagingReaders(readers, self, page_bytes, pool) if self.staged else readers


class _CopyIn:
    """A read whose landed regions are copied to HBM once it completed (a Pending[int])."""

    def __init__(self, inner: Pending[int], moves: HbmMoves, regions: list[Region]) -> None:
        self._inner = inner
        self._moves = moves
        self._regions: list[Region] | None = regions
        self._lock = threading.Lock()

    def _land(self) -> None:
        with self._lock:
            regions, self._regions = self._regions, None
        if regions is not None:
            self._moves.to_device(regions)

    def done(self) -> bool:
        if not self._inner.done():
            return False
        self._land()
        return True

    def wait(self, timeout_s: float | None = None) -> int:
        nbytes = self._inner.wait(timeout_s)
        self._land()
        return nbytes


class _StagedTransport:
    """TransportPort over staged pools: reads copy in after landing, writes copy out first."""

    def __init__(self, moves: HbmMoves) -> None:
        self._moves = moves

    def read(self, peer: str, moves: Sequence[Move]) -> Pending[int]:
        pending = self._moves.transport.read(peer, moves)
        return _CopyIn(pending, self._moves, [local for local, _ in moves])

    def write(self, peer: str, moves: Sequence[Move]) -> Pending[int]:
        self._moves.to_host(local for local, _ in moves)
        return self._moves.transport.write(peer, moves)


class _StagingReaders:
    """ReaderPort whose page pulls (persistence) find the pages' bytes in the mirror."""

    def __init__(self, inner: ReaderPort, moves: HbmMoves, page_bytes: int, pool: str) -> None:
        self._inner = inner
        self._moves = moves
        self._page_bytes = page_bytes
        self._pool = pool

    def persist_pages(
        self, node_id: str, owner: str, blocks: Sequence[tuple[int, PersistedBlock]], paged: PagedBlockLayers | None = None,
    ) -> Pending[int]:
        size = self._page_bytes
        if paged is None:
            self._moves.to_host(Region(self._pool, page * size, size) for page, _ in blocks)
        else:  # a compute's own pages: the runs the reader pulls
            self._moves.to_host(
                Region(paged.pool, offset, nbytes) for page, _ in blocks for offset, nbytes in paged.runs(page)
            )
        return self._inner.persist_pages(node_id, owner, blocks, paged)

    # The other calls touch no engine memory.
    def read_hits(
        self, node_id: str, owner: str, keys: Sequence[str], total_blocks: int, path: ReadPath, first_block: int = 0,
        staged: StagedRead | None = None,
    ) -> Pending[ExtentGrant]:
        return self._inner.read_hits(node_id, owner, keys, total_blocks, path, first_block, staged)

    def lease(self, node_id: str, owner: str, n_blocks: int) -> Pending[ExtentGrant]:
        return self._inner.lease(node_id, owner, n_blocks)

    def free(self, grant: ExtentGrant) -> None:
        self._inner.free(grant)

    def reclaim(self, node_id: str, owner: str) -> None:
        self._inner.reclaim(node_id, owner)

    def persist_extent(self, grant: ExtentGrant, blocks: Sequence[tuple[int, PersistedBlock]]) -> Pending[int]:
        return self._inner.persist_extent(grant, blocks)
