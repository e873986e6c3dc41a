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

    def reset_prefix_cache(self) -> None:
        self.index.clear()


@ray.remote(num_cpus=0, max_concurrency=4096)
class Scheduler:
    """Named, detached singleton; `generate` is awaited by every caller."""

    def __init__(self, cfg: DualPathConfig, store_root: str | None, mode: str) -> None:
        self.core = SchedulerCore(cfg, store_root, mode)
        self.pending: dict[str, asyncio.Future[TurnResult]] = {}
        self.started_at = time.time()

    async def ready(self) -> bool:
        return True

    async def generate(self, spec: RequestSpec) -> TurnResult:
        if spec.request_id in self.pending:
            raise ValueError(f"request id {spec.request_id!r} is already in flight; ids must be unique")
        future: asyncio.Future[TurnResult] = asyncio.get_running_loop().create_future()
        self.pending[spec.request_id] = future
        try:
            self.core.submit(spec)
        except Exception:
            self.pending.pop(spec.request_id)
            raise
        return await future

    async def fetch_decode(self, report: GroupReport) -> list[DecodeReservation]:
        return self.core.fetch_decode(report)

    async def fetch_prefill(self, report: GroupReport) -> list[PrefillTask]:
        return self.core.fetch_prefill(report)

    async def complete(self, result: TurnResult) -> None:
        holder = self.core.finish(result)
        if holder is not None:
            ray.get_actor(holder, namespace=self.core.cfg.runtime.namespace).cancel.remote(result.request_id)
        future = self.pending.pop(result.request_id, None)
        if future is not None and not future.done():
            future.set_result(result)

    async def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()
