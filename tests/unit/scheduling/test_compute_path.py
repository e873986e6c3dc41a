"""The compute path's split rule (scheduling/compute_path.py) against a literal reference: every
k from 0 to hit evaluated, the earliest finish taken, ties to the largest k."""

from __future__ import annotations

import itertools

import pytest

from dualpath_ray.scheduling.compute_path import ComputePathModel, SplitInputs, blocks_to_read, finish_s


def linear_prefill(per_token_s: float, per_pair_s: float):  # type: ignore[no-untyped-def]
    """A prefill cost of the paper's form: per new token, plus attention per (new, prompt) pair."""
    return lambda cached, new: per_token_s * new + per_pair_s * new * (cached + new)


def literal(inputs: SplitInputs, model: ComputePathModel) -> int:
    best_k, best = 0, None
    for k in range(inputs.hit_blocks + 1):
        b = inputs.block_tokens
        read_done = (inputs.read_queue_tokens + k * b) / model.read_tokens_per_s if k else 0.0
        start = max(read_done, inputs.engine_queue_tokens / model.compute_tokens_per_s)
        if k == inputs.hit_blocks and inputs.miss_tokens == 0:  # a partial-block hit read whole: its last token is computed
            end = start + model.prefill_s(k * b - 1, 1)
        else:
            end = start + model.prefill_s(k * b, inputs.miss_tokens + (inputs.hit_blocks - k) * b)
        if best is None or end <= best:
            best_k, best = k, end
    return best_k


MODELS = [
    ComputePathModel(2_000.0, 40_000.0, linear_prefill(1 / 40_000, 0.0)),  # SNIC-bound: compute 20x the read rate
    ComputePathModel(200_000.0, 4_000.0, linear_prefill(1 / 4_000, 1e-9)),  # compute-bound
    ComputePathModel(10_000.0, 10_000.0, linear_prefill(1 / 12_000, 2e-9)),  # balanced, attention included
]


@pytest.mark.parametrize("model", MODELS)
def test_the_split_is_the_literal_scans_earliest_finish(model: ComputePathModel) -> None:
    for hit, miss, read_q, engine_q in itertools.product((0, 1, 2, 7, 40), (0, 1, 64, 900), (0, 5_000, 80_000), (0, 3_000, 60_000)):
        if hit == miss == 0:
            continue  # an empty prompt (refused: test below)
        inputs = SplitInputs(hit, 64, miss, read_q, engine_q)
        assert blocks_to_read(inputs, model) == literal(inputs, model), (
            f"the binary search finds the literal scan's latest earliest-finishing k for {inputs}"
        )


def test_reading_wins_when_compute_is_the_bottleneck_and_computing_when_the_snic_is() -> None:
    compute_bound, snic_bound = MODELS[1], MODELS[0]
    inputs = SplitInputs(hit_blocks=32, block_tokens=64, miss_tokens=64, read_queue_tokens=0, engine_queue_tokens=20_000)
    assert blocks_to_read(inputs, compute_bound) == 32, "with cheap reads and a busy engine the whole hit is read"
    waiting = SplitInputs(hit_blocks=32, block_tokens=64, miss_tokens=64, read_queue_tokens=60_000, engine_queue_tokens=0)
    k = blocks_to_read(waiting, snic_bound)
    assert k == 0, "behind a 30 s read queue an idle engine that computes 20x faster than the SNIC reads computes it all"
    assert finish_s(waiting, snic_bound, 0) < finish_s(waiting, snic_bound, 32), "and that ends the request sooner"


def test_a_tail_is_recomputed_where_the_read_and_the_engine_meet() -> None:
    # Reads at 10k tokens/s behind 0.8 s of queue; the engine is busy for 1.0 s and then
    # computes at 20k tokens/s. Reading k blocks ends at 0.8 + 0.0064 k s, past the engine's
    # 1.0 s from k = 32 on: up to there each block read saves compute for free, after it each
    # costs 6.4 ms of waiting to save 3.2 ms of compute.
    model = ComputePathModel(10_000.0, 10_000.0, linear_prefill(1 / 20_000, 0.0))
    inputs = SplitInputs(hit_blocks=40, block_tokens=64, miss_tokens=64, read_queue_tokens=8_000, engine_queue_tokens=10_000)
    assert blocks_to_read(inputs, model) == 31 == literal(inputs, model), (
        "the split falls where the read's end meets the engine's: blocks [31, 40) are computed"
    )


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        SplitInputs(-1, 64, 1, 0, 0)
    with pytest.raises(ValueError, match="rates must be > 0"):
        ComputePathModel(0.0, 1.0, linear_prefill(1.0, 0.0))
    with pytest.raises(ValueError, match="outside"):
        finish_s(SplitInputs(2, 64, 1, 0, 0), MODELS[0], 3)
    with pytest.raises(ValueError, match="empty prompt"):
        SplitInputs(0, 64, 0, 0, 0)


def test_a_partial_block_hit_read_whole_still_computes_its_last_token() -> None:
    # 32 blocks of 64 hold the whole 2,048-token prompt (miss 0): reading all of them leaves
    # the last token to compute (cached 2,047, new 1); reading 31 computes the last block (64).
    calls: list[tuple[int, int]] = []

    def prefill_s(cached: int, new: int) -> float:
        calls.append((cached, new))
        return new / 1_000

    model = ComputePathModel(1_000_000.0, 1_000.0, prefill_s)
    inputs = SplitInputs(hit_blocks=32, block_tokens=64, miss_tokens=0, read_queue_tokens=0, engine_queue_tokens=0)
    assert finish_s(inputs, model, 32) == pytest.approx(32 * 64 / 1_000_000 + 1 / 1_000), "read every block, compute 1 token"
    assert calls[-1] == (2047, 1), "the latency model is asked for the one token past the 2,047 read"
    assert finish_s(inputs, model, 31) == pytest.approx(31 * 64 / 1_000_000 + 64 / 1_000), "31 read, the last block computed"
    assert calls[-1] == (1984, 64), "the last block's 64 tokens are computed on 1,984 read"
