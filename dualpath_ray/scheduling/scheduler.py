"""The scheduler core: every decision of the central scheduler, with no Ray and no torch.

It owns one `Request` record per request in flight (scheduling/requests.py), the prefix index
that finds each prompt's hit blocks (leaving one token to compute; at submit and again at
placement, scheduling/binding.py), the constants alpha and
beta, decode and prefill placement and the read path (the dispatcher and the policy), the
tasks handed to the engines, and which engines and readers may take work. The runtime's
Scheduler actor (runtime/control/scheduler.py) is a shell around it that adds futures, heartbeats and
Ray calls; the cluster simulator (sim/) drives the very same object with simulated reports.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Callable, Protocol

from dualpath_ray.kv.index import PrefixIndex
from dualpath_ray.protocol.messages import (
    DecodeReservation,
    ErrorKind,
    GroupReport,
    Holding,
    PeerState,
    PrefillTask,
    RequestSpec,
    TurnResult,
)
from dualpath_ray.scheduling.binding import HitBinder
from dualpath_ray.scheduling.core_settings import CoreSettings
from dualpath_ray.scheduling.dispatcher import Dispatcher
from dualpath_ray.scheduling.liveness import is_attempt
from dualpath_ray.scheduling.loads import decode_tokens
from dualpath_ray.scheduling.requests import Request, RequestState
from dualpath_ray.scheduling.sharing import InFlightSharing
from dualpath_ray.scheduling.staging import StageOrder, StagingBook
from dualpath_ray.protocol.types import Mode, ReadPath, Role

if TYPE_CHECKING:
    from dualpath_ray.kv.eviction import LRUEviction


class BlockDeleter(Protocol):
    def delete(self, key: str) -> bool: ...


class SchedulerCore:
    """The scheduler's state and decisions. `eviction` (the store's capacity) and `store` (to
    delete a corrupt block before its recompute) are optional: the simulator has neither.
    `clock` times the staged chains' orders (scheduling/staging.py): the simulator's event time,
    the runtime's monotonic clock."""

    def __init__(
        self, settings: CoreSettings, index: PrefixIndex,
        eviction: LRUEviction | None = None, store: BlockDeleter | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.mode = settings.mode
        self.epoch = settings.epoch
        self.index = index
        self.eviction = eviction
        self.store = store
        self.binder = HitBinder(index, settings.block_size, eviction, late=settings.bind_hits == "late",
                                partial=settings.partial_block_hits)
        sharing = None
        if settings.share_in_flight is not None and settings.mode is not Mode.ORACLE:
            sharing = InFlightSharing(settings.share_in_flight, index, settings.block_size,  # type: ignore[arg-type]
                                      settings.early_prompt_publish, settings.partial_block_hits)
        self.dispatcher = Dispatcher(
            settings.constants, settings.mode, settings.read_split, settings.decode_groups, settings.compute_path,
            self.binder, sharing,
        )
        self.dead: set[str] = set()  # engines gone for good
        self.presumed_dead: set[str] = set()  # silent past the heartbeat timeout; see _live
        self.readmitted = 0
        self.unpublished_blocks = 0  # persisted blocks whose chain was gone from the index (not indexed)
        self.reread_elsewhere: dict[str, int] = {}  # retries read through the other side's reader, by cause
        # Engines that said they do not hold the published weights yet (restarted, catching up):
        # no work until they say they do (runtime/engine/held_weights.py).
        self.unready: set[str] = set()
        self.readers_dead: set[str] = set()  # nodes whose reader is gone for good
        self.readers_unavailable: set[str] = set()  # nodes whose reader is silent or restarting
        self.clock = clock
        self.staging = StagingBook(settings.staging)
        self._stage_orders: list[StageOrder] = []  # planned, not yet taken by the driver

    @property
    def requests(self) -> dict[str, Request]:
        return self.dispatcher.requests

    # --- submit -------------------------------------------------------------------------

    def lookup(self, spec: RequestSpec) -> tuple[tuple[str, ...], int]:
        """Hit blocks of a prompt, leaving at least one token to compute (it yields the logits)."""
        return self.binder.lookup(spec)

    def submit(self, spec: RequestSpec) -> Request:
        """Queue a turn's attempt; a new turn that finds the queue full raises QueueFull
        (scheduling/admission.py), before anything of it is recorded. Its hits are looked up
        now and again when it is placed (scheduling/binding.py)."""
        self.settings.admission.check(spec.request_id, spec.attempt, self.dispatcher.queued)
        reserved = decode_tokens(len(spec.prompt), spec.sampling.max_new_tokens, self.settings.block_size)
        request = Request(spec.request_id, len(spec.prompt), 0, reserved, (), spec, avoid_reader=spec.avoid_reader)
        self.binder.bind(request)
        if len(self.staging) and request.hit_keys:
            request.staged = self.staging.claim(request.hit_keys, self.clock())
        self.dispatcher.submit(request)
        if self.eviction is not None:
            self.eviction.pin(request.hit_keys)  # unpinned when it leaves the dispatcher (_released)
        return request

    # --- placement ----------------------------------------------------------------------

    def fetch_decode(self, report: GroupReport) -> list[DecodeReservation]:
        self._note_read_q(report)
        if not self.takes_work(Role.DECODE, report):
            return []
        return [
            DecodeReservation(r.request_id, r.spec.attempt, r.decode_tokens, r.decode_engine, self.epoch)
            for r in self.dispatcher.fetch_decode(report.group_id, self._live(report))
        ]

    def fetch_prefill(self, report: GroupReport) -> list[PrefillTask]:
        self._note_read_q(report)
        live = self._live(report) if self.takes_work(Role.PREFILL, report) else ()
        return [self.task_of(r) for r in self.dispatcher.fetch_prefill(live, self.clock())] if live else []

    def _note_read_q(self, report: GroupReport) -> None:
        if report.read_q_tokens is not None:
            self.dispatcher.report_read_q(report.node_id, report.read_q_tokens)

    def task_of(self, request: Request) -> PrefillTask:
        """What the prefill engine is handed for a placed request."""
        assert request.path is not None, f"request {request.request_id} has no read path yet"
        return PrefillTask(
            request=request.spec, hit_keys=request.read_keys, hit_tokens=request.read_tokens, path=request.path,
            oracle=self.mode is Mode.ORACLE, prefill_engine=request.prefill_engine,
            prefill_node=request.prefill_node, decode_engine=request.decode_engine, decode_node=request.decode_node,
            pe_hit_blocks=request.pe_hit_blocks, staged=request.staged.read() if request.staged else None,
            recomputed_keys=request.hit_keys[len(request.read_keys):], recomputed_tokens=request.recomputed_hit_tokens,
            partial_hit=request.partial_hit,
        )

    def handed_off(self, request_id: str) -> bool:
        """Its KV reached the decode engine: from now on its prefill engine's death costs it nothing."""
        return self.dispatcher.handed_off(request_id)

    def takes_work(self, role: Role, report: GroupReport) -> bool:
        """Whether the report's group can be given work now: every decode request's KV (and
        every basic-mode prefill's hits) goes through the node's reader, so not while it is
        down; a dualpath prefill group reads through the DE path meanwhile."""
        return report.reader_alive or (role is Role.PREFILL and self.mode is Mode.DUALPATH)

    def decode_waiting(self) -> bool:
        return self.dispatcher.decode_waiting()

    # --- who may take work ----------------------------------------------------------------

    def _live(self, report: GroupReport) -> tuple:
        """The report's engines that may take work. An engine only presumed dead (silent past
        the heartbeat timeout) that a report names is readmitted (see `readmit`): whoever made
        the report reached it. (The runtime's reports leave out engines out of service, and its
        heartbeat readmits one that answers.)"""
        for load in report.engines:
            self.readmit(load.engine_id)
        out = self.out_of_service()
        return tuple(e for e in report.engines if e.engine_id not in out)

    def readmit(self, engine_id: str) -> bool:
        """An engine presumed dead (silent past the heartbeat timeout) answered again: a loaded
        host is slow, not dead, so it takes work again. False when it was not presumed dead."""
        if engine_id not in self.presumed_dead:
            return False
        self.presumed_dead.discard(engine_id)
        self.readmitted += 1
        return True

    def out_of_service(self) -> set[str]:
        return self.dead | self.presumed_dead | self.unready

    def engine_readiness(self, engine_id: str, ready: bool) -> bool:
        """What `engine_id` said of its weights (see `unready`); True when that changed. An engine
        turning unready holds nothing of this scheduler's: it is a new process (engine_restarted
        failed what its old one held), and it refuses whatever reaches it before this."""
        if ready == (engine_id not in self.unready):
            return False
        if ready:
            self.unready.discard(engine_id)
        else:
            self.unready.add(engine_id)
            self.dispatcher.forget_engine(engine_id)
        return True

    def engine_died(self, engine_id: str, confirmed: bool = True) -> list[RequestSpec]:
        """Place no more work on `engine_id` (for good when its death is certain; until it is
        reachable again when it was only silent); returns the in-flight requests that depended
        on it, which the caller fails with PEER_DIED (and so retries)."""
        (self.dead if confirmed else self.presumed_dead).add(engine_id)
        self.dispatcher.forget_engine(engine_id)
        return [r.spec for r in self.dispatcher.requests_on(engine_id)]

    def engine_restarted(self, engine_id: str) -> list[RequestSpec]:
        """`engine_id` runs a new incarnation: the requests that depended on the old one are
        returned (the caller fails and retries them), and the engine takes work again."""
        self.dead.discard(engine_id)
        self.presumed_dead.discard(engine_id)
        self.unready.discard(engine_id)  # the new process says whether it is ready
        self.dispatcher.forget_engine(engine_id)
        return [r.spec for r in self.dispatcher.requests_on(engine_id)]

    def reader_restarted(self, node_id: str) -> list[RequestSpec]:
        """The reader of `node_id` runs a new incarnation: every extent of the old one is gone,
        so each request staged, prefilled or persisting through that node's buffer is returned
        (the caller fails and retries it); the node reads again."""
        self.readers_unavailable.discard(node_id)
        self.readers_dead.discard(node_id)  # it answers: whatever took it for dead was wrong
        self.dispatcher.no_pe_reads.discard(node_id)
        return [r.spec for r in self.requests.values() if r.uses_node(node_id)]

    def note_report(self, role: Role, report: GroupReport) -> list[RequestSpec]:
        """Act on the state of a report's reader; returns the in-flight requests that must be
        failed.

        A reader that is only silent or restarting is routed around for the time being: a
        prefill node's hits are read through the DE path (dualpath mode), and a group that
        cannot work without its reader gets no new work (see takes_work); nothing is failed
        (a restart shows as a new incarnation, which fails what the old one held). A reader gone
        for good: a decode node needs it (every request's KV arrives through that node's
        buffer), so its engines are treated as dead; a prefill node reads its requests' hits
        through the DE path in dualpath mode, and in basic mode (PE path only) its engines are
        dropped too."""
        node = report.node_id
        dualpath_prefill = role is Role.PREFILL and self.mode is Mode.DUALPATH
        if report.reader_state is PeerState.ALIVE:
            if node in self.readers_unavailable and node not in self.readers_dead:
                self.readers_unavailable.discard(node)
                self.dispatcher.no_pe_reads.discard(node)
            return []
        if report.reader_state is not PeerState.DEAD:
            self.readers_unavailable.add(node)
            if dualpath_prefill:
                self.dispatcher.no_pe_reads.add(node)
            return []
        self.readers_dead.add(node)
        self.staging.drop_node(node)
        if dualpath_prefill:
            if node in self.dispatcher.no_pe_reads:
                return []
            self.dispatcher.no_pe_reads.add(node)
            return [
                r.spec for r in self.requests.values()
                if r.state is RequestState.PREFILLING and r.path is ReadPath.PE and r.prefill_node == node
                and r.read_tokens > 0
            ]
        failed: list[RequestSpec] = []
        for engine in report.engines:
            if engine.engine_id not in self.out_of_service():
                failed.extend(self.engine_died(engine.engine_id))
        return failed

    # --- results ------------------------------------------------------------------------

    def is_current(self, result: TurnResult) -> bool:
        """Whether `result` is of the attempt now in flight (not a late one of an earlier try)."""
        request = self.requests.get(result.request_id)
        spec = request.spec if request is not None else None
        return spec is not None and spec.attempt == result.attempt and spec.epoch == result.epoch

    def finish(self, result: TurnResult) -> tuple[str, ...]:
        """Record a finished turn; for a failed one, returns the engines that may still hold
        something of its attempt (its HBM reservation, its queued prefill), other than the one
        that reported it. A late result of an earlier attempt only contributes its published blocks."""
        published = self.index.publish((block.key, block.parent) for block in result.persisted)
        self.unpublished_blocks += len(result.persisted) - published
        self.binder.published(published)
        current = self.is_current(result)
        request = self.dispatcher.finish(result.request_id, failed=result.error is not None) if current else None
        if request is not None:
            self._released(request)
        if request is not None and result.error is None:
            self._plan_staging(request, result)
        if self.eviction is not None:
            self.eviction.touch(block.key for block in result.persisted[:published])
            self.eviction.evict()
        if request is None or result.error is None:
            return ()
        return tuple(e for e in (request.decode_engine, request.prefill_engine) if e and e != result.prefill_engine)

    def prompt_persisted(self, request_id: str) -> int:
        """The prompt blocks a request in flight computed are in the store before its turn ends
        (the simulator reports it), or in its decode node's memory (the runtime's readers report
        it, with a decode-buffer source; scheduling/sharing.py): they are published now and the
        requests waiting for them are released. Returns the blocks indexed."""
        request, sharing = self.requests.get(request_id), self.dispatcher.sharing
        if request is None or sharing is None or not sharing.early_publish:
            return 0  # without a decode-buffer source the runtime publishes with the turn's result
        published = self.index.publish(sharing.prompt_blocks(request))
        self.binder.published(published)
        self.dispatcher.release(sharing.fulfilled(request), may_wait=True)
        return published

    def sharing_counts(self) -> dict[str, int]:
        """Late binding's and in-flight sharing's totals (`Scheduler.status(StatusQuery.CALLS)`, tests)."""
        sharing = self.dispatcher.sharing
        return {"late_hit_tokens": self.binder.late_hit_tokens, **(sharing.counts() if sharing is not None else {})}

    def _plan_staging(self, request: Request, result: TurnResult) -> None:
        """A finished turn hinted to continue: order its context's blocks (its hits, then what it
        published) staged on the decode node the next turn will most likely read through."""
        hint = request.spec.expect_next_turn_s if request.spec is not None else None
        if hint is None or not self.staging.settings.enabled:
            return
        keys = request.hit_keys + tuple(block.key for block in result.persisted)
        nodes = self.dispatcher.decode_nodes_taking_work()
        read_q = {node: self.dispatcher.read_q.get(node, 0) for node in nodes if node not in self.readers_unavailable
                  and node not in self.readers_dead}
        tokens = len(keys) * self.settings.block_size
        order = self.staging.plan(keys, tokens, hint, self.clock(), read_q, nodes)
        if order is not None:
            self._stage_orders.append(order)

    def take_stage_orders(self) -> list[StageOrder]:
        """The staging orders planned since the last call, for the driver to send to the readers."""
        orders, self._stage_orders = self._stage_orders, []
        return orders

    def _released(self, request: Request) -> None:
        """`request` left the dispatcher: its hits may be evicted again."""
        if self.eviction is not None:
            self.eviction.unpin(request.hit_keys)

    def abandon(self, request_id: str) -> tuple[str, ...]:
        """Forget a request whose deadline passed; returns the engines that may hold its attempt."""
        request = self.dispatcher.cancel(request_id)
        if request is None:
            return ()
        self._released(request)
        return tuple(e for e in (request.decode_engine, request.prefill_engine) if e)

    def stale_holdings(self, held: dict[str, dict[str, Holding]]) -> list[tuple[str, str]]:
        """(engine, owner) of each attempt an engine holds that is no longer the one in flight
        (it finished, failed or was retried) and that has not reached its decode step: a cancel
        whose call was lost, or an accept that came after its cancel, must not hold HBM or
        extents for good. One already decoding finishes on its own."""
        stale = []
        for engine, holds in held.items():
            for rid, holding in holds.items():
                request = self.requests.get(rid)
                if not holding.handed_off and not is_attempt(holding, request.spec if request else None):
                    stale.append((engine, holding.owner(rid)))
        return stale

    def should_retry(self, result: TurnResult) -> bool:
        kind = result.error_kind
        if result.error is None or kind is None or not kind.retryable:
            return False
        if kind.about_stored_kv and self.settings.kv_failure_policy == "fail":
            return False
        return result.attempt + 1 < self.settings.max_attempts

    def next_attempt(self, result: TurnResult, spec: RequestSpec) -> tuple[RequestSpec, int]:
        """The retry of `spec`, whose attempt failed with `result`, and the blocks unindexed
        for it. A read that failed on one node's reader in a way that may be that node's (an
        I/O error: its storage client, its path to the disk) is first read again through the
        other side's reader, in dualpath mode, with nothing repaired; if that fails too, or the
        failure is the block's (missing, corrupt), the blocks it names are repaired and the retry
        recomputes from there."""
        kind = result.error_kind
        node = result.failed_reader
        elsewhere = (
            self.mode is Mode.DUALPATH and kind is not None and kind.may_be_the_readers and node
            and not spec.avoid_reader and node not in self.readers_dead
        )
        if elsewhere:
            assert kind is not None
            self.reread_elsewhere[kind.value] = self.reread_elsewhere.get(kind.value, 0) + 1
            return dataclasses.replace(spec, attempt=spec.attempt + 1, avoid_reader=node), 0
        return dataclasses.replace(spec, attempt=spec.attempt + 1, avoid_reader=""), self.repair(result)

    def repair(self, result: TurnResult) -> int:
        """Before a retry: the blocks a KV failure names (and every block after them) leave the
        index, so the retry hits only the longest valid prefix and recomputes the rest; a corrupt
        or unreadable block is deleted so that the retry's persist republishes it. Returns blocks
        unindexed."""
        removed = 0
        for key in result.bad_keys:
            removed += self.index.remove(key)
            if result.error_kind in (ErrorKind.KV_CORRUPT, ErrorKind.KV_UNREADABLE) and self.store is not None:
                self.store.delete(key)
        return removed

    def reset_prefix_cache(self) -> None:
        """Forget every indexed block; the eviction (the index's observer) hands them all to the
        store's janitor, which deletes them off the event loop, except those a request in flight
        hits (its reads go on; the janitor's sweep deletes them later)."""
        if self.eviction is not None:
            self.eviction.spare({key for request in self.requests.values() for key in request.hit_keys})
        self.index.clear()
