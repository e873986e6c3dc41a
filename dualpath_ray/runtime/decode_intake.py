"""A decode engine's intake: handoffs taken, their prompt KV moved from the buffer into pages.

A mixin of DecodeCore (runtime/decode_core.py), kept apart as one stage of a request's life
there: a handoff is claimed against its reservation under the lock (so a cancel cannot free the
pages between the check and the load), the scheduler is told it was taken (one note per step),
and the prompt's KV moves from the decode node's buffer extent into the request's pages in one
transport read of whole Full Blocks (RESERVED -> LOADING). A landed load is checked against the
prefill engine's digests (one reload on a first mismatch) and, with runtime.verify_kv, against
the store and a recompute, before the request runs. Oracle mode fills the pages in place.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Sequence

import numpy as np

from dualpath_ray.kv.block_store import BlockStore
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.paged import PagedKVPool
from dualpath_ray.runtime.accounting import NodeCounters
from dualpath_ray.runtime.cancelled import CancelledAttempts
from dualpath_ray.runtime.compute import EngineCompute
from dualpath_ray.runtime.decode_job import DecodeJob, DecodePorts, DecodeSettings, DecodeState, DecodeStats, transition
from dualpath_ray.runtime.emulation.links import Link
from dualpath_ray.runtime.failures import KVMismatchError
from dualpath_ray.runtime.messages import DecodeHandoff, ErrorKind, Holding, TurnResult, failed_result
from dualpath_ray.runtime.transport import Move, Region
from dualpath_ray.runtime.verify import landed_mismatches, verify_prompt_kv
from dualpath_ray.scheduling.types import ReadPath

LOG = logging.getLogger("dualpath_ray.decode")
HBM_POOL = "hbm"
BUFFER_POOL = "buffer"


class DecodeIntake:
    """What DecodeCore's __init__ sets up, and the calls of its own this stage uses."""

    settings: DecodeSettings
    layout: KVLayout
    compute: EngineCompute
    pages: PagedKVPool
    ports: DecodePorts
    store: BlockStore | None
    cnic_in: Link
    counters: NodeCounters
    stats: DecodeStats
    jobs: dict[str, DecodeJob]
    _arrived: deque[DecodeHandoff]
    _taking: set[str]
    _early_since: dict[str, float]
    _cancelled: CancelledAttempts
    _lock: threading.Lock
    _fail: Callable[..., None]
    _report: Callable[[TurnResult], None]
    _jobs_in: Callable[..., list[DecodeJob]]
    _persist_prompt: Callable[[DecodeJob], None]
    _stream: Callable[[DecodeJob, int], None]

    def _take_handoffs(self) -> bool:
        with self._lock:
            arrived, self._arrived = list(self._arrived), deque()
            # Until each is claimed or dropped, heartbeats still count it as arrived.
            self._taking = {h.task.request.owner for h in arrived}
        early, claimed = [], {}
        for handoff in arrived:
            job, verdict = self._claim(handoff)
            if verdict == "early":
                early.append(handoff)
                continue
            self._early_since.pop(handoff.task.request.owner, None)
            if job is None:
                self._drop_handoff(handoff, verdict)
                continue
            claimed[job.request_id] = Holding.of(handoff.task.request, True)
            try:
                self._start_load(job)
            except Exception as exc:  # noqa: BLE001 - fail this request, keep serving the others
                self._fail(job, exc)
        with self._lock:
            self._arrived.extendleft(reversed(early))
            self._taking = set()
        if claimed:
            self.ports.scheduler.handed_off(claimed)
        return len(early) < len(arrived)

    def _claim(self, handoff: DecodeHandoff) -> tuple[DecodeJob | None, str]:
        """Bind a handoff to its reservation under the lock, so a cancel cannot release the
        pages between the check and the load: (job, "claimed"), or (None, why not)."""
        owner = handoff.task.request.owner
        with self._lock:
            job = self.jobs.get(owner)
            if job is not None and job.state is DecodeState.RESERVED and job.handoff is None:
                job.handoff = handoff
                return job, "claimed"
            if job is None and owner in self._cancelled:
                return None, "cancelled"
            if job is not None and job.handoff is not None:
                return None, "duplicate"
        if job is None and self._may_still_be_reserved(owner):
            return None, "early"
        return None, "unreserved"

    def _drop_handoff(self, handoff: DecodeHandoff, why: str) -> None:
        """A handoff with no reservation to load into: its buffer extent goes back at once. Only
        one the scheduler did not cancel needs a result (the scheduler still waits for it)."""
        spec = handoff.task.request
        if why == "cancelled":
            self.stats.cancelled_handoffs += 1
        elif why == "duplicate":
            LOG.warning("%s: ignored a second handoff of %s", self.settings.engine_id, spec.owner)
        else:
            LOG.error("%s: handoff of %s without a reservation", self.settings.engine_id, spec.request_id)
            self._report(failed_result(
                spec, self.settings.engine_id, "handoff without a reservation", ErrorKind.PEER_DIED
            ))
        if handoff.extent is not None:
            self.ports.readers.free(handoff.extent)

    def _may_still_be_reserved(self, owner: str) -> bool:
        """A handoff may overtake its reservation (the group leader's accept is one more call
        than the prefill engine's path): it waits for it up to transfer_timeout_s."""
        now = time.monotonic()
        first = self._early_since.setdefault(owner, now)
        return now - first < self.settings.transfer_timeout_s

    def _start_load(self, job: DecodeJob) -> None:
        assert job.handoff is not None
        task = job.handoff.task
        prompt = np.asarray(task.request.prompt, dtype=np.int64)
        job.tokens = [int(t) for t in prompt] + [job.handoff.first_token]
        job.log_probs = [job.handoff.first_log_prob]
        job.kv_len = len(prompt)
        job.parent_key = task.hit_keys[-1] if task.hit_keys else None
        table = self.pages.ensure(job.owner, len(prompt))
        if task.oracle:
            self._materialise(job, prompt, table)
            self._start_running(job)
            return
        self._post_load(job, table, len(prompt))
        transition(job, DecodeState.LOADING)

    def _post_load(self, job: DecodeJob, table: Sequence[int], tokens: int) -> None:
        assert job.handoff is not None
        extent = job.handoff.extent
        assert extent is not None, f"request {job.request_id}: a non-oracle handoff names an extent"
        moves = self._prompt_moves(table, extent.slots, tokens)
        nbytes = sum(m[0].nbytes for m in moves)
        self.cnic_in.take(nbytes)
        self.counters.cnic_in[ReadPath(job.handoff.task.path).side.value] += nbytes
        job.load = self.ports.transport.read(extent.reader, moves)

    def _prompt_moves(self, table: Sequence[int], slots: Sequence[int], tokens: int) -> list[Move]:
        """Whole Full Blocks page <- slot, and the partial last block layer by layer."""
        layout = self.layout
        full, tail = divmod(tokens, layout.block_size)
        moves = [
            (Region(HBM_POOL, table[b] * layout.full_block_bytes, layout.full_block_bytes),
             Region(BUFFER_POOL, slots[b] * layout.full_block_bytes, layout.full_block_bytes))
            for b in range(full)
        ]
        for layer in range(layout.n_layer if tail else 0):
            nbytes = tail * layout.bytes_per_token_per_layer
            moves.append((
                Region(HBM_POOL, layout.slot_byte_offset(table[full], layer, 0), nbytes),
                Region(BUFFER_POOL, layout.slot_byte_offset(slots[full], layer, 0), nbytes),
            ))
        return moves

    def _materialise(self, job: DecodeJob, prompt: np.ndarray, table: Sequence[int]) -> None:
        """Oracle mode: hit KV straight from the store into pages, the rest computed in place."""
        assert self.store is not None and job.handoff is not None
        task = job.handoff.task
        for block, key in enumerate(task.hit_keys):
            self._store_read(key, table[block])
        self.compute.fill_pages(prompt, task.hit_tokens, len(prompt), self.pages.tensor, table)

    def _store_read(self, key: str, page: int) -> None:
        assert self.store is not None
        target = self.pages.page(page)
        if target.device.type == "cpu":
            self.store.get_into(key, target)
            return
        host = self.layout.empty_full_block()
        self.store.get_into(key, host)
        target.copy_(host)

    def _poll_loads(self) -> bool:
        did = False
        for job in self._jobs_in(DecodeState.LOADING):
            try:
                if not job.load.done():  # type: ignore[union-attr]
                    continue
                job.load.wait(0)  # type: ignore[union-attr]
            except Exception as exc:  # noqa: BLE001 - fail this request only
                self._fail(job, exc)
                continue
            job.load = None
            self.stats.loads += 1
            try:
                if self._reloading(job):
                    continue
                self._start_running(job)
            except Exception as exc:  # noqa: BLE001
                self._fail(job, exc)
            did = True
        return did

    def _reloading(self, job: DecodeJob) -> bool:
        """Check the landed prompt KV against the prefill engine's digests. A first mismatch is
        loaded once more (the copy went wrong); a second means the buffer itself holds bad KV
        (the transfer into it went wrong): the attempt fails before any decode step."""
        assert job.handoff is not None
        digests = job.handoff.digests
        if not self.settings.kv_digests or digests is None:
            return False
        bad = landed_mismatches(self.pages.tensor, self.pages.table(job.owner), digests)
        seen = job.bad_tokens if job.bad_tokens is not None else np.zeros(0, dtype=np.int64)
        self.stats.digest_mismatches += len(np.setdiff1d(bad, seen))
        if not len(bad):
            self.stats.digest_reloads += int(job.bad_tokens is not None)
            return False
        if job.bad_tokens is not None:
            raise KVMismatchError(
                f"{job.request_id}: prompt KV in the decode buffer differs from the prefill engine's "
                f"digests at {len(bad)} (layer, token)s after a second load"
            )
        job.bad_tokens = bad
        self._post_load(job, self.pages.table(job.owner), digests.shape[1])
        return True

    def _start_running(self, job: DecodeJob) -> None:
        assert job.handoff is not None
        task = job.handoff.task
        if self.settings.verify_kv:
            assert self.store is not None
            job.check = verify_prompt_kv(self.compute, self.store, task, self.pages.tensor, self.pages.table(job.owner))
            if job.check.mismatches:
                # Never decode on KV that differs from what the store and a recompute say.
                raise KVMismatchError(
                    f"{job.request_id}: assembled prompt KV differs from the store / a recompute "
                    f"({job.check.mismatches} of hit and computed parts)"
                )
        job.compute_state = self.compute.decode_state(job.tokens)
        self._persist_prompt(job)
        transition(job, DecodeState.RUNNING)
        self._stream(job, 0)  # the first token, sampled by the prefill engine
