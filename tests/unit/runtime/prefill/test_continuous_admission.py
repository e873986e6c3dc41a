"""PrefillCore over a compute that runs its own prefill loop (runtime/compute/continuous_prefill.py,
vLLM's continuous batching): chunks are admitted as jobs become READY, bounded by the window's
tokens less those in flight; each is collected as the compute finishes it; a prompt's next chunk
waits for its previous one; a failed chunk fails its request alone."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from dualpath_ray.config import DualPathConfig, parse_config
from dualpath_ray.protocol.errors import ErrorKind
from dualpath_ray.runtime.prefill.job import PrefillState
from dualpath_ray.runtime.transport.moves import TransportError
from tests.engine_harness import EngineHarness, Request
from tests.fakes import ScriptedContinuousPrefill

BLOCK = 16
WINDOW = 256  # the prefill window's tokens: what may be in the compute's loop at once


def config() -> DualPathConfig:
    return parse_config(
        {
            "model": {"n_layer": 2, "max_context": WINDOW},
            "cluster": {"hbm_tokens_per_engine": 4096, "buffer_blocks_per_node": 256, "prefill_hbm_tokens": WINDOW},
            "store": {"block_size": BLOCK},
            "scheduler": {"compute_quota_ms": 1e9},  # the window's tokens bind here, not the quota
            "emulation": {"enabled": False, "compute": "profile"},
        }
    )


@pytest.fixture
def engine(tmp_path: Path):
    h = EngineHarness(config(), tmp_path)
    loop = ScriptedContinuousPrefill()
    h.compute.continuous_prefill = loop  # type: ignore[misc]
    h.handoff.cores.clear()  # handoffs are recorded, not decoded: the fake computes no KV
    yield h, loop
    h.close()


def prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 512, n)]


def step_until(h: EngineHarness, done, what: str) -> None:
    deadline = time.monotonic() + 30
    while not done():
        if not h.prefill.step():
            time.sleep(0.001)
        assert time.monotonic() < deadline, f"timed out waiting for {what}"


def admitted(loop: ScriptedContinuousPrefill) -> list[tuple[int, int, int]]:
    """(prompt length, start, end) of every chunk admitted, in order."""
    return [(len(c.prompt), c.start, c.end) for batch in loop.admissions for _, c in batch]


def test_chunks_are_admitted_beside_those_in_flight_within_the_window_and_collected_one_by_one(engine) -> None:
    h, loop = engine
    h.prefill.accept([h.task(Request(f"r{n}", prompt(length, n))) for n, length in enumerate((100, 100, 120))])
    step_until(h, lambda: loop.admissions, "the first admission")
    assert admitted(loop) == [(100, 0, 100), (100, 0, 100), (120, 0, 56)], (
        "the first admission fills the window's 256 tokens: two prompts whole, the third cut to the tokens left"
    )
    assert all(c.kv is not None and c.kv.sent for _, c in loop.admissions[0]), "each chunk names where its KV goes"
    for _ in range(3):
        h.prefill.step()
    assert len(loop.admissions) == 1, "nothing more is admitted while the chunks in flight fill the window"

    loop.finish(loop.ticket(120, 0))
    step_until(h, lambda: any(j.state is PrefillState.READY for j in h.prefill.jobs.values()), "the cut chunk's collection")
    third = next(j for j in h.prefill.jobs.values() if len(j.prompt) == 120)
    assert third.computed == 56 and third.chunks == 1, "a collected non-final chunk advanced its job, back to READY"
    for _ in range(3):
        h.prefill.step()
    assert len(loop.admissions) == 1 and third.state is PrefillState.READY, (
        "its next chunk waits: its 56 tokens of past need the window's room too, which the two in flight hold"
    )
    assert not h.handoff.handoffs, "a non-final chunk hands nothing off"

    first, second = [t for t, c in loop.admissions[0][:2]]
    loop.finish(first, token=11)
    step_until(h, lambda: len(loop.admissions) == 2, "the cut prompt's next chunk")
    assert admitted(loop)[3:] == [(120, 56, 120)], (
        "the cut prompt's next chunk goes in once a chunk in flight was collected and freed the window's room"
    )
    assert [(x.task.request.request_id, x.first_token) for x in h.handoff.handoffs] == [("r0", 11)], (
        "a finished chunk is handed off with the token the compute sampled, while others still compute"
    )
    assert h.prefill.stats.pipeline.reads >= 1, "the compute's transfer statistics are folded into the engine's"

    loop.finish(second, error=TransportError("a landing's digests differed twice"))
    loop.finish(loop.ticket(120, 56), token=13)
    step_until(h, lambda: not h.prefill.jobs, "every job to leave the core")
    failed = [r for r in h.collector.results if r.error is not None]
    assert [r.request_id for r in failed] == ["r1"] and failed[0].error_kind is ErrorKind.TRANSFER, (
        "the failed chunk fails its own request (a transfer failure: the scheduler retries it) and no other"
    )
    assert [(x.task.request.request_id, x.first_token) for x in h.handoff.handoffs] == [("r0", 11), ("r2", 13)], (
        "the chunk collected beside the failure is handed off"
    )
    assert h.prefill.stats.handoffs == 2 and h.prefill.stats.chunks == 3, "two handoffs, three chunks computed"
    for node, core in h.readers.cores.items():
        counts = core.pool.check_integrity()
        leased_by_handoffs = sum(len(x.extent.slots) for x in h.handoff.handoffs if x.extent is not None and node == "d0")
        assert counts.capacity - counts.free == leased_by_handoffs, (
            f"reader {node}: only the handed-off requests' decode extents are still leased (the failed one's were freed)"
        )


def test_nothing_is_admitted_while_the_compute_drains_after_a_failure(engine) -> None:
    h, loop = engine
    loop.open = False
    h.prefill.accept([h.task(Request("r0", prompt(40, 0)))])
    step_until(h, lambda: any(j.state is PrefillState.READY for j in h.prefill.jobs.values()), "staging")
    for _ in range(3):
        h.prefill.step()
    assert not loop.admissions, "a compute that is not admitting (draining to empty its prefix cache) gets no chunk"
    assert [j.state for j in h.prefill.jobs.values()] == [PrefillState.READY], "the job waits READY"
    loop.open = True
    step_until(h, lambda: loop.admissions, "the admission once the compute admits again")
    loop.finish(loop.admissions[0][0][0], token=5)
    step_until(h, lambda: h.handoff.handoffs, "the handoff")
    assert h.handoff.handoffs[0].first_token == 5, "it is served once the compute admits again"
