"""Deterministic stamps for `profile` compute: tokens and KV bytes as functions of the prefix.

`ProfileCompute` produces the next token from a 64-bit hash of the token prefix, and KV bytes from
(prefix hash, layer), so every byte the decode side assembles can still be checked exactly
without running a model.
"""

from __future__ import annotations

import numpy as np
import torch

from dualpath_ray.kv.layout import KVLayout


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _mix(tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return _splitmix64(tokens ^ (positions * np.uint64(0xD6E8FEB86659FD93)))


def prefix_hashes(token_ids: np.ndarray) -> np.ndarray:
    """h[i] = a 64-bit hash of token_ids[0..i] (order- and position-sensitive), vectorised.

    h[i] = splitmix(S_i) with S_i the wrapping sum of the mixed (token, position) values up to i,
    so a decoder can extend a prefix by one token in O(1) with `extend_prefix`.
    """
    tokens = np.asarray(token_ids, dtype=np.uint64)
    positions = np.arange(tokens.shape[0], dtype=np.uint64)
    with np.errstate(over="ignore"):
        return _splitmix64(np.cumsum(_mix(tokens, positions), dtype=np.uint64))


def prefix_sum(token_ids: np.ndarray) -> np.uint64:
    """S of a whole prefix: the running state `extend_prefix` continues from."""
    tokens = np.asarray(token_ids, dtype=np.uint64)
    positions = np.arange(tokens.shape[0], dtype=np.uint64)
    with np.errstate(over="ignore"):
        return np.uint64(np.sum(_mix(tokens, positions), dtype=np.uint64))


def extend_prefix(state: np.uint64, token: int, position: int) -> tuple[np.uint64, int]:
    """(S, h) of the prefix after appending `token` at `position` to a prefix whose S is `state`."""
    mixed = _mix(np.array([token], dtype=np.uint64), np.array([position], dtype=np.uint64))
    with np.errstate(over="ignore"):
        total = np.uint64(state + mixed[0])
    return total, int(_splitmix64(np.array([total], dtype=np.uint64))[0])


def stamp_kv(layout: KVLayout, hashes: np.ndarray, layer: int) -> torch.Tensor:
    """KV bytes [T, bytes_per_token_per_layer] for tokens with prefix hashes `hashes` at `layer`."""
    words = -(-layout.bytes_per_token_per_layer // 8)
    with np.errstate(over="ignore"):
        seeds = hashes[:, None] ^ (np.uint64(layer + 1) * np.uint64(0xA0761D6478BD642F))
        grid = seeds + np.arange(words, dtype=np.uint64)[None, :] * np.uint64(0xE7037ED1A0B428DB)
    data = _splitmix64(grid).view(np.uint8).reshape(hashes.shape[0], words * 8)
    return torch.from_numpy(np.ascontiguousarray(data[:, : layout.bytes_per_token_per_layer]))


def stamp_token(prefix_hash: int, vocab_size: int) -> int:
    """The `profile` mode's next token after a prefix with hash `prefix_hash`."""
    mixed = _splitmix64(np.array([prefix_hash], dtype=np.uint64) ^ np.uint64(0x8EBC6AF09C88C6E3))
    return int(mixed[0] % np.uint64(vocab_size))


def expected_kv(layout: KVLayout, prompt: np.ndarray, layer: int) -> torch.Tensor:
    """The stamped KV bytes [len(prompt), bpt] `ProfileCompute` produces for a prefix."""
    return stamp_kv(layout, prefix_hashes(prompt), layer)
