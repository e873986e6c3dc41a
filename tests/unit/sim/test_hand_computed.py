"""The simulator against times worked out by hand (tests/unit/sim/simcases.py has the set-up).

Each case times turn 1 of two-turn trajectories (turn 0 runs untimed, warmup_turns=1): a 212-token
prompt whose 3 stored blocks (192 tokens) are hits and 20 tokens are computed, 3 tokens generated.
Its pieces: the hit read, 3 x 32,768 B through a 1 MB/s SNIC = 0.098304 s; the prefill batch, two
layers of 20 ms compute with per-layer loads a and sends s pipelined = a + 2 x 0.020 + s; the
prompt's KV into decode HBM (212 x 512 B through the decode engine's CNIC); two decode steps of
2 ms. No block is persisted in turn 1 (212 // 64 = 3 and (212 + 2) // 64 = 3 are all stored).
"""

from __future__ import annotations

import pytest

from dualpath_ray.model.cost import DecodeModel
from dualpath_ray.sim.results import engine_totals_balance, weighted_balance, weighted_fill
from dualpath_ray.sim.settings import SimOptions
from dualpath_ray.sim.simulator import simulate
from dualpath_ray.sim.workload import from_trajectories
from tests.unit.sim.simcases import PER_TOKEN_LAYER_BYTES, SNIC_BYTES_S, case_config, two_turns

READ_S = 3 * 64 * 512 / SNIC_BYTES_S
COMPUTE_S = 0.020
DECODE_S = 2 * 0.002
HIT, NEW, PROMPT = 192, 20, 212


def layer_bytes(tokens: int) -> int:
    return tokens * PER_TOKEN_LAYER_BYTES


def test_one_request_on_the_pe_path(tmp_path):
    cfg = case_config(tmp_path)  # CNIC 8 Gbit/s = 1e9 B/s
    cnic = 1e9
    result = simulate(cfg, from_trajectories([two_turns("a")]), "basic", SimOptions(warmup_turns=1))
    load, send = layer_bytes(HIT) / cnic, layer_bytes(PROMPT) / cnic  # PE path: hits in, everything out
    expected = READ_S + (load + 2 * COMPUTE_S + send) + PROMPT * 512 / cnic + DECODE_S
    assert result.jct_s == pytest.approx(expected, rel=1e-9), "JCT = read + layer pipeline + H2D + decode steps"
    assert result.snic_read_bytes == {"p0": 3 * 32768 + 0, "d0": 0}, "basic mode reads every hit on the prefill node"
    assert result.requests_by_path["pe"] == 1


def test_two_requests_contend_on_one_snic(tmp_path):
    cfg = case_config(tmp_path, prefill_gpus=2, decode_gpus=2)
    cnic = 1e9
    trajectories = [two_turns("a"), two_turns("b")]
    result = simulate(cfg, from_trajectories(trajectories), "basic", SimOptions(warmup_turns=1))
    after_read = (layer_bytes(HIT) / cnic + 2 * COMPUTE_S + layer_bytes(PROMPT) / cnic) + PROMPT * 512 / cnic + DECODE_S
    first, second = READ_S + after_read, 2 * READ_S + after_read
    assert result.trajectory_jct_s["a"] == pytest.approx(first, rel=1e-9), "the first read has the SNIC to itself"
    assert result.trajectory_jct_s["b"] == pytest.approx(second, rel=1e-9), "the second read queues behind the first"
    assert result.jct_s == pytest.approx(second, rel=1e-9)


def test_a_de_path_request_crosses_the_cnic(tmp_path):
    cnic = 1e7  # 0.08 Gbit/s: slow enough that the hit KV crossing it per layer shows
    cfg = case_config(tmp_path, prefill_gpus=2, decode_gpus=2, cnic_gbps=cnic * 8 / 1e9)
    result = simulate(cfg, from_trajectories([two_turns("a"), two_turns("b")]), "dualpath",
                      SimOptions(warmup_turns=1, record_decisions=True))
    paths = {decision[0]: decision[3] for decision in result.decisions}
    assert paths == {"a/t1": "pe", "b/t1": "de"}, "a tie goes PE; a's hits then lengthen p0's queue, so b reads via DE"
    h2d = PROMPT * 512 / cnic
    # PE path: hits from the prefill buffer in, hits + new tokens out.
    pe_round = layer_bytes(HIT) / cnic + 2 * COMPUTE_S + layer_bytes(PROMPT) / cnic
    # DE path: the same hits come in from the decode buffer (through the decode engine's CNIC and
    # the prefill engine's), and only the 20 new tokens go out.
    de_round = layer_bytes(HIT) / cnic + 2 * COMPUTE_S + layer_bytes(NEW) / cnic
    assert result.trajectory_jct_s["a"] == pytest.approx(READ_S + pe_round + h2d + DECODE_S, rel=1e-9)
    assert result.trajectory_jct_s["b"] == pytest.approx(READ_S + de_round + h2d + DECODE_S, rel=1e-9), (
        "both reads run at once on their own SNICs; the DE request's round sends less"
    )
    assert result.snic_read_bytes == {"p0": 3 * 32768, "d0": 3 * 32768}, "each side read one request's hits"


def test_measured_runtime_overheads_add_where_they_happen(tmp_path):
    cfg = case_config(tmp_path)
    cnic = 1e9
    options = SimOptions(warmup_turns=1, pull_delay_s=0.010, result_delay_s=0.030, decode_model=DecodeModel(7.0, 0.0, 0.0))
    result = simulate(cfg, from_trajectories([two_turns("a")]), "basic", options)
    pipeline = layer_bytes(HIT) / cnic + 2 * COMPUTE_S + layer_bytes(PROMPT) / cnic
    expected = 2 * 0.010 + READ_S + pipeline + PROMPT * 512 / cnic + 2 * 0.007 + 0.030
    assert result.jct_s == pytest.approx(expected, rel=1e-9), (
        "two placement pulls (decode, then prefill) wait the pull delay, each decode step takes the measured "
        "7 ms, and the result reaches the caller after the result delay"
    )


def test_attention_balance_measures_by_hand():
    rounds = [(0.0, 2.0, 1.5, 0.5), (2.0, 1.0, 1.0, 1.0), (9.0, 5.0, 3.0, 0.2)]
    assert weighted_balance(rounds, 0.0, 3.0) == (2.0 * 1.5 + 1.0 * 1.0) / 3.0, "length-weighted, window 0-3 s"
    assert weighted_balance(rounds, 0.0, 3.0, min_fill=0.9) == 1.0, "only the full round counts"
    assert weighted_fill(rounds, 0.0, 3.0) == (2.0 * 0.5 + 1.0 * 1.0) / 3.0
    engine_ms = {"a": {0: 3.0, 1: 1.0, 7: 50.0}, "b": {0: 2.0, 1: 2.0}, "c": {1: 9.0}, "d": {1: 3.0}}
    assert engine_totals_balance([["a", "b"], ["c", "d"]], engine_ms, 0, 1) == 9.0 / 6.0, (
        "a and b did 4 ms each (1.0); c and d 9 and 3 ms (1.5): the worst unit's; window 7 left out"
    )
