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
    """
    if quota_ms <= 0:
        raise ValueError(f"quota_ms must be > 0 (got {quota_ms})")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 (got {max_tokens})")
    batch: list[tuple[int, int]] = []
    packed: list[tuple[str, int, int]] = []
    room = max_tokens if max_tokens is not None else None
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
        if not packed and limit < 1 and room is not None and cached + 1 > room:
            raise ValueError(
                f"request {request_id!r}: {cached} cached + 1 new tokens exceed the batch capacity of "
                f"{max_tokens} tokens; raise the capacity (cluster.prefill_hbm_tokens)"
            )
        chunk = _largest_fitting_chunk(batch, cached, bsz, predict_ms, quota_ms, limit) if limit >= 1 else 0
        if not packed:
            chunk = max(1, chunk) if (room is None or cached + 1 <= room) else 0
        if chunk:
            packed.append((request_id, cached, chunk))
        break
    return packed
