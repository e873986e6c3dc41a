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
"""

from __future__ import annotations

import enum
import math
import os
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import ray
import torch

TRANSPORT_GROUP = "transport"
TRANSPORT_KINDS = ("nixl", "gloo", "verbs")
OPS = ("read", "write")
_SPIN_S = 0.001  # wait() polls without sleeping this long: NIXL moves of <= 4 MiB finish inside it
_FIRST_PAUSE_S = 50e-6
_MAX_PAUSE_S = 1e-3
_PROBE_TIMEOUT_S = 5.0  # bound on the liveness probe that classifies a failed transfer


class TransportError(RuntimeError):
    """A move cannot be done or did not complete; its destination regions are undefined."""


class PeerDiedError(TransportError):
    """The peer endpoint is dead, restarted or unknown: its regions are gone."""


class RegionError(TransportError):
    """A region is outside its pool, sizes differ, the pool is unknown, or a view is unusable."""


@dataclass(frozen=True)
class Region:
    """Bytes [offset, offset + nbytes) of the registered pool `pool` of one endpoint."""

    pool: str
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


Move = tuple[Region, Region]  # (local region, remote region), equal nbytes


@dataclass(frozen=True)
class PoolInfo:
    name: str
    nbytes: int
    device: str  # "cpu" or "cuda:0"


@dataclass(frozen=True)
class EndpointInfo:
    """What a peer needs to address this endpoint; fetched once per peer."""

    endpoint: str
    incarnation: str
    kind: str
    pools: tuple[PoolInfo, ...]
    backend: object


@dataclass(frozen=True)
class TransportStats:
    posted: int = 0  # transfers posted to a peer or copied locally
    descriptors: int = 0  # contiguous moves after coalescing
    bytes_read: int = 0  # bytes of completed reads
    bytes_written: int = 0  # bytes of completed writes
    peer_calls: int = 0  # Ray actor calls this transport issued itself


@dataclass(frozen=True)
class InfoRequest:
    """Any peer -> endpoint: your EndpointInfo."""


class TransportState(enum.Enum):
    REGISTERING = "registering"  # pools may be registered; no moves until seal()
    AWAITING_WORLD = "awaiting_world"  # gloo only: sealed, no world joined yet
    READY = "ready"
    BROKEN = "broken"  # gloo only: the world is unusable until setup_gloo_world runs again
    CLOSED = "closed"


_TRANSITIONS: dict[TransportState, frozenset[TransportState]] = {
    TransportState.REGISTERING: frozenset(
        {TransportState.AWAITING_WORLD, TransportState.READY, TransportState.CLOSED}
    ),
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


def check_region(region: object, pools: Mapping[str, PoolInfo], owner: str, where: str) -> Region:
    """`region` must lie inside one of `owner`'s pools; messages name the field and the fix."""
    if not isinstance(region, Region):
        raise RegionError(f"{where} is {type(region).__name__}, not a Region; build it with region_of(pool, view)")
    pool = pools.get(region.pool)
    if pool is None:
        raise RegionError(f"{where}.pool {region.pool!r} is not a pool of {owner}; its pools are {sorted(pools)}")
    if not isinstance(region.offset, int) or region.offset < 0:
        raise RegionError(f"{where}.offset is {region.offset!r}; it must be an int >= 0")
    if not isinstance(region.nbytes, int) or region.nbytes <= 0:
        raise RegionError(f"{where}.nbytes is {region.nbytes!r}; it must be an int > 0")
    if region.end > pool.nbytes:
        raise RegionError(
            f"{where} ends at byte {region.end}, past the end of {owner}'s pool {pool.name!r} "
            f"({pool.nbytes} bytes); shrink nbytes or fix the offset"
        )
    return region


def check_moves(moves: object, where: str) -> list[Move]:
    """A non-empty sequence of (local, remote) Region pairs of equal size."""
    if not isinstance(moves, Sequence) or isinstance(moves, (str, bytes)) or not moves:
        raise RegionError(f"{where}: moves must be a non-empty list of (local, remote) Region pairs")
    checked: list[Move] = []
    for index, move in enumerate(moves):
        if not isinstance(move, tuple) or len(move) != 2:
            raise RegionError(f"{where}: moves[{index}] must be a (local Region, remote Region) tuple")
        local, remote = move
        if isinstance(local, Region) and isinstance(remote, Region) and local.nbytes != remote.nbytes:
            raise RegionError(
                f"{where}: moves[{index}] local nbytes {local.nbytes} != remote nbytes {remote.nbytes}; "
                "a move copies equal byte counts"
            )
        checked.append((local, remote))
    return checked


def coalesce_moves(moves: Sequence[Move]) -> list[Move]:
    """Merge each move into the previous one when both sides continue it, keeping list order.

    A run of blocks in consecutive slots then costs one descriptor / one gloo message."""
    merged: list[Move] = []
    for local, remote in moves:
        if merged:
            last_local, last_remote = merged[-1]
            if (
                local.pool == last_local.pool
                and remote.pool == last_remote.pool
                and local.offset == last_local.end
                and remote.offset == last_remote.end
            ):
                nbytes = last_local.nbytes + local.nbytes
                merged[-1] = (
                    Region(local.pool, last_local.offset, nbytes),
                    Region(remote.pool, last_remote.offset, nbytes),
                )
                continue
        merged.append((local, remote))
    return merged


class Transfer:
    """One posted move (read or write) of a list of regions. Thread-safe to poll.

    The outcome is sticky: once done() returned True it stays True, once it raised every later
    call raises the same error. A transfer still running at its deadline (posted + the
    transport's timeout_s) or when wait(timeout_s) expires is aborted, then fails."""

    def __init__(
        self, op: str, peer: str, nbytes: int, deadline: float, on_done: Callable[[Transfer], None]
    ) -> None:
        self.op = op
        self.peer = peer
        self.nbytes = nbytes
        self._deadline = deadline
        self._on_done = on_done
        self._lock = threading.Lock()
        self._finished = False
        self._error: TransportError | None = None

    def done(self) -> bool:
        """Polls the backend once; True once every byte landed; raises TransportError on failure."""
        with self._lock:
            return self._advance(None)

    def wait(self, timeout_s: float | None = None) -> int:
        """Blocks (spins briefly, then short sleeps) until done; returns nbytes; raises on failure.

        timeout_s=None waits up to the transfer's deadline."""
        start = time.monotonic()
        limit = math.inf if timeout_s is None else start + timeout_s
        pause = _FIRST_PAUSE_S
        while True:
            now = time.monotonic()
            with self._lock:
                if self._advance(f"wait({timeout_s}) expired" if now >= limit else None):
                    return self.nbytes
            if now - start >= _SPIN_S:
                time.sleep(pause)
                pause = min(2 * pause, _MAX_PAUSE_S)

    def _advance(self, give_up: str | None) -> bool:
        if self._finished:
            return True
        if self._error is not None:
            raise self._error
        try:
            if self._poll():
                self._finished = True
                self._on_done(self)
                return True
            if give_up is None and time.monotonic() >= self._deadline:
                give_up = "did not complete before the transport timeout"
            if give_up is not None:
                raise self._abort(give_up)
        except TransportError as exc:
            self._error = exc
            raise
        return False

    # ---- backend hooks -----------------------------------------------------------------
    def _poll(self) -> bool:
        """Advance the backend once; True when complete; raise TransportError on failure."""
        return True

    def _abort(self, reason: str) -> TransportError:
        """Give up: after this returns no byte of this transfer may land; the error to raise."""
        return TransportError(f"{self.op} with {self.peer}: {reason}")


class _Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = {f.name: 0 for f in fields(TransportStats)}

    def add(self, **increments: int) -> None:
        with self._lock:
            for name, value in increments.items():
                self._values[name] += value

    def snapshot(self) -> TransportStats:
        with self._lock:
            return TransportStats(**self._values)


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
        self._counters = _Counters()
        # Called (once per abort) when this endpoint's world becomes unusable (gloo's BROKEN),
        # so the actor can ask for a new one (runtime/restarts.py TransportKeeper).
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

    def release_memory(self) -> int:
        """Free every registered pool's memory (an engine going to sleep): each is deregistered
        and its storage shrunk to nothing; moves fail until `restore_memory`. The caller makes
        sure no transfer is in flight. Returns the bytes freed."""
        with self._lock:
            if self._released:
                return 0
            if self._state in (TransportState.REGISTERING, TransportState.CLOSED):
                raise TransportError(f"release_memory: {self.endpoint_name} is {self._state.value}")
            freed = 0
            for name, pool in self._pools.items():
                self._deregister_backend(name)
                freed += pool.untyped_storage().nbytes()
                pool.untyped_storage().resize_(0)
            self._released = True
        if any(p.device.type == "cuda" for p in self._pools.values()):
            torch.cuda.empty_cache()
        return freed

    def restore_memory(self) -> None:
        """Allocate the pools again (zeroed; every tensor viewing them sees the new memory),
        register them, and publish the new addressing under a new incarnation, so a peer that
        cached the old one finds out and fetches this one."""
        with self._lock:
            if not self._released:
                return
            for name, pool in self._pools.items():
                pool.untyped_storage().resize_(self._pool_infos[name].nbytes)
                pool.zero_()
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


class TransportEndpoint:
    """Mixin for endpoint actor classes: lets a peer's transport call into this actor."""

    _endpoint_transport: Transport | None = None

    def attach_transport(self, transport: Transport) -> Transport:
        """Install this actor's transport; its endpoint name must be the actor's Ray name."""
        actor_name = ray.get_runtime_context().get_actor_name()
        if actor_name and actor_name != transport.endpoint_name:
            raise TransportError(
                f"endpoint name {transport.endpoint_name!r} differs from the actor's Ray name "
                f"{actor_name!r}; peers find endpoints by name, so make them equal"
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
    """Options for ``@ray.remote(**...)`` on an endpoint class: the transport group and yours."""
    if transport_threads < 1:
        raise TransportError(f"transport_threads must be >= 1 (got {transport_threads})")
    return {"concurrency_groups": {TRANSPORT_GROUP: transport_threads, **(extra_concurrency_groups or {})}}


def make_transport(
    kind: str,
    endpoint_name: str,
    *,
    namespace: str,
    timeout_s: float = 60.0,
    service_level: int | None = None,
    traffic_class: int | None = None,
    ucx_tls: str | None = None,
    ucx_net_devices: str | None = None,
    verbs_settings: Any = None,
    verbs_device: str | None = None,
) -> Transport:
    """Build this process's transport; UCX knobs are applied to the process environment first.

    `verbs` (transport_verbs.py) takes its port settings from `verbs_settings` (a VerbsConfig)
    and `verbs_device`, and puts service_level / traffic_class into its queue pairs."""
    from dualpath_ray.runtime.transport_nixl import (
        apply_ucx_environment,
        ucx_environment,
    )

    if kind not in TRANSPORT_KINDS:
        raise TransportError(f"runtime.transport: unknown kind {kind!r}; use one of {TRANSPORT_KINDS}")
    if not endpoint_name:
        raise TransportError("endpoint_name must be the actor's Ray name, e.g. 'reader/n1'")
    if timeout_s <= 0:
        raise TransportError(f"timeout_s must be > 0 (got {timeout_s})")
    ucx = ucx_environment(service_level=service_level, traffic_class=traffic_class, tls=ucx_tls, net_devices=ucx_net_devices)
    apply_ucx_environment(ucx)
    if ucx:
        # The KV class knobs act only where UCX runs on an IB/RoCE device; on TCP or shared
        # memory UCX would warn at every agent start that they are unused. A user's own setting wins.
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    if kind == "nixl":
        from dualpath_ray.runtime.transport_nixl import NixlTransport

        return NixlTransport(endpoint_name, namespace, timeout_s)
    if kind == "verbs":
        from dualpath_ray.runtime.transport_verbs import make_verbs_transport

        return make_verbs_transport(
            endpoint_name, namespace, timeout_s, settings=verbs_settings, device=verbs_device,
            service_level=service_level, traffic_class=traffic_class,
        )
    from dualpath_ray.runtime.transport_gloo import GlooTransport

    return GlooTransport(endpoint_name, namespace, timeout_s)


def setup_gloo_world(endpoints: Sequence[Any], *, timeout_s: float = 60.0) -> Any:
    """Driver side: form one gloo world over these sealed endpoint actor handles (ranks = order)."""
    from dualpath_ray.runtime.transport_gloo import form_gloo_world

    return form_gloo_world(endpoints, timeout_s=timeout_s)
