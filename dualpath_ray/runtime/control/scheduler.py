"""The singleton Scheduler actor (`scheduler` in the dualpath namespace).

A thin async shell around the pure scheduler core. Callers submit turns in batches (`submit`,
from a `SchedulerClient`: api/client.py) and collect their results with one long-poll
(`collect`), or await one turn (`generate`, `generate_stream`). Decisions are event-driven and
pushed (runtime/control/decisions.py: the rounds the simulator runs too), engines tell it what a step
produced in one report (an EngineReport: handoffs taken, turns ended, streamed tokens), readers
tell it their read queues when they change (a ReaderReport), both on the report channel
(runtime/control/report_channel.py: a socket its event loop reads, not Ray calls), and the heartbeat watchdog
(runtime/control/watchdog.py) judges who is alive. The prefix index lives here (rebuilt from the store
at start) and learns every persisted block from the turn result before that result is
answered, so the next turn of a trajectory always sees its predecessor's blocks. An idle
scheduler makes no call and wakes for nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from typing import Any, AsyncIterator, Mapping

import ray

from dualpath_ray.config import DualPathConfig
from dualpath_ray.faults.injector import FaultInjector
from dualpath_ray.kv.eviction import LRUEviction
from dualpath_ray.kv.index import PrefixIndex
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.store import open_store
from dualpath_ray.model.profile import derive_alpha_beta
from dualpath_ray.runtime.control.aborts import Aborts
from dualpath_ray.runtime.telemetry.actor_metrics import SchedulerMetrics
from dualpath_ray.runtime.control.adoption import Adoptions
from dualpath_ray.runtime.control.fanout import ClusterControl
from dualpath_ray.runtime.control.decisions import Decisions, ReaderStates
from dualpath_ray.runtime.control.mailboxes import Mailboxes
from dualpath_ray.protocol.messages import (
    Collected,
    EngineReport,
    ErrorKind,
    PeerState,
    ReaderReport,
    Refusal,
    RequestSpec,
    StreamDelta,
    TensorSpec,
    TokenChunk,
    TurnResult,
    aborted_result,
    failed_result,
)
from dualpath_ray.runtime.control.report_channel import ChannelAddress, ReportServer
from dualpath_ray.runtime.engine.restarts import was_restarted
from dualpath_ray.runtime.control.watchdog import Watchdog
from dualpath_ray.scheduling.dispatcher import Constants
from dualpath_ray.scheduling.liveness import Liveness, is_attempt
from dualpath_ray.scheduling.requests import Request
from dualpath_ray.scheduling.scheduler import CoreSettings, SchedulerCore

LOG = logging.getLogger("dualpath_ray.scheduler")
# How long a client's `collect` waits for a first result before it answers with none (the
# client asks again while it has turns in flight).
COLLECT_WAIT_S = 10.0
# What `call_counts` always reports (0 until it happens): calls received, turns, and what the
# watchdog and the decisions did.
COUNTED = (
    "submit", "collect", "generate", "report", "reader_report", "complete", "retries", "timeouts", "stale_results",
    "unindexed_blocks", "aborted", "adopted", "adoptable", "pushes", "pushed_tasks", "failed_pushes", "heartbeats",
    "dead_engines", "presumed_dead", "restarted_engines", "lost_assignments", "stale_holdings", "dead_readers",
    "reader_unavailable", "restarted_readers", "worlds_formed",
)


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
class Scheduler:
    """Named, detached singleton. `routes` maps engine names to the actors that answer for them
    (the scale harness's simulated engines); empty in every deployment."""

    def __init__(
        self, cfg: DualPathConfig, store_root: str | None, mode: str, routes: Mapping[str, str] | None = None,
    ) -> None:
        # A new epoch per incarnation (Ray restarts this actor with the same arguments).
        self.cfg = cfg
        self.core = build_core(cfg, store_root, mode, epoch=time.time_ns())
        self.restarted = was_restarted()
        self.adoptions = Adoptions()
        self.aborts = Aborts()
        self.streams: dict[str, asyncio.Queue[TokenChunk]] = {}  # request id -> its tokens as sampled
        self.control = ClusterControl(cfg, routes)
        self.asleep = False
        self.starting: asyncio.Task[None] | None = None
        self.pending: dict[str, asyncio.Future[TurnResult]] = {}
        self.clients: dict[str, str] = {}  # request id -> the client that submitted it (submit/collect)
        self.servings = 0  # requests this incarnation began serving (RequestSpec.epoch)
        # Failed attempts whose peer died -> the peers to ask before their retry is placed.
        self.suspects: dict[str, set[str]] = {}
        self.mailboxes = Mailboxes(expiry_s=cfg.runtime.request_timeout_s + 4 * COLLECT_WAIT_S)
        self.calls: Counter[str] = Counter({name: 0 for name in COUNTED})
        runtime = cfg.runtime
        self.liveness = Liveness(
            runtime.heartbeat_timeout_s, time.monotonic, max(runtime.heartbeat_s, runtime.heartbeat_timeout_s / 3)
        )
        self.readers = ReaderStates()
        self.faults = FaultInjector(cfg.faults, "scheduler", self.restarted)
        self.metrics = SchedulerMetrics.start(cfg, mode, self.calls)
        # Both need the running event loop: made by the first call (see _started).
        self.decisions: Decisions | None = None
        self.watchdog: Watchdog | None = None
        self.reports: ReportServer | None = None

    def __repr__(self) -> str:
        # Ray prefixes this actor's log lines with it and shows it as the dashboard's repr name.
        return "scheduler"

    async def ready(self) -> bool:
        await self._started()
        return True

    async def _started(self) -> None:
        """Every entry point awaits this: the decisions and the watchdog run, and a restarted
        incarnation has learnt what the engines hold (runtime/control/adoption.py) before it serves."""
        if self.starting is None:
            self.starting = asyncio.get_running_loop().create_task(self._start())
        await asyncio.shield(self.starting)

    async def _start(self) -> None:
        self.decisions = Decisions(
            self.cfg, self.core, self.control, self.liveness, self.readers, self._accepted, self.faults, self.calls,
            self.metrics,
        )
        self.watchdog = Watchdog(
            self.cfg, self.core, self.control, self.liveness, self.adoptions, self.readers, self.calls,
            self._fail, self.decisions.rounds.everything_changed,
        )
        if self.restarted:
            await self.watchdog.learn_holdings()
        self.decisions.rounds.start()
        asyncio.get_running_loop().create_task(self.watchdog.run())
        # Last: a report handled before the holdings were learnt would race the adoption.
        self.reports = await ReportServer.start(
            self._received, ray.util.get_node_ip_address(), self.cfg.scheduler.report_port
        )

    def _accepted(self, engine: str, incarnation: str) -> None:
        assert self.watchdog is not None
        self.watchdog.observe(engine, incarnation)

    async def reform_transport(self, requester: str) -> bool:
        """A restarted or broken gloo endpoint (`requester`) asks for a new world over every
        engine and reader (runtime/control/fanout.py). NIXL needs no world: True."""
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
        assert self.watchdog is not None
        for engine, incarnation in (await self.control.wake_up()).items():
            self.watchdog.incarnations.known[engine] = incarnation  # a wake, not a restart: nothing to fail
        self.asleep = False

    async def join_weight_group(self, host: str, port: int, group_name: str = "policy", timeout_s: float = 300.0) -> int:
        """Every engine joins a trainer's weight broadcast group (runtime/deploy/weight_sync.py) as
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

    async def mode(self) -> str:
        """The read-path mode this scheduler was deployed with."""
        return self.core.mode

    # --- turns: batched (submit + collect) and one at a time (generate) ------------------

    def _refusal(self, spec: RequestSpec) -> Refusal | None:
        if spec.request_id in self.aborts.running or spec.request_id in self.adoptions.waiting:
            return Refusal.DUPLICATE
        if self.asleep:
            return Refusal.ASLEEP
        return None

    async def submit(self, client: str, specs: list[RequestSpec]) -> tuple[int, list[Refusal | None]]:
        """Start serving a client's turns; their results wait for its `collect`. Returns this
        incarnation's epoch and, per turn, why it was refused (None: accepted). A turn the same
        client already submitted is accepted again without a second serving (a client resubmits
        what it had in flight when it sees that the scheduler restarted)."""
        await self._started()
        self.calls["submit"] += 1
        refusals: list[Refusal | None] = []
        for spec in specs:
            if self.clients.get(spec.request_id) == client:
                refusals.append(None)
                continue
            refusal = self._refusal(spec)
            refusals.append(refusal)
            if refusal is None:
                self.clients[spec.request_id] = client
                asyncio.get_running_loop().create_task(self._serve_for(client, spec))
        return self.core.epoch, refusals

    async def _serve_for(self, client: str, spec: RequestSpec) -> None:
        try:
            result = await self._generate(spec)
        except Exception as exc:  # noqa: BLE001 - a bug must reach the caller, not hang it
            LOG.exception("serving %s failed", spec.request_id)
            result = failed_result(spec, "scheduler", exc, ErrorKind.INTERNAL)
        finally:
            self.clients.pop(spec.request_id, None)
        self.mailboxes.deliver(client, result)

    async def collect(self, client: str, epoch: int | None, wait_s: float = COLLECT_WAIT_S) -> Collected:
        """The client's finished turns, as soon as there is one (or none after wait_s). A client
        that knew another epoch is answered at once: this incarnation restarted and does not
        know what it submitted before (the client submits it again)."""
        await self._started()
        self.calls["collect"] += 1
        if epoch is not None and epoch != self.core.epoch:
            return Collected(self.core.epoch)
        results = await self.mailboxes.collect(client, wait_s)
        return Collected(self.core.epoch, tuple(results))

    async def generate(self, spec: RequestSpec) -> TurnResult:
        """Serve one turn: its result, or a failed result with an ErrorKind once its retries or
        its deadline (runtime.request_timeout_s) are used up. Never waits forever."""
        await self._started()
        refusal = self._refusal(spec)
        if refusal is not None:
            raise refusal.error(spec.request_id)
        return await self._generate(spec)

    async def _generate(self, spec: RequestSpec) -> TurnResult:
        self.calls["generate"] += 1
        if not self.aborts.start(spec.request_id):
            return aborted_result(spec)  # its trajectory was aborted
        assert self.watchdog is not None
        self.watchdog.work.set()
        try:
            return await self._serve(spec)
        finally:
            self.aborts.end(spec.request_id)

    async def _serve(self, spec: RequestSpec) -> TurnResult:
        deadline = time.monotonic() + self.cfg.runtime.request_timeout_s
        adopted = await self._adopt(spec.request_id, deadline)
        if adopted is not None and not self.core.should_retry(adopted):
            return adopted
        self.servings += 1
        spec = dataclasses.replace(spec, epoch=self.core.epoch + self.servings)  # see RequestSpec.epoch
        while not self.aborts.is_aborted(spec.request_id):
            result = await self._attempt(spec, deadline)
            suspects = self.suspects.pop(spec.owner, set())
            if not self.core.should_retry(result) or self.aborts.is_aborted(spec.request_id):
                break
            if suspects:
                # A peer of the attempt died: learn which before the retry is placed, or it may
                # land on the same dead peer (the heartbeat would tell only a beat later).
                assert self.watchdog is not None
                await self.watchdog.probe(suspects)
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
        assert self.decisions is not None
        future: asyncio.Future[TurnResult] = asyncio.get_running_loop().create_future()
        self.pending[spec.request_id] = future
        try:
            self.decisions.rounds.submit(spec)
            return await asyncio.wait_for(future, max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            self.calls["timeouts"] += 1
            self._cancel_at(self.core.abandon(spec.request_id), spec.owner)
            self.decisions.rounds.everything_changed()  # what it held is free again
            return failed_result(
                spec, "scheduler", f"no result within runtime.request_timeout_s={self.cfg.runtime.request_timeout_s}",
                ErrorKind.TIMEOUT,
            )
        finally:
            self.pending.pop(spec.request_id, None)
            self.liveness.forget(spec.owner)

    def _cancel_at(self, engines: tuple[str, ...], owner: str) -> None:
        """Drop what one attempt ("request#attempt") holds at these engines and has not started
        (a queued prefill, a handoff not taken yet); one that already started finishes on its own."""
        for engine in engines:
            self.control.cancel(engine, owner)

    # --- what engines and readers tell -------------------------------------------------------

    async def report_channel(self) -> ChannelAddress:
        """Where this incarnation reads engines' and readers' reports (runtime/control/report_channel.py),
        and the secret a sender proves: handed out only through this (authenticated) Ray call."""
        await self._started()
        assert self.reports is not None and self.reports.address is not None
        return self.reports.address

    def _received(self, message: EngineReport | ReaderReport) -> None:
        """A message from the report channel, on this actor's event loop."""
        if isinstance(message, EngineReport):
            self._engine_report(message)
        elif isinstance(message, ReaderReport):
            self._reader_report(message)
        else:
            raise TypeError(f"the report channel carries EngineReport and ReaderReport, not {type(message).__name__}")

    def _engine_report(self, report: EngineReport) -> None:
        """One step of an engine: the handoffs it took (those attempts are decoding and no
        longer depend on their prefill engines), the turns that ended, the tokens it streamed."""
        assert self.decisions is not None and self.watchdog is not None
        self.calls["report"] += 1
        self.watchdog.observe(report.engine, report.incarnation)
        for rid, holding in report.handed_off.items():
            request = self.core.requests.get(rid)
            if request is not None and is_attempt(holding, request.spec):
                self.decisions.rounds.handed_off(rid)
        for result in report.results:
            self._complete(result)
        self._stream(report.chunks)

    def _reader_report(self, report: ReaderReport) -> None:
        """A reader's read queue changed (or the reader just started)."""
        assert self.watchdog is not None
        self.calls["reader_report"] += 1
        self.watchdog.observe(report.reader, report.incarnation)
        self.core.dispatcher.report_read_q(report.node_id, report.read_q_tokens)
        if self.readers.state(report.node_id) is not PeerState.ALIVE and report.node_id not in self.core.readers_dead:
            self.watchdog.reader_state(report.node_id, PeerState.ALIVE)

    def _stream(self, chunks: tuple[TokenChunk, ...]) -> None:
        """Streamed tokens of one step; only the attempt in flight is passed on."""
        for chunk in chunks:
            queue = self.streams.get(chunk.request_id)
            request = self.core.requests.get(chunk.request_id)
            if queue is not None and request is not None and (request.spec.attempt, request.spec.epoch) == (
                chunk.attempt, chunk.epoch
            ):
                queue.put_nowait(chunk)

    def _fail(self, spec: RequestSpec, by: str, why: str) -> None:
        self._complete(failed_result(spec, by, why, ErrorKind.PEER_DIED))

    def _complete(self, result: TurnResult) -> None:
        assert self.decisions is not None
        self.calls["complete"] += 1
        current = self.core.is_current(result)
        request = self.core.requests.get(result.request_id)
        if current and request is not None and result.error_kind is ErrorKind.PEER_DIED:
            self.suspects[result.owner] = self._peers_of(request)
        decode_engine = result.decode_engine or (request.decode_engine if request is not None else "")
        holders = self.decisions.rounds.finish(result, self.decisions.decode_group_of.get(decode_engine))
        self._cancel_at(holders, result.owner)
        if not current:
            if result.epoch < self.core.epoch and self.adoptions.deliver(result):
                self.calls["adopted"] = self.adoptions.adopted
                return
            self.calls["stale_results"] += 1
            return
        self.liveness.forget(result.owner)
        self.metrics.finished(result)
        future = self.pending.get(result.request_id)
        if future is not None and not future.done():
            future.set_result(result)

    def _peers_of(self, request: Request) -> set[str]:
        """The engines an attempt used and the readers of their nodes."""
        engines = {e for e in (request.prefill_engine, request.decode_engine) if e}
        nodes = {n for n in (request.prefill_node, request.decode_node) if n}
        return engines | {f"reader/{node}" for node in nodes}

    # --- aborts -------------------------------------------------------------------------

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
            self.liveness.forget(request.spec.owner)
            for engine in self.core.abandon(request_id):
                self.control.abort(engine, request.spec.owner)
            assert self.decisions is not None
            self.decisions.rounds.everything_changed()  # what it held is free again
            future = self.pending.get(request_id)
            if future is not None and not future.done():
                future.set_result(aborted_result(request.spec))
        waiting = self.adoptions.waiting.get(request_id)
        if waiting is not None and not waiting.done():
            waiting.set_result(None)  # stop waiting for a dead incarnation's attempt
        return True

    # --- views --------------------------------------------------------------------------

    async def in_flight(self) -> dict[str, dict[str, Any]]:
        """Each live request: its state, attempt and the engines it holds (for `status` and tests)."""
        return {
            rid: {"state": e.state.value, "attempt": e.spec.attempt,
                  "prefill_engine": e.prefill_engine, "decode_engine": e.decode_engine}
            for rid, e in self.core.requests.items()
        }

    async def check_integrity(self) -> int:
        """The dispatcher's queue and book invariants (raises naming what is wrong); returns the
        number of requests in flight, which is 0 once every caller has its answer."""
        self.core.dispatcher.check_integrity()
        return len(self.core.requests)

    async def service_view(self) -> dict[str, list[str]]:
        """Who is out of service and why (for `status` and tests): engines dead for good or
        presumed dead from silence, nodes whose reader is gone or unavailable, nodes whose hits
        are read through the DE path instead, and the last incarnation seen of each actor."""
        core = self.core
        known = self.watchdog.incarnations.known if self.watchdog is not None else {}
        return {
            "dead": sorted(core.dead), "presumed_dead": sorted(core.presumed_dead),
            "readers_dead": sorted(core.readers_dead), "readers_unavailable": sorted(core.readers_unavailable),
            "no_pe_reads": sorted(core.dispatcher.no_pe_reads),
            "incarnations": [f"{name}={inc}" for name, inc in sorted(known.items())],
        }

    async def call_counts(self) -> dict[str, int]:
        """How often each entry point ran (submits, collects, engine and reader reports, task
        pushes, heartbeats, turns), retries and their causes, and the store's evictions."""
        evicted = self.core.eviction.stats.evicted_blocks if self.core.eviction is not None else 0
        rounds = self.decisions.rounds.stats if self.decisions is not None else None
        sent = {f"sent_{method}": count for method, count in self.control.sent.items()}
        return {**self.calls, **sent, "evicted_blocks": evicted,
                "indexed_blocks": len(self.core.index), "readmitted": self.core.readmitted,
                "adopted": self.adoptions.adopted, "adoptions_dropped": self.adoptions.dropped,
                "restarted": int(self.restarted), "mailboxes": len(self.mailboxes),
                "dropped_results": self.mailboxes.dropped,
                "decode_pulls": rounds.decode_pulls if rounds else 0, "prefill_pulls": rounds.prefill_pulls if rounds else 0}

    async def tracked(self) -> dict[str, int]:
        """Sizes of every per-request table this actor keeps (a soak test checks they return to
        their starting size once the turns are done)."""
        silent, unheld, delivering = self.liveness.tracked()
        return {"requests": len(self.core.requests), "pending": len(self.pending), "clients": len(self.clients),
                "suspects": len(self.suspects),
                "streams": len(self.streams), "running": len(self.aborts.running),
                "silent": silent, "unheld": unheld, "delivering": delivering}

    async def recent_turns(self) -> list[tuple[float, float, float, str]]:
        """(finished at, ttft_s, tpot_s, path) of the latest served turns, for `dualpath status`."""
        return self.metrics.recent_turns()

    async def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()
