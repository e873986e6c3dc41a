"""The scheduler's heartbeat watchdog: which engines are alive, and what their deaths cost.

A mixin of the Scheduler actor (runtime/scheduler.py), kept apart because it is one concern:
every heartbeat_s it asks the engines that hold requests what they hold (`holds`). An engine Ray
reports dead or restarting, or one silent for heartbeat_timeout_s, is dead: its attempts fail
with PEER_DIED (their callers retry them elsewhere) and its extents are reclaimed once its death
is certain. A new incarnation proves the old process gone. A request no live engine holds for
heartbeat_timeout_s is failed the same way, unless the answer that carried its assignment may
still be on its way. A restarted scheduler first learns what the engines hold (adoption).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import ray
import ray.exceptions

from dualpath_ray.config import DualPathConfig
from dualpath_ray.runtime.adoption import Adoptions
from dualpath_ray.runtime.control import ClusterControl
from dualpath_ray.runtime.messages import EngineHoldings, ErrorKind, Holding, PeerState, TurnResult, failed_result
from dualpath_ray.runtime.restarts import IncarnationTracker, peer_state_of
from dualpath_ray.scheduling.requests import RequestState
from dualpath_ray.scheduling.scheduler import SchedulerCore, is_attempt


class HeartbeatWatch:
    """What the Scheduler's __init__ sets up, and the two calls of its own this part uses."""

    cfg: DualPathConfig
    core: SchedulerCore
    control: ClusterControl
    adoptions: Adoptions
    incarnations: IncarnationTracker
    calls: dict[str, int]
    silent_since: dict[str, float]  # engine -> since when it has not answered
    unheld_since: dict[str, float]  # request id -> since when no live engine holds it
    unreclaimed: dict[str, list[str]]  # engine -> owners whose extents wait for its death to be certain
    delivering: dict[str, tuple[str, int]]  # request id -> (group, fetch) that carried its assignment
    fetches: dict[str, int]  # group -> fetches so far
    _complete: Callable[[TurnResult], None]
    _tell: Callable[..., None]

    async def _learn_holdings(self) -> None:
        engines = self.control.engines
        answers = await asyncio.gather(*(self._holds(e, self.cfg.runtime.heartbeat_timeout_s) for e in engines))
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
        runtime = self.cfg.runtime
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
            handle = self.control.handle(engine)
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
        for rid, entry in self.core.requests.items():
            spec = entry.spec
            if entry.state is RequestState.QUEUED_DECODE:
                continue
            if entry.decode_engine in silent or entry.prefill_engine in silent or self._in_delivery(rid):
                continue  # not known either way this round
            at_decode = held.get(entry.decode_engine, {}).get(rid)
            at_prefill = held.get(entry.prefill_engine, {}).get(rid) if entry.prefill_engine else None
            delivered = is_attempt(at_decode, spec) and (
                entry.state is RequestState.QUEUED_PREFILL or at_decode.handed_off or is_attempt(at_prefill, spec)
            )
            if is_attempt(at_decode, spec) and at_decode.handed_off:
                self.core.handed_off(rid)  # its prefill engine's death no longer concerns it
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

    def _in_delivery(self, rid: str) -> bool:
        """Whether the fetch answer that carried this request's latest assignment may still be
        being delivered: its group's leader has not fetched since. On a loaded host handing a
        large answer to the members can outlast the heartbeat grace; a lost answer, a dead
        leader (its standby fetches next) or a dead member all end with a later fetch."""
        group, seq = self.delivering.get(rid, ("", 0))
        return bool(group) and self.fetches.get(group, 0) == seq

