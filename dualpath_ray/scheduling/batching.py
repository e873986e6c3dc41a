"""Intra-engine batch packing of a prefill engine (paper section 6, "compute quota").

A forward batch is a list of (cached, bsz) pairs: tokens that already have KV, tokens to compute.
Packing keeps the predicted attention-layer time of a batch within a quota, so data-parallel
prefill engines spend about the same time per layer; the one request that does not fit whole is
cut to the largest chunk that does (chunked prefill), and the rest of it waits for a later batch.
An optional token capacity bounds the KV the batch holds per layer (sum of cached + bsz), which is
what a prefill engine's layer window can hold.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

BatchPredictor = Callable[[list[tuple[int, int]]], float]
"""Predicted attention-layer time in ms of a batch of (cached, bsz) pairs; must grow with bsz."""


def _check_entry(request_id: str, cached: int, bsz: int) -> None:
    if cached < 0:
        raise ValueError(f"request {request_id!r}: cached must be >= 0 (got {cached})")
    if bsz < 1:
        raise ValueError(
            f"request {request_id!r}: bsz must be >= 1 (got {bsz}); a request with nothing "
            "to compute does not belong in a prefill batch"
        )


def _largest_fitting_chunk(
    batch: list[tuple[int, int]], cached: int, bsz: int, predict_ms: BatchPredictor, quota_ms: float, limit: int
) -> int:
    """Largest b in [1, min(bsz - 1, limit)] with predict(batch + (cached, b)) <= quota, or 0.

    Binary search, so it relies on the predictor being monotone in b (every cost model is).
    """
    low, high, best = 1, min(bsz - 1, limit), 0
    while low <= high:
        middle = (low + high) // 2
        if predict_ms(batch + [(cached, middle)]) <= quota_ms:
            best, low = middle, middle + 1
        else:
            high = middle - 1
    return best


def pack_prefill_batch(
    queue: Sequence[tuple[str, int, int]],
    predict_ms: BatchPredictor,
    quota_ms: float = 300.0,
    max_tokens: int | None = None,
    running: Sequence[tuple[int, int]] = (),
) -> list[tuple[str, int, int]]:
    """Pack the head of a FIFO queue of (request_id, cached, bsz) into one forward batch.

    Requests go in whole while the predicted time of the batch stays <= quota_ms. The first one
    that does not fit whole is cut to the largest bsz' in [1, bsz - 1] that fits, added as
    (request_id, cached, bsz'), and packing stops there. If the batch would otherwise be empty,
    the first request goes in with bsz' = max(1, the largest that fits), so work always
    progresses even when one token alone exceeds the quota.

    With `max_tokens`, the batch's summed cached + bsz never exceeds it either: a request that
    does not fit whole is cut to the tokens left (its cached tokens must fit), and packing stops.
    A first request whose cached + 1 tokens exceed max_tokens can never run: ValueError.

    `running`: (cached, bsz) of chunks already admitted and not yet done (continuous batching:
    an engine whose own loop forms the steps, runtime/compute/continuous_prefill.py). They count
    against the quota and max_tokens as if they were the batch's head, and with any of them the
    progress rule is off: what does not fit waits for them to finish rather than going in cut
    to one token (they progress without it).
    """
    if quota_ms <= 0:
        raise ValueError(f"quota_ms must be > 0 (got {quota_ms})")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 (got {max_tokens})")
    batch: list[tuple[int, int]] = list(running)
    packed: list[tuple[str, int, int]] = []
    room = max_tokens - sum(c + b for c, b in running) if max_tokens is not None else None
    if running and (predict_ms(batch) >= quota_ms or (room is not None and room < 1)):
        return []
    for request_id, cached, bsz in queue:
        _check_entry(request_id, cached, bsz)
        fits_room = room is None or cached + bsz <= room
        if fits_room and predict_ms(batch + [(cached, bsz)]) <= quota_ms:
            batch.append((cached, bsz))
            packed.append((request_id, cached, bsz))
            if room is not None:
                room -= cached + bsz
            continue
        limit = bsz - 1 if room is None else min(bsz - 1, room - cached)
        if not packed and not running and limit < 1 and room is not None and cached + 1 > room:
            raise ValueError(
                f"request {request_id!r}: {cached} cached + 1 new tokens exceed the batch capacity of "
                f"{max_tokens} tokens; raise the capacity (cluster.prefill_hbm_tokens)"
            )
        chunk = _largest_fitting_chunk(batch, cached, bsz, predict_ms, quota_ms, limit) if limit >= 1 else 0
        if not packed and not running:
            chunk = max(1, chunk) if (room is None or cached + 1 <= room) else 0
        if chunk:
            packed.append((request_id, cached, chunk))
        break
    return packed


LockstepEntry = tuple[str, int, int, bool]
"""(request_id, cached, bsz, movable): one ready request of an engine of a lockstep unit. Movable:
it has computed nothing yet, so no engine holds state of it and any peer can run it."""


def pack_lockstep_round(
    queues: Sequence[Sequence[LockstepEntry]],
    predict_ms: BatchPredictor,
    quota_ms: float = 300.0,
    max_tokens: int | None = None,
) -> list[list[tuple[str, int, int]]]:
    """Pack one round of engines that step their layers together (data-parallel attention).

    A round lasts as long as its slowest engine, so an engine with less work than its peers idles
    while they compute. Each engine first packs its own FIFO queue as `pack_prefill_batch` does.
    Then engines short of the quota, least loaded first, take movable requests their peers could
    not fit this round (oldest positions first), whole or as the chunk that fits; and while moving
    one movable request from the slowest engine to the fastest shortens the round, it moves. A
    moved request belongs to its new engine from then on. Returns every engine's batch, in the
    order of `queues`.
    """
    own = [[(request_id, cached, bsz) for request_id, cached, bsz, _ in queue] for queue in queues]
    batches = [pack_prefill_batch(queue, predict_ms, quota_ms, max_tokens) if queue else [] for queue in own]
    times = [_batch_ms(batch, predict_ms) for batch in batches]
    spare = _left_over(queues, batches)
    for engine in sorted(range(len(queues)), key=lambda e: times[e]):
        if not spare:
            break
        if times[engine] >= quota_ms:
            continue
        repacked = pack_prefill_batch(batches[engine] + spare, predict_ms, quota_ms, max_tokens)
        taken = {request_id for request_id, _, _ in repacked[len(batches[engine]):]}
        if taken:
            batches[engine], times[engine] = repacked, _batch_ms(repacked, predict_ms)
            spare = [entry for entry in spare if entry[0] not in taken]
    movable = {request_id for queue in queues for request_id, _, _, can_move in queue if can_move}
    while _move_one(batches, times, movable, predict_ms, max_tokens):
        pass
    return batches


def _batch_ms(batch: list[tuple[str, int, int]], predict_ms: BatchPredictor) -> float:
    return predict_ms([(cached, bsz) for _, cached, bsz in batch]) if batch else 0.0


def _move_one(
    batches: list[list[tuple[str, int, int]]], times: list[float], movable: set[str],
    predict_ms: BatchPredictor, max_tokens: int | None,
) -> bool:
    """Move the one movable entry of the slowest engine's batch to the fastest engine that most
    shortens the slower of the two; False when no move shortens it."""
    slow = max(range(len(times)), key=lambda e: times[e])
    fast = min(range(len(times)), key=lambda e: times[e])
    if slow == fast:
        return False
    room = None if max_tokens is None else max_tokens - sum(c + b for _, c, b in batches[fast])
    best, best_ms = None, times[slow]
    for position, (request_id, cached, bsz) in enumerate(batches[slow]):
        if request_id not in movable or (room is not None and cached + bsz > room):
            continue
        rest = batches[slow][:position] + batches[slow][position + 1:]
        longer = max(_batch_ms(rest, predict_ms), _batch_ms(batches[fast] + [(request_id, cached, bsz)], predict_ms))
        if longer < best_ms:
            best, best_ms = position, longer
    if best is None:
        return False
    entry = batches[slow].pop(best)
    batches[fast].append(entry)
    times[slow], times[fast] = _batch_ms(batches[slow], predict_ms), _batch_ms(batches[fast], predict_ms)
    return True


def _left_over(
    queues: Sequence[Sequence[LockstepEntry]], batches: list[list[tuple[str, int, int]]]
) -> list[tuple[str, int, int]]:
    """Movable requests no engine packed, interleaved across engines by queue position (each
    position led by the engine with the most left over), so every peer's oldest goes first."""
    rest = []
    for queue, batch in zip(queues, batches):
        packed = {request_id for request_id, _, _ in batch}
        rest.append([(r, c, b) for r, c, b, movable in queue if movable and r not in packed])
    rest.sort(key=len, reverse=True)
    spare = []
    for position in range(max((len(r) for r in rest), default=0)):
        spare.extend(r[position] for r in rest if position < len(r))
    return spare
