"""The singleton Scheduler actor (`scheduler` in the dualpath namespace).

A thin async shell: callers await `generate(spec)`; group leaders pull with `fetch_decode` /
`fetch_prefill` and their load reports; decisions come from the pure `Dispatcher`. The prefix
index lives here (rebuilt from the store at start), so the hit tokens of a turn are known when
it is queued, and it learns of every persisted block from the decode engine's turn result before
that result is returned, so the next turn of a trajectory always sees its predecessor's blocks.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray

from dualpath_ray.config import DualPathConfig
from dualpath_ray.kv.index import PrefixIndex
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.store import open_store
from dualpath_ray.model.profile import derive_alpha_beta
from dualpath_ray.runtime.messages import (
    DecodeReservation,
    GroupReport,
    PrefillTask,
    RequestSpec,
    TurnResult,
)
from dualpath_ray.scheduling.dispatcher import Constants, Dispatcher


class SchedulerCore:
    """Scheduler logic without Ray: index lookups, the dispatcher, and pending futures."""

    def __init__(self, cfg: DualPathConfig, store_root: str | None, mode: str) -> None:
        self.cfg = cfg
        self.mode = mode
        self.layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
        self.store = open_store(cfg.store, self.layout, root=store_root)
        self.index = PrefixIndex.rebuild(self.store, cfg.store.block_size)
        alpha, beta = derive_alpha_beta(cfg, self.layout)
        self.dispatcher = Dispatcher(Constants(alpha, beta, cfg.scheduler.z_margin), mode)  # type: ignore[arg-type]
        self.specs: dict[str, RequestSpec] = {}
        self.hits: dict[str, tuple[tuple[str, ...], int]] = {}

    def lookup(self, spec: RequestSpec) -> tuple[tuple[str, ...], int]:
        """Hit blocks of a prompt, leaving at least one token to compute (it yields the logits)."""
        hit = self.index.match(spec.prompt, spec.namespace)
        usable = min(hit.hit_blocks, (len(spec.prompt) - 1) // self.layout.block_size)
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

    def fetch_decode(self, report: GroupReport) -> list[DecodeReservation]:
        self.dispatcher.report_read_q(report.node_id, report.read_q_tokens)
        decisions = self.dispatcher.fetch_decode(report.group_id, report.engines)
        return [
            DecodeReservation(d.request_id, self.specs[d.request_id].attempt, d.tokens, d.decode_engine)
            for d in decisions
        ]

    def fetch_prefill(self, report: GroupReport) -> list[PrefillTask]:
        self.dispatcher.report_read_q(report.node_id, report.read_q_tokens)
        tasks = []
        for d in self.dispatcher.fetch_prefill(report.engines):
            keys, hit_tokens = self.hits.pop(d.request_id)
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

    def finish(self, result: TurnResult) -> str | None:
        """Record a finished turn; returns the decode engine still holding HBM for a failed one."""
        for block in result.persisted:
            self.index.insert_block(block.key, block.parent)
        self.specs.pop(result.request_id, None)
        self.hits.pop(result.request_id, None)
        entry = self.dispatcher.entries.get(result.request_id)
        if entry is None:
            return None
        self.dispatcher.finish(result.request_id, failed=result.error is not None)
        return entry.decode_engine if result.error is not None and entry.decode_engine else None

    def decode_waiting(self) -> bool:
        """Whether any request still waits for a decode engine (global or a group's queue)."""
        return bool(self.dispatcher.decode_global) or any(self.dispatcher.decode_private.values())

    def reset_prefix_cache(self) -> None:
        self.index.clear()


@ray.remote(num_cpus=0, max_concurrency=4096)
class Scheduler:
    """Named, detached singleton; `generate` is awaited by every caller."""

    def __init__(self, cfg: DualPathConfig, store_root: str | None, mode: str) -> None:
        self.core = SchedulerCore(cfg, store_root, mode)
        self.pending: dict[str, asyncio.Future[TurnResult]] = {}
        self.started_at = time.time()
        # Set when a role may have new work: leaders waiting in a fetch wake at once instead of
        # polling (decode: a request arrived or one finished and freed HBM; prefill: a request
        # got its decode engine, or one finished and lightened an engine).
        self.new_work = {"decode": asyncio.Event(), "prefill": asyncio.Event()}
        self.calls: dict[str, int] = {"generate": 0, "complete": 0, "fetch_decode": 0, "fetch_prefill": 0, "empty_waits": 0}

    async def ready(self) -> bool:
        return True

    async def generate(self, spec: RequestSpec) -> TurnResult:
        if spec.request_id in self.pending:
            raise ValueError(f"request id {spec.request_id!r} is already in flight; ids must be unique")
        self.calls["generate"] += 1
        future: asyncio.Future[TurnResult] = asyncio.get_running_loop().create_future()
        self.pending[spec.request_id] = future
        try:
            self.core.submit(spec)
        except Exception:
            self.pending.pop(spec.request_id)
            raise
        self.new_work["decode"].set()
        return await future

    async def fetch_decode(self, report: GroupReport, wait_s: float = 0.0) -> list[DecodeReservation]:
        """A decode group's pull; with nothing to place, waits up to wait_s for new work."""
        placed = await self._fetch("decode", lambda: self.core.fetch_decode(report), wait_s)
        if placed:
            self.new_work["prefill"].set()
        return placed

    async def fetch_prefill(self, report: GroupReport, wait_s: float = 0.0) -> list[PrefillTask]:
        """A prefill group's pull; with nothing to assign, waits up to wait_s for new work.

        The report was taken before the wait; meanwhile its engines can only have finished work
        (no one else assigns to them), so deciding on it after the wait is conservative."""
        return await self._fetch("prefill", lambda: self.core.fetch_prefill(report), wait_s)

    async def _fetch(self, role: str, fetch: Any, wait_s: float) -> list[Any]:
        self.calls[f"fetch_{role}"] += 1
        work = fetch()
        if work or wait_s <= 0:
            return work
        event = self.new_work[role]
        event.clear()
        self.calls["empty_waits"] += 1
        try:
            await asyncio.wait_for(event.wait(), wait_s)
        except asyncio.TimeoutError:
            return []
        return fetch()

    async def complete(self, result: TurnResult) -> None:
        self.calls["complete"] += 1
        holder = self.core.finish(result)
        if holder is not None:
            ray.get_actor(holder, namespace=self.core.cfg.runtime.namespace).cancel.remote(result.request_id)
        future = self.pending.pop(result.request_id, None)
        if future is not None and not future.done():
            future.set_result(result)
        # A finished turn frees its decode engine's HBM, which matters only to requests still
        # waiting for a decode engine; prefill engines were lightened at handoff already.
        if self.core.decode_waiting():
            self.new_work["decode"].set()

    async def call_counts(self) -> dict[str, int]:
        """How often each entry point ran (pulls, empty pulls that waited, turns)."""
        return dict(self.calls)

    async def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()
