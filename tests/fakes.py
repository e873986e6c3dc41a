"""In-process fakes of the engine cores' ports, so a whole request's life runs in one process.

- `Fabric`: every endpoint's registered pools by name; `FakeTransport` moves bytes between them
  with the same Region/Move contract as the real transports (bounds checked), optionally failing
  or holding transfers until released (to prove the pipeline overlaps and waits correctly).
- `FakeReaders`: the real `ReaderCore` of each node (real store, real buffer pool, real SNIC
  accounting), called synchronously or on a thread (`slow_writes_s` delays every persist).
- `FakeSnicLink`, `ScriptedFaults`: a ReaderCore's own SNIC links and fault plan, recorded and
  scripted, to run the reader core with no real link or plan.
- `ScriptedContinuousPrefill`: a compute's own prefill loop whose chunks finish when the test says.
- `Collector`: the scheduler port, keeping every reported TurnResult, handoff note and chunk;
  `DirectHandoff`: the decode port, handing straight to in-process DecodeCores.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from dualpath_ray.faults.injector import FaultCount, fault_label
from dualpath_ray.faults.plan import FaultMode, FaultSite, FaultSpec
from dualpath_ray.kv.paged_block_layers import PagedBlockLayers
from dualpath_ray.protocol.types import ReadPath
from dualpath_ray.protocol.messages import (
    DecodeHandoff, ExtentGrant, Holding, PersistedBlock, StagedRead, TokenChunk, TurnResult,
)
from dualpath_ray.protocol.names import Pool
from dualpath_ray.runtime.compute.continuous_prefill import PrefillCollected
from dualpath_ray.runtime.compute.prefill_kv import PrefillMoved
from dualpath_ray.runtime.engine.ports import Failed, Ready
from dualpath_ray.runtime.reader.core import ReaderCore
from dualpath_ray.runtime.reader.page_pulls import pull_moves, settle_pulled
from dualpath_ray.runtime.transport.moves import Move, Region, RegionError
from dualpath_ray.scheduling.staging import StageOrder


class Fabric:
    """Registered pools of every endpoint: endpoint -> pool name -> uint8 byte view."""

    def __init__(self) -> None:
        self.pools: dict[str, dict[str, torch.Tensor]] = {}

    def register(self, endpoint: str, name: str, tensor: torch.Tensor) -> None:
        self.pools.setdefault(endpoint, {})[name] = tensor.view(-1).view(torch.uint8)

    def view(self, endpoint: str, region: Region) -> torch.Tensor:
        pool = self.pools.get(endpoint, {}).get(region.pool)
        if pool is None:
            raise RegionError(f"{endpoint} has no pool {region.pool!r}")
        if region.offset < 0 or region.offset + region.nbytes > pool.numel():
            raise RegionError(f"{region} is outside {endpoint}'s pool of {pool.numel()} bytes")
        return pool[region.offset : region.offset + region.nbytes]


class FakeTransfer:
    """A move that happens at once, or (lazy) only when someone waits for it: polls report it
    still in flight, so a test sees exactly which waits the caller's critical path contains."""

    def __init__(self, run: Callable[[], int], lazy: bool) -> None:
        self._run = run
        self._result: int | None = None
        self._error: BaseException | None = None
        self._moved = False
        self.waited = False
        if not lazy:
            self._move()

    def _move(self) -> None:
        if self._moved:
            return
        self._moved = True
        try:
            self._result = self._run()
        except BaseException as exc:  # noqa: BLE001 - surfaced by done()/wait()
            self._error = exc

    def done(self) -> bool:
        if self._error is not None:
            raise self._error
        return self._moved

    def wait(self, timeout_s: float | None = None) -> int:
        self.waited = True
        self._move()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


@dataclass
class FakeTransport:
    """TransportPort of one endpoint over a Fabric."""

    fabric: Fabric
    endpoint: str
    lazy: bool = False
    fail_reads: int = 0
    fail_writes: int = 0
    log: list[tuple[str, str, int]] = field(default_factory=list)
    events: list[str] | None = None

    def read(self, peer: str, moves: Sequence[Move]) -> FakeTransfer:
        return self._move("read", peer, moves)

    def write(self, peer: str, moves: Sequence[Move]) -> FakeTransfer:
        return self._move("write", peer, moves)

    def _move(self, op: str, peer: str, moves: Sequence[Move]) -> FakeTransfer:
        nbytes = sum(local.nbytes for local, _ in moves)
        self.log.append((op, peer, nbytes))
        if self.events is not None:
            self.events.append(f"post {op} {peer}")
        failing = (op == "read" and self.fail_reads > 0) or (op == "write" and self.fail_writes > 0)
        if failing:
            if op == "read":
                self.fail_reads -= 1
            else:
                self.fail_writes -= 1

        def run() -> int:
            if failing:
                raise RuntimeError(f"injected {op} failure towards {peer}")
            for local, remote in moves:
                if local.nbytes != remote.nbytes:
                    raise RegionError(f"{local} and {remote} differ in size")
                mine, theirs = self.fabric.view(self.endpoint, local), self.fabric.view(peer, remote)
                (mine if op == "read" else theirs).copy_(theirs if op == "read" else mine)
            return nbytes

        return FakeTransfer(run, self.lazy)


class FakeReaders:
    """ReaderPort over real ReaderCores (one per node) sharing one store root."""

    def __init__(self, cores: dict[str, ReaderCore], fabric: Fabric, slow_writes_s: float = 0.0) -> None:
        self.cores = cores
        self.fabric = fabric
        self.slow_writes_s = slow_writes_s
        self.fail_read_hits = 0
        # While set and not open, leases wait for it on a helper thread (a pool that is full).
        self.lease_gate: threading.Event | None = None
        # While set and not open, page pulls (persist_pages) wait for it after their lease and
        # before they copy the pages: a D2H the engine's wait gives up on while it still runs.
        self.pull_gate: threading.Event | None = None
        self.calls: list[str] = []
        self.engines_by_owner: dict[str, str] = {}
        self._pool = ThreadPoolExecutor(max_workers=4)
        for node, core in cores.items():
            fabric.register(f"reader/{node}", Pool.BUFFER, core.pool.buffer)

    def read_hits(
        self, node_id: str, owner: str, keys: Sequence[str], total_blocks: int, path: ReadPath, first_block: int = 0,
        staged: StagedRead | None = None,
    ) -> Any:
        self.calls.append("read_hits")
        if self.fail_read_hits:
            self.fail_read_hits -= 1
            return Failed(RuntimeError(f"injected read failure on {node_id}"))
        core = self.cores[node_id]
        return Ready(core.read_hits(owner, keys, total_blocks, path, f"reader/{node_id}", first_block, staged))

    def stage_ahead(self, orders: Sequence[StageOrder], now: float) -> None:
        """As the reader actor's stage_ahead, synchronously, on the test's clock `now` (expire
        staged extents with `cores[node].expire(now)`)."""
        self.calls.append("stage_ahead")
        for order in orders:
            self.cores[order.node_id].stage_ahead(order, now)

    def lease(self, node_id: str, owner: str, n_blocks: int) -> Any:
        self.calls.append("lease")
        core = self.cores[node_id]
        gate = self.lease_gate
        if gate is not None:
            def gated() -> ExtentGrant:
                gate.wait()
                return core.grant(core.lease(owner, n_blocks), f"reader/{node_id}")

            return _FuturePending(self._pool.submit(gated))
        return Ready(core.grant(core.lease(owner, n_blocks), f"reader/{node_id}"))

    def free(self, grant: ExtentGrant) -> None:
        self.calls.append("free")
        self.cores[grant.node_id].free(grant.extent_id)

    def reclaim(self, node_id: str, owner: str) -> None:
        self.calls.append("reclaim")
        self.cores[node_id].reclaim(owner)

    def persist_extent(self, grant: ExtentGrant, blocks: Sequence[tuple[int, PersistedBlock]]) -> Any:
        self.calls.append("persist_extent")
        return _FuturePending(self._pool.submit(self._slow, self.cores[grant.node_id].write_extent, grant.extent_id, list(blocks)))

    def persist_pages(
        self, node_id: str, owner: str, blocks: Sequence[tuple[int, PersistedBlock]], paged: PagedBlockLayers | None = None,
    ) -> Any:
        """Like the actor: lease slots, copy the engine's pages in (D2H: the same moves,
        runtime/reader/page_pulls.py), make them Full Blocks, write, free."""
        self.calls.append("persist_pages")
        core = self.cores[node_id]
        engine = self.engines_by_owner[owner]

        def run() -> int:
            extent = core.lease(owner, len(blocks))
            core.begin_write(extent.extent_id)  # as the actor: reclaim must not free it under the D2H
            try:
                if self.pull_gate is not None:
                    self.pull_gate.wait()
                buffer = core.pool.buffer.view(-1)
                pages = [page for page, _ in blocks]
                for local, remote in pull_moves(extent.slots, pages, core.layout.full_block_bytes, paged):
                    buffer[local.offset : local.end].copy_(self.fabric.view(engine, remote))
                slots = [core.pool.full_block(slot) for slot in extent.slots]
                settle_pulled(slots, paged)
                return core.write_blocks([(data, b) for data, (_, b) in zip(slots, blocks)])
            finally:
                core.end_write(extent.extent_id)

        return _FuturePending(self._pool.submit(self._slow, run))

    def _slow(self, fn: Callable[..., int], *args: Any) -> int:
        if self.slow_writes_s:
            time.sleep(self.slow_writes_s)
        return fn(*args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _FuturePending:
    def __init__(self, future: Future[int]) -> None:
        self.future = future

    def done(self) -> bool:
        if self.future.done():
            self.future.result()
            return True
        return False

    def wait(self, timeout_s: float | None = None) -> int:
        return self.future.result(timeout_s)


@dataclass
class Collector:
    """SchedulerPort: every reported result, optionally checked as it arrives."""

    results: list[TurnResult] = field(default_factory=list)
    on_result: Callable[[TurnResult], None] | None = None

    chunks: list[TokenChunk] = field(default_factory=list)
    handed_off_notes: list[dict[str, Holding]] = field(default_factory=list)
    reports: int = 0

    def report(
        self, handed_off: dict[str, Holding], results: Sequence[TurnResult], chunks: Sequence[TokenChunk]
    ) -> Ready[None]:
        self.reports += 1
        if handed_off:
            self.handed_off_notes.append(dict(handed_off))
        self.chunks.extend(chunks)
        for result in results:
            if self.on_result is not None:
                self.on_result(result)
            self.results.append(result)
        return Ready(None)


@dataclass
class DirectHandoff:
    """DecodePort: hands off to in-process decode cores by engine name, or just records."""

    cores: dict[str, Any] = field(default_factory=dict)
    readers: FakeReaders | None = None
    handoffs: list[DecodeHandoff] = field(default_factory=list)
    calls: int = 0

    def hand_off(self, engine: str, handoffs: Sequence[DecodeHandoff]) -> Ready[None]:
        self.calls += 1
        self.handoffs.extend(handoffs)
        if self.readers is not None:
            for handoff in handoffs:
                self.readers.engines_by_owner[handoff.task.request.owner] = engine
        if engine in self.cores:
            self.cores[engine].hand_off(list(handoffs))
        return Ready(None)


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.value = start

    def now(self) -> float:
        self.value += 0.001
        return self.value


# --- a storage reader's own collaborators (runtime/reader/core.py) --------------------------


@dataclass
class FakeSnicLink:
    """SnicLink (runtime/reader/snic.py) that records every charge and never waits: a test sees
    exactly which blocks a reader core paid for, and in what order relative to `events`."""

    name: str
    takes: list[int] = field(default_factory=list)
    events: list[str] | None = None

    @property
    def turns(self) -> None:
        return None  # never emulated: no FIFO turns to take

    @property
    def bytes_total(self) -> int:
        return sum(self.takes)

    def take(self, nbytes: int) -> None:
        self.takes.append(nbytes)
        if self.events is not None:
            self.events.append(f"take {self.name}")


class ScriptedFaults:
    """ReaderFaults with a script instead of a plan: each `decide` at a site pops that site's next
    mode (None: no fault; an empty script: no fault either), so a test picks the exact event a
    fault hits. Without any script it is inactive, and a core that asks it anyway fails loudly."""

    def __init__(self, script: dict[FaultSite, list[FaultMode | None]] | None = None, seed: int = 0) -> None:
        self.script = {site: list(modes) for site, modes in (script or {}).items()}
        self.corruption_rng = random.Random(seed)
        self.asked: list[FaultSite] = []
        self._counts: dict[str, FaultCount] = {}

    @property
    def active(self) -> bool:
        return bool(self.script)

    def decide(self, site: FaultSite, method: str | None = None) -> FaultSpec | None:
        assert self.active, "an inactive fault plan must never be asked"
        self.asked.append(site)
        modes = self.script.get(site, [])
        mode = modes.pop(0) if modes else None
        if mode is None:
            return None
        spec = FaultSpec(site=site, mode=mode, nth=1)
        count = self._counts.setdefault(fault_label(spec), FaultCount())
        count.events += 1
        count.injected += 1
        return spec

    def counts(self) -> dict[str, FaultCount]:
        return {label: FaultCount(c.events, c.injected) for label, c in self._counts.items()}


# --- state a restarted actor finds again (runtime/restarts/kept_state.py) ----------------------


class FakeKeptState:
    """KeptState in a dict instead of Ray's GCS: the record survives what a test calls a restart."""

    def __init__(self) -> None:
        self.record: dict[str, Any] = {}

    def save(self, state: dict[str, Any]) -> None:
        import json

        self.record = json.loads(json.dumps(state, sort_keys=True))  # what the GCS keeps: JSON

    def load(self) -> dict[str, Any]:
        return dict(self.record)

    def forget(self) -> None:
        self.record = {}


# --- a store read caught halfway (runtime/reader/extents.py) ---------------------------------


class GatedStore:
    """A block store (wrapping a real one) whose get_many_into reads one block at a time, as the
    real one's contract says (before_read(i), the read, on_verified(i)), and before block
    `pause_at` sets `paused` and waits for `proceed`: a store read a test catches halfway, to
    free or reclaim its extent under it. `read_after_pause` counts the blocks it read after."""

    def __init__(self, inner: Any, pause_at: int = 1, timeout_s: float = 30.0) -> None:
        self.inner = inner
        self.pause_at = pause_at
        self.timeout_s = timeout_s
        self.paused = threading.Event()
        self.proceed = threading.Event()
        self.read_after_pause = 0

    def get_many_into(
        self, keys: Sequence[str], outs: Sequence[torch.Tensor],
        before_read: Callable[[int], object] | None = None, on_verified: Callable[[int], object] | None = None,
        on_failed: Callable[[int, BaseException], object] | None = None,
    ) -> None:
        for index, (key, out) in enumerate(zip(keys, outs)):
            if index == self.pause_at:
                self.paused.set()
                assert self.proceed.wait(self.timeout_s), "the test never let the gated read go on"
            if before_read is not None:
                before_read(index)
            try:
                self.inner.get_into(key, out)
            except BaseException as exc:
                if on_failed is not None:
                    on_failed(index, exc)
                raise
            if index >= self.pause_at:
                self.read_after_pause += 1
            if on_verified is not None:
                on_verified(index)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class ScriptedContinuousPrefill:
    """ContinuousPrefill (runtime/compute/continuous_prefill.py) whose chunks finish when the test
    says so (`finish`): it moves no KV and samples `token` for each, recording every admission."""

    def __init__(self) -> None:
        self.admissions: list[list[tuple[str, Any]]] = []  # per admit call: (ticket, ChunkSpec)
        self.open = True  # what `admitting` answers
        self.wakes = 0
        self._done: list[Any] = []
        self._wake: Callable[[], None] = lambda: None
        self._tickets = 0

    def bind_wake(self, wake: Callable[[], None]) -> None:
        self._wake = wake

    def admitting(self) -> bool:
        return self.open

    def admit(self, chunks: Sequence[Any]) -> list[str]:
        tickets = [f"t{self._tickets + i}" for i in range(len(chunks))]
        self._tickets += len(chunks)
        self.admissions.append(list(zip(tickets, chunks)))
        return tickets

    def ticket(self, prompt_len: int, start: int) -> str:
        """The ticket of the admitted chunk of the `prompt_len`-token prompt starting at `start`."""
        found = [t for batch in self.admissions for t, c in batch if len(c.prompt) == prompt_len and c.start == start]
        assert len(found) == 1, f"one chunk of a {prompt_len}-token prompt from {start} admitted, found {found}"
        return found[0]

    def finish(self, ticket: str, token: int = 7, error: BaseException | None = None) -> None:
        self._done.append(PrefillCollected(ticket, token, -0.5) if error is None else PrefillCollected(ticket, error=error))
        self.wakes += 1
        self._wake()

    def collect(self) -> list[PrefillCollected]:
        done, self._done = self._done, []
        return done

    def take_moved(self) -> PrefillMoved:
        return PrefillMoved(reads=1)
