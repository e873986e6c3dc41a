"""The singleton Scheduler actor (`scheduler` in the dualpath namespace).

A thin async shell: callers await `generate(spec)`; group leaders pull with `fetch_decode` /
`fetch_prefill` and their load reports; decisions come from the pure `Dispatcher`. The prefix
index lives here (rebuilt from the store at start), so the hit tokens of a turn are known when
it is queued, and it learns of every persisted block from the decode engine's turn result before
that result is returned, so the next turn of a trajectory always sees its predecessor's blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import logging
from typing import Any

import ray
import ray.exceptions

from dualpath_ray.config import DualPathConfig
from dualpath_ray.kv.eviction import LRUEviction
from dualpath_ray.kv.index import PrefixIndex
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.store import open_store
from dualpath_ray.model.profile import derive_alpha_beta
from dualpath_ray.runtime.actor_metrics import SchedulerMetrics
from dualpath_ray.runtime.adoption import Adoptions
from dualpath_ray.runtime.messages import (
    DecodeReservation,
    EngineHoldings,
    ErrorKind,
    GroupReport,
    Holding,
    PeerState,
    PrefillTask,
    RequestSpec,
    TurnResult,
    failed_result,
)
from dualpath_ray.runtime.restarts import IncarnationTracker, peer_state_of, was_restarted
from dualpath_ray.runtime.topology import plan_nodes
from dualpath_ray.runtime.transport import TransportError, setup_gloo_world
from dualpath_ray.scheduling.dispatcher import Constants, Dispatcher, RequestState

LOG = logging.getLogger("dualpath_ray.scheduler")


def is_attempt(holding: Holding | None, spec: RequestSpec | None) -> bool:
    """Whether an engine's holding is the attempt `spec` now in flight."""
    return holding is not None and spec is not None and (holding.attempt, holding.epoch) == (spec.attempt, spec.epoch)


class SchedulerCore:
    """Scheduler logic without Ray: index lookups, the dispatcher, and pending futures."""

    def __init__(self, cfg: DualPathConfig, store_root: str | None, mode: str, epoch: int = 0) -> None:
        self.cfg = cfg
        self.mode = mode
        self.epoch = epoch  # this incarnation's; every attempt it dispatches carries it
        self.layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
        self.store = open_store(cfg.store, self.layout, root=store_root)
        self.index = PrefixIndex.rebuild(self.store, cfg.store.block_size)
        self.eviction = LRUEviction(self.index, self.store, cfg.store.capacity_bytes, self.layout.full_block_bytes)
        alpha, beta = derive_alpha_beta(cfg, self.layout)
        self.dispatcher = Dispatcher(Constants(alpha, beta, cfg.scheduler.z_margin), mode)  # type: ignore[arg-type]
        self.specs: dict[str, RequestSpec] = {}
        # Hit keys and tokens of each request in flight, from submit until it finishes.
        self.hits: dict[str, tuple[tuple[str, ...], int]] = {}
        self.dead: set[str] = set()  # Ray confirmed: gone for good
        self.presumed_dead: set[str] = set()  # silent past heartbeat_timeout_s; see _live
        self.readmitted = 0
        self.readers_dead: set[str] = set()  # nodes whose reader is gone for good
        self.readers_unavailable: set[str] = set()  # nodes whose reader is silent or restarting

    def lookup(self, spec: RequestSpec) -> tuple[tuple[str, ...], int]:
        """Hit blocks of a prompt, leaving at least one token to compute (it yields the logits)."""
        hit = self.index.match(spec.prompt, spec.namespace)
        usable = min(hit.hit_blocks, (len(spec.prompt) - 1) // self.layout.block_size)
        self.eviction.touch(hit.keys[:usable])
        return tuple(hit.keys[:usable]), usable * self.layout.block_size

    def submit(self, spec: RequestSpec) -> None:
        keys, hit_tokens = self.lookup(spec)
        # Decode engines hold KV in whole pages of block_size tokens, so a reservation is counted
        # in pages' tokens; the dispatcher's free-HBM arithmetic then matches the engines' exactly.
        pages = self.layout.blocks_for(len(spec.prompt) + spec.sampling.max_new_tokens)
        decode_tokens = pages * self.layout.block_size
        self.dispatcher.submit(spec.request_id, len(spec.prompt), hit_tokens, decode_tokens)
        self.specs[spec.request_id] = spec
        self.hits[spec.request_id] = (keys, hit_tokens)

    def _live(self, report: GroupReport) -> tuple[Any, ...]:
        """The report's engines that may take work. An engine only presumed dead (silent past
        the heartbeat timeout) that its group leader reached again is readmitted: a loaded host
        is slow, not dead, and dropping it for good could leave a role with no engine at all.
        Its earlier attempts were failed already; the heartbeat cancels what they still hold."""
        for load in report.engines:
            if load.engine_id in self.presumed_dead:
                self.presumed_dead.discard(load.engine_id)
                self.readmitted += 1
        return tuple(e for e in report.engines if e.engine_id not in self.out_of_service())

    def out_of_service(self) -> set[str]:
        return self.dead | self.presumed_dead

    def engine_restarted(self, engine_id: str) -> list[RequestSpec]:
        """`engine_id` runs a new incarnation: the requests that depended on the old one are
        returned (the caller fails and retries them), and the engine takes work again."""
        self.dead.discard(engine_id)
        self.presumed_dead.discard(engine_id)
        self.dispatcher.forget_engine(engine_id)
        return [self.specs[rid] for rid in self.dispatcher.requests_on(engine_id) if rid in self.specs]

    def reader_restarted(self, node_id: str) -> list[RequestSpec]:
        """The reader of `node_id` runs a new incarnation: every extent of the old one is gone,
        so each request staged or being served through that node's buffer is returned (the
        caller fails and retries it); the node reads again."""
        self.readers_unavailable.discard(node_id)
        self.readers_dead.discard(node_id)  # it answers: whatever took it for dead was wrong
        self.dispatcher.no_pe_reads.discard(node_id)
        return [
            self.specs[rid] for rid, entry in self.dispatcher.entries.items()
            if rid in self.specs and entry.state is RequestState.PREFILLING
            and node_id in (entry.prefill_node, entry.decode_node)
        ]

    def engine_died(self, engine_id: str, confirmed: bool = True) -> list[RequestSpec]:
        """Place no more work on `engine_id` (for good when Ray confirmed the death; until it is
        reachable again when it was only silent); returns the in-flight requests that depended
        on it, which the caller fails with PEER_DIED (and so retries)."""
        (self.dead if confirmed else self.presumed_dead).add(engine_id)
        self.dispatcher.forget_engine(engine_id)
        return [self.specs[rid] for rid in self.dispatcher.requests_on(engine_id) if rid in self.specs]

    def note_report(self, role: str, report: GroupReport) -> list[RequestSpec]:
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
        if report.reader_state is PeerState.ALIVE:
            if node in self.readers_unavailable and node not in self.readers_dead:
                self.readers_unavailable.discard(node)
                self.dispatcher.no_pe_reads.discard(node)
            return []
        if report.reader_state is not PeerState.DEAD:
            self.readers_unavailable.add(node)
            if role == "prefill" and self.mode == "dualpath":
                self.dispatcher.no_pe_reads.add(node)
            return []
        self.readers_dead.add(node)
        if role == "prefill" and self.mode == "dualpath":
            if report.node_id in self.dispatcher.no_pe_reads:
                return []
            self.dispatcher.no_pe_reads.add(report.node_id)
            return [
                self.specs[rid] for rid, entry in self.dispatcher.entries.items()
                if rid in self.specs and entry.state is RequestState.PREFILLING and entry.path == "pe"
                and entry.prefill_node == report.node_id and entry.hit_tokens > 0
            ]
        failed: list[RequestSpec] = []
        for engine in report.engines:
            if engine.engine_id not in self.out_of_service():
                failed.extend(self.engine_died(engine.engine_id))
        return failed

    def takes_work(self, role: str, report: GroupReport) -> bool:
        """Whether the report's group can be given work now: every decode request's KV (and
        every basic-mode prefill's hits) goes through the node's reader, so not while it is
        down; a dualpath prefill group reads through the DE path meanwhile."""
        return report.reader_alive or (role == "prefill" and self.mode == "dualpath")

    def fetch_decode(self, report: GroupReport) -> list[DecodeReservation]:
        self.dispatcher.report_read_q(report.node_id, report.read_q_tokens)
        if not self.takes_work("decode", report):
            return []
        decisions = self.dispatcher.fetch_decode(report.group_id, self._live(report))
        return [
            DecodeReservation(d.request_id, self.specs[d.request_id].attempt, d.tokens, d.decode_engine, self.epoch)
            for d in decisions
        ]

    def fetch_prefill(self, report: GroupReport) -> list[PrefillTask]:
        self.dispatcher.report_read_q(report.node_id, report.read_q_tokens)
        tasks = []
        live = self._live(report) if self.takes_work("prefill", report) else ()
        for d in self.dispatcher.fetch_prefill(live) if live else []:
            keys, hit_tokens = self.hits[d.request_id]
            tasks.append(
                PrefillTask(
                    request=self.specs[d.request_id],
                    hit_keys=keys,
                    hit_tokens=hit_tokens,
                    path=d.path,
                    oracle=self.mode == "oracle",
                    prefill_engine=d.prefill_engine,
                    prefill_node=d.prefill_node,
                    decode_engine=d.decode_engine,
                    decode_node=d.decode_node,
                )
            )
        return tasks

    def is_current(self, result: TurnResult) -> bool:
        """Whether `result` is of the attempt now in flight (not a late one of an earlier try)."""
        spec = self.specs.get(result.request_id)
        return spec is not None and spec.attempt == result.attempt and spec.epoch == result.epoch

    def finish(self, result: TurnResult) -> tuple[str, ...]:
        """Record a finished turn; for a failed one, returns the engines that may still hold
        something of its attempt (its HBM reservation, its queued prefill), other than the one
        that reported it. A late result of an earlier attempt only contributes its published blocks."""
        for block in result.persisted:
            self.index.insert_block(block.key, block.parent)
        self.eviction.touch(block.key for block in result.persisted)
        current = self.is_current(result)
        if current:
            self.specs.pop(result.request_id, None)
            self.hits.pop(result.request_id, None)
        if self.eviction.over_capacity():
            self.eviction.evict(self._keys_in_use())
        if not current:
            return ()
        entry = self.dispatcher.entries.get(result.request_id)
        if entry is None:
            return ()
        self.dispatcher.finish(result.request_id, failed=result.error is not None)
        if result.error is None:
            return ()
        return tuple(e for e in (entry.decode_engine, entry.prefill_engine) if e and e != result.prefill_engine)

    def _keys_in_use(self) -> set[str]:
        return {key for keys, _ in self.hits.values() for key in keys}

    def abandon(self, request_id: str) -> tuple[str, ...]:
        """Forget a request whose deadline passed; returns the engines that may hold its attempt."""
        self.specs.pop(request_id, None)
        self.hits.pop(request_id, None)
        entry = self.dispatcher.cancel(request_id)
        return tuple(e for e in (entry.decode_engine, entry.prefill_engine) if e) if entry is not None else ()

    def stale_holdings(self, held: dict[str, dict[str, Holding]]) -> list[tuple[str, str]]:
        """(engine, owner) of each attempt an engine holds that is no longer the one in flight
        (it finished, failed or was retried) and that has not reached its decode step: a cancel
        whose call was lost, or an accept that came after its cancel, must not hold HBM or
        extents for good. One already decoding finishes on its own."""
        stale = []
        for engine, holds in held.items():
            for rid, holding in holds.items():
                spec = self.specs.get(rid)
                if not holding.handed_off and not is_attempt(holding, spec):
                    stale.append((engine, holding.owner(rid)))
        return stale

    def should_retry(self, result: TurnResult) -> bool:
        kind = result.error_kind
        if result.error is None or kind is None or not kind.retryable:
            return False
        if kind.about_stored_kv and self.cfg.runtime.kv_failure_policy == "fail":
            return False
        return result.attempt + 1 < self.cfg.runtime.max_attempts

    def repair(self, result: TurnResult) -> int:
        """Before a retry: the blocks a KV failure names (and every block after them) leave the
        index, so the retry hits only the longest valid prefix and recomputes the rest; a corrupt
        block is deleted so that the retry's persist republishes it. Returns blocks unindexed."""
        removed = 0
        for key in result.bad_keys:
            removed += self.index.remove(key)
            if result.error_kind is ErrorKind.KV_CORRUPT:
                self.store.delete(key)
        return removed

    def decode_waiting(self) -> bool:
        """Whether any request still waits for a decode engine (global or a group's queue)."""
        return bool(self.dispatcher.decode_global) or any(self.dispatcher.decode_private.values())

    def reset_prefix_cache(self) -> None:
        self.index.clear()


@ray.remote(num_cpus=0, max_concurrency=4096)
class Scheduler:
    """Named, detached singleton; `generate` is awaited by every caller."""

    def __init__(self, cfg: DualPathConfig, store_root: str | None, mode: str) -> None:
        # A new epoch per incarnation (Ray restarts this actor with the same arguments).
        self.core = SchedulerCore(cfg, store_root, mode, epoch=time.time_ns())
        self.restarted = was_restarted()
        self.adoptions = Adoptions()
        self.incarnations = IncarnationTracker()
        # Attempts failed because their engine went silent: their extents are reclaimed only
        # once the death is certain (Ray reports it, or the engine comes back as a new process).
        self.unreclaimed: dict[str, list[str]] = {}
        self.world_lock = asyncio.Lock()
        self.worlds_formed = 0
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

    async def _learn_holdings(self) -> None:
        namespace = self.core.cfg.runtime.namespace
        engines = sorted(
            a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == namespace and a["name"].startswith(("prefill/", "decode/"))
        )
        answers = await asyncio.gather(*(self._holds(e, self.core.cfg.runtime.heartbeat_timeout_s) for e in engines))
        for engine, (answer, _) in zip(engines, answers):
            if answer is not None:
                self.incarnations.observe(engine, answer.incarnation)
            for owner in self.adoptions.learn(engine, answer.held if answer is not None else {}):
                self._tell(engine, "cancel", owner)
        self.calls["adoptable"] = len(self.adoptions.holders)

    async def _watch(self) -> None:
        """Heartbeats to the engines that hold requests. One that Ray reports dead or
        restarting, or that has not answered for heartbeat_timeout_s (hung, its worker loop
        died, its answers lost), is dead: its requests are failed with PEER_DIED (their generate
        loops retry them elsewhere) and it gets no more work until it answers again. A request no live engine holds for heartbeat_timeout_s (its
        assignment died in transit with a group leader, or a message was lost) is failed the same
        way; one on an engine that merely missed a beat waits."""
        runtime = self.core.cfg.runtime
        while True:
            await asyncio.sleep(runtime.heartbeat_s)
            in_use = self.core.dispatcher.engines_in_use() | self.adoptions.engines()
            engines = sorted(in_use - self.core.out_of_service())
            answers = await asyncio.gather(*(self._holds(e, runtime.heartbeat_timeout_s) for e in engines))
            held, silent, now = {}, set(), time.monotonic()
            for engine, (answer, state) in zip(engines, answers):
                gone = state is PeerState.DEAD
                if answer is not None:
                    self.silent_since.pop(engine, None)
                    self._observe(engine, answer.incarnation)
                    held[engine] = answer.held
                elif (gone or state is PeerState.RESTARTING
                      or now - self.silent_since.setdefault(engine, now) >= runtime.heartbeat_timeout_s):
                    # Ray restarting it means its process died: its attempts are lost, so they are
                    # retried at once; its extents are reclaimed once the new incarnation shows.
                    self.silent_since.pop(engine, None)
                    self._engine_died(engine, confirmed=gone)
                else:
                    silent.add(engine)
            self._fail_lost(held, silent, runtime.heartbeat_timeout_s)
            self.adoptions.check(held, silent, now, runtime.heartbeat_timeout_s)
            for engine, owner in self.core.stale_holdings(held):
                self.calls["stale_holdings"] += 1
                self._tell(engine, "cancel", owner)

    async def _holds(self, engine: str, timeout_s: float) -> tuple[EngineHoldings | None, PeerState]:
        """What `engine` holds (None when it does not answer), and what its silence says: gone
        for good (DEAD), restarting, or only silent (hung, its worker loop died, the answer lost)."""
        try:
            handle = ray.get_actor(engine, namespace=self.core.cfg.runtime.namespace)
        except ValueError:
            return None, PeerState.DEAD
        try:
            answer = await asyncio.wait_for(asyncio.wrap_future(handle.holds.remote().future()), timeout_s)
        except ray.exceptions.RayActorError as exc:
            return None, peer_state_of(exc)
        except Exception:  # noqa: BLE001 - hung, its worker loop died, or the answer was lost
            return None, PeerState.SILENT
        return answer, PeerState.ALIVE

    def _fail_lost(self, held: dict[str, dict[str, Holding]], silent: set[str], grace_s: float) -> None:
        now = time.monotonic()
        lost = []
        for rid, entry in self.core.dispatcher.entries.items():
            spec = self.core.specs.get(rid)
            if spec is None or entry.state is RequestState.WAITING_DECODE:
                continue
            if entry.decode_engine in silent or entry.prefill_engine in silent or self._in_delivery(rid):
                continue  # not known either way this round
            at_decode = held.get(entry.decode_engine, {}).get(rid)
            at_prefill = held.get(entry.prefill_engine, {}).get(rid) if entry.prefill_engine else None
            delivered = is_attempt(at_decode, spec) and (
                entry.state is RequestState.WAITING_PREFILL or at_decode.handed_off or is_attempt(at_prefill, spec)
            )
            if delivered:
                self.unheld_since.pop(rid, None)
            elif now - self.unheld_since.setdefault(rid, now) >= grace_s:
                lost.append(spec)
        for spec in lost:
            self.unheld_since.pop(spec.request_id, None)
            self.calls["lost_assignments"] += 1
            self._complete(failed_result(spec, "scheduler", "no live engine holds this attempt", ErrorKind.PEER_DIED))

    def _engine_died(self, engine: str, confirmed: bool) -> None:
        self.calls["dead_engines"] += 1
        self.calls["presumed_dead"] += not confirmed
        owners = []
        for spec in self.core.engine_died(engine, confirmed):
            self._complete(failed_result(spec, engine, f"engine {engine} died", ErrorKind.PEER_DIED))
            owners.append(spec.owner)
        if confirmed:
            self._reclaim(owners + self.unreclaimed.pop(engine, []))
        else:
            # Not from an engine that only stopped answering: it may still move KV into the
            # extents, and a slot freed under a transfer would damage its next owner's KV.
            self.unreclaimed.setdefault(engine, []).extend(owners)

    def _reclaim(self, owners: list[str]) -> None:
        """Take back the extents lent to these attempts, whose engine is certainly gone."""
        for owner in owners:
            for node in self.core.dispatcher.read_q:
                self._tell(f"reader/{node}", "reclaim", owner)

    def _observe(self, name: str, incarnation: str) -> None:
        """A new incarnation of an engine or reader proves its old process gone: fail (and so
        retry) what depended on it, reclaim what its attempts leased, and let it work again."""
        if not self.incarnations.observe(name, incarnation):
            return
        if name.startswith("reader/"):
            node = name.removeprefix("reader/")
            self.calls["restarted_readers"] += 1
            for spec in self.core.reader_restarted(node):
                self._complete(failed_result(spec, name, "storage reader restarted", ErrorKind.PEER_DIED))
            return
        self.calls["restarted_engines"] += 1
        self.silent_since.pop(name, None)
        owners = []
        for spec in self.core.engine_restarted(name):
            self._complete(failed_result(spec, name, f"engine {name} restarted", ErrorKind.PEER_DIED))
            owners.append(spec.owner)
        self._reclaim(owners + self.unreclaimed.pop(name, []))

    async def reform_transport(self, requester: str) -> bool:
        """A restarted gloo endpoint (`requester`) asks for a new world over every engine and
        reader of the deployment (a gloo world cannot take a new member in place). Requests are
        served one at a time; one that a world formed after it was asked already covers is
        answered at once. NIXL needs no world: True."""
        if self.core.cfg.runtime.transport != "gloo":
            return True
        asked_at = self.worlds_formed
        async with self.world_lock:
            if self.worlds_formed > asked_at:
                return True
            try:
                await asyncio.to_thread(self._form_world)
            except (TransportError, ValueError) as exc:
                LOG.warning("forming a new gloo world for %s failed: %s", requester, exc)
                return False
            self.worlds_formed += 1
            self.calls["worlds_formed"] += 1
            return True

    def _form_world(self) -> None:
        namespace = self.core.cfg.runtime.namespace
        names = [name for spec in plan_nodes(self.core.cfg) for name in (spec.reader_name, *spec.engine_names())]
        setup_gloo_world([ray.get_actor(name, namespace=namespace) for name in names],
                         timeout_s=self.core.cfg.runtime.transfer_timeout_s)

    def _note_report(self, role: str, report: GroupReport) -> None:
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
            getattr(ray.get_actor(actor, namespace=self.core.cfg.runtime.namespace), method).remote(*args)
        except ValueError:
            pass  # that actor is gone

    async def mode(self) -> str:
        """The read-path mode this scheduler was deployed with."""
        return self.core.mode

    async def generate(self, spec: RequestSpec) -> TurnResult:
        """Serve one turn: its result, or a failed result with an ErrorKind once its retries or
        its deadline (runtime.request_timeout_s) are used up. Never waits forever."""
        await self._started()
        if spec.request_id in self.pending or spec.request_id in self.adoptions.waiting:
            raise ValueError(f"request id {spec.request_id!r} is already in flight; ids must be unique")
        self.calls["generate"] += 1
        deadline = time.monotonic() + self.core.cfg.runtime.request_timeout_s
        adopted = await self._adopt(spec.request_id, deadline)
        if adopted is not None and not self.core.should_retry(adopted):
            return adopted
        spec = dataclasses.replace(spec, epoch=self.core.epoch)
        while True:
            result = await self._attempt(spec, deadline)
            if not self.core.should_retry(result):
                return result
            self.calls["retries"] += 1
            self.calls["unindexed_blocks"] += self.core.repair(result)
            spec = dataclasses.replace(spec, attempt=spec.attempt + 1)

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
                spec, "scheduler", f"no result within runtime.request_timeout_s={self.core.cfg.runtime.request_timeout_s}",
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
        self._note_report("decode", report)
        placed = await self._fetch("decode", report.group_id, lambda: self.core.fetch_decode(report), wait_s)
        if placed:
            self.new_work["prefill"].set()
        return placed

    async def fetch_prefill(self, report: GroupReport, wait_s: float = 0.0) -> list[PrefillTask]:
        """A prefill group's pull; with nothing to assign, waits up to wait_s for new work.

        The report was taken before the wait; meanwhile its engines can only have finished work
        (no one else assigns to them), so deciding on it after the wait is conservative."""
        await self._started()
        self._note_report("prefill", report)
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

    def _in_delivery(self, rid: str) -> bool:
        """Whether the fetch answer that carried this request's latest assignment may still be
        being delivered: its group's leader has not fetched since. On a loaded host handing a
        large answer to the members can outlast the heartbeat grace; a lost answer, a dead
        leader (its standby fetches next) or a dead member all end with a later fetch."""
        group, seq = self.delivering.get(rid, ("", 0))
        return bool(group) and self.fetches.get(group, 0) == seq

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
            rid: {"state": e.state.value, "attempt": self.core.specs[rid].attempt if rid in self.core.specs else None,
                  "prefill_engine": e.prefill_engine, "decode_engine": e.decode_engine}
            for rid, e in self.core.dispatcher.entries.items()
        }

    async def check_integrity(self) -> int:
        """The dispatcher's queue invariants (raises naming what is wrong); returns the number
        of requests in flight, which is 0 once every caller has its answer."""
        self.core.dispatcher.check_integrity()
        return len(self.core.dispatcher.entries)

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
        return {**self.calls, "evicted_blocks": self.core.eviction.stats.evicted_blocks,
                "indexed_blocks": len(self.core.index), "readmitted": self.core.readmitted,
                "adopted": self.adoptions.adopted, "adoptions_dropped": self.adoptions.dropped,
                "restarted": int(self.restarted)}

    async def recent_turns(self) -> list[tuple[float, float, float, str]]:
        """(finished at, ttft_s, tpot_s, path) of the latest served turns, for `dualpath status`."""
        return self.metrics.recent_turns()

    async def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()
