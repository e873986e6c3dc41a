"""The whole actor graph on a local multi-node Ray cluster (1P1D, 2 fake GPUs per node), once per
transport: modes agree with each other and with a recompute from scratch, both read paths carry
requests, every KV byte is checked, storage bytes are exact, and nothing leaks."""

from __future__ import annotations

import importlib.util
import math
import time

import pytest
import ray

from dualpath_ray.cluster import DualPathCluster
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.runtime.engine.base import IDLE_S
from dualpath_ray.runtime.telemetry.status_views import StatusQuery
from tests.helpers import recompute_outputs, runtime_config, trajectories
from tests.shared_cluster import SharedCluster

pytestmark = pytest.mark.integration

TRANSPORTS = [
    pytest.param("gloo", id="gloo"),
    pytest.param(
        "nixl",
        id="nixl",
        marks=pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl extra not installed"),
    ),
]


@pytest.fixture(scope="module", params=TRANSPORTS)
def runs(request: pytest.FixtureRequest, shared_cluster: SharedCluster):
    """Run the same trajectories in every mode on the shared embedded cluster; keep what tests check."""
    cfg = runtime_config(transport=request.param)
    trajs = trajectories()
    observed = {}
    with shared_cluster.deployed(cfg, "basic") as cluster:
        for mode in ("basic", "dualpath", "oracle"):
            deployment = cluster.deployment if mode == "basic" else cluster.deploy(mode)
            assert deployment is not None and deployment.mode == mode, f"{mode} is deployed"
            results = cluster.run_trajectories(trajs)
            observed[mode] = {
                "results": results,
                "counters": cluster.counters(),
                "pools": cluster.pool_integrity(),
                "health": cluster.health(),
                "placement": deployment.placement,
                "named": [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == "scheduler"],
            }
            if mode == "dualpath":
                observed["idle"] = idle_activity(cluster, deployment, seconds=3.0)
        split = cfg.with_overrides(scheduler={"read_split": "proportional"})
        cluster.deploy("dualpath", cfg=split)
        observed["split"] = {"results": cluster.run_trajectories(trajs), "counters": cluster.counters(),
                             "pools": cluster.pool_integrity()}
        profile = cfg.with_overrides(emulation={"compute": "profile"})
        cluster.deploy("dualpath", cfg=profile)
        observed["profile"] = {"results": cluster.run_trajectories(trajs), "health": cluster.health()}
        cluster.teardown()
        observed["leftover"] = [
            a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == cfg.runtime.namespace
        ]
        yield cfg, trajs, observed


def idle_activity(cluster: DualPathCluster, deployment, seconds: float) -> dict[str, object]:
    """What a deployment does with nothing to do, over `seconds` once the last turn settled:
    the engines' worker wake-ups, the scheduler's calls and the readers' reports. "window" is
    measured around both snapshots, so it covers every moment counted whatever the machine's
    speed (a slow machine lengthens it, and the wake-ups it allows, never the other way)."""
    time.sleep(2.0)  # the last heartbeat and read-queue report of the run go out

    def snapshot() -> tuple[dict[str, int], dict[str, int], list[int]]:
        loops = {name: stats.worker_loops for name, stats in cluster.engine_stats().items()}
        calls = ray.get(deployment.scheduler.status.remote(StatusQuery.CALLS)).to_json()
        reports = ray.get([reader.reports_sent.remote() for reader in deployment.readers.values()])
        return loops, calls, reports

    opened = time.monotonic()
    before = snapshot()
    time.sleep(seconds)
    after = snapshot()
    window = time.monotonic() - opened
    return {"window": window, "loops": {e: after[0][e] - before[0][e] for e in after[0]},
            "calls": {k: after[1][k] - before[1].get(k, 0) for k in after[1] if after[1][k] != before[1].get(k, 0)},
            "reports": [b - a for a, b in zip(before[2], after[2])]}


def outputs_of(results):
    return {tid: [r.output_tokens for r in turns] for tid, turns in results.items()}


def test_modes_agree_and_equal_a_recompute_from_scratch(runs):
    cfg, trajs, observed = runs
    reference = recompute_outputs(cfg, trajs)
    for mode in ("basic", "dualpath", "oracle"):
        assert observed[mode]["health"] == {}, f"{mode}: an engine thread failed: {observed[mode]['health']}"
        assert outputs_of(observed[mode]["results"]) == reference, (
            f"{mode}: served tokens must equal a single-process float32 recompute from scratch"
        )


def test_turns_reuse_their_predecessors_blocks(runs):
    _, _, observed = runs
    for mode in ("basic", "dualpath"):
        for tid, turns in observed[mode]["results"].items():
            assert turns[0].hit_tokens == 0, f"{mode} {tid}: the first turn has nothing stored yet"
            hits = [t.hit_tokens for t in turns[1:]]
            assert all(h > 0 for h in hits) and hits == sorted(hits), (
                f"{mode} {tid}: later turns must hit, and hit more as the context grows ({hits})"
            )


def test_dualpath_uses_both_paths_and_basic_only_the_pe_path(runs):
    _, _, observed = runs
    paths = {mode: [r.path for turns in observed[mode]["results"].values() for r in turns[1:]] for mode in ("basic", "dualpath")}
    assert set(paths["basic"]) == {"pe"}, "basic mode reads through the prefill node only"
    assert {"pe", "de"} <= set(paths["dualpath"]), f"dualpath mode must use both read paths: {paths['dualpath']}"


def test_every_assembled_kv_byte_is_verified(runs):
    _, _, observed = runs
    for mode in ("basic", "dualpath", "oracle"):
        for turns in observed[mode]["results"].values():
            for r in turns:
                assert r.kv_bytes_verified > 0, f"{mode} {r.request_id}: decode side must check its KV"
                assert r.kv_mismatches == 0, f"{mode} {r.request_id}: assembled KV differs from store/recompute"


def test_storage_bytes_read_equal_hit_tokens_times_bytes_per_token(runs):
    cfg, _, observed = runs
    layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
    for mode in ("basic", "dualpath"):
        results = [r for turns in observed[mode]["results"].values() for r in turns]
        for path in ("pe", "de"):
            hit = sum(r.hit_tokens for r in results if r.path == path)
            read = sum(c.snic_read[path] for c in observed[mode]["counters"].values())
            assert read == hit * layout.bytes_per_token, f"{mode}/{path}: SNIC bytes read must be exactly the hits"
    oracle = observed["oracle"]["counters"]
    assert all(sum(c.snic_read.values()) == 0 and c.snic_write == 0 for c in oracle.values()), (
        "oracle mode moves no storage bytes"
    )


def test_an_idle_deployment_sleeps(runs):
    _, _, observed = runs
    idle = observed["idle"]
    allowed = math.ceil(idle["window"] / IDLE_S) + 1
    assert all(loops <= allowed for loops in idle["loops"].values()), (
        f"an idle engine's worker wakes only at its idle timeout (IDLE_S = {IDLE_S} s): at most {allowed} times "
        f"in the {idle['window']:.1f} s around the snapshots: {idle['loops']}"
    )
    assert idle["calls"] == {}, f"an idle scheduler is called by no one and calls no one: {idle['calls']}"
    assert idle["reports"] == [0] * len(idle["reports"]), "an idle reader reports nothing"


def test_placement_and_singleton_scheduler(runs):
    cfg, _, observed = runs
    for mode in ("basic", "dualpath", "oracle"):
        placement = observed[mode]["placement"]
        assert set(placement) == {"p0", "d0"}, "every logical node is placed"
        assert len(set(placement.values())) == 2, "prefill and decode nodes are distinct Ray nodes"
        assert len(observed[mode]["named"]) == 1, "exactly one actor is named `scheduler`"


def test_pools_are_free_after_the_run_and_no_actor_leaks(runs):
    _, _, observed = runs
    for mode in ("basic", "dualpath", "oracle"):
        for node, (free, leased, in_flight, capacity) in observed[mode]["pools"].items():
            assert (leased, in_flight) == (0, 0) and free == capacity, f"{mode} {node}: buffer pool not fully free"
    assert observed["leftover"] == [], f"teardown must remove every named actor: {observed['leftover']}"


def test_profile_compute_stamps_kv_that_the_decode_side_verifies(runs):
    _, _, observed = runs
    profile = observed["profile"]
    assert profile["health"] == {}, "profile-mode engines ran without failures"
    results = [r for turns in profile["results"].values() for r in turns]
    assert all(r.kv_bytes_verified > 0 and r.kv_mismatches == 0 for r in results), (
        "every stamped KV byte the decode engines assemble matches the (prefix, layer, position) pattern"
    )
    assert all(t[1].hit_tokens > 0 for t in profile["results"].values()), "profile mode persists and reuses blocks too"


def test_split_reads_serve_the_same_tokens_reading_each_hit_once_through_one_side(runs):
    """scheduler.read_split: proportional: a request's hits are split between both nodes' readers."""
    cfg, trajs, observed = runs
    split = observed["split"]
    results = [r for turns in split["results"].values() for r in turns]
    assert outputs_of(split["results"]) == recompute_outputs(cfg, trajs), "split reads change no served token"
    assert any(r.path == "split" for r in results), f"some turns were split: {sorted({r.path for r in results})}"
    assert all(r.kv_bytes_verified > 0 and r.kv_mismatches == 0 for r in results), "every assembled KV byte checks out"
    layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
    read = sum(sum(c.snic_read.values()) for c in split["counters"].values())
    assert read == sum(r.hit_tokens for r in results) * layout.bytes_per_token, (
        "every hit block is read from the store exactly once, by one of the two sides"
    )
    assert all(sum(c.snic_read.values()) > 0 for c in split["counters"].values()), "both nodes' SNICs read hits"
    assert all(free == cap for free, _, _, cap in split["pools"].values()), "every buffer pool is free afterwards"
