"""The wait-or-compute rule of in-flight sharing (scheduling/share_rule.py) against the rule
written out literally, step by step, and on hand-worked cases."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dualpath_ray.scheduling.compute_path import ComputePathModel
from dualpath_ray.scheduling.share_rule import (
    ShareInputs, ShareSource, end_if_computed, end_if_waiting, should_wait, wait_source,
)

READ_RATE, COMPUTE_RATE = 2048.0, 1024.0  # powers of two: every figure below is exact in binary


def prefill_s(cached: int, new: int) -> float:
    return cached / 4096 + new / 256  # attention over the cached tokens, then the new ones' compute


MODEL = ComputePathModel(READ_RATE, COMPUTE_RATE, prefill_s)
BUFFER_RATE = 16384.0  # one CNIC, 8x the SNIC
BUFFERED = ComputePathModel(READ_RATE, COMPUTE_RATE, prefill_s, buffer_read_tokens_per_s=BUFFER_RATE)


def reference_should_wait(hit: int, promised: int, miss: int, ready_in: float, read_q: int, engine_q: int) -> bool:
    """Issue 37's rule, literally: wait if the producer's blocks, then read, let the request end
    sooner than computing the prefix again."""
    if promised == 0:
        return False
    engines_free_in = engine_q / COMPUTE_RATE
    computing_ends = engines_free_in + prefill_s(hit, promised + miss)
    blocks_published_in = ready_in
    blocks_read_in = blocks_published_in + read_q / READ_RATE + promised / READ_RATE
    starts_in = blocks_read_in if blocks_read_in > engines_free_in else engines_free_in
    if miss == 0:  # the last promised block holds the prompt's last token: read whole, that token is computed
        waiting_ends = starts_in + prefill_s(hit + promised - 1, 1)
    else:
        waiting_ends = starts_in + prefill_s(hit + promised, miss)
    return waiting_ends < computing_ends


# One request's inputs to the rule, drawn the same way for both literal references.
RULE_INPUTS = dict(
    hit=st.integers(0, 64).map(lambda b: b * 16),
    promised=st.integers(0, 256).map(lambda b: b * 16),
    miss=st.integers(0, 4096),  # 0: a partial-block hit (the promised run ends with the prompt)
    ready_in=st.integers(0, 4096).map(lambda t: t / 64),
    read_q=st.integers(0, 1 << 16),
    engine_q=st.integers(0, 1 << 16),
)


@settings(max_examples=400, deadline=None)
@given(**RULE_INPUTS)
def test_the_rule_matches_its_literal_reference(
    hit: int, promised: int, miss: int, ready_in: float, read_q: int, engine_q: int
) -> None:
    assume(hit + promised + miss >= 1)  # an empty prompt is refused (test_bad_inputs_name_themselves)
    inputs = ShareInputs(hit, promised, miss, ready_in, read_q, engine_q)
    assert should_wait(inputs, MODEL) == reference_should_wait(hit, promised, miss, ready_in, read_q, engine_q), (
        f"the rule differs from its literal reference at {inputs}"
    )


def test_behind_a_long_engine_queue_a_sample_waits_for_its_prompts_producer() -> None:
    """G samples of a 2,048-token prompt: the engines hold 8,192 tokens (8 s); the producer
    publishes in 3 s, its blocks read in 1 s: waiting ends at 8 s + 0.5 s + 1/256 s, computing
    at 8 s + 8 s."""
    inputs = ShareInputs(0, 2048, 1, 3.0, 0, 8192)
    assert end_if_computed(inputs, MODEL) == 8.0 + 2049 / 256
    assert end_if_waiting(inputs, MODEL) == 8.0 + 2048 / 4096 + 1 / 256, "the read ends before the engines are free"
    assert should_wait(inputs, MODEL), "waiting saves computing 2,048 tokens again"


def test_with_idle_engines_and_a_late_producer_it_computes() -> None:
    inputs = ShareInputs(0, 256, 16, 60.0, 0, 0)
    assert end_if_computed(inputs, MODEL) == 272 / 256, "idle engines: about a second"
    assert not should_wait(inputs, MODEL), "a producer a minute away is not worth waiting for"


def test_equal_ends_compute_and_nothing_promised_never_waits() -> None:
    # computing: 0 + (64 + 1) / 256; waiting: ready_in + 64 / 2048 + 64 / 4096 + 1 / 256, made equal
    ready_in = 64 / 256 - 64 / 2048 - 64 / 4096
    assert end_if_waiting(ShareInputs(0, 64, 1, ready_in, 0, 0), MODEL) == end_if_computed(ShareInputs(0, 64, 1, ready_in, 0, 0), MODEL)
    assert not should_wait(ShareInputs(0, 64, 1, ready_in, 0, 0), MODEL), "a tie computes: no dependency on another request"
    assert not should_wait(ShareInputs(0, 0, 100, 0.0, 0, 1 << 20), MODEL), "nothing promised: nothing to wait for"


def test_bad_inputs_name_themselves() -> None:
    with pytest.raises(ValueError, match="hit \\+ promised \\+ miss >= 1"):
        ShareInputs(0, 0, 0, 0.0, 0, 0)


def test_a_promise_that_ends_with_the_prompt_leaves_one_token_to_compute() -> None:
    """G samples of a 2,048-token prompt of exactly 32 blocks, partial-block hits on: the
    producer promises all 32, so a waiter reads them whole and computes the last token (cached
    2,047, new 1); computing them itself costs the whole prompt."""
    inputs = ShareInputs(0, 2048, 0, 3.0, 0, 8192)
    assert end_if_computed(inputs, MODEL) == 8.0 + 2048 / 256, "computing: every token of the prompt"
    assert end_if_waiting(inputs, MODEL) == 8.0 + 2047 / 4096 + 1 / 256, "waiting: 2,047 cached, the last token computed"
    assert should_wait(inputs, MODEL), "waiting saves computing the whole prompt again"
    with pytest.raises(ValueError, match="share inputs"):
        ShareInputs(0, 16, 1, -1.0, 0, 0)


def reference_wait_source(
    hit: int, promised: int, miss: int, ready_in: float, read_q: int, engine_q: int, same_node: bool,
) -> str | None:
    """The source choice, literally: each way of waiting ends at the later of the read's end and
    the engines' being free, plus the prefill of what is left; the store's read waits behind the
    SNIC's queue, the producer's decode-node buffer (only for a request on that node) behind
    nothing, at the CNIC's rate. The soonest wait (the buffer on a tie) if it beats computing."""
    if promised == 0:
        return None
    engines_free_in = engine_q / COMPUTE_RATE
    computing_ends = engines_free_in + prefill_s(hit, promised + miss)
    after_read = prefill_s(hit + promised - 1, 1) if miss == 0 else prefill_s(hit + promised, miss)  # miss 0: see above
    store_read_in = ready_in + read_q / READ_RATE + promised / READ_RATE
    store_ends = max(store_read_in, engines_free_in) + after_read
    best, best_ends = "store", store_ends
    if same_node:
        buffer_read_in = ready_in + promised / BUFFER_RATE
        buffer_ends = max(buffer_read_in, engines_free_in) + after_read
        if buffer_ends <= store_ends:
            best, best_ends = "buffer", buffer_ends
    return best if best_ends < computing_ends else None


@settings(max_examples=400, deadline=None)
@given(**RULE_INPUTS, same_node=st.booleans())
def test_the_source_choice_matches_its_literal_reference(
    hit: int, promised: int, miss: int, ready_in: float, read_q: int, engine_q: int, same_node: bool,
) -> None:
    assume(hit + promised + miss >= 1)  # an empty prompt is refused (test_bad_inputs_name_themselves)
    inputs = ShareInputs(hit, promised, miss, ready_in, read_q, engine_q, same_decode_node=same_node)
    got = wait_source(inputs, BUFFERED)
    expected = reference_wait_source(hit, promised, miss, ready_in, read_q, engine_q, same_node)
    assert (got.value if got else None) == expected, f"the source choice differs from its literal reference at {inputs}"
    assert wait_source(inputs, MODEL) in (None, ShareSource.STORE), "without a buffer rate only the store is a source"


def test_behind_a_slow_snic_the_producers_decode_buffer_beats_computing_where_the_store_does_not() -> None:
    """bench-1p1d's case, scaled: the SNIC reads 2,048 tokens/s, the CNIC 16,384; 1,984 shared
    tokens computed at idle engines take 1,985 / 256 = 7.75 s. Read through the store, after the
    producer's 0.5 s: 0.5 + 1,984 / 2,048 + the rest, and behind a 16,384-token SNIC queue 8 s
    more: computing wins. From the producer's decode-node buffer the queue does not apply:
    0.5 + 1,984 / 16,384 s, then 1,984 / 4,096 + 1 / 256 s of prefill."""
    inputs = ShareInputs(0, 1984, 1, 0.5, 16384, 0, same_decode_node=True)
    assert end_if_computed(inputs, BUFFERED) == 1985 / 256
    assert end_if_waiting(inputs, BUFFERED, ShareSource.STORE) > end_if_computed(inputs, BUFFERED), "the store loses"
    assert end_if_waiting(inputs, BUFFERED, ShareSource.BUFFER) == 0.5 + 1984 / 16384 + 1984 / 4096 + 1 / 256
    assert wait_source(inputs, BUFFERED) is ShareSource.BUFFER, "it waits and reads the producer's buffer"
    other_node = ShareInputs(0, 1984, 1, 0.5, 16384, 0, same_decode_node=False)
    assert wait_source(other_node, BUFFERED) is None, "on another decode node only the store is a source: it computes"
