"""Statistics of a trace, including the KV-cache hit rate it should reach in steady state.

Expected hit model (what the runtime persists, paper "Persistence during decode"): after turn k
of a trajectory, the store holds every full block of that turn's context except the last
generated token, whose KV is only computed when it is fed back as input in turn k+1. So turn
k+1 hits `block_size * floor((context_k - 1) / block_size)` tokens, where context_k is turn k's
prompt plus its generated tokens; turn 0 of a trajectory hits nothing. The hit rate is cached
prompt tokens over all prompt tokens; the steady-state rate leaves out each trajectory's turn 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from dualpath_ray.workload.trace import Trajectory, TrajectoryShape


@dataclass(frozen=True)
class TraceStats:
    """Per-turn and per-trajectory statistics of a trace (token counts unless named otherwise)."""

    trajectories: int
    turns: int
    turns_per_trajectory_mean: float
    turns_per_trajectory_min: int
    turns_per_trajectory_max: int
    appended_mean: float
    gen_len_mean: float
    prompt_len_mean: float
    final_context_mean: float
    final_context_max: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    steady_hit_rate: float
    block_size: int
    arrival_span_s: float

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def expected_cached_tokens(previous_context: int, block_size: int) -> int:
    """Tokens of the next prompt whose KV the store should hold after a turn of this context."""
    if previous_context < 1:
        return 0
    return block_size * ((previous_context - 1) // block_size)


def prompt_and_cached(shape: TrajectoryShape, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompt length, expected cached tokens) of each turn of one trajectory."""
    appended = np.asarray(shape.appended_lens, dtype=np.int64)
    context_after = np.cumsum(appended + np.asarray(shape.gen_lens, dtype=np.int64))
    context_before = np.r_[0, context_after[:-1]]
    prompt = context_before + appended
    cached = np.where(
        context_before > 0, block_size * ((context_before - 1) // block_size), 0
    )
    return prompt, cached


def shapes_of(trajectories: Sequence[Trajectory]) -> list[TrajectoryShape]:
    """The lengths-only view of in-memory trajectories."""
    return [
        TrajectoryShape(
            trajectory_id=t.trajectory_id,
            appended_lens=tuple(len(turn.appended) for turn in t.turns),
            gen_lens=tuple(turn.gen_len for turn in t.turns),
            arrival_s=t.arrival_s,
        )
        for t in trajectories
    ]


def trace_stats(shapes: Sequence[TrajectoryShape], block_size: int) -> TraceStats:
    """Statistics of a trace given as shapes (see `trace_shapes` / `shapes_of`)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not shapes:
        raise ValueError("the trace has no trajectories")
    pairs = [prompt_and_cached(shape, block_size) for shape in shapes]
    prompts = np.concatenate([prompt for prompt, _ in pairs])
    cached = np.concatenate([hit for _, hit in pairs])
    steady_prompt = sum(int(prompt[1:].sum()) for prompt, _ in pairs)
    steady_cached = sum(int(hit[1:].sum()) for _, hit in pairs)
    n_turns = np.array([len(shape.gen_lens) for shape in shapes])
    appended = np.concatenate([np.asarray(s.appended_lens, dtype=np.int64) for s in shapes])
    gen = np.concatenate([np.asarray(s.gen_lens, dtype=np.int64) for s in shapes])
    final = np.array([sum(s.appended_lens) + sum(s.gen_lens) for s in shapes])
    arrivals = [shape.arrival_s for shape in shapes]
    return TraceStats(
        trajectories=len(shapes),
        turns=int(n_turns.sum()),
        turns_per_trajectory_mean=float(n_turns.mean()),
        turns_per_trajectory_min=int(n_turns.min()),
        turns_per_trajectory_max=int(n_turns.max()),
        appended_mean=float(appended.mean()),
        gen_len_mean=float(gen.mean()),
        prompt_len_mean=float(prompts.mean()),
        final_context_mean=float(final.mean()),
        final_context_max=int(final.max()),
        prompt_tokens=int(prompts.sum()),
        cached_tokens=int(cached.sum()),
        hit_rate=float(cached.sum() / prompts.sum()),
        steady_hit_rate=steady_cached / steady_prompt if steady_prompt else 0.0,
        block_size=block_size,
        arrival_span_s=max(arrivals) - min(arrivals),
    )
