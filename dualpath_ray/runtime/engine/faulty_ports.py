"""The engines' ports with the fault plan applied: each wraps a real (or fake) port, so faults
reach the real readers, transports, scheduler and decode engines through the same calls.

Actor calls (site actor_call): a lost request never reaches the callee; a lost response means
the callee did the work but the caller sees an error (only calls with a reply can lose one).
Transfers (layer_transfer, buffer_to_hbm): fail raises at the wait; corrupt flips one byte of
what arrives (a read: the local destination after it landed; a write: the local source while
it is in flight, restored afterwards, so only the peer's copy is damaged).

These wrappers live on the runtime side: they wrap runtime/engine/ports.py's ports and raise
the transport's errors, while faults/ (the plan and the injector that decides) stays a pure
layer that never imports runtime/.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable, Sequence

import torch

from dualpath_ray.kv.paged_block_layers import PagedBlockLayers
from dualpath_ray.faults.injector import FaultInjector, InjectedFault
from dualpath_ray.faults.plan import CallPhase, FaultMode, FaultSite
from dualpath_ray.protocol.types import ReadPath
from dualpath_ray.protocol.messages import (
    DecodeHandoff, ExtentGrant, Holding, PersistedBlock, StagedRead, TokenChunk, TurnResult,
)
from dualpath_ray.runtime.engine.ports import DecodePort, Failed, Pending, ReaderPort, Ready, SchedulerPort, TransportPort
from dualpath_ray.runtime.transport.moves import Move, Region, TransportError


def flip_byte(data: torch.Tensor, rng: random.Random) -> int:
    """Corrupt one byte of a uint8 view in place (XOR 0xFF, so flipping again restores it)."""
    flat = data.view(-1)
    position = rng.randrange(flat.numel())
    flat[position] ^= 0xFF
    return position


class InjectedTransferError(InjectedFault, TransportError):
    """A transfer the fault plan failed: classified like any transfer failure (retryable)."""


class _LostReply:
    """A call whose callee ran but whose reply the caller never gets."""

    def __init__(self, inner: Pending[Any], error: InjectedFault) -> None:
        self.inner = inner
        self.error = error

    def done(self) -> bool:
        if not self.inner.done():
            return False
        raise self.error

    def wait(self, timeout_s: float | None = None) -> Any:
        self.inner.wait(timeout_s)
        raise self.error


def _call(faults: FaultInjector, method: str, send: Callable[[], Pending[Any]]) -> Pending[Any]:
    if faults.fail_call(method, CallPhase.REQUEST):
        return Failed(InjectedFault("actor_call", f"{method} request lost"))
    pending = send()
    if faults.fail_call(method, CallPhase.RESPONSE):
        return _LostReply(pending, InjectedFault("actor_call", f"{method} reply lost"))
    return pending


class FaultyReaders:
    def __init__(self, inner: ReaderPort, faults: FaultInjector) -> None:
        self.inner = inner
        self.faults = faults

    def read_hits(
        self, node_id: str, owner: str, keys: Sequence[str], total_blocks: int, path: ReadPath, first_block: int = 0,
        staged: StagedRead | None = None,
    ) -> Pending[ExtentGrant]:
        return _call(
            self.faults, "read_hits", lambda: self.inner.read_hits(node_id, owner, keys, total_blocks, path, first_block, staged)
        )

    def lease(self, node_id: str, owner: str, n_blocks: int) -> Pending[ExtentGrant]:
        return _call(self.faults, "lease", lambda: self.inner.lease(node_id, owner, n_blocks))

    def free(self, grant: ExtentGrant) -> None:
        self.inner.free(grant)

    def reclaim(self, node_id: str, owner: str) -> None:
        self.inner.reclaim(node_id, owner)

    def persist_extent(self, grant: ExtentGrant, blocks: Sequence[tuple[int, PersistedBlock]]) -> Pending[int]:
        return _call(self.faults, "persist_extent", lambda: self.inner.persist_extent(grant, blocks))

    def persist_pages(
        self, node_id: str, owner: str, blocks: Sequence[tuple[int, PersistedBlock]], paged: PagedBlockLayers | None = None,
    ) -> Pending[int]:
        return _call(self.faults, "persist_pages", lambda: self.inner.persist_pages(node_id, owner, blocks, paged))


class FaultySchedulerPort:
    """`report` has no reply: only its request can be lost (the sender believes it delivered;
    the heartbeat finds the attempts no engine holds any more and retries them, and names the
    handoffs it carried)."""

    def __init__(self, inner: SchedulerPort, faults: FaultInjector) -> None:
        self.inner = inner
        self.faults = faults

    def report(
        self, handed_off: dict[str, Holding], results: Sequence[TurnResult], chunks: Sequence[TokenChunk]
    ) -> Pending[None]:
        if self.faults.fail_call("report", CallPhase.REQUEST):
            return Ready(None)  # lost on the way: the sender believes it delivered
        return self.inner.report(handed_off, results, chunks)


class FaultyDecodePort:
    def __init__(self, inner: DecodePort, faults: FaultInjector) -> None:
        self.inner = inner
        self.faults = faults

    def hand_off(self, engine: str, handoffs: Sequence[DecodeHandoff]) -> Pending[None]:
        if self.faults.fail_call("hand_off", CallPhase.REQUEST):
            owners = ", ".join(h.task.request.owner for h in handoffs)
            raise InjectedFault("actor_call", f"hand_off of {owners} to {engine} lost")
        return self.inner.hand_off(engine, handoffs)


class _Corrupted:
    """A transfer whose data is damaged: `on_end` runs once, when the inner transfer ended
    (well, or also badly when `always`: a write's source is restored in any case)."""

    def __init__(self, inner: Pending[int], on_end: Callable[[], None], always: bool) -> None:
        self.inner = inner
        self.on_end: Callable[[], None] | None = on_end
        self.always = always

    def _end(self, ok: bool) -> None:
        if self.on_end is not None and (ok or self.always):
            action, self.on_end = self.on_end, None
            action()

    def done(self) -> bool:
        try:
            finished = self.inner.done()
        except BaseException:
            self._end(False)
            raise
        if finished:
            self._end(True)
        return finished

    def wait(self, timeout_s: float | None = None) -> int:
        try:
            value = self.inner.wait(timeout_s)
        except BaseException:
            self._end(False)
            raise
        self._end(True)
        return value


class FaultyTransport:
    """TransportPort with layer_transfer (prefill) or buffer_to_hbm (decode) faults; `view`
    gives the local tensor of a region (the engine's own registered memory)."""

    def __init__(
        self, inner: TransportPort, faults: FaultInjector, site: FaultSite, view: Callable[[Region], torch.Tensor]
    ) -> None:
        self.inner = inner
        self.faults = faults
        self.site = site
        self.view = view
        self.rng: random.Random = faults.corruption_rng

    def read(self, peer: str, moves: Sequence[Move]) -> Pending[int]:
        spec = self.faults.decide(self.site)
        if spec is not None and spec.mode is FaultMode.FAIL:
            return Failed(InjectedTransferError(self.site.value, f"read from {peer} failed"))
        pending = self.inner.read(peer, moves)
        if spec is not None and spec.mode is FaultMode.CORRUPT:
            local = self.view(self.rng.choice(list(moves))[0])

            def damage() -> None:
                flip_byte(local, self.rng)

            return _Corrupted(pending, damage, always=False)
        return pending

    def write(self, peer: str, moves: Sequence[Move]) -> Pending[int]:
        spec = self.faults.decide(self.site)
        if spec is not None and spec.mode is FaultMode.FAIL:
            return Failed(InjectedTransferError(self.site.value, f"write to {peer} failed"))
        if spec is not None and spec.mode is FaultMode.CORRUPT:
            source = self.view(self.rng.choice(list(moves))[0])
            flat = source.view(-1)
            position = self.rng.randrange(flat.numel())
            flat[position] ^= 0xFF
            pending = self.inner.write(peer, moves)

            def restore() -> None:
                flat[position] ^= 0xFF

            return _Corrupted(pending, restore, always=True)
        return self.inner.write(peer, moves)


def with_faults(ports: Any, faults: FaultInjector, view: Callable[[Region], torch.Tensor]) -> Any:
    """An engine's ports (PrefillPorts or DecodePorts) with the plan applied: a prefill engine's
    transfers are layer_transfer events, a decode engine's (buffer -> HBM) buffer_to_hbm."""
    site = FaultSite.LAYER_TRANSFER if hasattr(ports, "decode") else FaultSite.BUFFER_TO_HBM
    changes: dict[str, Any] = {
        "readers": FaultyReaders(ports.readers, faults),
        "transport": FaultyTransport(ports.transport, faults, site, view),
        "scheduler": FaultySchedulerPort(ports.scheduler, faults),
    }
    if hasattr(ports, "decode"):
        changes["decode"] = FaultyDecodePort(ports.decode, faults)
    return dataclasses.replace(ports, **changes)
