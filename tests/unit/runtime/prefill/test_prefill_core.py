"""PrefillCore with in-process ports: both read paths, chunked prefill, oracle, failures, and the
layer pipeline's transfers (one per layer and reader, posted ahead of compute)."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from dualpath_ray.config import DualPathConfig, parse_config
from dualpath_ray.protocol.messages import Holding
from tests.engine_harness import EngineHarness, Request

BLOCK = 16


def config(**runtime: object) -> DualPathConfig:
    return parse_config(
        {
            "model": {"n_layer": 3, "max_context": 512},
            "cluster": {"hbm_tokens_per_engine": 4096, "buffer_blocks_per_node": 256, "prefill_hbm_tokens": 2048},
            "store": {"block_size": BLOCK},
            "emulation": {"enabled": False, "compute": "profile"},
            "runtime": {"verify_kv": True, **runtime},
        }
    )


def tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 512, n)]


@pytest.fixture
def harness(tmp_path: Path):
    built = []

    def make(cfg: DualPathConfig | None = None, **kwargs: object) -> EngineHarness:
        h = EngineHarness(cfg or config(), tmp_path, **kwargs)
        built.append(h)
        return h

    yield make
    for h in built:
        h.close()


def two_turns(h: EngineHarness, path: str, first: int = 100, appended: int = 20) -> tuple[list[int], list]:
    """Turn 1 (no hits) then turn 2 (its predecessor's blocks hit) on `path`."""
    context = tokens(first, 1)
    (turn1,) = h.serve([Request("t1", context, path)])
    context = context + list(turn1.output_tokens) + tokens(appended, 2)
    (turn2,) = h.serve([Request("t2", context, path)])
    return context, [turn1, turn2]


@pytest.mark.parametrize("path", ["pe", "de", "split"])
def test_second_turn_hits_and_its_kv_reaches_the_decode_side_exactly(harness, path: str) -> None:
    h = harness()
    context, (turn1, turn2) = two_turns(h, path)
    assert turn1.error is None and turn2.error is None, f"both turns are served: {turn1.error} {turn2.error}"
    stored = (len(turn1.output_tokens) + 100 - 1) // BLOCK * BLOCK
    assert turn2.hit_tokens == stored, "turn 2 hits every full block of turn 1's prompt and output"
    assert turn2.path == path, "the hit is served on the requested path"
    assert turn2.kv_bytes_verified > 0 and turn2.kv_mismatches == 0, (
        "every byte of the prompt's KV the decode engine assembled equals the store and a recompute"
    )
    h.assert_idle()


def test_pe_path_layers_read_the_pe_buffer_and_send_hits_plus_new_tokens(harness) -> None:
    h = harness()
    h.pe_transport.log.clear()
    context, (_, turn2) = two_turns(h, "pe")
    log = [entry for entry in h.pe_transport.log]
    layout = h.layout
    n_layer = layout.n_layer
    turn2_log = log[-2 * n_layer :]
    reads = [e for e in turn2_log if e[0] == "read"]
    writes = [e for e in turn2_log if e[0] == "write"]
    assert len(reads) == n_layer and all(peer == "reader/p0" for _, peer, _ in reads), (
        "one read per layer, from the prefill node's buffer, for the whole batch"
    )
    assert all(n == turn2.hit_tokens * layout.bytes_per_token_per_layer for _, _, n in reads), "reads move the hits"
    assert len(writes) == n_layer and all(peer == "reader/d0" for _, peer, _ in writes), (
        "one write per layer into the decode node's buffer"
    )
    assert all(n == len(context) * layout.bytes_per_token_per_layer for _, _, n in writes), (
        "the PE path sends every token of the layer: hits and computed"
    )


def test_de_path_reads_the_decode_buffer_and_sends_only_computed_tokens(harness) -> None:
    h = harness()
    context, (_, turn2) = two_turns(h, "de")
    n_layer = h.layout.n_layer
    turn2_log = h.pe_transport.log[-2 * n_layer :]
    bpt = h.layout.bytes_per_token_per_layer
    assert [(op, peer) for op, peer, _ in turn2_log] == [("read", "reader/d0")] * 2 + [
        ("write", "reader/d0"), ("read", "reader/d0"), ("write", "reader/d0"), ("write", "reader/d0")
    ], "layers 0 and 1 load ahead, then each computed layer leaves while the next loads"
    assert sum(n for op, _, n in turn2_log if op == "write") == n_layer * (len(context) - turn2.hit_tokens) * bpt, (
        "the DE path sends only the miss tokens; the hits are already in the decode node's buffer"
    )


def test_a_split_read_loads_each_part_from_its_reader_and_sends_the_prefill_side_hits(harness) -> None:
    """scheduler.read_split: the first hit blocks come from the prefill node's buffer, the rest
    from the decode node's (read straight into their places in its extent); per layer one read
    from each and one write to the decode side, carrying the prefill-side hits and the new tokens."""
    h = harness()
    context, (turn1, _) = two_turns(h, "pe")
    context = context + tokens(30, 3)
    pe_blocks = 2
    h.pe_transport.log.clear()
    (turn3,) = h.serve([Request("t3", context, "split", pe_hit_blocks=pe_blocks)])
    assert turn3.error is None and turn3.path == "split", f"served on the split path: {turn3.error}"
    assert turn3.kv_mismatches == 0 and turn3.kv_bytes_verified > 0, "the decode side's KV is exact, byte for byte"
    bpt, n_layer = h.layout.bytes_per_token_per_layer, h.layout.n_layer
    reads = [(peer, n) for op, peer, n in h.pe_transport.log if op == "read"]
    writes = [(peer, n) for op, peer, n in h.pe_transport.log if op == "write"]
    hit_tokens = turn3.hit_tokens
    assert hit_tokens > pe_blocks * BLOCK, "some hit blocks are left for the decode side to read"
    assert sorted(set(reads)) == [("reader/d0", (hit_tokens - pe_blocks * BLOCK) * bpt), ("reader/p0", pe_blocks * BLOCK * bpt)], (
        "each layer reads its first blocks' KV from the prefill node and the rest from the decode node"
    )
    assert len(reads) == 2 * n_layer, "one read per layer and reader"
    assert writes == [("reader/d0", (pe_blocks * BLOCK + len(context) - hit_tokens) * bpt)] * n_layer, (
        "each layer sends the prefill-side hits and the new tokens; the decode node read the rest itself"
    )
    h.assert_idle()


def test_pipeline_posts_the_next_layer_before_computing_this_one(harness) -> None:
    h = harness(lazy=True)
    events: list[str] = []
    h.pe_transport.events = events
    compute_layer = h.compute.prefill_layer

    def recording(batch, layer, slot):
        events.append(f"compute {layer}")
        compute_layer(batch, layer, slot)

    h.compute.prefill_layer = recording  # type: ignore[method-assign]
    two_turns(h, "de")
    start = [i for i, e in enumerate(events) if e == "compute 0"][1]
    turn2 = events[start - 2 :]
    assert turn2[:3] == ["post read reader/d0", "post read reader/d0", "compute 0"], (
        "layers 0 and 1 are both on their way in before layer 0 computes"
    )
    assert turn2.index("post read reader/d0", 2) < turn2.index("compute 1"), (
        "layer 2's read is posted before layer 1 computes (double buffering)"
    )
    assert h.window.max_held <= 3, "the prefill engine never holds more than 3 layers of the batch's KV"


def test_chunked_prefill_across_batches_gives_the_same_kv_and_tokens(harness, tmp_path: Path) -> None:
    whole = harness(config())
    context, whole_turns = two_turns(whole, "de", first=300, appended=150)
    chunked_cfg = config().with_overrides(scheduler={"compute_quota_ms": 0.02})
    chunked = EngineHarness(chunked_cfg, tmp_path / "chunked")
    try:
        _, chunked_turns = two_turns(chunked, "de", first=300, appended=150)
        assert chunked.prefill.stats.chunks > chunked.prefill.stats.handoffs, "a tiny quota cuts prompts into chunks"
        assert [t.output_tokens for t in chunked_turns] == [t.output_tokens for t in whole_turns], (
            "chunked prefill produces the same tokens"
        )
        assert all(t.kv_mismatches == 0 and t.kv_bytes_verified > 0 for t in chunked_turns), (
            "every chunk's KV, computed on the KV of the chunks before it, is exact at the decode side"
        )
        chunked.assert_idle()
    finally:
        chunked.close()


def test_a_batch_of_only_first_chunks_on_the_model_backend_samples_nothing_and_fails_nothing(tmp_path: Path) -> None:
    """The model computing for real (compute/engine_compute.py): a batch whose chunks all end before
    their prompt's end has nothing to sample (an empty row index was a float tensor: IndexError)."""
    model_cfg = config().with_overrides(emulation={"compute": "model"})
    whole = EngineHarness(model_cfg, tmp_path / "whole")
    chunked = EngineHarness(model_cfg.with_overrides(scheduler={"compute_quota_ms": 0.02}), tmp_path / "chunked")
    try:
        _, whole_turns = two_turns(whole, "de", first=300, appended=150)
        _, chunked_turns = two_turns(chunked, "de", first=300, appended=150)
        assert chunked.prefill.stats.chunks > chunked.prefill.stats.handoffs, "a tiny quota cuts prompts into chunks"
        assert all(t.error is None for t in chunked_turns), "no batch failed"
        assert [t.output_tokens for t in chunked_turns] == [t.output_tokens for t in whole_turns], (
            "chunked prefill produces the same tokens"
        )
    finally:
        whole.close()
        chunked.close()


def test_batch_of_several_requests_one_transfer_per_layer_and_reader(harness) -> None:
    h = harness()
    prompts = [tokens(64 + 16 * i, 10 + i) for i in range(4)]
    h.serve([Request(f"a{i}", p, "de") for i, p in enumerate(prompts)])
    turn2 = [p + tokens(8, 20 + i) for i, p in enumerate(prompts)]
    before = len(h.pe_transport.log)
    results = h.serve([Request(f"b{i}", p, "de") for i, p in enumerate(turn2)])
    assert all(r.error is None and r.hit_tokens > 0 for r in results), "all four second turns hit"
    assert h.prefill.stats.pipeline.max_transfers_per_layer_peer <= 2, (
        "a layer has at most one read and one write per reader, whatever the batch size"
    )
    assert len(h.pe_transport.log) - before == 2 * h.layout.n_layer, "one batch: a read and a write per layer"


def test_oracle_mode_moves_nothing_and_produces_the_same_tokens(harness, tmp_path: Path) -> None:
    h = harness()
    _, turns = two_turns(h, "pe")
    oracle = EngineHarness(config(), tmp_path / "oracle")
    try:
        context = tokens(100, 1)
        (t1,) = oracle.serve([Request("t1", context)], oracle=True)
        context = context + list(t1.output_tokens) + tokens(20, 2)
        (t2,) = oracle.serve([Request("t2", context)], oracle=True)
        assert [t1.output_tokens, t2.output_tokens] == [t.output_tokens for t in turns], "oracle = same outputs"
        assert oracle.pe_transport.log == [] and oracle.de_transport.log == [], "oracle mode moves no KV"
        assert t2.hit_tokens > 0 and t2.kv_mismatches == 0, "oracle still reuses and verifies stored KV"
        oracle.assert_idle()
    finally:
        oracle.close()


def test_a_failed_read_fails_only_that_request_and_frees_its_extents(harness) -> None:
    h = harness()
    context = tokens(100, 1)
    (turn1,) = h.serve([Request("t1", context, "pe")])
    h.readers.fail_read_hits = 1
    follow = context + list(turn1.output_tokens) + tokens(10, 3)
    results = h.serve([Request("bad", follow, "pe"), Request("good", tokens(40, 4), "pe")])
    assert results[0].error and "injected read failure" in results[0].error, "the failed read is the request's error"
    assert results[1].error is None, "another request in the same engine is served"
    h.assert_idle()


def test_a_lease_granted_after_its_request_failed_is_freed_not_leaked(harness) -> None:
    h = harness()
    context = tokens(100, 1)
    (turn1,) = h.serve([Request("t1", context, "pe")])
    gate = threading.Event()
    h.readers.fail_read_hits, h.readers.lease_gate = 1, gate
    (bad,) = h.serve([Request("bad", context + list(turn1.output_tokens), "pe")])
    assert bad.error and "injected read failure" in bad.error, "the PE read failed while the DE lease still waited"
    assert h.prefill.orphans() == 1, "the waiting lease is remembered, not waited for in the failure path"
    gate.set()
    while h.prefill.orphans():  # the test's timeout ends it if the orphan is never settled
        h.prefill.step()
        time.sleep(0.001)
    h.readers.lease_gate = None
    h.assert_idle()


def test_a_duplicate_delivery_leases_nothing_and_runs_once(harness) -> None:
    h = harness()
    task = h.task(Request("once", tokens(60, 7), "de"))
    h.prefill.accept([task])
    h.prefill.accept([task])
    staging = [call for call in h.readers.calls if call in ("read_hits", "lease")]
    assert staging == ["lease"], "one extent for the first delivery (no hits: an empty lease); the duplicate staged nothing"
    while not h.collector.results:  # the test's timeout ends it if it never finishes
        h.prefill.step() | h.decode.step()
    assert [r.request_id for r in h.collector.results] == ["once"], "the request ran exactly once"
    h.assert_idle()


def test_a_cancelled_attempt_is_dropped_before_compute_and_a_late_accept_refused(harness) -> None:
    h = harness()
    queued = h.task(Request("queued", tokens(60, 10), "pe"))
    h.prefill.accept([queued])
    h.prefill.cancel(queued.request.owner)
    late = h.task(Request("late", tokens(60, 11), "de"))
    h.prefill.cancel(late.request.owner)
    h.prefill.accept([late])
    assert h.prefill.holds() == {"queued": Holding(0, False)}, "the accept its cancel overtook holds nothing"
    for _ in range(50):
        h.prefill.step() | h.decode.step()
    assert h.prefill.holds() == {} and h.prefill.stats.cancelled == 1, "the queued attempt was dropped before compute"
    assert h.collector.results == [], "a cancelled attempt reports nothing: the scheduler already failed it"
    for owner in ("queued#0", "late#0"):
        h.decode.cancel(owner)
    h.assert_idle()


def test_two_attempts_of_one_request_coexist_and_each_frees_its_own_extents(harness) -> None:
    h = harness()
    prompt = tokens(60, 8)
    first = h.task(Request("r", prompt, "de"))
    retry = dataclasses.replace(first, request=dataclasses.replace(first.request, attempt=1))
    h.prefill.accept([first, retry])
    assert h.prefill.holds() == {"r": Holding(1, False)}, "the heartbeat names the newest attempt"
    while len(h.collector.results) < 2:  # the test's timeout ends it if an attempt never finishes
        h.prefill.step() | h.decode.step()
    attempts = sorted(r.attempt for r in h.collector.results if r.error is None)
    assert attempts == [0, 1], "both attempts ran to their own results"
    h.assert_idle()


def test_a_failed_transfer_fails_the_batch_and_the_engine_keeps_serving(harness) -> None:
    h = harness()
    context = tokens(100, 1)
    (turn1,) = h.serve([Request("t1", context, "de")])
    h.pe_transport.fail_reads = 1
    (bad,) = h.serve([Request("bad", context + list(turn1.output_tokens), "de")])
    assert bad.error and "injected read failure" in bad.error, "a failed layer read fails its batch's requests"
    (after,) = h.serve([Request("after", tokens(50, 9), "de")])
    assert after.error is None, "the engine serves the next batch"
    h.assert_idle()


def test_a_failed_compute_fails_the_batch_and_frees_everything(harness) -> None:
    h = harness()

    def broken(batch, layer, slot):
        raise RuntimeError("injected compute failure")

    real = h.compute.prefill_layer
    h.compute.prefill_layer = broken  # type: ignore[method-assign]
    (bad,) = h.serve([Request("bad", tokens(70, 5), "pe")])
    assert bad.error and "injected compute failure" in bad.error, "the compute error is reported"
    h.compute.prefill_layer = real  # type: ignore[method-assign]
    h.assert_idle()
