"""Grouped sampling: P prompts, G samples of each, T turns (GRPO and its relatives).

An RL rollout sends G samples (8-16) of every prompt together: the G trajectories of one prompt
share its first turn's tokens exactly and diverge after (each sample's later turns append tokens
of its own: a tool's answer, the environment's next observation). The G trajectories of a prompt
are `p<prompt>-s<sample>`, adjacent in the list, all arriving at 0: what the scheduler sees when
a trainer hands it a batch. What the scheduler can share: the prompt's blocks, computed once and
read by the other G - 1 (scheduler.share_in_flight; late binding alone helps those that wait).
"""

from __future__ import annotations

import numpy as np

from dualpath_ray.workload.trace import Trajectory, Turn


def grouped_trajectories(
    prompts: int, samples: int, turns: int, first: int, appended: int, gen: int, vocab: int, seed: int = 0,
) -> list[Trajectory]:
    """`prompts` x `samples` trajectories of `turns` turns: a shared `first`-token prompt per
    group, then `appended` tokens of each sample's own per later turn, `gen` generated per turn."""
    for name, value in (("prompts", prompts), ("samples", samples), ("turns", turns), ("first", first),
                        ("appended", appended), ("gen", gen), ("vocab", vocab)):
        if value < 1:
            raise ValueError(f"grouped sampling: {name} must be >= 1 (got {value})")
    rng = np.random.default_rng(seed)
    out = []
    for p in range(prompts):
        shared = tuple(int(x) for x in rng.integers(0, vocab, first))
        for s in range(samples):
            later = tuple(Turn(tuple(int(x) for x in rng.integers(0, vocab, appended)), gen) for _ in range(turns - 1))
            out.append(Trajectory(f"p{p}-s{s}", (Turn(shared, gen), *later)))
    return out
