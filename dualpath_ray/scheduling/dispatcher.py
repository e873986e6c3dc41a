"""The scheduler's queues around the pure policy functions (paper section 6).

No Ray here: the runtime's scheduler core and the simulator both drive a `Dispatcher` with load
reports and get placed `Request` records back (scheduling/requests.py has their lifecycle). A
request first gets a decode engine (its HBM is reserved there), then a prefill engine and a
read path:

  submit -> global decode queue -> a decode group's private queue -> its decode engine
         -> FIFO prefill queue -> its prefill engine and read path
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterator, Sequence

from dualpath_ray.scheduling.binding import HitBinder
from dualpath_ray.scheduling.compute_path import ComputePathModel, SplitInputs, blocks_to_read
from dualpath_ray.scheduling.engine_book import EngineBook
from dualpath_ray.scheduling.integrity import DispatcherView, check_dispatcher
from dualpath_ray.scheduling.loads import EngineLoad, QueuedRequest
from dualpath_ray.scheduling.policy import (
    assign_decode_in_group,
    assign_prefill,
    assign_to_groups,
    choose_read_path,
    split_read,
)
from dualpath_ray.scheduling.requests import Request, RequestState, transition
from dualpath_ray.protocol.types import Mode, ReadPath
from dualpath_ray.scheduling.sharing import InFlightSharing


@dataclass(frozen=True)
class Constants:
    alpha_tokens: int
    beta_tokens: int
    z_margin: float = 1.05


class Dispatcher:
    """Waiting queues plus the latest load of every group; decisions come from the policy."""

    def __init__(
        self, constants: Constants, mode: Mode = Mode.DUALPATH, read_split: str = "whole", decode_groups: int = 0,
        compute_path: ComputePathModel | None = None, binder: HitBinder | None = None,
        sharing: InFlightSharing | None = None,
    ) -> None:
        if read_split not in ("whole", "proportional"):
            raise ValueError(f"scheduler.read_split must be whole or proportional (got {read_split!r})")
        self.constants = constants
        self.mode = Mode(mode)
        self.read_split = read_split
        # The compute path (scheduling/compute_path.py): None = every hit block is read.
        self.compute_path = compute_path if Mode(mode) is not Mode.ORACLE else None
        self.recomputed_hit_tokens = 0  # hit tokens placed to be computed instead of read
        # Looks each request's hits up again as placement considers it (scheduling/binding.py);
        # None: the hits found at submit are kept.
        self.binder = binder
        # In-flight sharing (scheduling/sharing.py): None = off, nothing waits for a producer.
        self.sharing = sharing
        self.requests: dict[str, Request] = {}
        # Requests in a queued state (RequestState.queued), kept as they move: what admission
        # counts (scheduling/admission.py), in O(1).
        self.queued = 0
        # What each engine holds, kept as requests move (scheduling/engine_book.py).
        self.decode_book = EngineBook()
        self.prefill_book = EngineBook()
        self.decode_global: deque[str] = deque()
        self.decode_private: dict[str, deque[str]] = {}
        self.prefill_queue: deque[str] = deque()
        self.decode_loads: dict[str, tuple[EngineLoad, ...]] = {}
        self.decode_tok: dict[str, int] = {}  # each group's summed tok, kept with decode_loads (phase 1)
        self.read_q: dict[str, int] = {}
        self._engine_node: dict[str, str] = {}
        # Prefill nodes whose storage reader is down: their requests read through the DE path.
        self.no_pe_reads: set[str] = set()
        self.staged_missed = 0  # staged chains dropped: their turn was placed on another decode node
        # Phase 1 spreads the global queue over the decode groups that have reported. A fresh
        # dispatcher (a restarted scheduler, whose callers retry their turns at once) holds its
        # first spread until all `decode_groups` have reported, or for at most 2 x that many
        # pulls (a group gone for good), so that burst does not all land on the first to pull.
        self.decode_groups = decode_groups
        self._held_pulls = 0
        self._spread_yet = decode_groups <= 1

    def submit(self, request: Request) -> Request:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id} is already queued")
        if request.state is not RequestState.QUEUED_DECODE:
            raise ValueError(f"request {request.request_id} is {request.state.value}; only a new request is submitted")
        self.requests[request.request_id] = request
        self.decode_global.append(request.request_id)
        self.queued += 1
        return request

    def report_read_q(self, node_id: str, tokens: int) -> None:
        self.read_q[node_id] = tokens

    def fetch_decode(self, group_id: str, engines: Sequence[EngineLoad]) -> list[Request]:
        """A decode group leader pulls: phase 1 drains the global queue to groups, phase 2
        places this group's private queue on its engines within their free HBM. A group with
        no live engines is dropped (its private queue back to the global one)."""
        if not engines:
            self.decode_loads.pop(group_id, None)
            self.decode_tok.pop(group_id, None)
            self.decode_global.extendleft(reversed(self.decode_private.pop(group_id, deque())))
            return []
        self.decode_loads[group_id] = tuple(engines)
        self.decode_tok[group_id] = sum(engine.tok for engine in engines)
        self._engine_node.update({e.engine_id: e.node_id for e in engines})
        self.decode_private.setdefault(group_id, deque())
        if self.decode_global and self._may_spread():
            queue = [self._decode_request(rid) for rid in self._to_staged_groups(self.decode_global)]
            for assignment in assign_to_groups(queue, self.decode_tok):
                self.decode_private[assignment.target].append(assignment.request_id)
            self.decode_global.clear()
        private = self.decode_private[group_id]
        placed = assign_decode_in_group(self._admissible_head(private, engines), engines, self.constants.z_margin)
        requests = []
        for assignment in placed:
            request = self.requests[assignment.request_id]
            request.decode_engine = assignment.target
            request.decode_node = self._engine_node[assignment.target]
            self.decode_book.add(request.decode_engine, request.decode_tokens)
            transition(request, RequestState.QUEUED_PREFILL)
            self.prefill_queue.append(request.request_id)
            requests.append(request)
        for _ in requests:  # phase 2 places a prefix of the queue
            private.popleft()
        return requests

    def _to_staged_groups(self, queue: deque[str]) -> list[str]:
        """Phase 1's exception for tool-time staging (scheduling/staging.py): a request whose
        first hits are staged on a decode node that takes work goes to that node's group, where
        its staged extent is; the rest of the queue, returned, is spread by the paper's rule."""
        group_of = self._decode_group_of_node()
        rest = []
        for rid in queue:
            staged = self.requests[rid].staged
            group = group_of.get(staged.node_id) if staged is not None else None
            if group is None:
                rest.append(rid)
                continue
            self.decode_private[group].append(rid)
        return rest

    def _decode_group_of_node(self) -> dict[str, str]:
        return {loads[0].node_id: group for group, loads in self.decode_loads.items() if loads}

    def decode_nodes_taking_work(self) -> dict[str, int]:
        """Each decode node whose group took work at its last report: its summed decode tok."""
        return {node: self.decode_tok[group] for node, group in self._decode_group_of_node().items()}

    def _may_spread(self) -> bool:
        """Whether phase 1 may drain the global queue now (see decode_groups in __init__)."""
        if not self._spread_yet:
            self._held_pulls += 1
            self._spread_yet = len(self.decode_tok) >= self.decode_groups or self._held_pulls > 2 * self.decode_groups
        return self._spread_yet

    def _admissible_head(self, queue: deque[str], engines: Sequence[EngineLoad]) -> list[QueuedRequest]:
        """The longest prefix of a private queue whose tokens fit in the group's summed free HBM
        (phase 2's set R). Phase 2 places a prefix of R, so handing it R alone gives the same
        placements for O(|R|) instead of O(queue) per pull (the simulator's 48K-agent runs)."""
        room = sum(engine.free_hbm_tokens for engine in engines)
        head = []
        for rid in queue:
            request = self._decode_request(rid)
            if request.tokens > room:
                break
            room -= request.tokens
            head.append(request)
        return head

    def fetch_prefill(self, engines: Sequence[EngineLoad], now: float = 0.0) -> list[Request]:
        """A prefill group leader pulls: FIFO assignment to its engines, then the read path.
        `now` (the core's clock) times in-flight sharing's waits."""
        self._engine_node.update({e.engine_id: e.node_id for e in engines})
        read_q = {e.node_id: self.read_q.get(e.node_id, 0) for e in engines}
        considered: list[str] = []  # handed to the policy, in order; the policy places a prefix of them
        held: list[str] = []  # held by in-flight sharing instead
        assignments = assign_prefill(
            self._considered(engines, now, considered, held), engines, read_q,
            self.constants.alpha_tokens, self.constants.beta_tokens,
        )
        requests = []
        # Prefill tokens each engine holds, as the requests of this call land on them.
        engine_tok = {e.engine_id: e.tok for e in engines}
        for assignment in assignments:
            request = self.requests[assignment.request_id]
            pe_node = self._engine_node[assignment.target]
            staged = self._staged_blocks(request)
            # The policy's pick, once per placement of a request that reads and is not staged (an
            # ablation's RoundRobinPaths advances per call, so it alternates over those requests).
            reads = bool(request.hit_keys) and not staged
            # Blocks its decode node holds in memory, maybe not stored yet: read there (sharing.py).
            from_buffer = reads and self.sharing is not None and self.sharing.in_buffer(request)
            choice = (ReadPath.DE if from_buffer else self._path(pe_node, request.decode_node, request.avoid_reader)) if reads else None
            if not staged:
                self._choose_read_blocks(request, choice, pe_node, engine_tok[assignment.target])
            engine_tok[assignment.target] += request.prefill_tokens
            pe_blocks = 0 if staged or from_buffer else self._pe_blocks(request, pe_node, choice)
            hit_blocks = len(request.read_keys)
            path = ReadPath.PE if pe_blocks == hit_blocks and hit_blocks else ReadPath.DE if not pe_blocks else ReadPath.SPLIT
            if not hit_blocks:  # nothing to read: the policy's pick, for the record
                path = choice or Dispatcher._path(self, pe_node, request.decode_node, request.avoid_reader)
            # Until the readers report again, count this request's hits in the queues they join
            # (staged blocks are read already), whole blocks: a partial last one is read whole.
            block_tokens = request.hit_block_tokens
            self.read_q[pe_node] = self.read_q.get(pe_node, 0) + pe_blocks * block_tokens
            de_tokens = (hit_blocks - pe_blocks - staged) * block_tokens
            self.read_q[request.decode_node] = self.read_q.get(request.decode_node, 0) + de_tokens
            request.prefill_engine, request.prefill_node, request.path = assignment.target, pe_node, path
            request.pe_hit_blocks = pe_blocks
            self.prefill_book.add(request.prefill_engine, request.prefill_tokens)
            transition(request, RequestState.PREFILLING)
            self.queued -= 1
            requests.append(request)
            if self.sharing is not None:
                self.sharing.placed(request, now)
        if self.sharing is not None:
            for rid in considered[len(assignments):]:
                self.sharing.unpromise(rid)
        if held:  # what left the queue is no longer a prefix of it
            gone = {*held, *(a.request_id for a in assignments)}
            self.prefill_queue = deque(rid for rid in self.prefill_queue if rid not in gone)
        else:
            for _ in requests:
                self.prefill_queue.popleft()
        return requests

    def _considered(
        self, engines: Sequence[EngineLoad], now: float, considered: list[str], held: list[str],
    ) -> Iterator[QueuedRequest]:
        """The prefill queue as the policy walks it. Lazy: the policy stops at the first request
        no engine can take, so a long queue costs only what is assigned (and one more). Each
        request's hits are looked up again as it is considered (scheduling/binding.py), so its
        prefill tokens, read queues and path all use the late answer; with in-flight sharing on,
        one whose prefix a producer is computing may be held instead (scheduling/sharing.py),
        and each one handed on promises its blocks to those after it."""
        nodes = {e.node_id for e in engines}
        ahead = min((e.tok for e in engines), default=0) * len(engines)  # prefill tokens before it, all engines
        for rid in self.prefill_queue:
            request = self.requests[rid]
            if self.binder is not None:
                self.binder.rebind(request)
            if self.sharing is not None:
                engine_q = ahead // max(1, len(engines))
                read_q = min(self.read_q.get(node, 0) for node in (*nodes, request.decode_node))
                if self.sharing.consider(request, now, read_q, engine_q):
                    transition(request, RequestState.WAITING_PREFIX)
                    held.append(rid)
                    continue
                self.sharing.promise(request, now, engine_q)
            considered.append(rid)
            ahead += request.prefill_tokens
            yield QueuedRequest(rid, request.prefill_tokens)

    def release(self, waiters: Sequence[str], may_wait: bool) -> None:
        """Held waiters go back to the head of the prefill queue, in the order they were held
        (they were ahead of everything queued since); `may_wait` False: their producer failed,
        so they compute."""
        for rid in waiters:
            request = self.requests[rid]
            request.may_wait = request.may_wait and may_wait
            transition(request, RequestState.QUEUED_PREFILL)
        self.prefill_queue.extendleft(reversed(waiters))

    def handed_off(self, request_id: str) -> bool:
        """The request's KV reached its decode engine: it no longer depends on its prefill
        engine. False when it is not prefilling (unknown, or known already)."""
        request = self.requests.get(request_id)
        if request is None or request.state is not RequestState.PREFILLING:
            return False
        self.prefill_book.remove(request.prefill_engine, request.prefill_tokens)
        transition(request, RequestState.DECODING)
        return True

    def finish(self, request_id: str, failed: bool = False) -> Request:
        """The request is done, or failed in any live state (its engine died while it waited
        for a prefill engine, say): it leaves every queue, so a retry under the same id is
        queued afresh and never meets a stale copy of itself."""
        request = self.requests.pop(request_id)
        if request.state.queued:
            self.queued -= 1
        if request.state is RequestState.PREFILLING:
            self.prefill_book.remove(request.prefill_engine, request.prefill_tokens)
        if request.decode_engine:
            self.decode_book.remove(request.decode_engine, request.decode_tokens)
        transition(request, RequestState.FAILED if failed else RequestState.DONE)
        if failed:
            self._dequeue(request_id)
        if self.sharing is not None:  # its waiters, if it was a producer, go back at once
            self.release(self.sharing.ended(request_id, published=not failed), may_wait=not failed)
        return request

    def cancel(self, request_id: str) -> Request | None:
        """Drop a request in any live state (its deadline passed): out of every queue, FAILED."""
        request = self.requests.get(request_id)
        return None if request is None else self.finish(request_id, failed=True)

    def _dequeue(self, request_id: str) -> None:
        for queue in (self.decode_global, self.prefill_queue, *self.decode_private.values()):
            if request_id in queue:
                queue.remove(request_id)

    def check_integrity(self) -> None:
        """Every queued id is a live request in the state its queue holds, queued once; every
        waiting request is in exactly one queue (or held by in-flight sharing); the books equal
        what the live requests add up to. Raises AssertionError naming what is wrong
        (scheduling/integrity.py)."""
        check_dispatcher(DispatcherView(
            self.requests, [*self.decode_global, *(rid for q in self.decode_private.values() for rid in q)],
            self.prefill_queue, self.sharing.waiters() if self.sharing is not None else [], self.queued,
            self.decode_book, self.prefill_book,
        ))

    def engines_in_use(self) -> set[str]:
        """Engines that hold a live request (its HBM reservation, its prefill)."""
        return self.decode_book.engines() | self.prefill_book.engines()

    def requests_on(self, engine_id: str) -> list[Request]:
        """Live requests that depend on `engine_id` (reserved there, or prefilling there and
        not handed off yet)."""
        return [request for request in self.requests.values() if engine_id in request.engines()]

    def forget_engine(self, engine_id: str) -> None:
        """A dead engine's groups stop receiving requests until they are asked again (without
        it); what waited in their private queues goes back to the global queue."""
        for group, loads in list(self.decode_loads.items()):
            if any(load.engine_id == engine_id for load in loads):
                del self.decode_loads[group]
                del self.decode_tok[group]
                self.decode_global.extendleft(reversed(self.decode_private.pop(group, deque())))

    def decode_waiting(self) -> bool:
        """Whether any request still waits for a decode engine (global or a group's queue)."""
        return bool(self.decode_global) or any(self.decode_private.values())

    def _decode_request(self, request_id: str) -> QueuedRequest:
        return QueuedRequest(request_id, self.requests[request_id].decode_tokens)

    def _staged_blocks(self, request: Request) -> int:
        """How many of its first hit blocks wait staged on its decode node (then its hits are
        read through the DE path, the staged extent being the decode-node extent); a staged chain
        on another node than the one it was placed on is dropped here (its reader expires it)."""
        staged = request.staged
        if staged is None:
            return 0
        if staged.node_id != request.decode_node:
            request.staged = None
            self.staged_missed += 1
            return 0
        return staged.blocks

    def _choose_read_blocks(self, request: Request, path: ReadPath | None, pe_node: str, engine_tok: int) -> None:
        """With the compute path on, how many of the request's hit blocks are read (the rest
        computed): the split that ends it soonest given the read queue of the reader its hits
        would go through and the prefill tokens its engine holds (scheduling/compute_path.py)."""
        hit_blocks = len(request.hit_keys)
        if self.compute_path is None or not hit_blocks:
            return
        reader = pe_node if path is ReadPath.PE else request.decode_node
        inputs = SplitInputs(
            hit_blocks, request.hit_block_tokens, request.prompt_tokens - hit_blocks * request.hit_block_tokens,
            self.read_q.get(reader, 0), engine_tok,
        )
        request.read_blocks = blocks_to_read(inputs, self.compute_path)
        self.recomputed_hit_tokens += request.recomputed_hit_tokens

    def _pe_blocks(self, request: Request, pe_node: str, path: ReadPath | None) -> int:
        """How many of the request's read blocks the prefill-side reader reads: all of them (PE
        path), none (DE path), or, with read_split proportional in dualpath mode, a share by
        the two read queues' headroom below alpha (split_read)."""
        hit_blocks = len(request.read_keys)
        if (self.read_split == "proportional" and self.mode is Mode.DUALPATH and pe_node not in self.no_pe_reads
                and not request.avoid_reader):
            pe, _ = split_read(hit_blocks, self.read_q.get(pe_node, 0), self.read_q.get(request.decode_node, 0),
                               self.constants.alpha_tokens)
            return pe
        return hit_blocks if path is ReadPath.PE else 0

    def _path(self, pe_node: str, de_node: str, avoid: str = "") -> ReadPath:
        """The read path: DE where the prefill node's reader is down or to be avoided (the
        request's previous attempt failed reading there), PE where the decode node's is to be
        avoided, else PE outside dualpath mode and the shorter read queue in it."""
        if pe_node in self.no_pe_reads or (avoid and avoid == pe_node and avoid != de_node):
            return ReadPath.DE
        if avoid and avoid == de_node:
            return ReadPath.PE
        if self.mode is not Mode.DUALPATH:
            return ReadPath.PE
        return choose_read_path(self.read_q.get(pe_node, 0), self.read_q.get(de_node, 0))
