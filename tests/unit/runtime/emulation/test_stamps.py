"""Deterministic stamps of profile compute: functions of (prefix, layer, position) only."""

from __future__ import annotations

import numpy as np
import torch

from dualpath_ray.config import ModelConfig
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.runtime.emulation.stamps import expected_kv, extend_prefix, prefix_hashes, prefix_sum, stamp_kv, stamp_token


def test_prefix_hashes_depend_on_the_prefix_only():
    tokens = np.array([5, 9, 2, 7, 7, 1])
    full = prefix_hashes(tokens)
    assert np.array_equal(prefix_hashes(tokens[:4]), full[:4]), "extending a prompt keeps earlier hashes"
    other = prefix_hashes(np.array([5, 9, 3, 7, 7, 1]))
    assert np.array_equal(other[:2], full[:2]) and not np.any(other[2:] == full[2:]), (
        "a changed token changes the hash of every later position"
    )
    assert prefix_hashes(np.array([1, 2]))[1] != prefix_hashes(np.array([2, 1]))[1], "order matters"


def test_stamped_kv_is_a_deterministic_function_of_prefix_layer_and_position():
    layout = KVLayout.from_model(ModelConfig(), block_size=64)
    prompt = np.arange(100) % 7
    a = expected_kv(layout, prompt, layer=2)
    assert a.shape == (100, layout.bytes_per_token_per_layer) and a.dtype == torch.uint8, "one row per token"
    assert torch.equal(a, expected_kv(layout, prompt, layer=2)), "the stamp is deterministic"
    assert not torch.equal(a, expected_kv(layout, prompt, layer=3)), "layers get different bytes"
    tail = stamp_kv(layout, prefix_hashes(prompt)[60:], layer=2)
    assert torch.equal(tail, a[60:]), "a chunk computed later stamps exactly what the full prefill stamps"
    assert 0 <= stamp_token(int(prefix_hashes(prompt)[-1]), 512) < 512, "stamped tokens are in the vocabulary"


def test_extending_a_prefix_by_one_token_gives_the_full_hash():
    tokens = np.array([3, 1, 4, 1, 5, 9, 2, 6])
    full = prefix_hashes(tokens)
    state = prefix_sum(tokens[:5])
    for position in range(5, 8):
        state, value = extend_prefix(state, int(tokens[position]), position)
        assert value == int(full[position]), f"O(1) extension at position {position} equals the vectorised hash"
