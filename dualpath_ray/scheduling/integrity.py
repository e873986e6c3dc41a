"""The dispatcher's invariants, checked on demand (tests, `Scheduler.status(StatusQuery.INTEGRITY)`): every
queued id is a live request in the state its queue holds, queued once; every waiting request is
in exactly one queue, or held by in-flight sharing as one producer's waiter; the engine books
equal what the live requests add up to."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dualpath_ray.scheduling.engine_book import EngineBook
from dualpath_ray.scheduling.requests import Request, RequestState


@dataclass(frozen=True)
class DispatcherView:
    """What the check reads of a dispatcher (scheduling/dispatcher.py)."""

    requests: Mapping[str, Request]
    decode_queued: Sequence[str]  # the global decode queue, then every group's private queue
    prefill_queue: Sequence[str]
    held: Sequence[str]  # waiters held by in-flight sharing (scheduling/sharing.py)
    queued: int  # the dispatcher's count of queued requests
    decode_book: EngineBook
    prefill_book: EngineBook


def check_dispatcher(view: DispatcherView) -> None:
    """Raises AssertionError naming what is wrong."""
    requests = view.requests
    for name, ids, state in (("decode", list(view.decode_queued), RequestState.QUEUED_DECODE),
                             ("prefill", list(view.prefill_queue), RequestState.QUEUED_PREFILL),
                             ("waiting", list(view.held), RequestState.WAITING_PREFIX)):
        duplicated = sorted({rid for rid in ids if ids.count(rid) > 1})
        assert not duplicated, f"{name} queues hold {duplicated} more than once"
        wrong = sorted(rid for rid in ids if rid not in requests or requests[rid].state is not state)
        assert not wrong, f"{name} queues hold {wrong}, which are not live requests in {state.value}"
        waiting = sorted(rid for rid, r in requests.items() if r.state is state and rid not in ids)
        assert not waiting, f"{waiting} are {state.value} but in no {name} queue"
    dead = sorted(rid for rid, r in requests.items() if not r.state.live)
    assert not dead, f"{dead} are done or failed but still held"
    queued = sum(1 for r in requests.values() if r.state.queued)
    assert view.queued == queued, f"the queued count {view.queued} differs from the {queued} queued requests"
    _check_books(view)


def _check_books(view: DispatcherView) -> None:
    """Each engine's seq and tok in the books equal what the live requests on it add up to."""
    decode, prefill = EngineBook(), EngineBook()
    for request in view.requests.values():
        if request.decode_engine:
            decode.add(request.decode_engine, request.decode_tokens)
        if request.state is RequestState.PREFILLING:
            prefill.add(request.prefill_engine, request.prefill_tokens)
    for role, kept, recomputed in (("decode", view.decode_book, decode), ("prefill", view.prefill_book, prefill)):
        assert kept.snapshot() == recomputed.snapshot(), (
            f"{role} book {kept.snapshot()} differs from what the live requests add up to {recomputed.snapshot()}"
        )
