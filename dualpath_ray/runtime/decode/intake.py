"""A decode engine's intake: handoffs taken, their prompt KV moved from the buffer into pages.

One stage of a request's life on a decode engine, an object its DecodeCore (runtime/decode/core.py)
holds: the intake owns the handoffs that arrived and wait to be taken (some of them for pages),
the claims under way and this step's oracle fills. A handoff is claimed under the engine's lock,
its pages reserved there and then (the scheduler counted them when it placed the request here,
so they are free; a cancel cannot slip between the check and the reservation), and the prompt's
KV moves from the decode node's buffer extent into the request's pages in one transport read of
whole Full Blocks (RESERVED -> LOADING). The scheduler learns of the handoff from the prefill
engine's report of the step that sent it. A landed load is checked against the prefill engine's
digests (one reload on a first mismatch) and, with runtime.verify_kv, against the store and a
recompute, before the request is handed back to the core to run. Oracle mode fills the pages in
place.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from dualpath_ray.kv.block_store import BlockStore
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.paged import PagedKVPool, PagePoolFullError
from dualpath_ray.protocol.counters import NodeCounters
from dualpath_ray.protocol.names import Pool
from dualpath_ray.runtime.compute.engine_compute import ComputeBusy, EngineCompute, PageFill
from dualpath_ray.runtime.decode.job import (
    DecodeJob,
    DecodeJobTable,
    DecodePorts,
    DecodeSettings,
    DecodeState,
    DecodeStats,
    transition,
)
from dualpath_ray.runtime.emulation.links import Link
from dualpath_ray.runtime.engine.failures import KVMismatchError
from dualpath_ray.protocol.messages import DecodeHandoff, ErrorKind, Holding, TurnResult, failed_result
from dualpath_ray.runtime.transport.moves import Move, Region
from dualpath_ray.runtime.decode.verify import check_prompt_kv, expected_prompt_kv, landed_mismatches
from dualpath_ray.scheduling.loads import decode_tokens
from dualpath_ray.protocol.types import ReadPath

LOG = logging.getLogger("dualpath_ray.decode")


class Claim(enum.Enum):
    """What taking one handoff came to."""

    CLAIMED = "claimed"  # its pages are reserved: it loads
    CANCELLED = "cancelled"  # the scheduler gave up on the attempt (or its caller aborted it)
    DUPLICATE = "duplicate"  # the attempt is here already
    NO_ROOM = "no_room"  # no free pages yet: it waits (_may_wait_for_pages), then fails


@dataclass(frozen=True)
class IntakeHooks:
    """What the intake hands back to its core."""

    run: Callable[[DecodeJob], None]  # its prompt KV is in its pages and checked: the core decodes it
    fail: Callable[[DecodeJob, BaseException], None]  # free what it holds, report the error
    report: Callable[[TurnResult], None]  # a turn's result for the core's report of this step


class DecodeIntake:
    """Handoffs from their arrival to a running job: what waits to be taken, the claims under way,
    the prompt loads and their checks. Its core hands it what it uses and steps it
    (`take_handoffs`, `poll_loads`); a job whose prompt KV is in its pages and checked goes back to
    the core (`hooks.run`), as does every failure (`hooks.fail`) and a handoff's result when no
    pages came for it in time (`hooks.report`)."""

    def __init__(
        self,
        settings: DecodeSettings,
        layout: KVLayout,
        compute: EngineCompute,
        pages: PagedKVPool,
        ports: DecodePorts,
        store: BlockStore | None,
        table: DecodeJobTable,
        hooks: IntakeHooks,
        metering: tuple[Link, NodeCounters, DecodeStats],
    ) -> None:
        self.settings = settings
        self.layout = layout
        self.compute = compute
        self.pages = pages
        self.ports = ports
        self.store = store
        self.table = table
        self.hooks = hooks
        self.cnic_in, self.counters, self.stats = metering
        # Guarded by table.lock, so that holds() sees each handoff as arrived, being taken or a job.
        self._arrived: deque[DecodeHandoff] = deque()
        self._taking: dict[str, tuple[str, Holding]] = {}  # owner -> what holds() names while it is claimed
        # Only the worker thread touches these.
        self._waiting_since: dict[str, float] = {}  # owner -> since when its handoff waits for pages
        self._filling: list[tuple[DecodeJob, PageFill]] = []  # oracle handoffs to compute at once (this step's, and any waiting for pages)
        # RESERVED jobs whose prompt lands in the compute's pages once runtime.verify_kv's
        # expected KV is recomputed (`_expect_then_load`), in arrival order.
        self._expecting: list[DecodeJob] = []

    # --- what the core calls from the actor's control and io threads ----------------------

    def arrive(self, handoffs: Sequence[DecodeHandoff]) -> None:
        """Prefill engines' handoffs, taken at the worker's next step."""
        with self.table.lock:
            self._arrived.extend(handoffs)

    def holdings_locked(self) -> list[tuple[str, Holding]]:
        """The attempts of handoffs that arrived or are being claimed and are not jobs yet (the
        caller holds table.lock, and reads the job table under the same hold)."""
        jobs = self.table.jobs
        entries = [(h.task.request_id, Holding.of(h.task.request, True))
                   for h in self._arrived if h.task.request.owner not in jobs]
        entries += [entry for owner, entry in self._taking.items() if owner not in jobs]
        return entries

    def has_arrivals_locked(self) -> bool:
        """Whether a handoff waits to be taken, to load after its KV check's recompute, or for
        the compute's pages to compute its prompt in (the caller holds table.lock)."""
        return bool(self._arrived) or bool(self._expecting) or bool(self._filling)

    # --- the worker thread ----------------------------------------------------------------

    def take_handoffs(self) -> bool:
        """Claim every handoff that arrived: its pages are reserved and its load posted. One
        that does not fit waits for pages (see _claim); True when any handoff was dealt with."""
        with self.table.lock:
            arrived, self._arrived = list(self._arrived), deque()
            # Until each is claimed or dropped, heartbeats still count it as arrived.
            self._taking = {h.task.request.owner: (h.task.request_id, Holding.of(h.task.request, True)) for h in arrived}
        waiting, took = [], False
        for handoff in arrived:
            job, verdict = self._claim(handoff)
            owner = handoff.task.request.owner
            if verdict is Claim.NO_ROOM and self._may_wait_for_pages(owner):
                waiting.append(handoff)
                continue
            self._waiting_since.pop(owner, None)
            took = True
            if job is None:
                self._drop_handoff(handoff, verdict)
                continue
            try:
                # Before its KV is loaded or a token sampled: a decode engine holding other weights
                # (or a restarted one not caught up yet) must neither decode nor persist it.
                self.ports.weights.check(handoff.task.request)
                self._start_load(job)
            except Exception as exc:  # noqa: BLE001 - fail this request, keep serving the others
                self.hooks.fail(job, exc)
        took |= self._expect_then_load()
        self._materialise()
        with self.table.lock:
            self._arrived.extendleft(reversed(waiting))
            self._taking = {}
        return took

    def _claim(self, handoff: DecodeHandoff) -> tuple[DecodeJob | None, Claim]:
        """Reserve the handoff's pages and make it a job, under the lock (a cancel or abort
        cannot slip between the check and the reservation): (job, CLAIMED), or (None, why not).
        Its pages are prompt + max new tokens, as the scheduler counted them when it placed the
        request here (scheduling/loads.py decode_tokens); they are free unless an attempt the
        scheduler already gave up on still holds pages here (NO_ROOM: it waits for them)."""
        spec = handoff.task.request
        owner = spec.owner
        with self.table.lock:
            if owner in self.table.cancelled:
                return None, Claim.CANCELLED
            if owner in self.table.jobs:
                return None, Claim.DUPLICATE
            tokens = decode_tokens(len(spec.prompt), spec.sampling.max_new_tokens, self.layout.block_size)
            try:
                self.pages.reserve(owner, self.pages.pages_for(tokens))
            except PagePoolFullError:
                return None, Claim.NO_ROOM
            # Keyed by owner (request id and attempt): a retry never meets an earlier attempt's
            # job, and a late cancel of that attempt cannot touch the retry.
            job = DecodeJob(spec.request_id, spec.attempt, tokens, spec.epoch, handoff=handoff)
            self.table.jobs[owner] = job
            return job, Claim.CLAIMED

    def _may_wait_for_pages(self, owner: str) -> bool:
        """A handoff with no free pages waits up to transfer_timeout_s for an attempt that still
        holds pages here to finish (one the scheduler gave up on keeps decoding to its end)."""
        now = time.monotonic()
        first = self._waiting_since.setdefault(owner, now)
        return now - first < self.settings.transfer_timeout_s

    def _drop_handoff(self, handoff: DecodeHandoff, why: Claim) -> None:
        """A handoff that will not be loaded: its buffer extent goes back at once. Only one that
        found no pages in time needs a result (the scheduler still waits for it)."""
        spec = handoff.task.request
        if why is Claim.CANCELLED:
            self.stats.cancelled_handoffs += 1
        elif why is Claim.DUPLICATE:
            LOG.warning("%s: ignored a second handoff of %s", self.settings.engine_id, spec.owner)
        else:
            LOG.error("%s: no free HBM pages for %s within %ss", self.settings.engine_id, spec.owner,
                      self.settings.transfer_timeout_s)
            self.hooks.report(failed_result(
                spec, self.settings.engine_id, "no free HBM pages for the handoff", ErrorKind.HBM_FULL
            ))
        if handoff.extent is not None:
            self.ports.readers.free(handoff.extent)

    def _start_load(self, job: DecodeJob) -> None:
        assert job.handoff is not None
        task = job.handoff.task
        prompt = np.asarray(task.request.prompt, dtype=np.int64)
        job.tokens = [int(t) for t in prompt] + [job.handoff.first_token]
        job.log_probs = [job.handoff.first_log_prob]
        job.kv_len = len(prompt)
        job.parent_key = task.stored_keys[-1] if task.stored_keys else None
        table = self.pages.ensure(job.owner, len(prompt))
        if self.compute.held_kv is not None:
            # The compute keeps the KV: the load or the oracle's compute goes into its pages.
            job.compute_state = self.compute.decode_state(job.tokens, task.request.namespace)
        if self.settings.verify_kv and self.compute.held_kv is not None:
            # The check's recompute runs in the compute's (vLLM's) pages: before the prompt lands
            # there or oracle mode computes it there, so a sequence holding its prompt never waits
            # in them for it (under preemption the sequences beside it could hold every page the
            # recompute needs until the core ends them).
            self._expecting.append(job)
            return
        self._land(job, table)

    def _land(self, job: DecodeJob, table: Sequence[int]) -> None:
        """The prompt's KV on its way into the job's pages: its load posted, or (oracle mode) its
        compute queued for this round's `_materialise`."""
        assert job.handoff is not None
        task = job.handoff.task
        if task.oracle:
            prompt = np.asarray(task.request.prompt, dtype=np.int64)
            start = task.hit_tokens
            if self.compute.held_kv is None:
                self._read_hits(job, table)
                # A partial hit's blocks hold the whole prompt: the stored bytes stay, nothing is
                # computed into its pages (as on the other paths, runtime/prefill/pipeline.py).
                start = task.read_end
            self._filling.append((job, PageFill(prompt, start, len(prompt), table)))
            return
        self._post_load(job, table, job.prompt_len)
        transition(job, DecodeState.LOADING)

    def _expect_then_load(self) -> bool:
        """Recompute runtime.verify_kv's expected KV of the jobs in `_expecting`, then post their
        loads; one the compute has no pages for yet (ComputeBusy) waits, with those after it,
        for a later round, in which the core has ended the sequences holding them."""
        did = False
        while self._expecting:
            job = self._expecting[0]
            if job.state is not DecodeState.RESERVED:
                self._expecting.pop(0)  # failed or aborted meanwhile
                continue
            assert job.handoff is not None and self.store is not None
            try:
                job.expected_kv = expected_prompt_kv(self.compute, self.store, job.handoff.task, self.pages.tensor.device)
            except ComputeBusy:
                self.stats.busy_checks += 1
                return did
            except Exception as exc:  # noqa: BLE001 - fail this request, keep serving the others
                self._expecting.pop(0)
                self.hooks.fail(job, exc)
                continue
            self._expecting.pop(0)
            did = True
            try:
                self._land(job, self.pages.table(job.owner))
            except Exception as exc:  # noqa: BLE001
                self.hooks.fail(job, exc)
        return did

    def _post_load(self, job: DecodeJob, table: Sequence[int], tokens: int) -> None:
        assert job.handoff is not None
        extent = job.handoff.extent
        assert extent is not None, f"request {job.request_id}: a non-oracle handoff names an extent"
        held = self.compute.held_kv
        if held is None:
            moves = self._prompt_moves(table, extent.slots, tokens)
            nbytes = sum(m[0].nbytes for m in moves)
        else:
            # Whole Full Blocks, the partial last one too, straight into the compute's pages.
            offsets = [slot * self.layout.full_block_bytes for slot in extent.slots[: self.layout.blocks_for(tokens)]]
            nbytes = len(offsets) * self.layout.full_block_bytes
        self.cnic_in.take(nbytes)
        self.counters.cnic_in[ReadPath(job.handoff.task.path).side.value] += nbytes
        if held is None:
            job.load = self.ports.transport.read(extent.reader, moves)
            return
        job.load = held.load_prompt(job.compute_state, job.handoff.task.request.sampling, extent.reader, Pool.BUFFER, offsets)

    def _prompt_moves(self, table: Sequence[int], slots: Sequence[int], tokens: int) -> list[Move]:
        """Whole Full Blocks page <- slot, and the partial last block layer by layer."""
        layout = self.layout
        full, tail = divmod(tokens, layout.block_size)
        moves = [
            (Region(Pool.HBM, table[b] * layout.full_block_bytes, layout.full_block_bytes),
             Region(Pool.BUFFER, slots[b] * layout.full_block_bytes, layout.full_block_bytes))
            for b in range(full)
        ]
        for layer in range(layout.n_layer if tail else 0):
            nbytes = tail * layout.bytes_per_token_per_layer
            moves.append((
                Region(Pool.HBM, layout.slot_byte_offset(table[full], layer, 0), nbytes),
                Region(Pool.BUFFER, layout.slot_byte_offset(slots[full], layer, 0), nbytes),
            ))
        return moves

    def _read_hits(self, job: DecodeJob, table: Sequence[int]) -> None:
        """Oracle mode: hit KV straight from the store into pages (the rest is computed in
        place by _materialise, for every handoff of the step at once)."""
        assert self.store is not None and job.handoff is not None
        for block, key in enumerate(job.handoff.task.hit_keys):
            self._store_read(key, table[block])

    def _materialise(self) -> None:
        """Oracle mode: the computed tokens' KV of this step's handoffs, in one batched forward;
        then they run. A failed forward fails them all. A compute with no pages for them all yet
        (ComputeBusy: vLLM's, under preemption) computes and runs them in turn, and the first it
        has no pages for waits, with those after it, in order, for a later round, in which the
        core has ended the sequences holding the pages (the compute carries on with the same
        sequences: runtime/compute/held_kv.py); as does a job whose check cannot read its prompt
        back yet."""
        filling = [(job, fill) for job, fill in self._filling if job.state is DecodeState.RESERVED]  # not failed meanwhile
        self._filling = []
        if not filling:
            return
        held = self.compute.held_kv
        try:
            if held is None:
                self.compute.fill_pages_many([fill for _, fill in filling if fill.start < fill.end], self.pages.tensor)
            else:
                held.compute_prompts(
                    [job.compute_state for job, _ in filling],
                    [job.handoff.task.request.sampling for job, _ in filling],  # type: ignore[union-attr]
                )
        except ComputeBusy:
            self.stats.busy_checks += 1
            self._materialise_in_turn(filling)
            return
        except Exception as exc:  # noqa: BLE001 - fail these requests, keep serving the others
            for job, _ in filling:
                self.hooks.fail(job, exc)
            return
        self._start_computed(filling)

    def _materialise_in_turn(self, filling: list[tuple[DecodeJob, PageFill]]) -> None:
        """A held-KV compute had no pages for the whole batch: those it computed may hold the
        pages the others need until the core has run and ended them, so each is computed and
        run in turn, and the first it has no pages for waits with those after it."""
        held = self.compute.held_kv
        assert held is not None
        for index, (job, _) in enumerate(filling):
            try:
                held.compute_prompts([job.compute_state], [job.handoff.task.request.sampling])  # type: ignore[union-attr]
            except ComputeBusy:
                self.stats.busy_checks += 1
                self._filling.extend(filling[index:])
                return
            except Exception as exc:  # noqa: BLE001 - fail this request, keep serving the others
                self.hooks.fail(job, exc)
                continue
            self._start_computed(filling[index : index + 1])

    def _start_computed(self, filling: list[tuple[DecodeJob, PageFill]]) -> None:
        """Jobs whose prompt KV is in their pages: checked, they run; one whose check cannot read
        its prompt back yet (ComputeBusy) waits for a later round."""
        for job, fill in filling:
            try:
                self._start_running(job)
            except ComputeBusy:
                self.stats.busy_checks += 1
                self._filling.append((job, fill))
            except Exception as exc:  # noqa: BLE001
                self.hooks.fail(job, exc)

    def _store_read(self, key: str, page: int) -> None:
        assert self.store is not None
        target = self.pages.page(page)
        if target.device.type == "cpu":
            self.store.get_into(key, target)
            return
        host = self.layout.empty_full_block()
        self.store.get_into(key, host)
        target.copy_(host)

    def poll_loads(self) -> bool:
        """Finish the loads that landed: check them against their digests, and the jobs run. A
        check the compute cannot read the landed KV for yet (ComputeBusy: vLLM preempted the
        sequence and the pages it needs are held by sequences the core is ending) is tried
        again next round, the job LOADING meanwhile; a busy check counts nothing."""
        did = False
        for job in self.table.in_states(DecodeState.LOADING):
            try:
                if not job.load.done():  # type: ignore[union-attr]
                    continue
                job.load.wait(0)  # type: ignore[union-attr]
            except Exception as exc:  # noqa: BLE001 - fail this request only
                self.hooks.fail(job, exc)
                continue
            try:
                reloading = self._reloading(job)
            except ComputeBusy:
                self.stats.busy_checks += 1
                continue
            except Exception as exc:  # noqa: BLE001
                self.hooks.fail(job, exc)
                continue
            self.stats.loads += 1
            did = True
            if reloading:
                continue
            job.load = None
            try:
                self._start_running(job)
            except Exception as exc:  # noqa: BLE001
                self.hooks.fail(job, exc)
        return did

    def _reloading(self, job: DecodeJob) -> bool:
        """Check the landed prompt KV against the prefill engine's digests. A first mismatch is
        loaded once more (the copy went wrong); a second means the buffer itself holds bad KV
        (the transfer into it went wrong): the attempt fails before any decode step."""
        assert job.handoff is not None
        digests = job.handoff.digests
        if not self.settings.kv_digests or digests is None:
            return False
        bad = landed_mismatches(*self._prompt_kv(job, digests.shape[1]), digests)
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
        if self.compute.held_kv is not None:
            # The landing goes into a fresh sequence of the compute (vLLM reads a source once).
            self.compute.release(job.compute_state)
            job.compute_state = self.compute.decode_state(job.tokens, job.handoff.task.request.namespace)
        self._post_load(job, self.pages.table(job.owner), digests.shape[1])
        return True

    def _start_running(self, job: DecodeJob) -> None:
        assert job.handoff is not None
        task = job.handoff.task
        if self.settings.verify_kv:
            assert self.store is not None
            pages, table = self._prompt_kv(job, job.prompt_len)
            expected = job.expected_kv
            if expected is None:  # not recomputed before the landing (a compute with its own pages)
                expected = expected_prompt_kv(self.compute, self.store, task, pages.device)
            job.check, job.expected_kv = check_prompt_kv(self.layout, expected, pages, table), None
            if job.check.mismatches:
                # Never decode on KV that differs from what the store and a recompute say. Counted:
                # the retry that follows may well succeed, and the chaos tests must still see it.
                self.stats.verify_mismatches += 1
                raise KVMismatchError(
                    f"{job.request_id}: assembled prompt KV differs from the store / a recompute "
                    f"({job.check.mismatches} of hit and computed parts)"
                )
        if job.compute_state is None:
            job.compute_state = self.compute.decode_state(job.tokens, job.handoff.task.request.namespace)
        self.hooks.run(job)

    def _prompt_kv(self, job: DecodeJob, tokens: int) -> tuple[torch.Tensor, Sequence[int]]:
        """Full Blocks holding the job's first `tokens` tokens' KV, and their table: its pages,
        or a copy read back from the compute's (HeldKV)."""
        held = self.compute.held_kv
        if held is None:
            return self.pages.tensor, self.pages.table(job.owner)
        blocks = list(range(self.layout.blocks_for(tokens)))
        return held.read_blocks(job.compute_state, blocks), blocks

