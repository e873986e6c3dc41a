"""Whole simulations: every request ends, a seed gives one result, the modes order as they must."""

from __future__ import annotations

from dualpath_ray.protocol.types import Mode
from dualpath_ray.sim.profiles import sim_config
from dualpath_ray.sim.settings import SimOptions
from dualpath_ray.sim.simulator import Simulation, simulate
from dualpath_ray.sim.workload import from_synth, from_trajectories
from dualpath_ray.workload.synth import SynthParams
from dualpath_ray.workload.trace import Trajectory, Turn
from tests.unit.sim.simcases import case_config

PROFILES = "cluster_configs/profiles"


def paper_config(**cluster: int) -> object:
    """The 2P4D-shaped cluster of the paper's large MLA model, scaled down to 1P2D by default."""
    return sim_config({
        "model": {"max_context": 20000},
        "cluster": {"prefill_nodes": 1, "decode_nodes": 2, "prefill_hbm_tokens": 65536, **cluster},
        "sim": {"hardware_profile": f"{PROFILES}/hardware/h100-sxm-8gpu.yaml",
                "model_profile": f"{PROFILES}/models/deepseek-v3.2-660b.yaml"},
    })


def small_workload(agents: int = 24, seed: int = 3):
    return from_synth(SynthParams(agents=agents, max_len=16384, seed=seed))


def test_every_request_ends_and_the_scheduler_holds_nothing():
    workload = small_workload()
    sim = Simulation(paper_config(), workload, Mode.DUALPATH, SimOptions(quota_scope="forward"))
    result = sim.run()
    assert result.turns == workload.turns, "every turn of every trajectory finished"
    assert result.trajectories == len(workload.trajectories)
    assert not sim.core.requests, "the scheduler core holds no request after the last turn"
    sim.core.dispatcher.check_integrity()
    for node in sim.prefill_nodes + sim.decode_nodes:
        assert node.buffer.free == node.buffer.capacity, f"{node.node_id}: every buffer extent was freed"
    for engine in sim.decode_engines.values():
        assert engine.free_pages == sim.settings.hbm_pages and engine.tok == 0, f"{engine.engine_id}: HBM all free"


def test_the_same_inputs_give_the_same_result():
    workload = small_workload()
    first = simulate(paper_config(), workload, "dualpath", SimOptions(record_decisions=True))
    second = simulate(paper_config(), workload, "dualpath", SimOptions(record_decisions=True))
    assert first.decisions == second.decisions, "decisions are a pure function of the inputs"
    assert first.jct_s == second.jct_s and first.ttft_s == second.ttft_s and first.snic_read_bytes == second.snic_read_bytes


def test_a_different_seed_gives_a_different_trace_and_result():
    first = simulate(paper_config(), small_workload(seed=3), "dualpath")
    second = simulate(paper_config(), small_workload(seed=4), "dualpath")
    assert first.jct_s != second.jct_s, "the seed reaches the simulated workload"


def storage_bound_agent(k: int) -> Trajectory:
    """A 400-token first prompt, then five turns of 10 more tokens: every later turn hits its
    whole stored prefix (its own tokens, so agents share nothing)."""
    base = 10_000 * (k + 1)
    later = [Turn(tuple(range(base + 500 + 10 * t, base + 510 + 10 * t)), 2) for t in range(5)]
    return Trajectory(f"agent-{k}", (Turn(tuple(range(base, base + 400)), 2), *later))


def test_storage_bound_modes_order_oracle_dualpath_basic(tmp_path):
    # 1P2D with 1 MB/s SNICs (tests/unit/sim/simcases.py): a later turn reads ~200 KB of hits and
    # computes 10 tokens, so six agents are storage-bound; basic reads through one SNIC,
    # dualpath through three, oracle reads nothing.
    cfg = case_config(tmp_path).with_overrides(cluster={"decode_nodes": 2})
    workload = from_trajectories([storage_bound_agent(k) for k in range(6)])
    jct = {mode: simulate(cfg, workload, mode, SimOptions(warmup_turns=1)).jct_s for mode in ("basic", "dualpath", "oracle")}
    assert jct["oracle"] <= jct["dualpath"] < jct["basic"], f"no I/O <= both paths < the prefill path only: {jct}"
    assert jct["basic"] > 1.5 * jct["dualpath"], f"three SNICs read well over one and a half times what one reads: {jct}"


def test_basic_reads_only_on_prefill_nodes_and_dualpath_on_both():
    workload = small_workload()
    basic = simulate(paper_config(), workload, "basic")
    dual = simulate(paper_config(), workload, "dualpath")
    assert basic.snic_read_bytes["d0"] == basic.snic_read_bytes["d1"] == 0, "basic never reads on decode nodes"
    assert basic.requests_by_path["de"] == 0
    assert dual.requests_by_path["de"] > 0 and dual.snic_read_bytes_by_path["de"] > 0, "dualpath uses the DE path"
    assert sum(basic.snic_read_bytes.values()) == sum(dual.snic_read_bytes.values()), (
        "both modes read exactly the same hit bytes, only through different SNICs"
    )


def test_proportional_split_reads_split_requests_between_the_two_readers():
    workload = small_workload(agents=48)
    cfg = paper_config().with_overrides(scheduler={"read_split": "proportional"})
    result = simulate(cfg, workload, "dualpath", SimOptions(record_decisions=True))
    assert result.requests_by_path["split"] > 0, "requests with headroom on both sides read from both"
    assert result.turns == workload.turns


def test_round_robin_paths_alternate():
    workload = small_workload()
    result = simulate(paper_config(), workload, "dualpath", SimOptions(path_choice="round_robin", record_decisions=True))
    paths = [decision[3] for decision in result.decisions if not decision[0].endswith("/t0")]  # turn 0 reads nothing
    assert paths[:6] in (["pe", "de"] * 3, ["de", "pe"] * 3), "round-robin alternates whatever the queues say"
    assert abs(paths.count("pe") - paths.count("de")) <= 1


def test_ttft_parts_add_up_to_the_mean_ttft():
    result = simulate(paper_config(), small_workload(), "dualpath", SimOptions(quota_scope="forward"))
    parts = result.ttft_parts_s
    assert all(seconds >= 0 for seconds in parts.values()), f"each part of TTFT is a duration: {parts}"
    assert abs(sum(parts.values()) - result.ttft_s["mean"]) < 1e-9, (
        "decode wait, prefill wait, staging and prefill are consecutive and cover TTFT"
    )


def test_binding_at_the_round_moves_jobs_between_lockstep_peers_and_loses_none():
    workload = small_workload(agents=48)
    sim = Simulation(paper_config(), workload, Mode.DUALPATH, SimOptions(quota_scope="forward", lockstep_binding="round"))
    assert sim.settings.lockstep_prefill, "the large MLA profile's prefill engines step together (EP)"
    moved = []
    units = set(sim.units.values())
    for unit in units:
        original = unit._move
        unit._move = lambda owner, engine, original=original: moved.append(owner) or original(owner, engine)
    result = sim.run()
    assert moved, "some round gave a ready job to a peer with less work"
    assert result.turns == workload.turns, "every turn finished, moved or not"
    assert not sim.core.requests, "the scheduler core holds no request after the last turn"
    for engine in sim.prefill_engines.values():
        assert not engine.jobs and engine.tok == 0, f"{engine.engine_id}: every job left with its tok"
    assert result.attention_engine_totals is not None and result.attention_fill is not None


def grouped_first_turns(share: bool):
    """16 requests, 4 samples of each of 4 prompts of 2,047 tokens, all arriving at 0, simulated
    with in-flight sharing on or off."""
    from dualpath_ray.sim.workload import from_mooncake
    from dualpath_ray.workload.mooncake import MooncakeRequest

    cfg = paper_config().with_overrides(scheduler={"share_in_flight": share})
    requests = [MooncakeRequest(4 * p + s + 1, 0.0, 2047, 16, tuple(range(4 * p, 4 * p + 4)))
                for p in range(4) for s in range(4)]
    sim = Simulation(cfg, from_mooncake(requests, cfg.store.block_size), Mode.DUALPATH, SimOptions())
    return sim, sim.run()


def test_samples_of_one_prompt_share_it_in_flight_in_the_simulator():
    off_sim, off = grouped_first_turns(share=False)
    on_sim, on = grouped_first_turns(share=True)
    assert on.turns == off.turns == 16, "every sample finished either way"
    assert off.hit_rate == 0.0, "without sharing the samples, placed together, all compute their prompt"
    counts = on_sim.core.sharing_counts()
    assert counts["prefix_waits"] == 12 and counts["waiting_prefix"] == 0, "3 of each 4 samples waited, none is left"
    assert on.hit_rate > 0.7, "the waiters read the producers' prompts (published when stored, before their turns end)"
    assert on.sharing["shared_prefix_tokens"] == counts["shared_prefix_tokens"] > 0, "the result reports the sharing"
    on_sim.core.dispatcher.check_integrity()
