"""The simulator's indexes answer the scheduler core's lookups as the runtime's PrefixIndex does."""

from __future__ import annotations

import numpy as np

from dualpath_ray.kv.index import PrefixIndex, block_keys
from dualpath_ray.sim.index import ChainIndex, SimPrompt, TreeIndex, chain_key
from dualpath_ray.sim.workload import block_key, from_mooncake
from dualpath_ray.workload.mooncake import MooncakeRequest

BLOCK = 64


def test_chain_index_hits_what_a_token_index_hits_for_a_growing_context():
    rng = np.random.default_rng(0)
    tokens_index, chain_index = PrefixIndex(BLOCK), ChainIndex(BLOCK)
    context = np.zeros(0, dtype=np.int64)
    for turn in range(12):
        context = np.concatenate([context, rng.integers(0, 512, int(rng.integers(1, 300)))])
        token_hit = tokens_index.match(context, "ns").hit_blocks
        chain_hit = chain_index.match(SimPrompt(len(context), chain=7), "ns").hit_blocks
        assert chain_hit == token_hit, f"turn {turn}: same longest stored prefix"
        generated = rng.integers(0, 512, int(rng.integers(1, 200)))
        context = np.concatenate([context, generated])
        stored = (len(context) - 1) // BLOCK  # what a turn persists (workload/stats.py)
        keys = block_keys(context[: stored * BLOCK], BLOCK, "ns")
        for position in range(token_hit, stored):
            tokens_index.insert_block(keys[position], keys[position - 1] if position else None)
            parent = chain_key(7, position - 1) if position else None
            chain_index.insert_block(chain_key(7, position), parent)
    assert len(chain_index) == len(tokens_index)


def test_chains_of_different_trajectories_never_hit_each_other():
    index = ChainIndex(BLOCK)
    index.insert_block(chain_key(1, 0), None)
    assert index.match(SimPrompt(500, chain=1), "ns").hit_blocks == 1
    assert index.match(SimPrompt(500, chain=2), "ns").hit_blocks == 0


def test_mooncake_requests_share_the_blocks_their_hash_ids_share():
    requests = [
        MooncakeRequest(1, 0.0, 1100, 10, (5, 6, 7)),
        MooncakeRequest(2, 1.0, 1100, 10, (5, 6, 8)),
        MooncakeRequest(3, 2.0, 600, 10, (9, 6)),
    ]
    workload = from_mooncake(requests, BLOCK)
    first, second, third = workload.trajectories
    assert len(first.keys) == 1100 // BLOCK
    assert first.keys[:16] == second.keys[:16], "two common 512-token hash ids: 16 shared 64-token blocks"
    assert first.keys[16] != second.keys[16], "the third hash id differs"
    assert not set(third.keys) & set(first.keys), "a different first hash id shares nothing (the chain differs)"
    index = TreeIndex(BLOCK)
    parent = None
    for position in range(len(first.keys)):
        key = block_key(first, position, tree=True)
        index.insert_block(key, parent)
        parent = key
    assert index.match(SimPrompt(1100, keys=second.keys), "ns").hit_blocks == 16
