"""KV transport between Ray actors: prefill engines, decode engines and per-node storage readers.

KV bytes never travel through the Ray object store. A source endpoint `offer`s views of its
registered pool and gets a small picklable `TransferTicket`; the ticket travels inside ordinary
actor messages (through the scheduler if need be); the destination `pull`s straight into views of
its own pool and the source `release`s the views afterwards (the puller may release it by message).

Backends
--------
* ``nixl`` (default): Ray Direct Transport with NIXL. `offer` is
  ``ray.put(views, _tensor_transport="nixl")`` inside the source; the ref is the ticket handle.
  `pull` is ``set_target_for_ref`` + ``ray.get``: a one-sided READ into the caller's targets.
* ``gloo``: two-sided ``ProcessGroupGloo`` send/recv with a unique tag per tensor, for machines
  without NIXL. The puller posts its receives, then asks the source (through
  `TransportEndpoint.transport_serve`, in the ``transport`` concurrency group) to send.
  The driver forms one world over all endpoints first: `setup_gloo_world(endpoint_handles)`.

Correctness rule shared by both: a pull succeeds only if the source still holds the offer *after*
the bytes landed (liveness only goes offered -> released, so this proves the views were valid
during the whole read). A released, unknown or foreign ticket, a shape/dtype mismatch or a dead
source raises `TransportError` (`SourceDiedError` for a dead source, so callers can re-offer
from another copy); after a `TransportError` the targets' contents are undefined.

RDMA hardware mapping
---------------------
* NIXL picks its UCX backend (LIBFABRIC only on AWS EFA). UCX selects IB or RoCE verbs (``rc``/
  ``dc``, GPUDirect RDMA for CUDA memory) when an RDMA NIC is present and falls back to TCP and
  shared memory otherwise (as on the CPU-only CI machines). ``UCX_TLS`` restricts the transports
  (e.g. ``rc,cuda_copy`` on IB, ``tcp`` to force sockets); ``UCX_NET_DEVICES`` picks the NIC
  port (``mlx5_0:1``): bind each engine to the compute NIC next to its GPU.
* Traffic isolation (paper section 5) keeps KV traffic from slowing model collectives:
  ``UCX_IB_SL`` sets the InfiniBand service level (0-15, mapped to a virtual lane by the subnet
  manager's SL2VL table); ``UCX_IB_TRAFFIC_CLASS`` sets the GRH traffic class (0-255) that RoCE
  switches read as DSCP (upper 6 bits) for PFC/ETS priority queues. Put KV on an SL/TC different
  from NCCL's (``NCCL_IB_SL`` / ``NCCL_IB_TC``). `make_transport(service_level=...,
  traffic_class=..., ucx_tls=..., ucx_net_devices=...)` sets these for the whole process; it
  must run before the process first uses NIXL (UCX reads them when the NIXL agent is created).
  They are not testable without RDMA hardware; gloo (TCP) ignores them.
* gloo uses TCP sockets only: no RDMA, no service levels.

Actor requirements
------------------
Every endpoint actor class inherits `TransportEndpoint`, is declared with
``@ray.remote(**endpoint_actor_options())`` (RDT enabled, ``transport`` concurrency group), is a
named actor whose Ray name equals its endpoint name (``reader/n1``, ``prefill/n0/g1``), and calls
``self.attach_transport(make_transport(...))`` in ``__init__``. `pull` blocks: async actors
should call it through ``asyncio.to_thread``; in async actors the ``transport`` group runs its
(synchronous) handlers one at a time, which is correct but serialises gloo sends of that source.
"""

from __future__ import annotations

import enum
import itertools
import threading
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import ray
import torch
import xxhash

TRANSPORT_GROUP = "transport"
TRANSPORT_KINDS = ("nixl", "gloo")


class TransportError(RuntimeError):
    """A transfer cannot be done or did not complete; targets of a failed pull are undefined."""


class SourceDiedError(TransportError):
    """The source endpoint is dead or unknown: its offers are gone (re-offer from another copy)."""


@dataclass(frozen=True)
class TransferTicket:
    """What a puller needs to fetch one offer; small and picklable."""

    transfer_id: str
    source: str
    nbytes: int
    shapes: tuple[tuple[int, ...], ...]
    handle: object


@dataclass(frozen=True)
class ConfirmRequest:
    """Puller -> source: is the offer still live (after the bytes landed)?"""

    transfer_id: str
    want_digest: bool


@dataclass(frozen=True)
class ConfirmReply:
    live: bool
    digest: int | None


@dataclass(frozen=True)
class ReleaseRequest:
    transfer_id: str


class TransportState(enum.Enum):
    AWAITING_WORLD = "awaiting_world"  # gloo only: no world joined yet
    READY = "ready"
    BROKEN = "broken"  # gloo only: the world is unusable until setup_gloo_world runs again
    CLOSED = "closed"


_TRANSITIONS: dict[TransportState, frozenset[TransportState]] = {
    TransportState.AWAITING_WORLD: frozenset({TransportState.READY, TransportState.CLOSED}),
    TransportState.READY: frozenset({TransportState.READY, TransportState.BROKEN, TransportState.CLOSED}),
    TransportState.BROKEN: frozenset({TransportState.READY, TransportState.CLOSED}),
    TransportState.CLOSED: frozenset(),
}


def next_state(current: TransportState, target: TransportState) -> TransportState:
    """The one transition function of a transport's lifecycle; rejects illegal moves."""
    if target not in _TRANSITIONS[current]:
        raise TransportError(f"transport cannot go from {current.value} to {target.value}")
    return target


def tensors_digest(tensors: Sequence[torch.Tensor]) -> int:
    """xxh3-64 over the bytes of the tensors in order (debug byte comparison)."""
    digest = xxhash.xxh3_64()
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().data)
    return digest.intdigest()


def check_offer_tensors(tensors: Sequence[torch.Tensor]) -> None:
    """Offered tensors must be non-empty contiguous uint8 views."""
    if not tensors:
        raise TransportError("offer: tensors is empty; offer at least one tensor")
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TransportError(f"offer: tensors[{index}] is {type(tensor).__name__}, not a tensor")
        if tensor.dtype != torch.uint8:
            raise TransportError(f"offer: tensors[{index}] has dtype {tensor.dtype}; use uint8 views")
        if not tensor.is_contiguous():
            raise TransportError(
                f"offer: tensors[{index}] is not contiguous; offer whole slots such as pool[i, layer]"
            )


def check_pull_targets(ticket: TransferTicket, targets: Sequence[torch.Tensor]) -> None:
    """Targets must match the ticket one for one: same shape, uint8, contiguous."""
    if len(targets) != len(ticket.shapes):
        raise TransportError(
            f"pull {ticket.transfer_id}: {len(targets)} targets for {len(ticket.shapes)} tensors"
        )
    for index, (target, shape) in enumerate(zip(targets, ticket.shapes)):
        if not isinstance(target, torch.Tensor):
            raise TransportError(f"pull: targets[{index}] is {type(target).__name__}, not a tensor")
        if tuple(target.shape) != shape:
            raise TransportError(
                f"pull {ticket.transfer_id}: targets[{index}] has shape {tuple(target.shape)}, "
                f"the offer has {shape}"
            )
        if target.dtype != torch.uint8:
            raise TransportError(f"pull: targets[{index}] has dtype {target.dtype}; use uint8 views")
        if not target.is_contiguous():
            raise TransportError(f"pull: targets[{index}] is not contiguous")


@dataclass(frozen=True)
class _Offer:
    ticket: TransferTicket
    tensors: tuple[torch.Tensor, ...]


class Transport(ABC):
    """One instance per endpoint actor process; methods are thread-safe."""

    kind: str

    def __init__(self, endpoint_name: str, namespace: str, timeout_s: float, verify_bytes: bool) -> None:
        self.endpoint_name = endpoint_name
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.verify_bytes = verify_bytes
        self._lock = threading.Lock()
        self._offers: dict[str, _Offer] = {}
        self._pools: list[torch.Tensor] = []
        self._sources: dict[str, Any] = {}
        self._sequence = itertools.count()
        self._incarnation = uuid.uuid4().hex[:8]
        self._state = self._initial_state()

    # ---- public interface -------------------------------------------------------------
    def register(self, pool: torch.Tensor) -> None:
        """Register a long-lived pool once, before offering or pulling views of it."""
        self._require_usable()
        if not isinstance(pool, torch.Tensor) or not pool.is_contiguous():
            raise TransportError("register: pool must be a contiguous tensor")
        self._register_backend(pool)
        with self._lock:
            self._pools.append(pool)

    def offer(self, tensors: list[torch.Tensor]) -> TransferTicket:
        """Publish views that stay valid until `release`; returns the ticket to hand around."""
        self._require(TransportState.READY)
        check_offer_tensors(tensors)
        views = tuple(tensors)
        transfer_id = f"{self.endpoint_name}#{self._incarnation}-{next(self._sequence)}"
        handle = self._publish(transfer_id, views)
        ticket = TransferTicket(
            transfer_id=transfer_id,
            source=self.endpoint_name,
            nbytes=sum(t.numel() for t in views),
            shapes=tuple(tuple(t.shape) for t in views),
            handle=handle,
        )
        with self._lock:
            self._offers[transfer_id] = _Offer(ticket, views)
        return ticket

    def pull(self, ticket: TransferTicket, targets: list[torch.Tensor]) -> int:
        """Fill `targets` in place with the offer's bytes; blocks; returns the bytes moved."""
        self._require(TransportState.READY)
        if not isinstance(ticket, TransferTicket):
            raise TransportError(f"pull: expected a TransferTicket, got {type(ticket).__name__}")
        check_pull_targets(ticket, targets)
        if ticket.source == self.endpoint_name:
            self._copy_local(ticket, list(targets))
        else:
            self._fetch(ticket, list(targets))
        return ticket.nbytes

    def release(self, ticket: TransferTicket) -> None:
        """Drop an offer; idempotent. Called by a non-source, it messages the source."""
        if ticket.source == self.endpoint_name:
            self._release_local(ticket.transfer_id)
            return
        try:
            self._source_actor(ticket.source).transport_serve.remote(ReleaseRequest(ticket.transfer_id))
        except TransportError:
            pass  # the source is gone, and its offers with it

    def close(self) -> None:
        with self._lock:
            if self._state is TransportState.CLOSED:
                return
            self._state = next_state(self._state, TransportState.CLOSED)
            self._offers = {}
            pools, self._pools = self._pools, []
        for pool in pools:
            self._deregister_backend(pool)
        self._close_backend()

    def outstanding_offers(self) -> int:
        """How many offers this endpoint still holds (leak checks)."""
        with self._lock:
            return len(self._offers)

    @property
    def state(self) -> TransportState:
        return self._state

    # ---- served on the source through TransportEndpoint.transport_serve ------------------
    def serve(self, request: object) -> object:
        if isinstance(request, ConfirmRequest):
            return self._confirm_local(request)
        if isinstance(request, ReleaseRequest):
            self._release_local(request.transfer_id)
            return None
        return self._serve_backend(request)

    # ---- shared helpers for backends ---------------------------------------------------
    def _offered(self, transfer_id: str) -> _Offer | None:
        with self._lock:
            return self._offers.get(transfer_id)

    def _release_local(self, transfer_id: str) -> None:
        with self._lock:
            self._offers.pop(transfer_id, None)

    def _confirm_local(self, request: ConfirmRequest) -> ConfirmReply:
        offer = self._offered(request.transfer_id)
        if offer is None:
            return ConfirmReply(live=False, digest=None)
        digest = tensors_digest(offer.tensors) if request.want_digest else None
        return ConfirmReply(live=True, digest=digest)

    def _confirm_remote(self, ticket: TransferTicket, targets: Sequence[torch.Tensor]) -> None:
        """Ask the source, after the bytes landed, whether the offer was live throughout."""
        reply = self._call_source(ticket.source, ConfirmRequest(ticket.transfer_id, self.verify_bytes))
        if not isinstance(reply, ConfirmReply) or not reply.live:
            raise TransportError(
                f"pull {ticket.transfer_id}: {ticket.source} no longer offers it (never offered, "
                "or released before the pull completed); the targets hold undefined bytes"
            )
        self._check_digest(ticket, targets, reply.digest)

    def _check_digest(self, ticket: TransferTicket, targets: Sequence[torch.Tensor], digest: int | None) -> None:
        if digest is not None and tensors_digest(targets) != digest:
            raise TransportError(f"pull {ticket.transfer_id}: landed bytes differ from the source")

    def _copy_local(self, ticket: TransferTicket, targets: list[torch.Tensor]) -> None:
        offer = self._offered(ticket.transfer_id)
        if offer is None:
            raise TransportError(f"pull {ticket.transfer_id}: not offered here (released or unknown)")
        for target, tensor in zip(targets, offer.tensors):
            target.copy_(tensor)
        if self._offered(ticket.transfer_id) is None:
            raise TransportError(f"pull {ticket.transfer_id}: released during the local copy")

    def _source_actor(self, name: str) -> Any:
        with self._lock:
            handle = self._sources.get(name)
        if handle is not None:
            return handle
        try:
            handle = ray.get_actor(name, namespace=self.namespace)
        except ValueError as exc:
            raise SourceDiedError(
                f"source endpoint {name!r} not found in namespace {self.namespace!r} (dead or never started)"
            ) from exc
        with self._lock:
            self._sources[name] = handle
        return handle

    def _forget_source(self, name: str) -> None:
        with self._lock:
            self._sources.pop(name, None)

    def _call_source(self, name: str, request: object, extra_s: float = 0.0) -> object:
        """Run `request` on the source's transport group; any failure is a TransportError."""
        try:
            ref = self._source_actor(name).transport_serve.remote(request)
            return ray.get(ref, timeout=self.timeout_s + extra_s)
        except ray.exceptions.GetTimeoutError as exc:
            raise TransportError(f"{name} did not answer within {self.timeout_s + extra_s}s") from exc
        except ray.exceptions.ActorUnavailableError as exc:
            raise TransportError(f"{name} is unreachable for now; the request may still run: {exc}") from exc
        except ray.exceptions.RayActorError as exc:
            self._forget_source(name)
            raise SourceDiedError(f"source endpoint {name} died: {exc}") from exc
        except ray.exceptions.RayTaskError as exc:
            raise TransportError(f"source endpoint {name} failed to serve: {exc}") from exc
        except AssertionError as exc:
            raise TransportError(
                f"{name} has no {TRANSPORT_GROUP!r} concurrency group; declare its class with "
                "@ray.remote(**endpoint_actor_options())"
            ) from exc

    def _require(self, state: TransportState) -> None:
        if self._state is not state:
            raise TransportError(
                f"{self.kind} transport of {self.endpoint_name} is {self._state.value}, "
                f"needs {state.value}" + self._state_hint()
            )

    def _require_usable(self) -> None:
        if self._state is TransportState.CLOSED:
            raise TransportError(f"transport of {self.endpoint_name} is closed")

    def _set_state(self, target: TransportState) -> None:
        with self._lock:
            self._state = next_state(self._state, target)

    def _state_hint(self) -> str:
        return ""

    # ---- backend hooks -----------------------------------------------------------------
    def _initial_state(self) -> TransportState:
        return TransportState.READY

    @abstractmethod
    def _register_backend(self, pool: torch.Tensor) -> None: ...

    @abstractmethod
    def _deregister_backend(self, pool: torch.Tensor) -> None: ...

    @abstractmethod
    def _publish(self, transfer_id: str, tensors: tuple[torch.Tensor, ...]) -> object: ...

    @abstractmethod
    def _fetch(self, ticket: TransferTicket, targets: list[torch.Tensor]) -> None: ...

    @abstractmethod
    def _serve_backend(self, request: object) -> object: ...

    @abstractmethod
    def _close_backend(self) -> None: ...


class TransportEndpoint:
    """Mixin for endpoint actor classes: lets a peer's transport call into this actor."""

    _endpoint_transport: Transport | None = None

    def attach_transport(self, transport: Transport) -> Transport:
        """Install this actor's transport; its endpoint name must be the actor's Ray name."""
        actor_name = ray.get_runtime_context().get_actor_name()
        if actor_name and actor_name != transport.endpoint_name:
            raise TransportError(
                f"endpoint name {transport.endpoint_name!r} differs from the actor's Ray name "
                f"{actor_name!r}; peers find sources by name, so make them equal"
            )
        self._endpoint_transport = transport
        return transport

    @ray.method(concurrency_group=TRANSPORT_GROUP)
    def transport_serve(self, request: object) -> object:
        if self._endpoint_transport is None:
            raise TransportError("this endpoint has no transport; call attach_transport in __init__")
        return self._endpoint_transport.serve(request)


def endpoint_actor_options(
    transport_threads: int = 8, extra_concurrency_groups: Mapping[str, int] | None = None
) -> dict[str, Any]:
    """Options for ``@ray.remote(**...)`` on an endpoint class (RDT on, a transport group)."""
    if transport_threads < 1:
        raise TransportError(f"transport_threads must be >= 1 (got {transport_threads})")
    groups = {TRANSPORT_GROUP: transport_threads, **(extra_concurrency_groups or {})}
    return {"enable_tensor_transport": True, "concurrency_groups": groups}


def make_transport(
    kind: str,
    endpoint_name: str,
    *,
    namespace: str,
    timeout_s: float = 60.0,
    verify_bytes: bool = False,
    service_level: int | None = None,
    traffic_class: int | None = None,
    ucx_tls: str | None = None,
    ucx_net_devices: str | None = None,
) -> Transport:
    """Build this process's transport; UCX knobs are applied to the process environment."""
    from dualpath_ray.runtime.transport_nixl import apply_ucx_environment, ucx_environment

    if kind not in TRANSPORT_KINDS:
        raise TransportError(f"runtime.transport: unknown kind {kind!r}; use one of {TRANSPORT_KINDS}")
    if not endpoint_name:
        raise TransportError("endpoint_name must be the actor's Ray name, e.g. 'reader/n1'")
    if timeout_s <= 0:
        raise TransportError(f"timeout_s must be > 0 (got {timeout_s})")
    apply_ucx_environment(
        ucx_environment(
            service_level=service_level, traffic_class=traffic_class, tls=ucx_tls, net_devices=ucx_net_devices
        )
    )
    if kind == "nixl":
        from dualpath_ray.runtime.transport_nixl import NixlTransport

        return NixlTransport(endpoint_name, namespace, timeout_s, verify_bytes)
    from dualpath_ray.runtime.transport_gloo import GlooTransport

    return GlooTransport(endpoint_name, namespace, timeout_s, verify_bytes)


def setup_gloo_world(endpoints: Sequence[Any], *, timeout_s: float = 60.0) -> Any:
    """Driver side: form one gloo world over these endpoint actor handles (ranks = order)."""
    from dualpath_ray.runtime.transport_gloo import form_gloo_world

    return form_gloo_world(endpoints, timeout_s=timeout_s)
