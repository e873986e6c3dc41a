"""The singleton Scheduler actor (`scheduler` in the dualpath namespace).

A thin async shell: callers await `generate(spec)`; group leaders pull with `fetch_decode` /
`fetch_prefill` and their load reports; decisions come from the pure `Dispatcher`. The prefix
index lives here (rebuilt from the store at start), so the hit tokens of a turn are known when
it is queued, and it learns of every persisted block from the decode engine's turn result before
that result is returned, so the next turn of a trajectory always sees its predecessor's blocks.
Which engines are alive, and what their deaths cost, is the heartbeat watchdog's
(runtime/watchdog.py, a mixin of this actor).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, AsyncIterator

import ray
import ray.exceptions

from dualpath_ray.config import DualPathConfig
from dualpath_ray.kv.eviction import LRUEviction
from dualpath_ray.kv.index import PrefixIndex
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.store import open_store
from dualpath_ray.model.profile import derive_alpha_beta
from dualpath_ray.runtime.aborts import Aborts
from dualpath_ray.runtime.actor_metrics import SchedulerMetrics
from dualpath_ray.runtime.adoption import Adoptions
from dualpath_ray.runtime.control import ClusterControl
from dualpath_ray.runtime.messages import (
    DecodeReservation,
    ErrorKind,
    GroupReport,
    Holding,
    PeerState,
    PrefillTask,
    RequestSpec,
    StreamDelta,
    TensorSpec,
    TokenChunk,
    TurnResult,
    aborted_result,
    failed_result,
)
from dualpath_ray.runtime.restarts import IncarnationTracker, was_restarted
from dualpath_ray.runtime.watchdog import HeartbeatWatch
from dualpath_ray.scheduling.dispatcher import Constants
from dualpath_ray.scheduling.scheduler import CoreSettings, SchedulerCore, is_attempt
from dualpath_ray.scheduling.types import Role

LOG = logging.getLogger("dualpath_ray.scheduler")


def build_core(cfg: DualPathConfig, store_root: str | None, mode: str, epoch: int = 0) -> SchedulerCore:
    """The scheduler core of a deployment: its index rebuilt from the store, the store's
    capacity, and alpha/beta of the configured cluster and model."""
    layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
    store = open_store(cfg.store, layout, root=store_root)
    index = PrefixIndex.rebuild(store, cfg.store.block_size)
    eviction = LRUEviction(index, store, cfg.store.capacity_bytes, layout.full_block_bytes)
    alpha, beta = derive_alpha_beta(cfg, layout)
    settings = CoreSettings.of(cfg, mode, Constants(alpha, beta, cfg.scheduler.z_margin), epoch)
    return SchedulerCore(settings, index, eviction, store)


@ray.remote(num_cpus=0, max_concurrency=4096)
class Scheduler(HeartbeatWatch):
    """Named, detached singleton; `generate` is awaited by every caller."""

    def __init__(self, cfg: DualPathConfig, store_root: str | None, mode: str) -> None:
        # A new epoch per incarnation (Ray restarts this actor with the same arguments).
        self.cfg = cfg
        self.core = build_core(cfg, store_root, mode, epoch=time.time_ns())
        self.restarted = was_restarted()
        self.adoptions = Adoptions()
        self.aborts = Aborts()
        self.streams: dict[str, asyncio.Queue[TokenChunk]] = {}  # request id -> its tokens as sampled
        self.incarnations = IncarnationTracker()
        # Attempts failed because their engine went silent: their extents are reclaimed only
        # once the death is certain (Ray reports it, or the engine comes back as a new process).
        self.unreclaimed: dict[str, list[str]] = {}
        self.control = ClusterControl(cfg)
        self.asleep = False
        self.starting: asyncio.Task[None] | None = None
        self.pending: dict[str, asyncio.Future[TurnResult]] = {}
        self.started_at = time.time()
        # Set when a role may have new work: leaders waiting in a fetch wake at once instead of
        # polling (decode: a request arrived or one finished and freed HBM; prefill: a request
        # got its decode engine, or one finished and lightened an engine).
        self.new_work = {"decode": asyncio.Event(), "prefill": asyncio.Event()}
        self.watchdog: asyncio.Task[None] | None = None
        self.unheld_since: dict[str, float] = {}
        # Fetches per group so far, and the group and fetch that carried each request's latest
        # assignment (see _in_delivery).
        self.fetches: dict[str, int] = {}
        self.delivering: dict[str, tuple[str, int]] = {}
        self.silent_since: dict[str, float] = {}
        self.calls: dict[str, int] = {
            "generate": 0, "complete": 0, "fetch_decode": 0, "fetch_prefill": 0, "empty_waits": 0,
            "retries": 0, "timeouts": 0, "stale_results": 0, "unindexed_blocks": 0, "dead_engines": 0,
            "lost_assignments": 0, "dead_readers": 0, "stale_holdings": 0, "presumed_dead": 0,
            "restarted_engines": 0, "restarted_readers": 0, "reader_unavailable": 0, "worlds_formed": 0,
        }
        self.metrics = SchedulerMetrics.start(cfg, mode, self.calls)

    def __repr__(self) -> str:
        # Ray prefixes this actor's log lines with it and shows it as the dashboard's repr name.
        return "scheduler"

    async def ready(self) -> bool:
        await self._started()
        return True

    async def _started(self) -> None:
        """Every entry point awaits this: the watchdog runs, and a restarted incarnation has
        learnt what the engines hold (runtime/adoption.py) before it serves or dispatches."""
        if self.starting is None:
            self.starting = asyncio.get_running_loop().create_task(self._start())
        await asyncio.shield(self.starting)

    async def _start(self) -> None:
        if self.restarted:
            await self._learn_holdings()
        self.watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def reform_transport(self, requester: str) -> bool:
        """A restarted or broken gloo endpoint (`requester`) asks for a new world over every
        engine and reader (runtime/control.py). NIXL needs no world: True."""
        if self.cfg.runtime.transport != "gloo":
            return True
        formed = await self.control.reform_gloo_world(requester)
        self.calls["worlds_formed"] = self.control.worlds_formed
        return formed

    # --- between rollouts: sleep, wake, weights from a trainer ---------------------------

    async def sleep(self) -> int:
        """Put every engine to sleep (KV memory freed, weights off the accelerator; the store
        and the index are kept). Refused while a request is in flight; while asleep, generate
        is refused with a clear error. Returns the bytes freed."""
        await self._started()
        self._require_idle("sleep")
        self.asleep = True
        return await self.control.sleep()

    async def wake_up(self) -> None:
        """Wake every engine (memory allocated again, peers told to fetch its new addressing)."""
        await self._started()
        for engine, incarnation in (await self.control.wake_up()).items():
            self.incarnations.known[engine] = incarnation  # a wake, not a restart: nothing to fail
        self.asleep = False

    async def join_weight_group(self, host: str, port: int, group_name: str = "policy", timeout_s: float = 300.0) -> int:
        """Every engine joins a trainer's weight broadcast group (runtime/weight_sync.py) as
        ranks 1..N; the trainer joins as rank 0 beside this call. Returns the world size."""
        await self._started()
        return await self.control.join_weight_group(host, port, group_name, timeout_s)

    async def update_weights_from_group(self, version: int, manifest: list[TensorSpec]) -> int:
        """Every engine receives the trainer's broadcast of `manifest` (sent beside this call)
        and loads it as weight version `version`. Refused while a request is in flight."""
        await self._started()
        self._require_idle("update_weights_from_group")
        await self.control.receive_weights(version, manifest)
        return version

    async def engine_names(self) -> list[str]:
        return list(self.control.engines)

    def _require_idle(self, what: str) -> None:
        if self.aborts.running or self.core.requests:
            raise RuntimeError(
                f"{what} with {len(self.aborts.running)} requests in flight; call it between rollouts "
                "(abort_all() first to stop them)"
            )

    def _note_report(self, role: Role, report: GroupReport) -> None:
        """New incarnations in a report (restarts), then its reader's state: a reader that did
        not answer is routed around (see note_report)."""
        for name, incarnation in report.incarnations:
            self._observe(name, incarnation)
        if report.reader_state is PeerState.DEAD and report.node_id not in self.core.readers_dead:
            self.calls["dead_readers"] += 1
        elif report.reader_state in (PeerState.SILENT, PeerState.RESTARTING):
            self.calls["reader_unavailable"] += 1
        for spec in self.core.note_report(role, report):
            self._complete(failed_result(spec, f"reader/{report.node_id}", "storage reader died", ErrorKind.PEER_DIED))

    def _tell(self, actor: str, method: str, *args: Any) -> None:
        try:
            getattr(self.control.handle(actor), method).remote(*args)
        except ValueError:
            pass  # that actor is gone

    async def mode(self) -> str:
        """The read-path mode this scheduler was deployed with."""
        return self.core.mode

    async def generate(self, spec: RequestSpec) -> TurnResult:
        """Serve one turn: its result, or a failed result with an ErrorKind once its retries or
        its deadline (runtime.request_timeout_s) are used up. Never waits forever."""
        await self._started()
        if spec.request_id in self.aborts.running or spec.request_id in self.adoptions.waiting:
            raise ValueError(f"request id {spec.request_id!r} is already in flight; ids must be unique")
        if self.asleep:
            raise RuntimeError("the cluster is asleep: call wake_up() before generating")
        self.calls["generate"] += 1
        if not self.aborts.start(spec.request_id):
            return aborted_result(spec)  # its trajectory was aborted
        try:
            return await self._serve(spec)
        finally:
            self.aborts.end(spec.request_id)

    async def _serve(self, spec: RequestSpec) -> TurnResult:
        deadline = time.monotonic() + self.cfg.runtime.request_timeout_s
        adopted = await self._adopt(spec.request_id, deadline)
        if adopted is not None and not self.core.should_retry(adopted):
            return adopted
        spec = dataclasses.replace(spec, epoch=self.core.epoch)
        while not self.aborts.is_aborted(spec.request_id):
            result = await self._attempt(spec, deadline)
            if not self.core.should_retry(result) or self.aborts.is_aborted(spec.request_id):
                break
            self.calls["retries"] += 1
            self.calls["unindexed_blocks"] += self.core.repair(result)
            spec = dataclasses.replace(spec, attempt=spec.attempt + 1)
        return aborted_result(spec) if self.aborts.is_aborted(spec.request_id) else result

    async def generate_stream(self, spec: RequestSpec) -> AsyncIterator[StreamDelta | TurnResult]:
        """`generate`, streamed (a Ray streaming generator): the output tokens as the decode
        engine samples them, as StreamDeltas in order with no token twice, then the TurnResult.
        A retried attempt streams from its first token again; sampling is seeded by (seed,
        position), so its tokens equal the ones already sent and only new positions go out. A
        chunk lost on the way is made up from the final result."""
        queue: asyncio.Queue[TokenChunk] = asyncio.Queue()
        self.streams[spec.request_id] = queue
        served = asyncio.ensure_future(self.generate(dataclasses.replace(spec, stream=True)))
        sent = 0
        try:
            while not served.done() or not queue.empty():
                chunk = await self._next_chunk(queue, served)
                if chunk is None:
                    continue
                delta = StreamDelta.after(chunk, sent)
                if delta is not None:
                    sent += len(delta.tokens)
                    yield delta
            result = served.result()
            if len(result.output_tokens) > sent:
                yield StreamDelta(sent, result.output_tokens[sent:], result.log_probs[sent:])
            yield result
        finally:
            self.streams.pop(spec.request_id, None)
            if not served.done():
                served.cancel()

    @staticmethod
    async def _next_chunk(queue: asyncio.Queue[TokenChunk], served: asyncio.Future[TurnResult]) -> TokenChunk | None:
        """The next chunk, or None once the request was served (and nothing is queued)."""
        if not queue.empty():
            return queue.get_nowait()
        getter = asyncio.ensure_future(queue.get())
        await asyncio.wait({getter, served}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            return getter.result()
        getter.cancel()
        return None

    async def stream(self, chunks: list[TokenChunk]) -> None:
        """Decode engines' streamed tokens of one step; only the attempt in flight is passed on."""
        for chunk in chunks:
            queue = self.streams.get(chunk.request_id)
            request = self.core.requests.get(chunk.request_id)
            if queue is not None and request is not None and (request.spec.attempt, request.spec.epoch) == (
                chunk.attempt, chunk.epoch
            ):
                queue.put_nowait(chunk)

    async def handed_off(self, held: dict[str, Holding]) -> None:
        """A decode engine took these attempts' handoffs: they are decoding and no longer depend
        on their prefill engines (the heartbeat learns the same a beat later, or never when the
        turn ends first: `in_flight` and a prefill engine's death would see them prefilling)."""
        await self._started()
        for rid, holding in held.items():
            request = self.core.requests.get(rid)
            if request is not None and is_attempt(holding, request.spec):
                self.core.handed_off(rid)

    async def abort(self, request_id: str) -> bool:
        """Stop one request now: its caller gets a result with stop reason `aborted` (no
        output), every engine holding its attempt drops it even mid-decode (its extents and
        pages freed, nothing more of it persisted), and it is not retried. False when no
        request of that id is in flight."""
        await self._started()
        return self._abort(request_id)

    async def abort_prefix(self, prefix: str) -> int:
        """Abort a whole trajectory (its request ids start with `prefix`, e.g. "traj7/"): every
        turn of it in flight now, and every later one until `clear_aborts([prefix])`. Returns how
        many were in flight."""
        await self._started()
        return sum(self._abort(rid) for rid in self.aborts.abort_prefix(prefix))

    async def abort_all(self) -> int:
        """Abort every request in flight (later ones run as usual); returns how many."""
        await self._started()
        return sum(self._abort(rid) for rid in sorted(self.aborts.running))

    async def clear_aborts(self, prefixes: list[str] | None = None) -> None:
        """Let the requests of these aborted trajectories (all, with None) run again."""
        self.aborts.clear(prefixes)

    def _abort(self, request_id: str) -> bool:
        if not self.aborts.abort(request_id):
            return False
        self.calls["aborted"] = self.aborts.count
        request = self.core.requests.get(request_id)
        if request is not None:
            self.delivering.pop(request_id, None)
            self.unheld_since.pop(request_id, None)
            for engine in self.core.abandon(request_id):
                self._tell(engine, "abort", request.spec.owner)
            future = self.pending.get(request_id)
            if future is not None and not future.done():
                future.set_result(aborted_result(request.spec))
        waiting = self.adoptions.waiting.get(request_id)
        if waiting is not None and not waiting.done():
            waiting.set_result(None)  # stop waiting for a dead incarnation's attempt
        return True

    async def _adopt(self, request_id: str, deadline: float) -> TurnResult | None:
        """The result of a dead incarnation's attempt that an engine still holds (None: there
        is none, or it was dropped; the request is then dispatched afresh)."""
        result = self.adoptions.claim(request_id)
        if result is not None or request_id not in self.adoptions.holders:
            return result
        try:
            return await asyncio.wait_for(self.adoptions.wait_for(request_id), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return None
        finally:
            self.adoptions.forget(request_id)

    async def _attempt(self, spec: RequestSpec, deadline: float) -> TurnResult:
        future: asyncio.Future[TurnResult] = asyncio.get_running_loop().create_future()
        self.pending[spec.request_id] = future
        try:
            self.core.submit(spec)
            self.new_work["decode"].set()
            return await asyncio.wait_for(future, max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            self.calls["timeouts"] += 1
            self.delivering.pop(spec.request_id, None)
            self._cancel_at(self.core.abandon(spec.request_id), spec.owner)
            return failed_result(
                spec, "scheduler", f"no result within runtime.request_timeout_s={self.cfg.runtime.request_timeout_s}",
                ErrorKind.TIMEOUT,
            )
        finally:
            self.pending.pop(spec.request_id, None)

    def _cancel_at(self, engines: tuple[str, ...], owner: str) -> None:
        """Drop what one attempt ("request#attempt") holds at these engines and has not started
        (an HBM reservation, a queued prefill); one that already started finishes on its own."""
        for engine in engines:
            self._tell(engine, "cancel", owner)

    async def fetch_decode(self, report: GroupReport, wait_s: float = 0.0) -> list[DecodeReservation]:
        """A decode group's pull; with nothing to place, waits up to wait_s for new work."""
        await self._started()
        self._note_report(Role.DECODE, report)
        placed = await self._fetch("decode", report.group_id, lambda: self.core.fetch_decode(report), wait_s)
        if placed:
            self.new_work["prefill"].set()
        return placed

    async def fetch_prefill(self, report: GroupReport, wait_s: float = 0.0) -> list[PrefillTask]:
        """A prefill group's pull; with nothing to assign, waits up to wait_s for new work.

        The report was taken before the wait; meanwhile its engines can only have finished work
        (no one else assigns to them), so deciding on it after the wait is conservative."""
        await self._started()
        self._note_report(Role.PREFILL, report)
        return await self._fetch("prefill", report.group_id, lambda: self.core.fetch_prefill(report), wait_s)

    async def _fetch(self, role: str, group: str, fetch: Any, wait_s: float) -> list[Any]:
        self.calls[f"fetch_{role}"] += 1
        # A leader fetches again only once it has delivered (or given up on) its last answer.
        self.fetches[group] = self.fetches.get(group, 0) + 1
        work = self.metrics.decide(role, fetch)
        if not work and wait_s > 0:
            event = self.new_work[role]
            event.clear()
            self.calls["empty_waits"] += 1
            try:
                await asyncio.wait_for(event.wait(), wait_s)
            except asyncio.TimeoutError:
                return []
            work = self.metrics.decide(role, fetch)
        self.metrics.placed(role, work)
        for item in work:
            self.delivering[item.request_id] = (group, self.fetches[group])
        return work

    async def complete(self, result: TurnResult) -> None:
        await self._started()
        self._complete(result)

    def _complete(self, result: TurnResult) -> None:
        self.calls["complete"] += 1
        current = self.core.is_current(result)
        holders = self.core.finish(result)
        self._cancel_at(holders, result.owner)
        if not current:
            if result.epoch != self.core.epoch and self.adoptions.deliver(result):
                self.calls["adopted"] = self.adoptions.adopted
                return
            self.calls["stale_results"] += 1
            return
        self.delivering.pop(result.request_id, None)
        self.metrics.finished(result)
        future = self.pending.get(result.request_id)
        if future is not None and not future.done():
            future.set_result(result)
        # A finished turn frees its decode engine's HBM, which matters only to requests still
        # waiting for a decode engine; prefill engines were lightened at handoff already.
        if self.core.decode_waiting():
            self.new_work["decode"].set()

    async def in_flight(self) -> dict[str, dict[str, Any]]:
        """Each live request: its state, attempt and the engines it holds (for `status` and tests)."""
        return {
            rid: {"state": e.state.value, "attempt": e.spec.attempt,
                  "prefill_engine": e.prefill_engine, "decode_engine": e.decode_engine}
            for rid, e in self.core.requests.items()
        }

    async def check_integrity(self) -> int:
        """The dispatcher's queue invariants (raises naming what is wrong); returns the number
        of requests in flight, which is 0 once every caller has its answer."""
        self.core.dispatcher.check_integrity()
        return len(self.core.requests)

    async def service_view(self) -> dict[str, list[str]]:
        """Who is out of service and why (for `status` and tests): engines dead for good or
        presumed dead from silence, nodes whose reader is gone or unavailable, nodes whose hits
        are read through the DE path instead, and the last incarnation seen of each actor."""
        core = self.core
        return {
            "dead": sorted(core.dead), "presumed_dead": sorted(core.presumed_dead),
            "readers_dead": sorted(core.readers_dead), "readers_unavailable": sorted(core.readers_unavailable),
            "no_pe_reads": sorted(core.dispatcher.no_pe_reads),
            "incarnations": [f"{name}={inc}" for name, inc in sorted(self.incarnations.known.items())],
        }

    async def call_counts(self) -> dict[str, int]:
        """How often each entry point ran (pulls, empty pulls that waited, turns), retries and
        their causes, and the store's evictions."""
        evicted = self.core.eviction.stats.evicted_blocks if self.core.eviction is not None else 0
        return {**self.calls, "evicted_blocks": evicted,
                "indexed_blocks": len(self.core.index), "readmitted": self.core.readmitted,
                "adopted": self.adoptions.adopted, "adoptions_dropped": self.adoptions.dropped,
                "restarted": int(self.restarted)}

    async def recent_turns(self) -> list[tuple[float, float, float, str]]:
        """(finished at, ttft_s, tpot_s, path) of the latest served turns, for `dualpath status`."""
        return self.metrics.recent_turns()

    async def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()
