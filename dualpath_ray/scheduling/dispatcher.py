"""The scheduler's queues and request lifecycle, around the pure policy functions.

No Ray here: the runtime's Scheduler actor and the simulator both drive a `Dispatcher` with
load reports and get decisions back. A request first gets a decode engine (its HBM is reserved
there), then a prefill engine and a read path:

  submit -> WAITING_DECODE (global decode queue, then a group's private queue)
         -> WAITING_PREFILL (FIFO prefill queue)  -> PREFILLING -> DONE | FAILED
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Literal, Sequence

from dualpath_ray.scheduling.loads import EngineLoad, QueuedRequest
from dualpath_ray.scheduling.policy import (
    assign_decode_groups,
    assign_decode_in_group,
    assign_prefill,
    choose_read_path,
)

Mode = Literal["dualpath", "basic", "oracle"]


class RequestState(enum.Enum):
    WAITING_DECODE = "waiting_decode"
    WAITING_PREFILL = "waiting_prefill"
    PREFILLING = "prefilling"
    DONE = "done"
    FAILED = "failed"


_LEGAL = {
    RequestState.WAITING_DECODE: {RequestState.WAITING_PREFILL, RequestState.FAILED},
    RequestState.WAITING_PREFILL: {RequestState.PREFILLING, RequestState.FAILED},
    RequestState.PREFILLING: {RequestState.DONE, RequestState.FAILED},
    RequestState.DONE: set(),
    RequestState.FAILED: set(),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass
class Entry:
    request_id: str
    prompt_tokens: int
    hit_tokens: int
    decode_tokens: int
    state: RequestState = RequestState.WAITING_DECODE
    decode_engine: str = ""
    decode_node: str = ""
    prefill_engine: str = ""
    prefill_node: str = ""
    path: Literal["pe", "de", ""] = ""


def transition(entry: Entry, new: RequestState) -> None:
    """The one way a request's state changes; an illegal move raises."""
    if new not in _LEGAL[entry.state]:
        raise IllegalTransition(f"request {entry.request_id}: {entry.state.value} -> {new.value}")
    entry.state = new


@dataclass(frozen=True)
class DecodeDecision:
    request_id: str
    decode_engine: str
    tokens: int


@dataclass(frozen=True)
class PrefillDecision:
    request_id: str
    prefill_engine: str
    prefill_node: str
    decode_engine: str
    decode_node: str
    path: Literal["pe", "de"]


@dataclass(frozen=True)
class Constants:
    alpha_tokens: int
    beta_tokens: int
    z_margin: float = 1.05


class Dispatcher:
    """Waiting queues plus the latest load of every group; decisions come from the policy."""

    def __init__(self, constants: Constants, mode: Mode = "dualpath") -> None:
        self.constants = constants
        self.mode = mode
        self.entries: dict[str, Entry] = {}
        self.decode_global: deque[str] = deque()
        self.decode_private: dict[str, deque[str]] = {}
        self.prefill_queue: deque[str] = deque()
        self.decode_loads: dict[str, tuple[EngineLoad, ...]] = {}
        self.read_q: dict[str, int] = {}
        self._engine_node: dict[str, str] = {}
        # Prefill nodes whose storage reader is down: their requests read through the DE path.
        self.no_pe_reads: set[str] = set()

    def submit(self, request_id: str, prompt_tokens: int, hit_tokens: int, decode_tokens: int) -> None:
        if request_id in self.entries:
            raise ValueError(f"request {request_id} is already queued")
        self.entries[request_id] = Entry(request_id, prompt_tokens, hit_tokens, decode_tokens)
        self.decode_global.append(request_id)

    def report_read_q(self, node_id: str, tokens: int) -> None:
        self.read_q[node_id] = tokens

    def fetch_decode(self, group_id: str, engines: Sequence[EngineLoad]) -> list[DecodeDecision]:
        """A decode group leader pulls: phase 1 drains the global queue to groups, phase 2
        places this group's private queue on its engines within their free HBM. A group with
        no live engines is dropped (its private queue back to the global one)."""
        if not engines:
            self.decode_loads.pop(group_id, None)
            self.decode_global.extendleft(reversed(self.decode_private.pop(group_id, deque())))
            return []
        self.decode_loads[group_id] = tuple(engines)
        self._engine_node.update({e.engine_id: e.node_id for e in engines})
        self.decode_private.setdefault(group_id, deque())
        if self.decode_global:
            queue = [self._decode_request(rid) for rid in self.decode_global]
            for assignment in assign_decode_groups(queue, self.decode_loads):
                self.decode_private[assignment.target].append(assignment.request_id)
            self.decode_global.clear()
        private = self.decode_private[group_id]
        placed = assign_decode_in_group(
            [self._decode_request(rid) for rid in private], engines, self.constants.z_margin
        )
        decisions = []
        for assignment in placed:
            entry = self.entries[assignment.request_id]
            entry.decode_engine = assignment.target
            entry.decode_node = self._engine_node[assignment.target]
            transition(entry, RequestState.WAITING_PREFILL)
            self.prefill_queue.append(entry.request_id)
            decisions.append(DecodeDecision(entry.request_id, assignment.target, entry.decode_tokens))
        placed_ids = {d.request_id for d in decisions}
        self.decode_private[group_id] = deque(rid for rid in private if rid not in placed_ids)
        return decisions

    def fetch_prefill(self, engines: Sequence[EngineLoad]) -> list[PrefillDecision]:
        """A prefill group leader pulls: FIFO assignment to its engines, then the read path."""
        self._engine_node.update({e.engine_id: e.node_id for e in engines})
        queue = [QueuedRequest(rid, self.entries[rid].prompt_tokens) for rid in self.prefill_queue]
        read_q = {e.node_id: self.read_q.get(e.node_id, 0) for e in engines}
        assignments = assign_prefill(
            queue, engines, read_q, self.constants.alpha_tokens, self.constants.beta_tokens
        )
        decisions = []
        for assignment in assignments:
            entry = self.entries[assignment.request_id]
            pe_node = self._engine_node[assignment.target]
            path = self._path(pe_node, entry.decode_node)
            # Until the readers report again, count this request's hits in the chosen queue.
            chosen = pe_node if path == "pe" else entry.decode_node
            self.read_q[chosen] = self.read_q.get(chosen, 0) + entry.hit_tokens
            entry.prefill_engine, entry.prefill_node, entry.path = assignment.target, pe_node, path
            transition(entry, RequestState.PREFILLING)
            decisions.append(
                PrefillDecision(entry.request_id, assignment.target, pe_node, entry.decode_engine, entry.decode_node, path)
            )
        for _ in decisions:
            self.prefill_queue.popleft()
        return decisions

    def finish(self, request_id: str, failed: bool = False) -> None:
        """The request is done, or failed in any live state (its engine died while it waited
        for a prefill engine, say): it leaves every queue, so a retry under the same id is
        queued afresh and never meets a stale copy of itself."""
        entry = self.entries.pop(request_id)
        transition(entry, RequestState.FAILED if failed else RequestState.DONE)
        if entry.state is RequestState.FAILED:
            self._dequeue(request_id)

    def cancel(self, request_id: str) -> Entry | None:
        """Drop a request in any live state (its deadline passed): out of every queue, FAILED."""
        entry = self.entries.pop(request_id, None)
        if entry is None:
            return None
        self._dequeue(request_id)
        transition(entry, RequestState.FAILED)
        return entry

    def _dequeue(self, request_id: str) -> None:
        for queue in (self.decode_global, self.prefill_queue, *self.decode_private.values()):
            if request_id in queue:
                queue.remove(request_id)

    def check_integrity(self) -> None:
        """Every queued id is a live request in the state its queue holds, queued once; every
        waiting request is in exactly one queue. Raises AssertionError naming what is wrong."""
        decode_queued = [*self.decode_global, *(rid for q in self.decode_private.values() for rid in q)]
        for name, ids, state in (("decode", decode_queued, RequestState.WAITING_DECODE),
                                 ("prefill", list(self.prefill_queue), RequestState.WAITING_PREFILL)):
            duplicated = sorted({rid for rid in ids if ids.count(rid) > 1})
            assert not duplicated, f"{name} queues hold {duplicated} more than once"
            wrong = sorted(rid for rid in ids if rid not in self.entries or self.entries[rid].state is not state)
            assert not wrong, f"{name} queues hold {wrong}, which are not live requests in {state.value}"
            waiting = sorted(rid for rid, e in self.entries.items() if e.state is state and rid not in ids)
            assert not waiting, f"{waiting} are {state.value} but in no {name} queue"

    def engines_in_use(self) -> set[str]:
        """Engines that hold a live request (its HBM reservation, its prefill)."""
        used = set()
        for entry in self.entries.values():
            used.update(e for e in (entry.decode_engine, entry.prefill_engine) if e)
        return used

    def requests_on(self, engine_id: str) -> list[str]:
        """Live requests that depend on `engine_id` (reserved there or prefilling there)."""
        return [
            rid for rid, entry in self.entries.items()
            if engine_id in (entry.decode_engine, entry.prefill_engine)
        ]

    def forget_engine(self, engine_id: str) -> None:
        """A dead engine's groups stop receiving requests until their leader reports again
        (without it); what waited in their private queues goes back to the global queue."""
        for group, loads in list(self.decode_loads.items()):
            if any(load.engine_id == engine_id for load in loads):
                del self.decode_loads[group]
                self.decode_global.extendleft(reversed(self.decode_private.pop(group, deque())))

    def _decode_request(self, request_id: str) -> QueuedRequest:
        return QueuedRequest(request_id, self.entries[request_id].decode_tokens)

    def _path(self, pe_node: str, de_node: str) -> Literal["pe", "de"]:
        if pe_node in self.no_pe_reads:
            return "de"
        if self.mode != "dualpath":
            return "pe"
        return choose_read_path(self.read_q.get(pe_node, 0), self.read_q.get(de_node, 0))

