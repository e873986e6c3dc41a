"""KV transport between Ray actors (prefill engines, decode engines, storage readers), v2: regions.

An endpoint registers its long-lived pools once (`register`), then `seal`s. A peer fetches the
endpoint's `EndpointInfo` (pool sizes, backend addressing) once, with one Ray call, and caches
it. A transfer names byte ranges (`Region`s) of registered pools on both sides: `read` pulls
remote bytes into local regions, `write` pushes local bytes into remote regions. Both post the
move and return a `Transfer` to poll (`done`) or block on (`wait`). The Ray object store never
carries KV bytes.

Backends: ``nixl`` (transport_nixl.py: one-sided READ/WRITE through the nixl agent, no Ray call
per transfer), ``gloo`` (transport_gloo.py: two-sided send/recv over host memory, one Ray call
per transfer to the passive side; the CPU fallback) and ``verbs`` (transport_verbs.py: RC queue
pairs through pyverbs, one doorbell per batch of RDMA READs/WRITEs, the KV service level on
every queue pair; needs an RDMA NIC).

Ownership rule: the transport moves bytes, it does not lease them. Whoever names a remote region
must know by its own protocol (a message from the owner) that the region holds the wanted bytes
(read) or may be overwritten (write) until the transfer completes. After a TransportError the
destination regions hold undefined bytes; a transfer that fails or times out is aborted before
the error is raised, so no byte lands after it (gloo does that by aborting its world: BROKEN).

Actor requirements: every endpoint actor class inherits `TransportEndpoint`, is declared with
``@ray.remote(**endpoint_actor_options())`` (it gets the ``transport`` concurrency group), is a
named actor whose Ray name equals its endpoint name (``reader/n1``, ``prefill/n0/g1``), and calls
``self.attach_transport(make_transport(...))``, then `register` and `seal`, in ``__init__``.

Where the pieces live: this module is the contract every backend implements, the Transport base
class (the checks every backend gets, the small backend hooks); moves.py its typed errors,
regions, lifecycle and `Transfer` (importable from here too, as part of the contract);
endpoint.py the actor side (`TransportEndpoint`, `endpoint_actor_options`); factory.py
`make_transport`, which picks a backend; gloo_world.py `setup_gloo_world`. The backends import
this module, so it never imports them (nor the factory, which does).
"""

from __future__ import annotations

import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch

from dualpath_ray.runtime.transport.moves import (
    EndpointInfo,
    InfoRequest,
    Move,
    PeerDiedError,
    PoolInfo,
    Region,
    RegionError,
    StatsCounter,
    Transfer,
    TransportError,
    TransportState,
    TransportStats,
    check_moves,
    check_region,
    coalesce_moves,
    next_state,
)

OPS = ("read", "write")
# The Ray concurrency group every endpoint actor serves its peers' transport calls on
# (endpoint.py declares it; a peer's call names it).
TRANSPORT_GROUP = "transport"
_PROBE_TIMEOUT_S = 5.0  # bound on the liveness probe that classifies a failed transfer


@dataclass(frozen=True)
class _Peer:
    info: EndpointInfo
    pools: dict[str, PoolInfo]


class Transport(ABC):
    """One per endpoint actor process; every method is thread-safe."""

    kind: str

    def __init__(self, endpoint_name: str, namespace: str, timeout_s: float) -> None:
        self.endpoint_name = endpoint_name
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.incarnation = uuid.uuid4().hex[:12]
        self._lock = threading.Lock()
        self._state = TransportState.REGISTERING
        self._pools: dict[str, torch.Tensor] = {}  # name -> uint8 1-D view of the whole pool
        self._pool_infos: dict[str, PoolInfo] = {}
        self._info: EndpointInfo | None = None
        self._peers: dict[str, _Peer] = {}
        self._actors: dict[str, Any] = {}
        self._counters = StatsCounter()
        # Called (once per abort) when this endpoint's world becomes unusable (gloo's BROKEN),
        # so the actor can ask for a new one (runtime/restarts/incarnations.py TransportKeeper).
        self.on_broken: Callable[[], None] | None = None
        self._released = False  # the pools' memory is freed (the engine sleeps)

    # ---- registration ------------------------------------------------------------------
    def register(self, name: str, pool: torch.Tensor) -> None:
        """Register a contiguous tensor (any dtype, host or cuda) as the byte pool `name`."""
        if not isinstance(name, str) or not name:
            raise RegionError(f"register: name must be a non-empty str (got {name!r})")
        if not isinstance(pool, torch.Tensor) or not pool.is_contiguous() or pool.numel() == 0:
            raise RegionError(f"register {name!r}: pool must be a non-empty contiguous tensor")
        with self._lock:
            if self._state is not TransportState.REGISTERING:
                raise TransportError(
                    f"register {name!r}: {self.endpoint_name} is {self._state.value}; register before seal()"
                )
            if name in self._pools:
                raise RegionError(f"register: pool name {name!r} is already registered; names are unique")
            self._register_backend(name, pool)
            self._pools[name] = pool.reshape(-1).view(torch.uint8)
            self._pool_infos[name] = PoolInfo(name, pool.numel() * pool.element_size(), str(pool.device))

    def seal(self) -> None:
        """No more registrations; publishes this endpoint's metadata."""
        with self._lock:
            if self._state is not TransportState.REGISTERING:
                raise TransportError(f"seal: {self.endpoint_name} is {self._state.value}; seal() runs once")
            backend = self._seal_backend()
            pools = tuple(self._pool_infos.values())
            self._info = EndpointInfo(self.endpoint_name, self.incarnation, self.kind, pools, backend)
            self._state = next_state(self._state, self._sealed_state())

    def release_memory(self, free: Callable[[str, torch.Tensor], int]) -> int:
        """Free every registered pool's memory (an engine going to sleep): each is deregistered,
        then `free(name, pool)` frees it and returns the bytes (the engine's HbmMoves: a pinned
        mirror of HBM is unpinned first and its HBM freed too). Moves fail until
        `restore_memory`. The caller makes sure no transfer is in flight."""
        with self._lock:
            if self._released:
                return 0
            if self._state in (TransportState.REGISTERING, TransportState.CLOSED):
                raise TransportError(f"release_memory: {self.endpoint_name} is {self._state.value}")
            freed = 0
            for name, pool in self._pools.items():
                self._deregister_backend(name)
                freed += free(name, pool)
            self._released = True
        if any(p.device.type == "cuda" for p in self._pools.values()):
            torch.cuda.empty_cache()
        return freed

    def restore_memory(self, allocate: Callable[[str, torch.Tensor, int], None]) -> None:
        """Allocate the pools again (`allocate(name, pool, nbytes)`: zeroed, every view sees the
        new memory), register them, and publish the new addressing under a new incarnation, so
        a peer that cached the old one fetches this one."""
        with self._lock:
            if not self._released:
                return
            for name, pool in self._pools.items():
                allocate(name, pool, self._pool_infos[name].nbytes)
                self._register_backend(name, pool)
            self.incarnation = uuid.uuid4().hex[:12]
            assert self._info is not None
            self._info = EndpointInfo(self.endpoint_name, self.incarnation, self.kind, self._info.pools, self._seal_backend())
            self._released = False

    def forget_peers(self) -> None:
        """Drop every cached peer's addressing (a peer woke with new memory): the next move to
        each fetches it again."""
        with self._lock:
            peers = list(self._peers)
        for peer in peers:
            self._forget_peer(peer)

    def info(self) -> EndpointInfo:
        if self._info is None or self._state is TransportState.CLOSED:
            raise TransportError(f"{self.endpoint_name} is {self._state.value}; info() needs seal() (and not close())")
        return self._info

    # ---- regions -----------------------------------------------------------------------
    def region_of(self, pool: str, view: torch.Tensor) -> Region:
        """The Region of a contiguous view into the local pool `pool` (data_ptr arithmetic)."""
        base = self._pools.get(pool)
        if base is None:
            raise RegionError(f"region_of: {pool!r} is not a pool of {self.endpoint_name} ({sorted(self._pools)})")
        if not isinstance(view, torch.Tensor) or view.device != base.device:
            raise RegionError(f"region_of {pool!r}: view must be a tensor on {base.device}")
        if not view.is_contiguous():
            raise RegionError(f"region_of {pool!r}: view is not contiguous; a Region is one byte range, so split it")
        offset = view.data_ptr() - base.data_ptr()
        region = Region(pool, offset, view.numel() * view.element_size())
        if offset < 0 or region.end > base.numel():
            raise RegionError(f"region_of {pool!r}: view is not inside pool {pool!r}; slice the registered tensor")
        return check_region(region, self._pool_infos, self.endpoint_name, f"region_of {pool!r}: view")

    def view(self, region: Region) -> torch.Tensor:
        """uint8 1-D view of a local region."""
        check_region(region, self._pool_infos, self.endpoint_name, "view: region")
        return self._pools[region.pool][region.offset : region.end]

    # ---- moves -------------------------------------------------------------------------
    def read(self, peer: str, moves: Sequence[Move]) -> Transfer:
        """Remote bytes -> local regions."""
        return self._move("read", peer, moves)

    def write(self, peer: str, moves: Sequence[Move]) -> Transfer:
        """Local bytes -> remote regions."""
        return self._move("write", peer, moves)

    def _move(self, op: str, peer: str, moves: Sequence[Move]) -> Transfer:
        where = f"{op} {'from' if op == 'read' else 'to'} {peer}"
        if self._released:
            raise TransportError(f"{where}: {self.endpoint_name} released its memory (asleep); wake it first")
        if peer != self.endpoint_name or self._state in (TransportState.REGISTERING, TransportState.CLOSED):
            self._require_ready(where)  # a self-move copies local memory: it needs no gloo world
        if not isinstance(peer, str) or not peer:
            raise TransportError(f"{op}: peer must be an endpoint name such as 'reader/n1' (got {peer!r})")
        checked = check_moves(moves, where)
        for index, (local, _) in enumerate(checked):
            check_region(local, self._pool_infos, self.endpoint_name, f"{where}: moves[{index}] local region")
        remote_pools = self._pool_infos if peer == self.endpoint_name else self._peer(peer).pools
        for index, (_, remote) in enumerate(checked):
            check_region(remote, remote_pools, peer, f"{where}: moves[{index}] remote region")
        merged = coalesce_moves(checked)
        if peer == self.endpoint_name:
            transfer = self._copy_locally(op, merged)
        else:
            transfer = self._post(op, peer, merged)
        self._counters.add(posted=1, descriptors=len(merged))
        return transfer

    def _copy_locally(self, op: str, moves: Sequence[Move]) -> Transfer:
        """A self-move is a plain copy, so callers need not special-case their own endpoint."""
        for local, remote in moves:
            source, target = (remote, local) if op == "read" else (local, remote)
            data = self._pools[source.pool][source.offset : source.end]
            overlaps = source.pool == target.pool and source.offset < target.end and target.offset < source.end
            self._pools[target.pool][target.offset : target.end].copy_(data.clone() if overlaps else data)
        transfer = self._new_transfer(Transfer, op, self.endpoint_name, moves)
        transfer.done()
        return transfer

    def _new_transfer(self, cls: type[Transfer], op: str, peer: str, moves: Sequence[Move], *args: Any) -> Any:
        nbytes = sum(local.nbytes for local, _ in moves)
        return cls(op, peer, nbytes, time.monotonic() + self.timeout_s, self._count_done, *args)

    def _count_done(self, transfer: Transfer) -> None:
        if transfer.op == "read":
            self._counters.add(bytes_read=transfer.nbytes)
        else:
            self._counters.add(bytes_written=transfer.nbytes)

    def stats(self) -> TransportStats:
        return self._counters.snapshot()

    # ---- peers -------------------------------------------------------------------------
    def _peer(self, peer: str) -> _Peer:
        """The peer's EndpointInfo, fetched through one Ray call and then cached."""
        with self._lock:
            cached = self._peers.get(peer)
        if cached is not None:
            return cached
        info = self._call_peer(peer, InfoRequest())
        if not isinstance(info, EndpointInfo) or info.endpoint != peer:
            raise TransportError(f"{peer} answered the info request with {info!r}; is it a TransportEndpoint?")
        if info.kind != self.kind:
            raise TransportError(f"{peer} uses the {info.kind} transport, {self.endpoint_name} {self.kind}; use one")
        with self._lock:
            return self._peers.setdefault(peer, _Peer(info, {p.name: p for p in info.pools}))

    def _peer_info(self, peer: str) -> EndpointInfo:
        return self._peer(peer).info

    def _submit(self, peer: str, request: object) -> Any:
        """Start `request` on the peer's transport group; returns its ObjectRef."""
        with self._lock:
            handle = self._actors.get(peer)
        if handle is None:
            try:
                handle = ray.get_actor(peer, namespace=self.namespace)
            except ValueError as exc:
                raise PeerDiedError(
                    f"endpoint {peer!r} not found in namespace {self.namespace!r} (dead or never started)"
                ) from exc
            with self._lock:
                handle = self._actors.setdefault(peer, handle)
        self._counters.add(peer_calls=1)
        try:
            return handle.transport_serve.remote(request)
        except AssertionError as exc:
            raise TransportError(
                f"{peer} has no {TRANSPORT_GROUP!r} concurrency group; declare its class with "
                "@ray.remote(**endpoint_actor_options())"
            ) from exc

    def _reply(self, peer: str, ref: Any, timeout_s: float) -> object:
        """The result of a request to the peer; any failure is a TransportError."""
        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            raise TransportError(f"{peer} did not answer within {timeout_s}s") from exc
        except ray.exceptions.ActorUnavailableError as exc:
            raise TransportError(f"{peer} is unreachable for now; the request may still run: {exc}") from exc
        except ray.exceptions.RayActorError as exc:
            self._forget_peer(peer)
            raise PeerDiedError(f"endpoint {peer} died: {exc}") from exc
        except ray.exceptions.RayTaskError as exc:
            raise TransportError(f"{peer} failed to serve the request: {exc}") from exc

    def _call_peer(self, peer: str, request: object, timeout_s: float | None = None) -> object:
        return self._reply(peer, self._submit(peer, request), self.timeout_s if timeout_s is None else timeout_s)

    def _failure(self, peer: str, what: str) -> TransportError:
        """Classify a failed transfer with a liveness probe: dead or restarted peers are PeerDiedError."""
        with self._lock:
            cached = self._peers.get(peer)
        try:
            current = self._call_peer(peer, InfoRequest(), min(self.timeout_s, _PROBE_TIMEOUT_S))
        except PeerDiedError as exc:
            return PeerDiedError(f"{what}; {exc}")
        except TransportError as exc:
            return TransportError(f"{what}; probing {peer} also failed: {exc}")
        if cached is not None and isinstance(current, EndpointInfo) and current.incarnation != cached.info.incarnation:
            self._forget_peer(peer)
            return PeerDiedError(f"{what}; {peer} restarted (a new incarnation): its regions are gone")
        return TransportError(what)

    def _forget_peer(self, peer: str) -> None:
        with self._lock:
            self._actors.pop(peer, None)
            dropped = self._peers.pop(peer, None)
        if dropped is not None:
            self._forget_backend_peer(dropped.info)

    # ---- lifecycle ---------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._state is TransportState.CLOSED:
                return
            self._state = next_state(self._state, TransportState.CLOSED)
        self._close_backend()

    @property
    def state(self) -> TransportState:
        return self._state

    def _set_state(self, target: TransportState) -> None:
        with self._lock:
            self._state = next_state(self._state, target)

    def _require_ready(self, where: str) -> None:
        state = self._state
        if state is TransportState.READY:
            return
        hint = {
            TransportState.REGISTERING: "; call seal() after registering its pools",
            TransportState.CLOSED: "; it was closed",
        }.get(state, self._state_hint())
        raise TransportError(f"{where}: the {self.kind} transport of {self.endpoint_name} is {state.value}{hint}")

    def serve(self, request: object) -> object:
        """What TransportEndpoint.transport_serve runs on the passive side."""
        if isinstance(request, InfoRequest):
            return self.info()
        return self._serve_backend(request)

    # ---- backend hooks -----------------------------------------------------------------
    def _sealed_state(self) -> TransportState:
        return TransportState.READY

    def _state_hint(self) -> str:
        return ""

    def _forget_backend_peer(self, info: EndpointInfo) -> None:
        return None

    def _deregister_backend(self, name: str) -> None:
        """Undo `_register_backend` of pool `name` (its memory is about to be freed)."""
        return None

    def _serve_backend(self, request: object) -> object:
        raise TransportError(f"{self.kind} endpoint {self.endpoint_name} cannot serve {type(request).__name__}")

    @abstractmethod
    def _register_backend(self, name: str, pool: torch.Tensor) -> None: ...

    @abstractmethod
    def _seal_backend(self) -> object: ...

    @abstractmethod
    def _post(self, op: str, peer: str, moves: Sequence[Move]) -> Transfer: ...

    @abstractmethod
    def _close_backend(self) -> None: ...
