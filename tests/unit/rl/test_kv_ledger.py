"""The namespace counts of the GRPO job (rl/kv_ledger.py), on turns as the server reports them."""

from __future__ import annotations

import numpy as np

from dualpath_ray.config import DualPathConfig
from dualpath_ray.rl.agent_loop import EpisodeRollout, TurnRecord
from dualpath_ray.rl.kv_ledger import NamespaceLedger
from dualpath_ray.rl.lookup_task import LookupTask, Score

BLOCK = 64


def episode(task: LookupTask, seed: int, version: int, hits: tuple[int, int]) -> EpisodeRollout:
    ep = task.episode(np.random.default_rng(seed))
    first = TurnRecord(ep.prompt, (3, 16), (-1.0, -1.0), hits[0], "pe", version)
    second = TurnRecord((*ep.prompt, 3, 16, 4, 32), (5, 32), (-1.0, -1.0), hits[1], "de", version)
    return EpisodeRollout(ep, (first, second), Score(False, False))


def ledger() -> NamespaceLedger:
    return NamespaceLedger(DualPathConfig().kv_namespace, BLOCK)


def test_a_moved_namespace_counts_no_old_hit_and_later_turns_hitting_earlier_ones() -> None:
    task, book = LookupTask(512), ledger()
    first = book.record_step(1, [episode(task, 1, 1, (0, 128)), episode(task, 2, 1, (64, 128))])
    assert first.old_version_hit_blocks == 0 and first.unexplained_hit_blocks == 0, "hits of this step's own blocks"
    assert first.later_turns == first.later_turns_hitting_earlier == 2, "each turn 1 hit turn 0's two full blocks"
    second = book.record_step(2, [episode(task, 3, 2, (0, 128))])
    assert second.old_version_hit_blocks == 0 and second.stale_version_turns == 0, "version 2 hits no version-1 block"
    assert second.old_version_blocks_offered >= 2, "the shared system prompt's block was there under version 1"


def test_a_namespace_that_did_not_move_is_counted() -> None:
    task, book = LookupTask(512), ledger()
    book.record_step(1, [episode(task, 1, 1, (0, 128))])
    stale = book.record_step(2, [episode(task, 2, 1, (64, 128))])
    assert stale.stale_version_turns == 2, "both turns were served at version 1 after version 2 was published"
    assert stale.old_version_hit_blocks == 2, "the system prompt's block of version 1 was hit, by both turns"
    assert stale.unexplained_hit_blocks == 3, "no hit block is one of version 2's"


def test_a_later_turn_that_missed_its_earlier_blocks_is_counted() -> None:
    counts = ledger().record_step(1, [episode(LookupTask(512), 1, 1, (0, 64))])
    assert counts.later_turns == 1 and counts.later_turns_hitting_earlier == 0, "64 of turn 0's 128 block tokens hit"
