"""Intra-engine batch packing of a prefill engine (paper section 6, "compute quota").

A forward batch is a list of (cached, bsz) pairs: tokens that already have KV, tokens to compute.
Packing keeps the predicted attention-layer time of a batch within a quota, so data-parallel
prefill engines spend about the same time per layer; the one request that does not fit whole is
cut to the largest chunk that does (chunked prefill), and the rest of it waits for a later batch.
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
    batch: list[tuple[int, int]], cached: int, bsz: int, predict_ms: BatchPredictor, quota_ms: float
) -> int:
    """Largest b in [1, bsz - 1] with predict(batch + (cached, b)) <= quota, or 0 if none fits.

    Binary search, so it relies on the predictor being monotone in b (every cost model is).
    """
    low, high, best = 1, bsz - 1, 0
    while low <= high:
        middle = (low + high) // 2
        if predict_ms(batch + [(cached, middle)]) <= quota_ms:
            best, low = middle, middle + 1
        else:
            high = middle - 1
    return best


def pack_prefill_batch(
    queue: Sequence[tuple[str, int, int]], predict_ms: BatchPredictor, quota_ms: float = 300.0
) -> list[tuple[str, int, int]]:
    """Pack the head of a FIFO queue of (request_id, cached, bsz) into one forward batch.

    Requests go in whole while the predicted time of the batch stays <= quota_ms. The first one
    that does not fit whole is cut to the largest bsz' in [1, bsz - 1] that fits, added as
    (request_id, cached, bsz'), and packing stops there. If the batch would otherwise be empty,
    the first request goes in with bsz' = max(1, the largest that fits), so work always
    progresses even when one token alone exceeds the quota.
    """
    if quota_ms <= 0:
        raise ValueError(f"quota_ms must be > 0 (got {quota_ms})")
    batch: list[tuple[int, int]] = []
    packed: list[tuple[str, int, int]] = []
    for request_id, cached, bsz in queue:
        _check_entry(request_id, cached, bsz)
        if predict_ms(batch + [(cached, bsz)]) <= quota_ms:
            batch.append((cached, bsz))
            packed.append((request_id, cached, bsz))
            continue
        chunk = _largest_fitting_chunk(batch, cached, bsz, predict_ms, quota_ms)
        if not packed:
            chunk = max(1, chunk)
        if chunk:
            packed.append((request_id, cached, chunk))
        break
    return packed
