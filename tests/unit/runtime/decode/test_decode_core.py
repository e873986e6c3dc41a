"""DecodeCore with in-process ports: batched steps, persistence with one owner and back-pressure,
the page pool's limits, and long concurrent first turns through both read paths."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import pytest

from dualpath_ray.config import DualPathConfig
from dualpath_ray.kv.index import block_keys
from dualpath_ray.protocol.messages import DecodeHandoff, ErrorKind, Holding
from tests.engine_harness import EngineHarness, Request
from tests.unit.runtime.engine.test_outbox import Gate
from tests.unit.runtime.prefill.test_prefill_core import BLOCK, config, tokens


@pytest.fixture
def make(tmp_path: Path):
    built: list[EngineHarness] = []

    def build(cfg: DualPathConfig | None = None, **kwargs: object) -> EngineHarness:
        h = EngineHarness(cfg or config(), tmp_path / f"h{len(built)}", **kwargs)
        built.append(h)
        return h

    yield build
    for h in built:
        h.close()


def test_requests_decode_in_one_batched_step(make) -> None:
    h = make()
    results = h.serve([Request(f"r{i}", tokens(30 + i, i), "pe", max_new_tokens=6) for i in range(8)])
    assert all(r.error is None and len(r.output_tokens) == 6 for r in results), "every request generates 6 tokens"
    assert h.decode.stats.max_batch == 8, "all eight running requests decode in the same step"
    assert h.decode.stats.steps < 8 * 6, "steps are shared, not one per request and token"
    h.assert_idle()


def test_persisted_keys_are_the_chain_of_the_whole_sequence_and_stored_before_the_result(make) -> None:
    h = make(slow_writes_s=0.02)
    prompt = tokens(40, 3)
    (result,) = h.serve([Request("r", prompt, "de", max_new_tokens=40)])
    sequence = prompt + list(result.output_tokens)
    # KV exists for every token but the last generated one, so its full blocks are persisted.
    expected = block_keys(sequence[: len(sequence) - 1], BLOCK, h.namespace)
    assert [b.key for b in result.persisted] == expected, (
        "the persisted blocks are exactly the full blocks of prompt + output, keyed by the chained hash"
    )
    assert [b.parent for b in result.persisted] == [None, *expected[:-1]], "each block names its predecessor"
    # The harness's result hook asserted that every reported block was already in the store.
    assert all(h.store.contains(b.key) for b in result.persisted), "every reported block is published"
    h.assert_idle()


def test_a_full_persist_budget_applies_back_pressure_instead_of_failing(make) -> None:
    cfg = config(max_persists_in_flight=1)
    h = make(cfg, slow_writes_s=0.01)
    results = h.serve([Request(f"r{i}", tokens(20, i), "pe", max_new_tokens=70) for i in range(3)])
    assert all(r.error is None for r in results), "a full persist budget never fails a request"
    assert h.decode.stats.max_persists_in_flight == 1, "at most the configured number of blocks is in flight"
    assert h.decode.stats.persist_waits > 0, "blocks waited for the budget"
    assert all(len(r.persisted) == (20 + 70 - 1) // BLOCK for r in results), "every full block is still persisted"
    h.assert_idle()


def test_the_next_turn_hits_every_block_the_previous_reported(make) -> None:
    h = make(slow_writes_s=0.01)
    context = tokens(33, 4)
    stored_chain = 0
    for turn in range(4):
        (result,) = h.serve([Request(f"t{turn}", context, "de" if turn % 2 else "pe", max_new_tokens=17)])
        assert result.hit_tokens == min(stored_chain, (len(context) - 1) // BLOCK) * BLOCK, (
            f"turn {turn} hits every block its predecessors reported (leaving one token to compute)"
        )
        assert result.kv_mismatches == 0, f"turn {turn}: the assembled KV is exact"
        stored_chain = result.hit_tokens // BLOCK + len(result.persisted)
        context = context + list(result.output_tokens) + tokens(5, 10 + turn)
    h.assert_idle()


def oracle_handoff(h: EngineHarness, rid: str, prompt_tokens: int, max_new: int, attempt: int = 0) -> DecodeHandoff:
    """What a prefill engine hands over for an oracle-mode request (no extent: KV made in place)."""
    task = h.task(Request(rid, tokens(prompt_tokens, 7), "pe", max_new_tokens=max_new), oracle=True)
    task = dataclasses.replace(task, request=dataclasses.replace(task.request, attempt=attempt))
    return DecodeHandoff(task, None, 1, 0.0, h.clock.now(), None)


def test_a_handoff_reserves_its_pages_when_it_arrives(make) -> None:
    h = make()
    capacity_tokens = h.pages.capacity * BLOCK
    h.decode.hand_off([oracle_handoff(h, "r", 40, 24)])
    assert h.decode.holds() == {"r": Holding(0, True)}, "an arrived handoff is held (and handed off) at once"
    h.decode.step()
    assert h.decode.load().free_hbm_tokens == capacity_tokens - 64, (
        "its pages are prompt + max new tokens in whole pages (40 + 24 -> 4 x 16), as the scheduler counts them"
    )


def test_a_handoff_that_does_not_fit_waits_for_pages_then_fails_with_hbm_full(make) -> None:
    h = make(config(transfer_timeout_s=0.3))
    h.pages.reserve("abandoned#0", h.pages.capacity)  # an attempt the scheduler gave up on still holds them
    h.decode.hand_off([oracle_handoff(h, "waits", 40, 8)])
    assert not h.decode.step() and h.decode.polling(), "no pages: it waits, and the worker looks again for it"
    assert h.decode.holds() == {"waits": Holding(0, True)}, "a waiting handoff is named by the heartbeat"
    h.pages.release("abandoned#0")
    h.decode.step()
    assert "waits#0" in h.decode.jobs, "once pages are free the waiting handoff is taken"
    while not h.collector.results:  # the test's timeout ends it if it never decodes
        h.decode.step()
    assert h.collector.results[0].error is None, "it then decodes as usual"

    h.pages.reserve("abandoned#1", h.pages.capacity)
    h.decode.hand_off([oracle_handoff(h, "late", 40, 8)])
    h.decode.step()
    time.sleep(0.35)
    h.decode.step()
    failed = h.collector.results[-1]
    assert failed.request_id == "late" and failed.error_kind is ErrorKind.HBM_FULL, (
        "past transfer_timeout_s without pages the attempt fails with a retryable hbm_full"
    )
    assert failed.error_kind.retryable, "the scheduler retries it"
    h.pages.release("abandoned#1")
    h.assert_idle()


def test_a_cancel_that_overtakes_its_handoff_drops_it_and_frees_its_extent(make) -> None:
    h = make()
    capacity_tokens = h.pages.capacity * BLOCK
    h.decode.cancel("late#0")
    h.decode.hand_off([oracle_handoff(h, "late", 40, 8), oracle_handoff(h, "late", 40, 8, attempt=1)])
    h.decode.step()
    assert set(h.decode.jobs) == {"late#1"}, "the cancelled attempt is dropped; its retry is taken"
    assert h.decode.stats.cancelled_handoffs == 1, "the drop is counted"
    h.decode.cancel("late#1")
    assert "late#1" in h.decode.jobs, "a cancel does not stop an attempt already taken (it finishes on its own)"
    while h.decode.jobs:  # the test's timeout ends it if the attempt never finishes
        h.decode.step()
    assert h.decode.load().free_hbm_tokens == capacity_tokens, "nothing of either attempt holds pages"
    h.assert_idle()


def test_a_failed_persist_fails_the_turn_and_frees_its_pages(make) -> None:
    h = make()
    core = h.readers.cores["d0"]
    real = core.write_extent

    def failing(extent_id, blocks):
        real(extent_id, [])
        raise RuntimeError("injected persist call failure")

    core.write_extent = failing  # type: ignore[method-assign]
    (result,) = h.serve([Request("r", tokens(50, 5), "pe", max_new_tokens=3)])
    assert result.error and "injected persist call failure" in result.error, (
        "a persist that fails outright (not a write the store refused: whether its blocks were written is "
        "unknown) fails the turn, which is retried"
    )
    h.assert_idle()


@pytest.mark.parametrize("compute", ["profile"])
def test_sixteen_concurrent_first_turns_of_max_context_through_both_paths(make, compute: str) -> None:
    cfg = config().with_overrides(
        cluster={"hbm_tokens_per_engine": 16 * 512, "buffer_blocks_per_node": 16 * 512 // BLOCK, "prefill_hbm_tokens": 2048},
        emulation={"compute": compute},
        runtime={"max_persists_in_flight": 8},
    )
    h = make(cfg)
    max_new = 4
    requests = [
        Request(f"r{i}", tokens(cfg.model.max_context - max_new, 100 + i), "pe" if i % 2 else "de", max_new_tokens=max_new)
        for i in range(16)
    ]
    results = h.serve(requests, timeout_s=120)
    assert [r.error for r in results] == [None] * 16, "no first turn of max_context fails, on either path"
    assert {r.path for r in results} == {"pe", "de"}, "both paths carried requests"
    full_blocks = (cfg.model.max_context - 1) // BLOCK
    assert all(len(r.persisted) == full_blocks for r in results), "every full block of every turn is stored"
    assert all(r.kv_mismatches == 0 for r in results), "every assembled KV byte is exact"
    h.assert_idle()
    stored = np.asarray([h.store.contains(b.key) for r in results for b in r.persisted])
    assert stored.all(), "every reported block is in the store"


def test_a_result_on_its_way_to_the_scheduler_is_still_held(make, monkeypatch) -> None:
    h = make()
    gates = []
    deliver = h.collector.report

    def slow_report(handed_off, results, chunks):
        deliver(handed_off, results, chunks)
        gates.append(Gate())
        return gates[-1]

    monkeypatch.setattr(h.collector, "report", slow_report)
    (result,) = h.serve([Request("r", tokens(40, 5), "pe", max_new_tokens=3)])
    h.decode.step()
    assert h.decode.holds() == {"r": Holding(0, True)}, "the heartbeat names an attempt whose result is not delivered yet"
    gates[-1].open = True
    h.decode.step()
    assert h.decode.holds() == {}, "once delivered, the engine holds nothing of it"
    h.assert_idle()


def test_a_handoff_is_noted_in_the_report_of_the_prefill_step_that_sent_it(make) -> None:
    h = make()
    results = h.serve([Request(f"r{i}", tokens(24, i), "de" if i % 2 else "pe", max_new_tokens=3) for i in range(4)])
    noted = {rid: held for note in h.collector.handed_off_notes for rid, held in note.items()}
    assert set(noted) == {r.request_id for r in results}, (
        "every request's handoff was noted to the scheduler by the prefill engine that sent it"
    )
    for result in results:
        assert noted[result.request_id] == Holding(result.attempt, True, result.epoch), (
            f"{result.request_id}: the note names the attempt that was handed off"
        )
    assert len(h.collector.handed_off_notes) <= len(results), "at most one note per step, never one per request"
    h.assert_idle()
