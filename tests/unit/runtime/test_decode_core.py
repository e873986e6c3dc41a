"""DecodeCore with in-process ports: batched steps, persistence with one owner and back-pressure,
the page pool's limits, and long concurrent first turns through both read paths."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dualpath_ray.config import DualPathConfig
from dualpath_ray.kv.index import block_keys
from dualpath_ray.runtime.messages import DecodeReservation, Holding
from tests.engine_harness import DE, EngineHarness, Request
from tests.unit.runtime.test_outbox import Gate
from tests.unit.runtime.test_prefill_core import BLOCK, config, tokens


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


def test_a_reservation_beyond_the_free_pages_is_refused(make) -> None:
    h = make()
    capacity_tokens = h.pages.capacity * BLOCK
    h.decode.accept([DecodeReservation("big", 0, capacity_tokens - BLOCK, DE),
                     DecodeReservation("more", 0, 2 * BLOCK, DE), DecodeReservation("fits", 0, BLOCK, DE)])
    assert set(h.decode.holds()) == {"big", "fits"}, "only the reservation that does not fit is refused"
    assert h.decode.load().free_hbm_tokens == 0, "the load report shows exactly the unreserved pages"
    h.decode.cancel("fits#0")
    assert h.decode.load().free_hbm_tokens == BLOCK, "a cancelled reservation frees its pages"
    h.decode.cancel("big#0")
    assert h.decode.load().free_hbm_tokens == capacity_tokens, "a cancelled reservation frees its pages"
    h.assert_idle()


def test_a_cancel_that_overtakes_its_accept_reserves_nothing(make) -> None:
    h = make()
    capacity_tokens = h.pages.capacity * BLOCK
    h.decode.cancel("late#0")
    h.decode.accept([DecodeReservation("late", 0, 2 * BLOCK, DE), DecodeReservation("late", 1, 2 * BLOCK, DE)])
    assert h.decode.holds() == {"late": Holding(1, False)}, "the cancelled attempt is refused; its retry is not"
    h.decode.cancel("late#1")
    assert h.decode.load().free_hbm_tokens == capacity_tokens, "nothing of either attempt holds pages"
    h.assert_idle()


def test_a_failed_persist_fails_the_turn_and_frees_its_pages(make) -> None:
    h = make()
    core = h.readers.cores["d0"]
    real = core.write_extent

    def failing(extent_id, blocks):
        real(extent_id, [])
        raise OSError("injected write failure")

    core.write_extent = failing  # type: ignore[method-assign]
    (result,) = h.serve([Request("r", tokens(50, 5), "pe", max_new_tokens=3)])
    assert result.error and "injected write failure" in result.error, "a turn whose blocks cannot be stored fails"
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
    deliver = h.collector.complete

    def slow_complete(result):
        deliver(result)
        gates.append(Gate())
        return gates[-1]

    monkeypatch.setattr(h.collector, "complete", slow_complete)
    (result,) = h.serve([Request("r", tokens(40, 5), "pe", max_new_tokens=3)])
    h.decode.step()
    assert h.decode.holds() == {"r": Holding(0, True)}, "the heartbeat names an attempt whose result is not delivered yet"
    gates[-1].open = True
    h.decode.step()
    assert h.decode.holds() == {}, "once delivered, the engine holds nothing of it"
    h.assert_idle()


def test_taking_a_handoff_tells_the_scheduler_at_once(make) -> None:
    h = make()
    results = h.serve([Request(f"r{i}", tokens(24, i), "de" if i % 2 else "pe", max_new_tokens=3) for i in range(4)])
    noted = {rid: held for note in h.collector.handed_off_notes for rid, held in note.items()}
    assert set(noted) == {r.request_id for r in results}, (
        "every request's handoff was noted to the scheduler when the decode engine took it"
    )
    for result in results:
        assert noted[result.request_id] == Holding(result.attempt, True, result.epoch), (
            f"{result.request_id}: the note names the attempt that was handed off"
        )
    assert len(h.collector.handed_off_notes) <= len(results), "at most one note per step, never one per poll"
    h.assert_idle()
