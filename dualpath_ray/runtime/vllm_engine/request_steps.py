"""The StepKV of vLLM's continuous prefill loop (prefill_loop.py): `RequestSteps`, bound to every
step for the loop's lifetime, dispatching per request.

Each admitted chunk is its own `PagedPrefillStep` (prefill_pages.py: its landings, sends and
digests, over every step vLLM schedules it in); a step's hooks go to the chunks vLLM scheduled
in it, so one step may serve chunks of several admissions (`mixed_steps` counts those). A
chunk's failure (a schedule its KV cannot follow, a landing that failed or differs from its
digests twice, a send that failed) fails that chunk only: it takes no more hooks in the step,
its transfers end and its pages are settled back at the step's end (`recover`), and the loop
aborts its vLLM request. The others carry on, except those whose prefix-cached blocks are the
failed chunk's: vLLM caches a request's full blocks when it allocates them, loaded or not, so
every block of a failed chunk is suspect (`tainted`) until vLLM's prefix cache is emptied, and a
request attending over one of them (in the same step or a later one) fails too. Emptying the
cache needs no request holding pages: the loop stops admitting and drains first.

Per step, transfers are per chunk (a chunk's reads of a layer are one per source reader, its
writes one per destination reader): a step of n chunks posts up to n per layer and peer, where
one batch's step posts one (`max_transfers_per_layer_peer` says which). That is the price of
failing one chunk alone: a transfer's failure names the chunks in it.
"""

from __future__ import annotations

import threading
from dataclasses import fields

import torch

from dualpath_ray.runtime.compute.prefill_kv import PrefillMoved
from dualpath_ray.runtime.vllm_engine.pages import PageCodec
from dualpath_ray.runtime.vllm_engine.prefill_pages import PagedPrefillStep
from dualpath_ray.runtime.vllm_engine.step_kv import ScheduledKV


class RequestSteps:
    """See the module doc. `add` a chunk's PagedPrefillStep before its vLLM request is added;
    `new_step` before each vLLM step; `take_failed` after it; `pop` a chunk once it is done."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._subs: dict[str, PagedPrefillStep] = {}
        self._admission: dict[str, int] = {}  # key -> the admission it came in
        self._lock = threading.Lock()  # `add` runs on the core's thread, the hooks on the loop's
        self.failed: dict[str, BaseException] = {}  # this step's failed chunks
        self.tainted: set[int] = set()  # vLLM blocks a failed chunk held, until the prefix cache empties
        self._all_suspect = False
        self.scheduled: set[str] = set()  # the requests vLLM scheduled in the last step
        self.steps = 0  # steps that scheduled any chunk
        self.mixed_steps = 0  # steps that held chunks of two admissions or more
        self.moved = PrefillMoved()  # what the popped chunks moved, since `take_moved`
        self.landed_block_layers = 0  # (block, layer)s of past KV the popped chunks landed, in all
        self._active: list[str] = []  # this step's chunks still taking hooks
        self._begun: list[str] = []  # this step's chunks whose `begin` ran (their per-step figures are this step's)
        self._requests: dict[str, ScheduledKV] = {}
        self._step_per_peer: dict[tuple[int, str], int] = {}

    # --- the loop's calls ---------------------------------------------------------------

    def add(self, key: str, admission: int, step: PagedPrefillStep) -> None:
        with self._lock:
            self._subs[key] = step
            self._admission[key] = admission

    def pop(self, key: str) -> PagedPrefillStep:
        """The chunk is done (sampled, or failed and recovered): its statistics fold into `moved`."""
        with self._lock:
            step = self._subs.pop(key)
            self._admission.pop(key)
            _fold(self.moved, step.moved)
            self.landed_block_layers += step.moved.block_layers_in
        return step

    def holds(self, key: str) -> bool:
        with self._lock:
            return key in self._subs

    def suspect(self) -> bool:
        """Whether vLLM's prefix cache may hold KV no chunk vouches for (a failure since it was
        last emptied)."""
        return bool(self.tainted) or self._all_suspect

    def suspect_all(self) -> None:
        """A failure that names no blocks (vLLM's step raised, a chunk sampled short): every
        block is suspect until the cache is emptied."""
        self._all_suspect = True

    def clear_suspect(self) -> None:
        """vLLM's prefix cache was emptied."""
        self.tainted.clear()
        self._all_suspect = False

    def take_moved(self) -> PrefillMoved:
        with self._lock:
            moved, self.moved = self.moved, PrefillMoved()
        return moved

    def new_step(self) -> None:
        self.scheduled, self._active, self._begun, self._requests, self.failed = set(), [], [], {}, {}
        self._step_per_peer = {}

    def take_failed(self) -> dict[str, BaseException]:
        failed, self.failed = self.failed, {}
        return failed

    def recover(self) -> None:
        """The step failed as a whole (vLLM raised): every chunk it scheduled ends its transfers
        and settles its pages back; every block they held is suspect."""
        with self._lock:
            subs = [self._subs[key] for key in self._begun if key in self._subs]
        for sub in subs:
            sub.recover()
        for request in self._requests.values():
            self.tainted.update(request.block_ids)

    # --- StepKV -------------------------------------------------------------------------

    def begin(self, requests: list[ScheduledKV], layers: list[torch.Tensor], codec: PageCodec) -> None:
        with self._lock:
            subs = {r.key: self._subs.get(r.key) for r in requests}
            admissions = {self._admission[r.key] for r in requests if r.key in self._admission}
        unknown = [key for key, sub in subs.items() if sub is None]
        if unknown:
            raise RuntimeError(f"vLLM scheduled requests {unknown[:5]} the continuous prefill loop never admitted")
        self._requests = {r.key: r for r in requests}
        self.scheduled = set(self._requests)
        self.steps += bool(requests)
        self.mixed_steps += len(admissions) > 1
        for request in requests:
            if self._hits_tainted(request):
                self._fail(request.key, RuntimeError(
                    f"{request.key}: vLLM's prefix cache served it blocks a failed chunk held; retried once the cache is emptied"
                ))
                continue
            self._begun.append(request.key)
            try:
                subs[request.key].begin([request], layers, codec)  # type: ignore[union-attr]
            except Exception as exc:  # noqa: BLE001 - fails this chunk, not the step's others
                self._fail(request.key, exc)
                continue
            self._active.append(request.key)

    def before_layer(self, layer: int) -> None:
        for key in list(self._active):
            try:
                self._subs[key].before_layer(layer)
            except Exception as exc:  # noqa: BLE001 - e.g. a landing's transfer or digest check failed
                self._fail(key, exc)

    def after_layer(self, layer: int) -> None:
        for key in list(self._active):
            try:
                self._subs[key].after_layer(layer)
            except Exception as exc:  # noqa: BLE001 - e.g. a send could not be posted
                self._fail(key, exc)

    def end(self) -> None:
        for key in list(self._active):
            try:
                self._subs[key].end()
            except Exception as exc:  # noqa: BLE001 - a send failed: its chunk fails
                self._fail(key, exc)
        for key in self.failed:
            if key in self._subs:
                self._subs[key].recover()  # its transfers end and its pages are vLLM's layout again
        for key in self._begun:
            sub = self._subs.get(key)
            for where, count in (sub.per_peer.items() if sub is not None else ()):
                self._step_per_peer[where] = self._step_per_peer.get(where, 0) + count
        top = max(self._step_per_peer.values(), default=0)
        self.moved.max_transfers_per_layer_peer = max(self.moved.max_transfers_per_layer_peer, top)

    # --- failures -----------------------------------------------------------------------

    def _hits_tainted(self, request: ScheduledKV) -> bool:
        """Whether vLLM's prefix cache served the request a suspect block: its tokens [0,
        load_from) at a (re)scheduling's first step are the cache's. Its later steps are not
        looked at again (a block a failed chunk freed may be handed to it fresh, and its own
        computed blocks are its own), nor blocks past load_from (allocated fresh)."""
        cached = request.load_from if request.first else 0
        return any(block in self.tainted for block in request.block_ids[: -(-cached // self.block_size)])

    def _fail(self, key: str, error: BaseException) -> None:
        """The chunk fails; its blocks are suspect, and so is every request of this step that
        attends over them (failed too, in turn)."""
        if key in self.failed:
            return
        self.failed[key] = error
        if key in self._active:
            self._active.remove(key)
        request = self._requests.get(key)
        if request is None:
            return
        self.tainted.update(request.block_ids)
        for other in list(self._requests.values()):
            if other.key not in self.failed and self._hits_tainted(other):
                self._fail(other.key, RuntimeError(
                    f"{other.key}: it attends over blocks of {key} from vLLM's prefix cache, which failed ({error!r})"
                ))


def _fold(total: PrefillMoved, part: PrefillMoved) -> None:
    """A chunk's figures into the loop's (maxima stay maxima; digests are the chunk's own)."""
    for f in fields(PrefillMoved):
        name = f.name
        if name == "digests":
            continue
        value = getattr(part, name)
        if name == "max_transfers_per_layer_peer":
            continue  # per step, over every chunk of it: RequestSteps.end
        if isinstance(value, dict):
            merged = getattr(total, name)
            for side, nbytes in value.items():
                merged[side] = merged.get(side, 0) + nbytes
        else:
            setattr(total, name, getattr(total, name) + value)
