"""The DualPath scheduling policy (paper section 6) as pure functions.

Each function reads immutable load reports and returns assignments; it never mutates its inputs,
and holds its running counters in local lists. The result is exactly the one the step-by-step
rule in each docstring gives, ties included, but each pick costs O(log engines) (heaps) or an
early-exit scan of a sorted list instead of a scan of every engine, so that one scheduler core
keeps up with a cluster of 1,000+ GPUs.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Iterable, Mapping, Sequence
from dualpath_ray.scheduling.loads import Assignment, EngineLoad, QueuedRequest
from dualpath_ray.protocol.types import ReadPath


def _require_unique_ids(engines: Sequence[EngineLoad]) -> None:
    ids = [engine.engine_id for engine in engines]
    if len(set(ids)) != len(ids):
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"engine ids must be unique; repeated: {', '.join(duplicates)}")


def _node_read_queue(read_q: Mapping[str, int], engine: EngineLoad) -> int:
    try:
        return read_q[engine.node_id]
    except KeyError:
        raise ValueError(
            f"read_q has no entry for node {engine.node_id!r} of engine {engine.engine_id!r}; "
            "report every node's pending read tokens (0 when idle)"
        ) from None


def assign_prefill(
    queue: Iterable[QueuedRequest],
    engines: Sequence[EngineLoad],
    read_q: Mapping[str, int],
    alpha: float,
    beta: float,
) -> list[Assignment]:
    """Assign the FIFO `queue` to prefill engines (one fetch call).

    For each request in order, with every engine's current tok:
    C1 = {tok > beta} (overloaded), C2 = {read_q(node) <= alpha, tok <= beta},
    C3 = {read_q(node) > alpha, tok <= beta}. The request goes to the min-tok engine of C2, else
    of C3 (ties: earliest in `engines`), whose tok grows by the request's tokens. The call stops
    at the first request for which C2 and C3 are both empty. read_q is constant within a call.
    """
    _require_unique_ids(engines)
    # read_q is fixed within the call, so each engine's side (C2 or C3) is fixed and only tok
    # moves, upwards: an engine past beta never comes back, so it simply leaves its heap, and the
    # heap minimum is then the min-tok engine of its class (ties by position, the heap's key).
    short_side: list[tuple[int, int]] = []
    long_side: list[tuple[int, int]] = []
    for index, engine in enumerate(engines):
        side = short_side if _node_read_queue(read_q, engine) <= alpha else long_side
        if engine.tok <= beta:
            side.append((engine.tok, index))
    heapq.heapify(short_side)
    heapq.heapify(long_side)

    assignments: list[Assignment] = []
    for request in queue:
        side = short_side or long_side
        if not side:
            break
        tok, index = side[0]
        assignments.append(Assignment(request.request_id, engines[index].engine_id))
        tok += request.tokens
        if tok <= beta:
            heapq.heapreplace(side, (tok, index))
        else:
            heapq.heappop(side)
    return assignments


def assign_decode_groups(
    queue: Sequence[QueuedRequest], groups: Mapping[str, Sequence[EngineLoad]]
) -> list[Assignment]:
    """Phase 1 of decode assignment: drain the global queue into decode groups.

    Each request, in order, goes to the group whose engines have the minimum summed tok (ties:
    the group's position in `groups`); that sum then grows by the request's tokens. The target
    of each assignment is a group id. With no groups nothing is assigned.
    """
    summed = {}
    for group_id, members in groups.items():
        if not members:
            raise ValueError(f"decode group {group_id!r} has no engines; drop it from `groups`")
        summed[group_id] = sum(engine.tok for engine in members)
    return assign_to_groups(queue, summed)


def assign_to_groups(queue: Iterable[QueuedRequest], group_tok: Mapping[str, int]) -> list[Assignment]:
    """`assign_decode_groups` given each group's summed tok (a caller that keeps the sums as the
    reports arrive pays O(groups) per call instead of O(engines))."""
    group_ids = list(group_tok)
    loads = [(group_tok[group_id], position) for position, group_id in enumerate(group_ids)]
    heapq.heapify(loads)

    assignments: list[Assignment] = []
    if not loads:
        return assignments
    for request in queue:
        load, position = loads[0]
        assignments.append(Assignment(request.request_id, group_ids[position]))
        heapq.heapreplace(loads, (load + request.tokens, position))
    return assignments


def _admissible_tokens(queue: Sequence[QueuedRequest], free_hbm_tokens: int) -> int:
    """Summed tokens of the longest queue prefix that fits in `free_hbm_tokens` (the set R)."""
    admitted = 0
    for request in queue:
        if admitted + request.tokens > free_hbm_tokens:
            break
        admitted += request.tokens
    return admitted


def assign_decode_in_group(
    queue: Sequence[QueuedRequest], engines: Sequence[EngineLoad], margin: float = 1.05
) -> list[Assignment]:
    """Phase 2 of decode assignment: a group's private queue to its engines, respecting HBM.

    R = the longest prefix of `queue` whose summed tokens fit in the group's summed free HBM;
    Z = margin * (tokens of R + summed tok) / len(engines). From the head of `queue`, for each
    request: candidates = engines with free_hbm_tokens >= tokens (none: the call stops);
    C_high = candidates with tok + tokens > Z, C_norm = the rest. Pick the min seq of C_norm
    (ties: min tok, then earliest in `engines`), else the min tok of C_high (ties: earliest).
    The chosen engine's tok += tokens, seq += 1, free_hbm_tokens -= tokens.
    """
    if not queue or not engines:
        return []
    _require_unique_ids(engines)
    seq = [engine.seq for engine in engines]
    tok = [engine.tok for engine in engines]
    free = [engine.free_hbm_tokens for engine in engines]
    admitted = _admissible_tokens(queue, sum(free))
    z = margin * (admitted + sum(tok)) / len(engines)

    # Both orders are kept sorted, so the first engine in by_seq order that passes both tests is
    # the C_norm pick, and the first in by_tok order with room is the C_high pick (C_norm being
    # empty, every candidate is in C_high). Scans stop at the first hit.
    by_seq = sorted((seq[i], tok[i], i) for i in range(len(engines)))
    by_tok = sorted((tok[i], i) for i in range(len(engines)))
    # Max-heap of free HBM with lazy deletion: an engine's free HBM only shrinks, so an entry
    # that disagrees with `free` is stale and is dropped when it surfaces.
    roomiest = [(-room, i) for i, room in enumerate(free)]
    heapq.heapify(roomiest)
    assignments: list[Assignment] = []
    for request in queue:
        need = request.tokens
        while -roomiest[0][0] != free[roomiest[0][1]]:
            heapq.heappop(roomiest)
        if need > -roomiest[0][0]:
            break
        chosen = _first_normal(by_seq, free, need, z)
        if chosen < 0:
            chosen = _first_with_room(by_tok, free, need)
        old_seq, old_tok = seq[chosen], tok[chosen]
        del by_seq[bisect_left(by_seq, (old_seq, old_tok, chosen))]
        del by_tok[bisect_left(by_tok, (old_tok, chosen))]
        seq[chosen] = old_seq + 1
        tok[chosen] = old_tok + need
        free[chosen] -= need
        insort(by_seq, (old_seq + 1, old_tok + need, chosen))
        insort(by_tok, (old_tok + need, chosen))
        heapq.heappush(roomiest, (-free[chosen], chosen))
        assignments.append(Assignment(request.request_id, engines[chosen].engine_id))
    return assignments


def _first_normal(by_seq: list[tuple[int, int, int]], free: list[int], need: int, z: float) -> int:
    """Index of the min-(seq, tok, position) engine with room and tok + need <= Z, or -1."""
    for _, engine_tok, index in by_seq:
        if free[index] >= need and engine_tok + need <= z:
            return index
    return -1


def _first_with_room(by_tok: list[tuple[int, int]], free: list[int], need: int) -> int:
    """Index of the min-(tok, position) engine with free HBM >= need (one exists: the caller checked)."""
    for _, index in by_tok:
        if free[index] >= need:
            return index
    raise AssertionError("no engine has room although the largest free HBM does")


def choose_read_path(pe_read_q: int, de_read_q: int) -> ReadPath:
    """Read a request's hit KV through the node with the shorter storage read queue; a tie -> PE."""
    return ReadPath.PE if pe_read_q <= de_read_q else ReadPath.DE


def split_read(hit_blocks: int, pe_read_q: int, de_read_q: int, alpha: float) -> tuple[int, int]:
    """Split one request's hit blocks between the prefill-side and the decode-side reader
    (scheduler.read_split: proportional; the paper leaves splitting as future work).

    Each side's headroom is how far its read queue is below alpha, max(0, alpha - read_q). The
    blocks go in proportion to the headrooms: pe = round(hit_blocks * h_pe / (h_pe + h_de)), de =
    the rest. With no headroom on either side the whole read goes to the shorter queue, as
    `choose_read_path` would send it. Returns (pe_blocks, de_blocks), summing to hit_blocks.
    """
    if hit_blocks < 0:
        raise ValueError(f"hit_blocks must be >= 0 (got {hit_blocks})")
    pe_room = max(0.0, alpha - pe_read_q)
    de_room = max(0.0, alpha - de_read_q)
    if pe_room + de_room <= 0:
        whole = choose_read_path(pe_read_q, de_read_q)
        return (hit_blocks, 0) if whole is ReadPath.PE else (0, hit_blocks)
    pe_blocks = int(hit_blocks * pe_room / (pe_room + de_room) + 0.5)
    return pe_blocks, hit_blocks - pe_blocks
