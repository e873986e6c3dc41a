"""The rollout's next-turn hint (api/rollout.py next_turn_hint): each turn but the last says how long
the trace's tool runs before the next one, which the scheduler stages for; none without tool time."""

from __future__ import annotations

from dualpath_ray.api.rollout import next_turn_hint
from dualpath_ray.workload.trace import Trajectory, Turn


def test_each_turn_hints_the_next_turns_tool_latency_and_the_last_hints_nothing() -> None:
    trajectory = Trajectory("t", (Turn((1, 2), 4), Turn((3,), 4, 2.5), Turn((4,), 4, 0.0), Turn((5,), 4, 7.0)))
    hints = [next_turn_hint(trajectory, k) for k in range(4)]
    assert hints == [2.5, None, 7.0, None], (
        "turn k hints turn k+1's tool latency; a next turn sent at once, or none, is no hint"
    )
