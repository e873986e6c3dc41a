"""Grouped sampling (workload/grouped.py): G trajectories per prompt share its first turn exactly
and nothing after it."""

from __future__ import annotations

import pytest

from dualpath_ray.workload.grouped import grouped_trajectories


def test_the_samples_of_a_prompt_share_its_first_turn_and_nothing_else() -> None:
    trajs = grouped_trajectories(prompts=3, samples=4, turns=3, first=100, appended=10, gen=5, vocab=512)
    assert [t.trajectory_id for t in trajs[:5]] == ["p0-s0", "p0-s1", "p0-s2", "p0-s3", "p1-s0"], "groups adjacent"
    assert all(len(t.turns) == 3 and t.arrival_s == 0.0 for t in trajs), "every trajectory has its turns, all at 0"
    for p in range(3):
        group = trajs[4 * p: 4 * p + 4]
        assert len({t.turns[0].appended for t in group}) == 1, f"prompt {p}: one shared first turn"
        assert len({t.turns[1].appended for t in group}) == 4, f"prompt {p}: each sample's later turns are its own"
    assert len({t.turns[0].appended for t in trajs}) == 3, "the prompts differ"
    assert len(trajs[0].turns[0].appended) == 100 and trajs[0].turns[0].gen_len == 5


def test_a_bad_size_names_itself() -> None:
    with pytest.raises(ValueError, match="samples must be >= 1"):
        grouped_trajectories(prompts=1, samples=0, turns=1, first=8, appended=1, gen=1, vocab=16)
