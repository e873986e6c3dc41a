"""The engine cores' ports implemented with Ray actor calls (the actor shells use these). Each
counts the calls it makes, by method (`sent`), for the engine's stats and the control-plane
benchmark."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import Counter
from typing import Any, Callable, Sequence

import ray

from dualpath_ray.kv.paged_block_layers import PagedBlockLayers
from dualpath_ray.protocol.names import SCHEDULER, reader_name
from dualpath_ray.runtime.engine.directory import ActorDirectory
from dualpath_ray.runtime.reporting.channel import ChannelAddress
from dualpath_ray.runtime.reporting.client import ReportClient, SentReport
from dualpath_ray.runtime.transport.moves import PeerDiedError
from dualpath_ray.protocol.types import ReadPath
from dualpath_ray.protocol.messages import (
    DecodeHandoff, EngineReport, ExtentGrant, Holding, PersistedBlock, StagedRead, TokenChunk, TurnResult,
)


class RefPending:
    """A Ray call in flight as a `Pending`. Ray resolves the reply's future on its own thread,
    so polling is a flag check (no RPC), and `wake` tells the engine's worker to look again."""

    def __init__(self, ref: ray.ObjectRef, wake: threading.Event | None = None) -> None:
        self.ref = ref
        self._future = ref.future()
        if wake is not None:
            self._future.add_done_callback(lambda _: wake.set())

    def done(self) -> bool:
        if not self._future.done():
            return False
        self._future.result()
        return True

    def wait(self, timeout_s: float | None = None) -> Any:
        try:
            return self._future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise ray.exceptions.GetTimeoutError(f"no reply from {self.ref} within {timeout_s}s") from None


class RayReaders:
    """ReaderPort: the `reader/<node>` actors."""

    def __init__(
        self, directory: ActorDirectory, engine: str, wake: threading.Event | None = None, sent: Counter[str] | None = None,
    ) -> None:
        self.directory = directory
        self.engine = engine
        self.wake = wake
        self.sent = sent if sent is not None else Counter()  # calls made, by method

    def _reader(self, node_id: str) -> Any:
        return self.directory.get(reader_name(node_id))

    def read_hits(
        self, node_id: str, owner: str, keys: Sequence[str], total_blocks: int, path: ReadPath, first_block: int = 0,
        staged: StagedRead | None = None,
    ) -> RefPending:
        self.sent["read_hits"] += 1
        reader = self._reader(node_id)
        return RefPending(reader.read_hits.remote(owner, list(keys), total_blocks, path, first_block, staged), self.wake)

    def lease(self, node_id: str, owner: str, n_blocks: int) -> RefPending:
        self.sent["lease"] += 1
        return RefPending(self._reader(node_id).lease.remote(owner, n_blocks), self.wake)

    def free(self, grant: ExtentGrant) -> None:
        """Free an extent; nothing to do when its reader is gone for good: its buffer, and so the
        extent, went with it. (Raising here killed a decode engine's worker loop in the middle of
        failing a job whose reader had died, and its turns waited for good.)"""
        self.sent["free"] += 1
        try:
            reader = self.directory.get(grant.reader)
        except PeerDiedError:
            return
        reader.free.remote(grant.extent_id, grant.incarnation)

    def reclaim(self, node_id: str, owner: str) -> None:
        """Free what `owner` leased on the node; nothing to do when its reader is gone (see free)."""
        self.sent["reclaim"] += 1
        try:
            reader = self._reader(node_id)
        except PeerDiedError:
            return
        reader.reclaim.remote(owner)

    def persist_extent(self, grant: ExtentGrant, blocks: Sequence[tuple[int, PersistedBlock]]) -> RefPending:
        self.sent["persist_extent"] += 1
        reader = self.directory.get(grant.reader)
        return RefPending(reader.persist_extent.remote(grant.extent_id, list(blocks), grant.incarnation), self.wake)

    def persist_pages(
        self, node_id: str, owner: str, blocks: Sequence[tuple[int, PersistedBlock]], paged: PagedBlockLayers | None = None,
    ) -> RefPending:
        self.sent["persist_pages"] += 1
        return RefPending(self._reader(node_id).persist_pages.remote(owner, self.engine, list(blocks), paged), self.wake)


class RayScheduler:
    """SchedulerPort: the singleton `scheduler` actor, reached through its report channel
    (runtime/reporting/channel.py), found with one Ray call. Reports carry this engine's name and its
    process's incarnation (which a wake from sleep renews: `incarnation` is read per report)."""

    def __init__(
        self, directory: ActorDirectory, engine: str, incarnation: Callable[[], str], sent: Counter[str] | None = None,
        ready: Callable[[], bool] = lambda: True,
    ) -> None:
        self.engine = engine
        self.incarnation = incarnation
        self.ready = ready
        self.sent = sent if sent is not None else Counter()
        self.channel = ReportClient(scheduler_channel(directory), name=f"{engine}-reports")
        # Readiness is read and sent in one step: reports leave in the order their state was
        # read, so the scheduler's last word on it is the engine's last state (a restarted
        # engine's worker and weights catch-up report from different threads).
        self._lock = threading.Lock()

    def report(
        self, handed_off: dict[str, Holding], results: Sequence[TurnResult], chunks: Sequence[TokenChunk]
    ) -> SentReport:
        with self._lock:
            self.sent["report"] += 1
            return self.channel.send(EngineReport(
                self.engine, self.incarnation(), dict(handed_off), tuple(results), tuple(chunks), self.ready(),
            ))


def scheduler_channel(directory: ActorDirectory) -> Callable[[], ChannelAddress]:
    """How a sender finds the scheduler's report channel: a Ray call, which waits while Ray
    restarts the scheduler (max_task_retries=-1), so a new incarnation's address is found."""

    def resolve() -> ChannelAddress:
        address: ChannelAddress = ray.get(directory.get(SCHEDULER).report_channel.remote())
        return address

    return resolve


class RayDecodeTargets:
    """DecodePort: decode engines by name."""

    def __init__(self, directory: ActorDirectory, sent: Counter[str] | None = None) -> None:
        self.directory = directory
        self.sent = sent if sent is not None else Counter()

    def hand_off(self, engine: str, handoffs: Sequence[DecodeHandoff]) -> RefPending:
        self.sent["handoff"] += 1
        return RefPending(self.directory.get(engine).handoff.remote(list(handoffs)))


class SystemClock:
    def now(self) -> float:
        return time.time()
