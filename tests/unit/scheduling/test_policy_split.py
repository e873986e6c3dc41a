"""split_read: one request's hit blocks split by the two readers' headroom below alpha."""

from __future__ import annotations

import pytest

from dualpath_ray.scheduling.policy import split_read


def test_equal_headroom_splits_evenly():
    assert split_read(10, 0, 0, alpha=1000) == (5, 5)


def test_blocks_follow_the_headroom():
    # headroom 750 on the PE side, 250 on the DE side: three quarters read on the prefill node.
    assert split_read(8, 250, 750, alpha=1000) == (6, 2)
    assert split_read(8, 1000, 0, alpha=1000) == (0, 8), "a side at alpha has no headroom and gets nothing"


def test_no_headroom_anywhere_sends_the_whole_read_to_the_shorter_queue():
    assert split_read(6, 5000, 3000, alpha=1000) == (0, 6)
    assert split_read(6, 3000, 3000, alpha=1000) == (6, 0), "a tie goes PE, as choose_read_path"


def test_parts_always_sum_to_the_hits():
    for hits in range(0, 40):
        for pe_q in (0, 10, 333, 999, 2000):
            pe, de = split_read(hits, pe_q, 500, alpha=1000)
            assert pe + de == hits and pe >= 0 and de >= 0


def test_negative_hits_are_refused():
    with pytest.raises(ValueError, match="hit_blocks"):
        split_read(-1, 0, 0, alpha=10)
