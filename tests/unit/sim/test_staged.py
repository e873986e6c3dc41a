"""Tool-time staging in the simulator (sim/staged.py): what it saves, what a wrong hint costs, and
that with scheduler.stage_tool_time false nothing changes.

Set-up of simcases.py (1P1D, SNICs of 1 MB/s: a 32 KiB block reads in 33 ms, 64-block buffers).
Each agent: a 200-token first turn (3 full blocks stored after it), then turns of 10 and 70 more
tokens, each after a tool call of 1 s; so each later turn's hits are 3 and 3 blocks, all of them
the context the turn before left, which staging can read during the tool call.
"""

from __future__ import annotations

import dataclasses

import pytest

from dualpath_ray.scheduling.staging import stage_id_of
from dualpath_ray.sim import agents as agents_module
from dualpath_ray.sim.index import chain_key
from dualpath_ray.sim.settings import SimOptions
from dualpath_ray.sim.simulator import Simulation
from dualpath_ray.sim.workload import from_trajectories
from dualpath_ray.workload.trace import Trajectory, Turn
from tests.unit.sim.simcases import case_config

AGENTS = 3
TOOL_S = 1.0


def tool_agent(name: str, arrival_s: float = 0.0) -> Trajectory:
    turns = (Turn(tuple(range(200)), 2), Turn(tuple(range(10)), 3, TOOL_S), Turn(tuple(range(70)), 3, TOOL_S))
    return Trajectory(name, turns, arrival_s=arrival_s)


def workload(count: int = AGENTS):
    return from_trajectories([tool_agent(f"a{i}", arrival_s=0.05 * i) for i in range(count)])


def run(tmp_path, staging: bool, work=None, **scheduler):
    cfg = case_config(tmp_path, mode="dualpath").with_overrides(scheduler={"stage_tool_time": staging, **scheduler})
    sim = Simulation(cfg, work if work is not None else workload(), "dualpath", SimOptions())
    return sim, sim.run()


def assert_all_free(sim) -> None:
    for node in sim.prefill_nodes + sim.decode_nodes:
        assert node.buffer.free == node.buffer.capacity, f"{node.node_id}: every extent, staged ones too, was freed"
    if sim.staged is not None:
        assert sim.staged.held_blocks() == 0, "no staged extent is left held"


def test_staged_turns_read_fewer_hit_blocks_and_wait_less_for_them(tmp_path):
    off_sim, off = run(tmp_path, staging=False)
    on_sim, on = run(tmp_path, staging=True)
    continued = AGENTS * 2
    assert off.turns == on.turns == AGENTS * 3, "every turn ends either way"
    assert off.staging == {}, "staging off: no counters, nothing ordered"
    assert on.staging["orders"] == continued, "each turn followed by a tool call gets one order"
    assert on.staging["used"] == continued and on.staging["missed"] == 0, "each next turn finds its staged extent"
    assert on.staging["expired"] == on.staging["cancelled"] == on.staging["skipped"] == 0, "nothing was wasted"
    assert on.staging["claimed_blocks"] == continued * 3, "every continued turn's 3 hit blocks were staged (the chain of its context)"
    real_off, real_on = sum(off.snic_read_bytes_by_path.values()), sum(on.snic_read_bytes_by_path.values())
    assert real_off == continued * 3 * 32768, "staging off: every continued turn reads its 3 hit blocks"
    assert real_on == 0, "staging on: the hits were read during the tool call, no turn reads them again"
    assert on.staging["staged_blocks"] == continued * 3, "the staged reads moved exactly those blocks"
    assert on.ttft_parts_s["staging"] < off.ttft_parts_s["staging"], "the staging part of TTFT drops"
    assert on.ttft_s["mean"] < off.ttft_s["mean"], "and with it the mean TTFT"
    assert on.requests_by_path["de"] == continued, "a claimed turn reads through its decode node (the DE path)"
    assert_all_free(on_sim)
    assert_all_free(off_sim)


def test_a_session_that_never_returns_costs_one_expired_extent(tmp_path, monkeypatch):
    """Every turn hints a continuation in 1 s, but each agent has one turn: its order is never
    claimed. A later agent (arriving after the first extent's ttl) sees it expired and freed."""
    monkeypatch.setattr(agents_module, "next_turn_hint", lambda trajectory, turn: TOOL_S)
    ttl = TOOL_S * 1.5 + 2.0  # scheduler.stage_slack 0.5, stage_margin_s 2 (the defaults)
    lone = from_trajectories([Trajectory("lone", (Turn(tuple(range(200)), 2),)),
                              Trajectory("late", (Turn(tuple(range(300)), 2),), arrival_s=ttl + 5.0)])
    sim, result = run(tmp_path, staging=True, work=lone)
    staging = result.staging
    assert staging["orders"] == 2, "each hinted turn got an order"
    assert staging["used"] == 0 and staging["claimed"] == 0, "no session came back to claim one"
    assert staging["expired"] == 2, "each session that never returned cost exactly one expired extent"
    assert staging["cancelled"] == staging["skipped"] == 0
    assert sim.core.staging.stats.expired >= 1, "the core's book dropped the first order when its time was up"
    assert len(sim.core.staging) <= 1, "the core keeps no expired order"
    assert_all_free(sim)


def test_a_real_lease_cancels_the_oldest_staged_extent_first(tmp_path):
    """A 12-block buffer, staged extents up to all of it. a0's and a1's first turns end at about
    0.70 s and 0.90 s and each stages 3 blocks; at 1.0 s a 500-token first turn (8 blocks) finds 6
    free: it cancels the oldest staged extent (a0's), which is enough, and leaves a1's."""
    work = from_trajectories([tool_agent("a0"), tool_agent("a1", 0.05),
                              Trajectory("big", (Turn(tuple(range(500)), 2),), arrival_s=1.0)])
    cfg = case_config(tmp_path, mode="dualpath").with_overrides(
        scheduler={"stage_tool_time": True, "stage_buffer_fraction": 1.0}, cluster={"buffer_blocks_per_node": 12})
    sim = Simulation(cfg, work, "dualpath", SimOptions())
    sim.driver.start()
    sim.agents.start()
    sim.loop.run(1.5)  # after the big lease, before a0's next turn
    held = list(sim.staged.nodes["d0"].extents)
    assert sim.staged.counters.cancelled == 1, "the big prompt's lease cancelled one staged extent instead of waiting"
    assert held == [stage_id_of((chain_key(2, 2),))], "the oldest (a0's) went; a1's, the younger, is still held"
    sim.loop.run()
    sim.staged.close(sim.loop.now)
    assert not sim.core.requests and sim.agents.stats.finished == 3, "every turn still ends"
    assert_all_free(sim)


def test_staging_off_is_the_simulator_without_staging(tmp_path, monkeypatch):
    """With stage_tool_time false, the hints change nothing: the run equals one without hints,
    nothing is ordered, and no buffer has a staging hook."""
    sim, hinted = run(tmp_path, staging=False)
    assert sim.staged is None and not sim.core.staging.stats.ordered, "nothing ordered"
    assert all(node.buffer.reclaim is None for node in sim.decode_nodes), "real leases never cancel anything"
    monkeypatch.setattr(agents_module, "next_turn_hint", lambda trajectory, turn: None)
    _, plain = run(tmp_path, staging=False)
    _, plain_on = run(tmp_path, staging=True)
    for result in (hinted, plain, plain_on):
        result.wall_s = result.scheduler_cpu_s = result.scheduler_cpu_per_sim_s = 0.0
    assert dataclasses.asdict(hinted) == dataclasses.asdict(plain), "hints without staging change no figure"
    plain_on.staging = {}
    assert dataclasses.asdict(plain_on) == dataclasses.asdict(plain), "staging on without hints changes no figure"


@pytest.mark.parametrize("tool_s, expected", [(0.0, None), (2.5, 2.5)])
def test_the_hint_is_the_next_turns_tool_latency(tool_s, expected):
    trajectory = from_trajectories([Trajectory("t", (Turn((1,), 1), Turn((2,), 1, tool_s)))]).trajectories[0]
    assert agents_module.next_turn_hint(trajectory, 0) == expected, "a tool call before the next turn is the hint"
    assert agents_module.next_turn_hint(trajectory, 1) is None, "the last turn hints nothing"
