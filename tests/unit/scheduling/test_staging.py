"""Tool-time staging in the pure scheduler core (scheduling/staging.py): a hinted turn's context is
ordered staged on the decode node with the shortest read queue, the next turn claims it at submit,
is placed on that node's group and reads through the DE path without counting the staged blocks;
no hint, basic mode or staging off change nothing; orders expire on the injected clock."""

from __future__ import annotations

import dataclasses

import numpy as np

from dualpath_ray.config import DualPathConfig
from dualpath_ray.kv.index import PrefixIndex, block_keys
from dualpath_ray.protocol.messages import GroupReport, PersistedBlock, RequestSpec, SamplingParams, TurnResult
from dualpath_ray.scheduling import EngineLoad
from dualpath_ray.scheduling.dispatcher import Constants
from dualpath_ray.scheduling.core_settings import CoreSettings
from dualpath_ray.scheduling.scheduler import SchedulerCore
from dualpath_ray.scheduling.staging import StagingBook, StagingSettings, stage_id_of
from dualpath_ray.protocol.types import Mode, ReadPath

BLOCK = 16
NAMESPACE = "model@0"
ON = StagingSettings(enabled=True, slack=0.5, margin_s=2.0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_core(clock: Clock, staging: StagingSettings = ON, mode: Mode = Mode.DUALPATH) -> SchedulerCore:
    settings = CoreSettings(mode, BLOCK, Constants(10_000, 100_000), decode_groups=2, staging=staging)
    return SchedulerCore(settings, PrefixIndex(BLOCK), clock=clock)


def decode(node: str, read_q: int = 0, tok: int = 0) -> GroupReport:
    return GroupReport(f"decode/{node}", node, (EngineLoad(f"decode/{node}/g0", node, 0, tok, 100_000),), read_q)


def prefill(read_q: int = 0) -> GroupReport:
    return GroupReport("prefill/p0", "p0", (EngineLoad("prefill/p0/g0", "p0", 0, 0),), read_q)


def turn(rid: str, prompt: np.ndarray, hint: float | None) -> RequestSpec:
    return RequestSpec(rid, 0, prompt, SamplingParams(max_new_tokens=8), NAMESPACE, 0.0, expect_next_turn_s=hint)


def place(c: SchedulerCore, s: RequestSpec, d1_read_q: int = 0):
    c.submit(s)
    reports = [decode("d0", read_q=500), decode("d1", read_q=d1_read_q)]
    for report in reports + reports:  # the first spread waits for both groups to report
        c.fetch_decode(report)
    (task,) = c.fetch_prefill(prefill(read_q=0))
    return task


def finish(c: SchedulerCore, s: RequestSpec, task) -> tuple[str, ...]:
    """Finish `s` publishing every full block of its prompt after its hits; returns all its keys."""
    keys = block_keys(s.prompt, BLOCK, NAMESPACE)
    hits = len(task.hit_keys)
    persisted = tuple(PersistedBlock(k, keys[i - 1] if i else None) for i, k in enumerate(keys) if i >= hits)
    c.finish(TurnResult(s.request_id, 0, (1,), (0.0,), "length", len(s.prompt), task.hit_tokens, task.path,
                        task.prefill_engine, task.decode_engine, 0.1, 0.01, persisted=persisted))
    return tuple(keys)


def test_a_hinted_turn_is_staged_on_the_quiet_decode_node_and_its_next_turn_claims_it() -> None:
    clock = Clock()
    c = make_core(clock)
    prompt = np.random.default_rng(0).integers(0, 512, 64)
    first = turn("s/t0", prompt, hint=3.0)
    keys = finish(c, first, place(c, first))
    (order,) = c.take_stage_orders()
    assert order.node_id == "d1", "the decode node with the shorter read queue stages (d0 reports 500 tokens)"
    assert order.keys == keys and order.stage_id == stage_id_of(keys), "the whole stored context, named by its last key"
    assert order.ttl_s == 3.0 * 1.5 + 2.0, "held for the hinted wait with slack, plus the margin"
    assert c.take_stage_orders() == [], "an order is taken once"

    clock.now = 3.0
    second = turn("s/t1", np.concatenate([prompt, [7] * 20]), hint=None)
    task = place(c, second, d1_read_q=900)
    assert task.decode_node == "d1", "the next turn goes to the staged node's group, whatever the spread says"
    assert task.path is ReadPath.DE and task.pe_blocks == 0, "its hits are read through the DE path"
    assert task.staged is not None and (task.staged.stage_id, task.staged.blocks) == (order.stage_id, 4)
    assert c.dispatcher.read_q["d1"] == 900, "staged blocks are not counted in the node's read queue"
    assert c.staging.stats.claimed == 1 and len(c.staging) == 0, "the order is claimed and leaves the book"
    c.dispatcher.check_integrity()


def test_no_hint_basic_mode_or_staging_off_order_nothing() -> None:
    prompt = np.random.default_rng(1).integers(0, 512, 64)
    for label, hint, settings, mode in (
        ("no hint", None, ON, Mode.DUALPATH),
        ("staging off", 3.0, StagingSettings(enabled=False), Mode.DUALPATH),
    ):
        c = make_core(Clock(), settings, mode)
        s = turn("s/t0", prompt, hint)
        finish(c, s, place(c, s))
        assert c.take_stage_orders() == [], f"{label}: nothing is ordered staged"
    basic = CoreSettings.of(DualPathConfig(), Mode.BASIC, Constants(1, 1))
    assert not basic.staging.enabled, "basic mode has no DE path to read a staged extent through"
    assert CoreSettings.of(DualPathConfig(), Mode.DUALPATH, Constants(1, 1)).staging.enabled, "on by default in dualpath"


def test_an_order_expires_on_the_clock_and_a_late_turn_reads_as_usual() -> None:
    clock = Clock()
    c = make_core(clock)
    prompt = np.random.default_rng(2).integers(0, 512, 64)
    first = turn("s/t0", prompt, hint=1.0)
    finish(c, first, place(c, first))
    (order,) = c.take_stage_orders()
    clock.now = order.expires_at + 0.01
    task = place(c, turn("s/t1", np.concatenate([prompt, [3] * 5]), hint=None))
    assert task.staged is None, "an expired order is not claimed (its reader has freed it)"
    assert c.staging.stats.expired == 1 and len(c.staging) == 0, "the book forgets it"


def test_a_turn_that_left_the_staged_context_does_not_claim_it() -> None:
    book = StagingBook(ON)
    order = book.plan(("a", "b", "c"), 48, 1.0, 0.0, {"d0": 0}, {"d0": 0})
    assert order is not None
    assert book.claim(("a", "b"), 0.5) is None, "a chain longer than the hits is not claimed"
    assert book.claim(("a", "x", "c"), 0.5) is None, "a chain claims only when every key matches"
    assert book.claim(("a", "b", "c", "d"), 0.5) == order, "hits that begin with the chain claim it"
    assert book.plan(("a",), 16, None, 0.0, {"d0": 0}, {"d0": 0}) is None, "no hint, no order"
    assert book.plan(("a",), 16, 1.0, 0.0, {}, {}) is None, "no decode node takes work: no order"


def test_a_claim_the_placement_cannot_honour_is_dropped() -> None:
    clock = Clock()
    c = make_core(clock)
    prompt = np.random.default_rng(3).integers(0, 512, 64)
    first = turn("s/t0", prompt, hint=2.0)
    finish(c, first, place(c, first))
    (order,) = c.take_stage_orders()
    assert order.node_id == "d1"
    second = turn("s/t1", np.concatenate([prompt, [5] * 9]), hint=None)
    c.submit(second)
    assert c.requests["s/t1"].staged == order, "the next turn claims the staged chain at submit"
    c.engine_died("decode/d1/g0")  # the staged node's group takes no more work
    c.fetch_decode(decode("d0"))
    (task,) = c.fetch_prefill(prefill())
    assert task.decode_node == "d0", "placed on the node that takes work"
    assert task.staged is None, "a staged chain on another node than its decode node is not used"
    assert c.dispatcher.staged_missed == 1, "and it is counted as missed (its reader expires it)"
    c.dispatcher.check_integrity()


def test_staging_is_ordered_only_where_the_tool_time_covers_the_read_and_claimed_once_it_is_done() -> None:
    book = StagingBook(dataclasses.replace(ON, read_tokens_per_s=1000.0))  # a SNIC reads 1000 tokens/s
    assert book.plan(("a",), 2000, 1.5, 0.0, {"d0": 0}, {"d0": 0}) is None, (
        "2000 tokens take 2 s, more than the 1.5 s of tool time: no order"
    )
    assert book.stats.too_short == 1, "and it is counted"
    first = book.plan(("b",), 500, 1.0, 0.0, {"d0": 300, "d1": 0}, {"d0": 0, "d1": 0})
    assert first is not None and first.node_id == "d1", "the node that would finish it first (empty queue)"
    assert first.ready_at == 0.5, "ready when its 500 tokens are read"
    second = book.plan(("c",), 500, 1.0, 0.0, {"d0": 300, "d1": 0}, {"d0": 0, "d1": 0})
    assert second is not None and second.node_id == "d0", "d1's SNIC has 500 staged tokens ahead: d0 (300) is sooner"
    assert second.ready_at == 0.8, "ready after the 300 tokens queued there, then its own 500"
    assert book.claim(("b", "x"), 0.4) is None, "a turn that comes before its chain is read is not steered to it"
    assert book.stats.unready == 1 and len(book) == 1, "counted, and forgotten (its reader expires the extent)"
    assert book.claim(("c", "x"), 0.8) == second, "one that comes after it is read claims it"
