"""gloo backend of the KV transport: two-sided send/recv over one world of all endpoints.

The world is a private ``ProcessGroupGloo`` (not torch's default group), so forming it again
after an endpoint restarts needs no process-global state. Rank 0 hosts the rendezvous
``TCPStore``; the driver hands its address to every endpoint (`form_gloo_world`).

A pull posts one receive per target with tags fresh to this puller (so concurrent transfers
between any pairs, and several between the same pair, never match each other), then asks the
source to send. Facts about gloo's TCP transport in torch 2.13 that shape the error handling
(checked on this machine):
* a receive that times out closes the pair for good ("Application timeout caused pair closure");
* a receive whose buffer is dropped before any send is harmless, but a later send on its tag
  wedges the pair; so receives are dropped only when the source reports it never sent;
* a dead peer makes pending receives fail within milliseconds ("Connection closed by peer");
* ``abort()`` on the group stops all its pairs; receives posted before it are never written.
When the outcome is ambiguous (the source neither answered nor died) the puller aborts its whole
group: late bytes can then never land in targets that were handed back as failed, and the
endpoint reports BROKEN until the driver calls `setup_gloo_world` again.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

import ray
import torch
import torch.distributed as dist

from dualpath_ray.runtime.transport import (
    SourceDiedError,
    TransferTicket,
    Transport,
    TransportError,
    TransportState,
    next_state,
    tensors_digest,
)

_MAX_TAG = 2**31 - 1
_ANSWER_GRACE_S = 5.0


@dataclass(frozen=True)
class GlooHandle:
    world_id: str
    rank: int


@dataclass(frozen=True)
class GlooWorld:
    """A formed world: endpoint names in rank order."""

    world_id: str
    endpoints: tuple[str, ...]


@dataclass(frozen=True)
class HostStoreRequest:
    world_id: str
    timeout_s: float


@dataclass(frozen=True)
class StoreAddress:
    host: str
    port: int


@dataclass(frozen=True)
class JoinRequest:
    world_id: str
    host: str
    port: int
    rank: int
    size: int
    timeout_s: float


@dataclass(frozen=True)
class Joined:
    endpoint_name: str
    rank: int


@dataclass(frozen=True)
class SendRequest:
    world_id: str
    transfer_id: str
    dst_rank: int
    tags: tuple[int, ...]
    want_digest: bool


@dataclass(frozen=True)
class SendOutcome:
    """sent is True once any byte may have left; the puller must then wait for its receives."""

    sent: bool
    error: str | None
    digest: int | None


@dataclass(frozen=True)
class _World:
    world_id: str
    rank: int
    size: int
    group: Any


class _TagCounter:
    """Tags unique to this puller process, hence unique per (source, puller) pair."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 1

    def allocate(self, count: int) -> tuple[int, ...]:
        with self._lock:
            if self._next + count > _MAX_TAG:
                self._next = 1
            start, self._next = self._next, self._next + count
        return tuple(range(start, start + count))


def _require_cpu(tensors: Sequence[torch.Tensor], what: str) -> None:
    for index, tensor in enumerate(tensors):
        if tensor.device.type != "cpu":
            raise TransportError(f"gloo moves CPU tensors only; {what}[{index}] is on {tensor.device}")


class GlooTransport(Transport):
    kind = "gloo"

    def __init__(self, endpoint_name: str, namespace: str, timeout_s: float, verify_bytes: bool) -> None:
        super().__init__(endpoint_name, namespace, timeout_s, verify_bytes)
        self._world: _World | None = None
        self._master_store: tuple[str, Any] | None = None
        self._broken_ranks: set[int] = set()
        self._tags = _TagCounter()

    def _initial_state(self) -> TransportState:
        return TransportState.AWAITING_WORLD

    def _state_hint(self) -> str:
        return "; the driver must call setup_gloo_world over all endpoints"

    def _register_backend(self, pool: torch.Tensor) -> None:
        _require_cpu([pool], "pool")

    def _deregister_backend(self, pool: torch.Tensor) -> None:
        return None

    def _publish(self, transfer_id: str, tensors: tuple[torch.Tensor, ...]) -> object:
        _require_cpu(tensors, "tensors")
        world = self._current_world()
        return GlooHandle(world.world_id, world.rank)

    def _current_world(self) -> _World:
        world = self._world
        if world is None:
            raise TransportError(f"{self.endpoint_name} has not joined a gloo world{self._state_hint()}")
        return world

    # ---- puller ------------------------------------------------------------------------
    def _fetch(self, ticket: TransferTicket, targets: list[torch.Tensor]) -> None:
        handle = ticket.handle
        if not isinstance(handle, GlooHandle):
            raise TransportError(
                f"pull {ticket.transfer_id}: handle is {type(handle).__name__}, not a gloo handle "
                "(a ticket from another backend?)"
            )
        _require_cpu(targets, "targets")
        world = self._current_world()
        if handle.world_id != world.world_id:
            raise TransportError(
                f"pull {ticket.transfer_id}: offered in gloo world {handle.world_id}, this endpoint "
                f"is in {world.world_id}; offer again"
            )
        if handle.rank in self._broken_ranks:
            raise TransportError(
                f"pull {ticket.transfer_id}: the gloo pair with rank {handle.rank} failed earlier"
                f"{self._state_hint()}"
            )
        tags = self._tags.allocate(len(targets))
        try:
            receives = [world.group.recv([t], handle.rank, tag) for t, tag in zip(targets, tags)]
        except RuntimeError as exc:
            self._broken_ranks.add(handle.rank)
            raise TransportError(f"pull {ticket.transfer_id}: cannot post receives: {exc}") from exc
        request = SendRequest(world.world_id, ticket.transfer_id, world.rank, tags, self.verify_bytes)
        outcome = self._ask_to_send(ticket, world, request)
        if not outcome.sent:
            raise TransportError(f"pull {ticket.transfer_id}: {ticket.source} did not send: {outcome.error}")
        self._wait_receives(ticket, handle.rank, receives)
        if outcome.error is not None:
            raise TransportError(f"pull {ticket.transfer_id}: {ticket.source}: {outcome.error}")
        self._check_digest(ticket, targets, outcome.digest)

    def _ask_to_send(self, ticket: TransferTicket, world: _World, request: SendRequest) -> SendOutcome:
        try:
            outcome = self._call_source(ticket.source, request, extra_s=_ANSWER_GRACE_S)
        except SourceDiedError:
            raise
        except TransportError as exc:
            self._abort_world(world)
            raise
        if not isinstance(outcome, SendOutcome):
            self._abort_world(world)
            raise TransportError(f"pull {ticket.transfer_id}: {ticket.source} is not a gloo endpoint")
        return outcome

    def _wait_receives(self, ticket: TransferTicket, rank: int, receives: list[Any]) -> None:
        try:
            for receive in receives:
                receive.wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            self._broken_ranks.add(rank)
            raise TransportError(f"pull {ticket.transfer_id}: receive failed: {exc}") from exc

    def _abort_world(self, world: _World) -> None:
        """The source may still send into posted receives: stop every pair of this group."""
        with self._lock:
            if self._world is not world or self._state is not TransportState.READY:
                return
        world.group.abort()
        self._set_state(TransportState.BROKEN)

    # ---- source ------------------------------------------------------------------------
    def _serve_backend(self, request: object) -> object:
        if isinstance(request, SendRequest):
            return self._serve_send(request)
        if isinstance(request, HostStoreRequest):
            return self._serve_host_store(request)
        if isinstance(request, JoinRequest):
            return self._serve_join(request)
        raise TransportError(f"gloo endpoint {self.endpoint_name} cannot serve {request!r}")

    def _serve_send(self, request: SendRequest) -> SendOutcome:
        world = self._world
        if self._state is not TransportState.READY or world is None or world.world_id != request.world_id:
            return SendOutcome(False, f"{self.endpoint_name} is not in gloo world {request.world_id}", None)
        offer = self._offered(request.transfer_id)
        if offer is None:
            return SendOutcome(False, "not offered (never offered, or already released)", None)
        if len(request.tags) != len(offer.tensors):
            return SendOutcome(False, f"{len(request.tags)} tags for {len(offer.tensors)} tensors", None)
        try:
            sends = [world.group.send([t], request.dst_rank, tag) for t, tag in zip(offer.tensors, request.tags)]
            for send in sends:
                send.wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            return SendOutcome(True, f"send failed: {exc}", None)
        if self._offered(request.transfer_id) is None:
            return SendOutcome(True, "released while sending; the bytes are undefined", None)
        digest = tensors_digest(offer.tensors) if request.want_digest else None
        return SendOutcome(True, None, digest)

    def _serve_host_store(self, request: HostStoreRequest) -> StoreAddress:
        host = ray.util.get_node_ip_address()
        store = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=request.timeout_s)
        )
        with self._lock:
            self._master_store = (request.world_id, store)
        return StoreAddress(host, store.port)

    def _serve_join(self, request: JoinRequest) -> Joined:
        self._require_usable()
        timeout = timedelta(seconds=request.timeout_s)
        store = self._rendezvous_store(request, timeout)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=ray.util.get_node_ip_address())]
        prefixed = dist.PrefixStore(f"dualpath/{request.world_id}", store)
        group = dist.ProcessGroupGloo(prefixed, request.rank, request.size, options)
        with self._lock:
            previous, self._world = self._world, _World(request.world_id, request.rank, request.size, group)
            self._broken_ranks = set()
            self._state = next_state(self._state, TransportState.READY)
        if previous is not None:
            previous.group.abort()
        return Joined(self.endpoint_name, request.rank)

    def _rendezvous_store(self, request: JoinRequest, timeout: timedelta) -> Any:
        if request.rank == 0:
            with self._lock:
                hosted = self._master_store
            if hosted is None or hosted[0] != request.world_id:
                raise TransportError(f"rank 0 ({self.endpoint_name}) does not host world {request.world_id}")
            return hosted[1]
        return dist.TCPStore(request.host, request.port, is_master=False, timeout=timeout)

    def _close_backend(self) -> None:
        with self._lock:
            world, self._world = self._world, None
            self._master_store = None
        if world is not None:
            world.group.abort()


def form_gloo_world(endpoints: Sequence[Any], *, timeout_s: float = 60.0) -> GlooWorld:
    """Driver side: one world over these endpoint actor handles; rank = position in the list."""
    if not endpoints:
        raise TransportError("setup_gloo_world: endpoints is empty; pass every endpoint actor handle")
    world_id = uuid.uuid4().hex
    try:
        address = ray.get(
            endpoints[0].transport_serve.remote(HostStoreRequest(world_id, timeout_s)), timeout=timeout_s
        )
        joins = [
            endpoint.transport_serve.remote(
                JoinRequest(world_id, address.host, address.port, rank, len(endpoints), timeout_s)
            )
            for rank, endpoint in enumerate(endpoints)
        ]
        joined = ray.get(joins, timeout=timeout_s + _ANSWER_GRACE_S)
    except (ray.exceptions.RayError, AssertionError) as exc:
        raise TransportError(
            f"setup_gloo_world: forming the world failed (every endpoint must be a TransportEndpoint "
            f"with a gloo transport): {exc}"
        ) from exc
    names = tuple(j.endpoint_name for j in joined)
    if len(set(names)) != len(names):
        raise TransportError(f"setup_gloo_world: endpoint names are not unique: {names}")
    return GlooWorld(world_id, names)
