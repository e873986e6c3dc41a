"""The scheduling rules of issue 3 written out literally, one O(engines) scan per pick.

Tests compare dualpath_ray.scheduling (heaps and sorted lists) against these, which follow the
wording of the spec step by step, so any divergence, ties included, is a bug in the fast code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dualpath_ray.scheduling import Assignment, EngineLoad, QueuedRequest


def reference_assign_prefill(
    queue: Sequence[QueuedRequest],
    engines: Sequence[EngineLoad],
    read_q: Mapping[str, int],
    alpha: float,
    beta: float,
) -> list[Assignment]:
    tok = [e.tok for e in engines]
    out: list[Assignment] = []
    for request in queue:
        c2 = [i for i, e in enumerate(engines) if read_q[e.node_id] <= alpha and tok[i] <= beta]
        c3 = [i for i, e in enumerate(engines) if read_q[e.node_id] > alpha and tok[i] <= beta]
        pool = c2 or c3
        if not pool:
            break
        best = min(pool, key=lambda i: (tok[i], i))
        tok[best] += request.tokens
        out.append(Assignment(request.request_id, engines[best].engine_id))
    return out


def reference_assign_decode_groups(
    queue: Sequence[QueuedRequest], groups: Mapping[str, Sequence[EngineLoad]]
) -> list[Assignment]:
    names = list(groups)
    sums = [sum(e.tok for e in groups[g]) for g in names]
    out: list[Assignment] = []
    if not names:
        return out
    for request in queue:
        best = min(range(len(names)), key=lambda i: (sums[i], i))
        sums[best] += request.tokens
        out.append(Assignment(request.request_id, names[best]))
    return out


def reference_assign_decode_in_group(
    queue: Sequence[QueuedRequest], engines: Sequence[EngineLoad], margin: float = 1.05
) -> list[Assignment]:
    if not queue or not engines:
        return []
    seq = [e.seq for e in engines]
    tok = [e.tok for e in engines]
    free = [e.free_hbm_tokens for e in engines]
    total_free = sum(free)
    r_tokens = 0
    for request in queue:
        if r_tokens + request.tokens > total_free:
            break
        r_tokens += request.tokens
    z = margin * (r_tokens + sum(tok)) / len(engines)
    out: list[Assignment] = []
    for request in queue:
        need = request.tokens
        candidates = [i for i in range(len(engines)) if free[i] >= need]
        if not candidates:
            break
        c_high = [i for i in candidates if tok[i] + need > z]
        c_norm = [i for i in candidates if i not in c_high]
        if c_norm:
            best = min(c_norm, key=lambda i: (seq[i], tok[i], i))
        else:
            best = min(c_high, key=lambda i: (tok[i], i))
        tok[best] += need
        seq[best] += 1
        free[best] -= need
        out.append(Assignment(request.request_id, engines[best].engine_id))
    return out
