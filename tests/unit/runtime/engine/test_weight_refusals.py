"""Engines refuse, before computing or storing anything, a request that names other weights than
they hold, or any request while a restarted engine has not caught up with the published weights
(runtime/engine/held_weights.py): a retryable STALE_WEIGHTS failure, never tokens of other
weights and never KV stored under another version's namespace."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from dualpath_ray.protocol.errors import ErrorKind
from tests.engine_harness import EngineHarness, Request
from tests.unit.runtime.prefill.test_prefill_core import config, tokens


@pytest.fixture
def harness(tmp_path: Path):
    built = EngineHarness(config(), tmp_path)
    yield built
    built.close()


def stored_blocks(h: EngineHarness) -> int:
    return sum(1 for _ in h.store.keys())


def test_a_prefill_engine_refuses_a_task_of_another_weight_version_before_leasing_anything(harness) -> None:
    h = harness
    task = h.task(Request("r", tokens(100, 1)))
    newer = h.cfg.kv_namespace(1)  # the scheduler believes in version 1; this engine holds version 0
    h.prefill.accept([dataclasses.replace(task, request=dataclasses.replace(task.request, namespace=newer))])
    assert not h.prefill.jobs, "nothing is staged for it (no extent leased, no read queued)"
    h.prefill.step()
    (result,) = h.collector.results
    assert result.error_kind is ErrorKind.STALE_WEIGHTS and result.error_kind.retryable, "a typed, retryable refusal"
    assert not result.output_tokens and stored_blocks(h) == 0, "no token sampled and no block stored"
    h.assert_idle()


def test_a_decode_engine_not_holding_the_published_weights_refuses_the_handoff_and_frees_it(harness) -> None:
    h = harness
    h.prefill.accept([h.task(Request("r", tokens(100, 2), max_new_tokens=40))])
    deadline = time.monotonic() + 30
    while not h.decode.intake.has_arrivals_locked():  # the prefill engine hands it off
        h.prefill.step()
        assert time.monotonic() < deadline, "the prefill engine hands the request off"
    h.weights.awaiting()  # the decode engine restarted: its config's weights are not the published ones
    while not h.collector.results:
        h.decode.step()
        assert time.monotonic() < deadline, "the decode engine answers the handoff"
    (result,) = h.collector.results
    assert result.error_kind is ErrorKind.STALE_WEIGHTS, "refused before its KV is loaded or a token sampled"
    assert not result.output_tokens and not result.persisted and stored_blocks(h) == 0, (
        "nothing decoded and nothing persisted under a namespace whose weights it does not hold"
    )
    h.assert_idle()
    assert h.weights.refused == 1, "exactly the one request was refused"
