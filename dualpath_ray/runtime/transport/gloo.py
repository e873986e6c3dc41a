"""gloo backend of the KV transport: two-sided send/recv of host regions over one world.

The world is a private ``ProcessGroupGloo`` over all endpoints (not torch's default group), so
forming it again after an endpoint restarts needs no process-global state. The driver forms it
(`setup_gloo_world`, gloo_world.py): it asks every endpoint for its EndpointInfo (so all are
sealed and gloo), rank 0 hosts the rendezvous ``TCPStore`` (`HostStoreRequest`, served here), and
every endpoint joins (`JoinRequest`, served here) knowing all names by rank.

A transfer is one Ray call to the passive side plus one gloo op per coalesced region on each side:
* read: post a recv per local region, then ask the peer (`SendRegions`) to send its regions; the
  peer posts the sends on a transport-group thread and answers once they completed;
* write: ask the peer (`RecvRegions`) to receive into its regions, then post the sends; the peer
  answers once its recvs completed, so a good answer proves the bytes landed.
`Transfer.done` is true when the answer is good and every local op completed.

Tags: gloo matches by (pair, direction, tag). Sends from X to Y carry tags chosen by Y for Y's
reads and by X for X's writes, so reads and writes draw from disjoint halves of the tag space,
each from a per-process counter: no two outstanding moves of one direction share a tag.

Facts about gloo's TCP transport in torch 2.13 that shape the error handling (checked on this
machine):
* a receive that times out closes the pair for good ("Application timeout caused pair closure");
* a receive whose buffer is dropped before any send is harmless, but a later send on its tag
  wedges the pair; a send without a matching receive just stays pending, other tags unaffected;
* a send posted before its receive waits for it (gloo rendezvous), so write's order is safe;
* only ``wait()`` completes a send/recv work: ``is_completed()`` stays False (and ``exception()``
  None) even after the bytes arrived or the peer died, and ``get_future()`` did not resolve either;
  so `Transfer.done` polls the peer's answer (``ray.wait``, timeout 0) and, once it is good, waits
  for the local ops, which the answer proves finished or about to;
* a dead peer fails pending ops within milliseconds (seen through ``wait()``);
* ``abort()`` on the group stops all its pairs; ops posted before it are never completed.
Hence: ops of a failed transfer are parked (kept alive) until the world is replaced, never
dropped while a send could still match them; when bytes may still land (the peer neither
answered nor died, or answered that its side failed), the initiator aborts its whole world and
reports BROKEN until a new world is formed (`on_broken` lets the actor ask the scheduler for one).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist

from dualpath_ray.runtime.transport.base import Transport
from dualpath_ray.runtime.transport.moves import (
    Move,
    PeerDiedError,
    Region,
    RegionError,
    Transfer,
    TransportError,
    TransportState,
    next_state,
)
from dualpath_ray.runtime.transport.gloo_world import HostStoreRequest, Joined, JoinRequest, StoreAddress

_MAX_TAG = 2**31 - 1
_TAG_RANGES = {"read": (1, 2**30), "write": (2**30, _MAX_TAG)}
_MIN_FINISH_S = 1.0  # local ops after a good answer get at least this long, even past the deadline


@dataclass(frozen=True)
class SendRegions:
    """Initiator of a read -> peer: send these regions of yours to rank `peer_rank`."""

    world_id: str
    regions: tuple[Region, ...]
    peer_rank: int
    tags: tuple[int, ...]


@dataclass(frozen=True)
class RecvRegions:
    """Initiator of a write -> peer: receive from rank `peer_rank` into these regions of yours."""

    world_id: str
    regions: tuple[Region, ...]
    peer_rank: int
    tags: tuple[int, ...]


@dataclass(frozen=True)
class RegionsOutcome:
    """posted: the peer posted its ops (bytes may have moved); error None: all of them completed."""

    posted: bool
    error: str | None


@dataclass(frozen=True)
class _World:
    world_id: str
    rank: int
    ranks: Mapping[str, int]
    group: Any


class _TagCounter:
    """Per-process tag counters, one per op, over disjoint ranges below gloo's int32 limit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = {op: low for op, (low, _) in _TAG_RANGES.items()}

    def allocate(self, op: str, count: int) -> tuple[int, ...]:
        low, high = _TAG_RANGES[op]
        with self._lock:
            if self._next[op] + count > high:
                self._next[op] = low
            start = self._next[op]
            self._next[op] = start + count
        return tuple(range(start, start + count))


class GlooTransfer(Transfer):
    """Local ops + the peer's answer; see the module docstring for when the world is aborted."""

    def __init__(
        self,
        op: str,
        peer: str,
        nbytes: int,
        deadline: float,
        on_done: Callable[[Transfer], None],
        transport: GlooTransport,
        world: _World,
        answer: Any,
        works: list[Any],
    ) -> None:
        super().__init__(op, peer, nbytes, deadline, on_done)
        self._transport = transport
        self._world = world
        self._answer = answer
        self._works = works
        self._answered = False

    def _poll(self) -> bool:
        if not self._transport._in_world(self._world):
            raise self._fail(f"the gloo world was aborted or replaced during the {self.op}", abort=False)
        if not self._answered:
            ready, _ = ray.wait([self._answer], timeout=0)
            if not ready:
                return False
            self._check_answer()
            self._answered = True
        self._finish_local_ops()
        return True

    def _finish_local_ops(self) -> None:
        """A good answer proves the peer's side is done, so the local ops finish at once; only
        wait() completes a gloo op, hence the (short) blocking wait here."""
        remaining = max(self._deadline - time.monotonic(), _MIN_FINISH_S)
        try:
            for work in self._works:
                work.wait(timedelta(seconds=remaining))
        except RuntimeError as exc:
            raise self._fail(f"local gloo op failed after the peer finished: {exc}", abort=False, broken=True) from exc

    def _check_answer(self) -> None:
        try:
            outcome = self._transport._reply(self.peer, self._answer, 0)
        except PeerDiedError as exc:
            raise self._fail(str(exc), abort=False, cls=PeerDiedError, broken=True) from exc
        except TransportError as exc:
            raise self._fail(str(exc), abort=True) from exc
        if not isinstance(outcome, RegionsOutcome):
            raise self._fail(f"{self.peer} answered {outcome!r}; is it a gloo endpoint?", abort=True)
        if not outcome.posted:
            raise self._fail(f"{self.peer} did not take part: {outcome.error}", abort=False)
        if outcome.error is not None:  # the peer's ops failed: ours may still complete into our regions
            raise self._fail(f"{self.peer}: {outcome.error}", abort=True, broken=True)

    def _fail(
        self, why: str, *, abort: bool, cls: type[TransportError] = TransportError, broken: bool = False
    ) -> TransportError:
        """Park the ops (and mark the pair broken), abort the world if bytes may still land; the error."""
        self._transport._park(self._works, self._world, self._rank(), broken)
        self._works = []
        if abort:
            self._transport._abort_world(self._world)
        return cls(f"gloo {self.op} with {self.peer}: {why}")

    def _abort(self, reason: str) -> TransportError:
        # Only an unanswered transfer can time out: once answered, _poll finishes or raises.
        why = f"{self.peer} did not answer in time ({reason}); this endpoint's world was aborted"
        return self._fail(why, abort=True)

    def _rank(self) -> int:
        return self._world.ranks[self.peer]


class GlooTransport(Transport):
    kind = "gloo"

    def __init__(self, endpoint_name: str, namespace: str, timeout_s: float) -> None:
        super().__init__(endpoint_name, namespace, timeout_s)
        self._world: _World | None = None
        self._master_store: tuple[str, Any] | None = None
        self._broken_ranks: set[int] = set()
        self._parked: list[Any] = []  # ops of failed transfers, alive until the world is replaced
        self._tags = _TagCounter()

    def _sealed_state(self) -> TransportState:
        return TransportState.AWAITING_WORLD

    def _state_hint(self) -> str:
        return "; a new world must be formed over all endpoints (setup_gloo_world; the scheduler does it on request)"

    def _register_backend(self, name: str, pool: torch.Tensor) -> None:
        if pool.device.type != "cpu":
            raise RegionError(
                f"register {name!r}: the pool is on {pool.device}; gloo moves host memory; use nixl on GPU nodes"
            )

    def _seal_backend(self) -> object:
        return None

    # ---- initiator ---------------------------------------------------------------------
    def _post(self, op: str, peer: str, moves: Sequence[Move]) -> Transfer:
        world = self._current_world()
        rank = world.ranks.get(peer)
        if rank is None:
            raise TransportError(f"{peer} is not in this endpoint's gloo world{self._state_hint()}")
        try:
            if rank in self._broken_ranks:
                raise TransportError(f"the gloo pair with {peer} (rank {rank}) failed earlier{self._state_hint()}")
            answer, works = self._start(op, peer, world, rank, moves)
        except PeerDiedError:
            raise
        except TransportError as exc:  # a closed pair or a failed call: a dead peer is PeerDiedError
            raise self._failure(peer, str(exc)) from exc
        return self._new_transfer(GlooTransfer, op, peer, moves, self, world, answer, works)

    def _start(self, op: str, peer: str, world: _World, rank: int, moves: Sequence[Move]) -> tuple[Any, list[Any]]:
        """Post the local ops and the request, in the order that lets each side's ops match."""
        tags = self._tags.allocate(op, len(moves))
        views = [self.view(local) for local, _ in moves]
        remote = tuple(region for _, region in moves)
        if op == "write":
            answer = self._submit(peer, RecvRegions(world.world_id, remote, world.rank, tags))
            return answer, self._post_ops(world, rank, "send", views, tags)
        works = self._post_ops(world, rank, "recv", views, tags)
        try:
            return self._submit(peer, SendRegions(world.world_id, remote, world.rank, tags)), works
        except TransportError:
            self._park(works, world, rank, broken=False)  # no send will ever carry these tags
            raise

    def _current_world(self) -> _World:
        world = self._world
        if world is None or self._state is not TransportState.READY:
            raise TransportError(f"{self.endpoint_name} is not in a usable gloo world{self._state_hint()}")
        return world

    def _post_ops(self, world: _World, rank: int, op: str, views: list[torch.Tensor], tags: Sequence[int]) -> list[Any]:
        post = world.group.recv if op == "recv" else world.group.send
        works: list[Any] = []
        try:
            for view, tag in zip(views, tags):
                works.append(post([view], rank, tag))
        except RuntimeError as exc:
            self._park(works, world, rank, broken=True)
            raise TransportError(f"gloo: cannot post a {op} with rank {rank}: {exc}") from exc
        return works

    def _in_world(self, world: _World) -> bool:
        return self._world is world and self._state is TransportState.READY

    def _park(self, works: list[Any], world: _World, rank: int, broken: bool) -> None:
        with self._lock:
            if self._world is world:
                self._parked.extend(works)
                if broken:
                    self._broken_ranks.add(rank)

    def _abort_world(self, world: _World) -> None:
        """Bytes of a failed transfer may still land: stop every pair of this world."""
        with self._lock:
            if self._world is not world or self._state is not TransportState.READY:
                return
            self._state = next_state(self._state, TransportState.BROKEN)
        world.group.abort()
        if self.on_broken is not None:
            self.on_broken()

    # ---- passive side ------------------------------------------------------------------
    def _serve_backend(self, request: object) -> object:
        if isinstance(request, SendRegions):
            return self._serve_regions(request, "send")
        if isinstance(request, RecvRegions):
            return self._serve_regions(request, "recv")
        if isinstance(request, HostStoreRequest):
            return self._serve_host_store(request)
        if isinstance(request, JoinRequest):
            return self._serve_join(request)
        return super()._serve_backend(request)

    def _serve_regions(self, request: SendRegions | RecvRegions, op: str) -> RegionsOutcome:
        world = self._world
        if not (world is not None and self._in_world(world) and world.world_id == request.world_id):
            return RegionsOutcome(False, f"{self.endpoint_name} is not in gloo world {request.world_id} (or broken)")
        if request.peer_rank in self._broken_ranks:
            return RegionsOutcome(False, f"the pair with rank {request.peer_rank} failed earlier")
        if len(request.tags) != len(request.regions):
            return RegionsOutcome(False, f"{len(request.tags)} tags for {len(request.regions)} regions")
        try:
            views = [self.view(region) for region in request.regions]
        except RegionError as exc:
            return RegionsOutcome(False, str(exc))
        try:
            works = self._post_ops(world, request.peer_rank, op, views, request.tags)
            for work in works:
                work.wait(timedelta(seconds=self.timeout_s))
        except (RuntimeError, TransportError) as exc:
            with self._lock:
                # Only a pair of the world these ops ran in: a world replaced meanwhile (an
                # endpoint restarted, `_serve_join`) aborted them, and marking the new world's pair
                # broken would fail every later transfer of that pair, all retries included,
                # until yet another world formed.
                if self._world is world:
                    self._broken_ranks.add(request.peer_rank)
            return RegionsOutcome(True, f"{op} failed: {exc}")
        return RegionsOutcome(True, None)

    def _serve_host_store(self, request: HostStoreRequest) -> StoreAddress:
        host = ray.util.get_node_ip_address()
        timeout = timedelta(seconds=request.timeout_s)
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        with self._lock:
            self._master_store = (request.world_id, store)
        return StoreAddress(host, store.port)

    def _serve_join(self, request: JoinRequest) -> Joined:
        if self._state is TransportState.REGISTERING:
            raise TransportError(f"join: {self.endpoint_name} is still registering; seal() it first")
        next_state(self._state, TransportState.READY)  # a closed endpoint refuses before any socket opens
        if request.endpoints[request.rank] != self.endpoint_name:
            raise TransportError(f"join: rank {request.rank} is {request.endpoints[request.rank]!r}, not this endpoint")
        timeout = timedelta(seconds=request.timeout_s)
        store = self._rendezvous_store(request, timeout)
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=ray.util.get_node_ip_address())]
        prefixed = dist.PrefixStore(f"dualpath/{request.world_id}", store)
        group = dist.ProcessGroupGloo(prefixed, request.rank, len(request.endpoints), options)
        ranks = {name: rank for rank, name in enumerate(request.endpoints)}
        with self._lock:
            self._state = next_state(self._state, TransportState.READY)
            previous, self._world = self._world, _World(request.world_id, request.rank, ranks, group)
            self._broken_ranks, self._parked = set(), []
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
            self._master_store, self._parked = None, []
        if world is not None:
            world.group.abort()
