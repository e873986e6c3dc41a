"""What each actor exports (docs/metrics.md): the storage reader, the engines and the scheduler.

Every actor builds one of these in its `__init__`; the periodic part (runtime/telemetry/metrics_export.py)
reads figures the actor keeps anyway, the `observe`-style methods are called where a duration
or a result exists only for a moment. All of them accept being built with metrics off.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, Sequence

from dualpath_ray import metrics as m
from dualpath_ray.config import DualPathConfig
from dualpath_ray.kv.staged import StagingCounts
from dualpath_ray.metrics import MetricSink, RayMetrics
from dualpath_ray.protocol.counters import PATHS, NodeCounters
from dualpath_ray.protocol.names import SCHEDULER, reader_name
from dualpath_ray.protocol.types import ReadPath
from dualpath_ray.runtime.telemetry.scheduler_counts import SchedulerCounts
from dualpath_ray.runtime.telemetry.metrics_export import CounterTotals, PeriodicExport

if TYPE_CHECKING:
    from dualpath_ray.kv.layout import KVLayout
    from dualpath_ray.kv.pool import BufferPool
    from dualpath_ray.protocol.messages import TurnResult
    from dualpath_ray.scheduling.scheduler import SchedulerCore

# Served turns the scheduler remembers for `dualpath status` (TTFT/TPOT of the recent ones).
RECENT_TURNS = 512


def node_role(cfg: DualPathConfig, node_id: str) -> str:
    """The role of a logical node of the configuration (p0 -> prefill, d0 -> decode)."""
    from dualpath_ray.runtime.placement.topology import plan_nodes

    for spec in plan_nodes(cfg):
        if spec.node_id == node_id:
            return spec.role
    raise ValueError(f"node {node_id!r} is not a node of this configuration")


def _periodic(cfg: DualPathConfig, name: str, collect: Callable[[], None]) -> PeriodicExport | None:
    if not cfg.runtime.metrics:
        return None
    return PeriodicExport(name, cfg.runtime.metrics_interval_s, collect).start()


class ReaderFigures(Protocol):
    """What ReaderMetrics reads from a node's reader (ReaderCore, runtime/reader/core.py).

    Declared here, by the reader of the figures, so this module never imports the reader: the
    reader actor imports this module, and the other way round would be an import circle."""

    @property
    def node_id(self) -> str: ...

    @property
    def counters(self) -> NodeCounters: ...

    @property
    def layout(self) -> KVLayout: ...

    @property
    def pool(self) -> BufferPool: ...

    def read_q(self) -> int: ...

    def integrity_keys(self) -> tuple[list[str], list[str]]: ...

    def corrupt_found(self) -> int: ...

    def store_faults(self) -> tuple[list[str], int]: ...

    @property
    def persist_mismatches(self) -> int: ...

    def staging_counts(self) -> StagingCounts: ...


class ReaderMetrics:
    """A node's storage NIC bytes, read queue, buffer use, bad stored blocks and refused block
    writes; KV load times."""

    def __init__(self, sink: MetricSink, core: ReaderFigures, role: str) -> None:
        self.sink = sink
        self.core = core
        self.tags = {"node": core.node_id, "role": role}
        self.totals = CounterTotals(sink)
        self.export: PeriodicExport | None = None

    @classmethod
    def start(cls, cfg: DualPathConfig, core: ReaderFigures) -> ReaderMetrics:
        exporter = cls(RayMetrics(cfg.runtime.metrics), core, node_role(cfg, core.node_id))
        exporter.export = _periodic(cfg, reader_name(core.node_id), exporter.collect)
        return exporter

    def collect(self) -> None:
        counters = self.core.counters
        for path in PATHS:
            self.totals.update(m.SNIC_READ_BYTES, counters.snic_read[path], {**self.tags, "path": path})
        self.totals.update(m.SNIC_WRITE_BYTES, counters.snic_write, self.tags)
        self.totals.update(m.STORE_CHECKSUM_FAILURES, self.core.corrupt_found(), self.tags)
        # Writes the store refused and blocks whose bytes failed their engine's digest: neither published.
        self.totals.update(m.STORE_WRITE_FAILURES, self.core.store_faults()[1] + self.core.persist_mismatches, self.tags)
        for outcome, blocks in self.core.staging_counts().as_dict().items():
            self.totals.update(m.STAGED_BLOCKS, blocks, {**self.tags, "outcome": outcome})
        self.sink.set(m.READ_QUEUE_TOKENS, self.core.read_q(), self.tags)
        pool = self.core.pool.check_integrity()
        block_bytes = self.core.layout.full_block_bytes
        self.sink.set(m.BUFFER_BYTES_USED, (pool.leased + pool.in_flight) * block_bytes, self.tags)
        self.sink.set(m.BUFFER_BYTES_CAPACITY, pool.capacity * block_bytes, self.tags)

    @contextmanager
    def kv_load(self, path: ReadPath, hit_blocks: int) -> Iterator[None]:
        """Time one read_hits call that loads `hit_blocks` blocks (lease wait + SNIC read); a call
        with no hit, or one that fails, is not a KV load and is not observed."""
        started = time.perf_counter()
        yield
        if hit_blocks and self.sink.enabled:
            self.sink.observe(m.KV_LOAD_SECONDS, time.perf_counter() - started, {**self.tags, "path": path.value})

    def close(self) -> None:
        if self.export is not None:
            self.export.close()


class EngineMetrics:
    """An engine's CNIC bytes, load (seq, tok), KV memory in use and digest mismatches."""

    def __init__(self, sink: MetricSink, engine_id: str, node_id: str, role: str, core: Any) -> None:
        self.sink = sink
        self.core = core
        self.role = role
        self.tags = {"engine": engine_id, "node": node_id, "role": role}
        self.totals = CounterTotals(sink)
        self.export: PeriodicExport | None = None

    @classmethod
    def start(cls, cfg: DualPathConfig, engine_id: str, node_id: str, role: str, core: Any) -> EngineMetrics:
        exporter = cls(RayMetrics(cfg.runtime.metrics), engine_id, node_id, role, core)
        exporter.export = _periodic(cfg, engine_id, exporter.collect)
        return exporter

    def collect(self) -> None:
        counters = self.core.counters
        for direction, totals in (("in", counters.cnic_in), ("out", counters.cnic_out)):
            for path in PATHS:
                self.totals.update(m.CNIC_BYTES, totals[path], {**self.tags, "direction": direction, "path": path})
        load = self.core.load()
        self.sink.set(m.ENGINE_TOKENS, load.tok, self.tags)
        self.sink.set(m.ENGINE_REQUESTS, load.seq, self.tags)
        used, capacity = self._kv_memory()
        self.sink.set(m.HBM_BYTES_USED, used, self.tags)
        self.sink.set(m.HBM_BYTES_CAPACITY, capacity, self.tags)
        self.totals.update(m.KV_DIGEST_MISMATCHES, self._digest_mismatches(), self.tags)

    def _kv_memory(self) -> tuple[int, int]:
        """(bytes in use, capacity) of the engine's KV memory. Decode: reserved pages, as the
        scheduler counts free HBM; prefill: layer window slots holding a layer (a racy read of
        three states, which a gauge tolerates)."""
        if self.role == "decode":
            pages = self.core.pages
            page_bytes = self.core.layout.full_block_bytes
            return (pages.capacity - pages.unreserved_pages) * page_bytes, pages.capacity * page_bytes
        from dualpath_ray.kv.window import (
            RING_LAYERS,  # torch: only engine processes import it
        )

        window = self.core.window
        return window.held() * window.slot_bytes, RING_LAYERS * window.slot_bytes

    def _digest_mismatches(self) -> int:
        stats = self.core.stats
        return stats.digest_mismatches if self.role == "decode" else stats.pipeline.digest_mismatches

    def close(self) -> None:
        if self.export is not None:
            self.export.close()


class SchedulerMetrics:
    """Decisions, placements by read path, served turns' TTFT/TPOT, failures and retries.

    `calls` is the scheduler's own counts (runtime/telemetry/scheduler_counts.py), from which retries, recomputed blocks and
    timeouts are exported periodically. The last RECENT_TURNS served turns are kept whether or
    not metrics are on: `dualpath status` shows them."""

    def __init__(self, sink: MetricSink, mode: str, calls: SchedulerCounts) -> None:
        self.sink = sink
        self.mode = mode
        self.calls = calls
        self.totals = CounterTotals(sink)
        self.recent: deque[tuple[float, float, float, str]] = deque(maxlen=RECENT_TURNS)
        self.export: PeriodicExport | None = None
        # The core whose late-binding and in-flight-sharing totals are exported (given at start).
        self.core: SchedulerCore | None = None

    @classmethod
    def start(
        cls, cfg: DualPathConfig, mode: str, calls: SchedulerCounts, core: SchedulerCore | None = None,
    ) -> SchedulerMetrics:
        exporter = cls(RayMetrics(cfg.runtime.metrics), mode, calls)
        exporter.core = core
        exporter.export = _periodic(cfg, SCHEDULER, exporter.collect)
        return exporter

    def decided(self, role: str, seconds: float) -> None:
        """One policy placement for a group (scheduling/rounds.py) took `seconds`."""
        self.sink.observe(m.DECISION_SECONDS, seconds, {"role": role})

    def placed(self, tasks: Sequence[Any]) -> None:
        """Count the requests a prefill placement placed, by the read path chosen for each."""
        if not tasks or not self.sink.enabled:
            return
        for path in PATHS:
            count = sum(1 for task in tasks if task.path == path)
            self.sink.inc(m.REQUESTS, count, {"mode": self.mode, "path": path})
        for task in tasks:
            if task.recomputed_tokens:
                self.sink.inc(m.RECOMPUTED_HIT_TOKENS, task.recomputed_tokens,
                              {"mode": self.mode, "engine": task.prefill_engine, "why": "compute_path"})

    def finished(self, result: TurnResult) -> None:
        """A result of the attempt in flight: a failure by its kind, or a served turn."""
        if result.error is not None:
            kind = result.error_kind.value if result.error_kind is not None else "internal"
            self.sink.inc(m.ATTEMPT_FAILURES, 1, {"mode": self.mode, "kind": kind})
            return
        self.recent.append((time.time(), result.ttft_s, result.tpot_s, result.path))
        tags = {"mode": self.mode, "path": result.path}
        self.sink.observe(m.TTFT_SECONDS, result.ttft_s, tags)
        if len(result.output_tokens) > 1:  # one token has no time per output token
            self.sink.observe(m.TPOT_SECONDS, result.tpot_s, tags)

    def collect(self) -> None:
        mode = {"mode": self.mode}
        if self.core is not None:
            self.totals.update(m.LATE_HIT_TOKENS, self.core.binder.late_hit_tokens, mode)
            sharing = self.core.dispatcher.sharing
            if sharing is not None:
                stats = sharing.stats  # per-engine totals; copied, since the event loop adds to them
                for spec, totals in ((m.SHARED_PREFIX_TOKENS, dict(stats.shared_tokens)),
                                     (m.PREFIX_WAITS, dict(stats.waits)), (m.PREFIX_WAIT_SECONDS, dict(stats.wait_s))):
                    for engine, total in totals.items():
                        self.totals.update(spec, total, {**mode, "engine": engine})
                self.totals.update(m.PREFIX_BUFFER_WAITS, stats.buffer_waits, mode)
        self.totals.update(m.RETRIES, self.calls.retries, mode)
        self.totals.update(m.RECOMPUTED_BLOCKS, self.calls.unindexed_blocks, mode)
        self.totals.update(m.ATTEMPT_FAILURES, self.calls.timeouts, {**mode, "kind": "timeout"})

    def recent_turns(self) -> list[tuple[float, float, float, str]]:
        """(finished at, wall clock; ttft_s; tpot_s; path) of the latest served turns, oldest first."""
        return list(self.recent)
