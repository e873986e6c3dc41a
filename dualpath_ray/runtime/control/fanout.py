"""Calls the Scheduler makes to the engines and readers of its deployment: cancels, aborts and
reclaims of one attempt, staging orders to one reader, and, to all at once, sleep and wake between rollouts, the trainer's
weight broadcast group, and a new gloo world. Every call names its method (no string dispatch).

The Scheduler is the one actor every trainer, adapter and restarted endpoint can reach by name,
so cluster-wide control goes through it; this class keeps that fan-out out of its request path.
Every call is awaited without blocking the Scheduler's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any, Callable, Mapping, Sequence

import ray

from dualpath_ray.config import DualPathConfig
from dualpath_ray.protocol.weights import TensorSpec
from dualpath_ray.runtime.placement.topology import plan_nodes
from dualpath_ray.scheduling.staging import StageOrder

LOG = logging.getLogger("dualpath_ray.control")


class ClusterControl:
    """`routes` maps an engine's name to the actor that answers for it (the scale harness's
    simulated engines, benchmarks/scale_harness.py); every actor answers for itself otherwise."""

    def __init__(self, cfg: DualPathConfig, routes: Mapping[str, str] | None = None) -> None:
        self.cfg = cfg
        nodes = plan_nodes(cfg)
        self.engines = [name for spec in nodes for name in spec.engine_names()]
        self.readers = [spec.reader_name for spec in nodes]
        self.routes = dict(routes or {})
        self.world_lock = asyncio.Lock()
        self.worlds_formed = 0
        self.sent: Counter[str] = Counter()  # one-actor calls made, by method
        self._handles: dict[str, Any] = {}

    def handle(self, name: str) -> Any:
        """The named actor's handle, looked up once: a lookup is a blocking GCS call, and the
        Scheduler makes these on its event loop every heartbeat. A handle outlives restarts of
        its actor; calls on one gone for good fail with Ray's ActorDiedError. ValueError: no
        actor of that name was ever found."""
        cached = self._handles.get(name)
        if cached is None:
            actor = self.routes.get(name, name)
            cached = self._handles[name] = ray.get_actor(actor, namespace=self.cfg.runtime.namespace)
        return cached

    # --- one actor, no reply awaited --------------------------------------------------------

    def cancel(self, engine: str, owner: str) -> None:
        """Drop what one attempt holds at `engine` and has not started (see the cores' cancel)."""
        self._send("cancel", engine, lambda handle: handle.cancel.remote(owner))

    def abort(self, engine: str, owner: str) -> None:
        """Drop one attempt at `engine` even if it started (see the cores' abort)."""
        self._send("abort", engine, lambda handle: handle.abort.remote(owner))

    def reclaim(self, reader: str, owner: str) -> None:
        """Free the extents `reader` leased to an attempt whose engine is certainly gone."""
        self._send("reclaim", reader, lambda handle: handle.reclaim.remote(owner))

    def stage_ahead(self, reader: str, orders: Sequence[StageOrder]) -> None:
        """Have `reader` stage these chains while their sessions' tools run (scheduling/staging.py)."""
        self._send("stage_ahead", reader, lambda handle: handle.stage_ahead.remote(list(orders)))

    def _send(self, method: str, name: str, call: Callable[[Any], Any]) -> None:
        self.sent[method] += 1
        try:
            call(self.handle(name))
        except ValueError:
            pass  # that actor is gone

    # --- every engine at once ------------------------------------------------------------

    async def _gather(self, refs: Sequence[Any]) -> list[Any]:
        return list(await asyncio.gather(*(asyncio.wrap_future(ref.future()) for ref in refs)))

    async def sleep(self) -> int:
        """Every engine releases its KV memory and moves its weights off the accelerator;
        returns the bytes freed."""
        return sum(await self._gather([self.handle(name).sleep.remote() for name in self.engines]))

    async def wake_up(self) -> dict[str, str]:
        """Every engine allocates its memory again (under a new incarnation of its addressing);
        then every engine and reader drops the addressing it cached, so its next transfer uses
        the new one. Returns engine -> its new incarnation."""
        incarnations = await self._gather([self.handle(name).wake_up.remote() for name in self.engines])
        await self._gather([self.handle(name).forget_peers.remote() for name in [*self.readers, *self.engines]])
        return dict(zip(self.engines, incarnations))

    # --- the trainer's weight broadcast group -----------------------------------------

    async def join_weight_group(self, host: str, port: int, group_name: str, timeout_s: float) -> int:
        """Every engine joins the trainer's group as ranks 1..N (the trainer is rank 0 and joins
        beside this call); returns the group's world size."""
        world_size = len(self.engines) + 1
        await asyncio.gather(*(
            asyncio.wrap_future(
                self.handle(name).join_weight_group.remote(host, port, world_size, rank, group_name, timeout_s).future()
            )
            for rank, name in enumerate(self.engines, start=1)
        ))
        return world_size

    async def receive_weights(self, version: int, manifest: Sequence[TensorSpec], expected: str | None) -> list[str]:
        """Every engine receives the broadcast the trainer sends beside this call and loads it;
        returns the fingerprint each loaded (see the engines' update_weights for `expected`)."""
        return await self._gather([
            self.handle(name).receive_weights.remote(version, list(manifest), expected) for name in self.engines
        ])

    async def update_weights(self, version: int, source: Any, expected: str | None) -> list[str]:
        """Every engine loads `source` (a checkpoint directory, or a state dict's ObjectRef, which
        each engine fetches itself) as weight version `version`; returns each one's fingerprint."""
        return await self._gather([self.handle(name).update_weights.remote(version, source, expected) for name in self.engines])

    # --- gloo worlds --------------------------------------------------------------------

    async def reform_gloo_world(self, requester: str) -> bool:
        """A new gloo world over every engine and reader (a gloo world cannot take a new member
        in place), asked for by a restarted or broken endpoint. One at a time; a request that a
        world formed after it was asked already covers is answered at once."""
        from dualpath_ray.runtime.transport.moves import TransportError

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
            return True

    def _form_world(self) -> None:
        from dualpath_ray.runtime.transport.gloo_world import setup_gloo_world

        handles = [self.handle(name) for name in [*self.readers, *self.engines]]
        setup_gloo_world(handles, timeout_s=self.cfg.runtime.transfer_timeout_s)
