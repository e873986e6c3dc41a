"""The one deterministic expansion of (length, seed) to token ids, shared by every trace form.

`expand_tokens(n, seed, V)` is part of the trace file format (docs/trace-format.md): a trace
row that stores `appended_len` and `token_seed` instead of explicit ids means exactly these ids,
on every machine and every NumPy release. It therefore uses only the raw 64-bit output stream of
NumPy's PCG64 bit generator seeded through SeedSequence, which NumPy keeps stable across
releases (NEP 19), and not `Generator.integers`, whose algorithm NumPy may change.
"""

from __future__ import annotations

import hashlib

import numpy as np

MAX_VOCAB_SIZE = 2**31
MAX_TOKEN_SEED = 2**63 - 1

_HIGH_WORD = np.uint64(32)


def check_vocab_size(vocab_size: int) -> None:
    """Reject a vocabulary size that token ids (int32) cannot address."""
    if not 2 <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be in [2, {MAX_VOCAB_SIZE}], got {vocab_size}; "
            "token ids are stored as int32"
        )


def expand_tokens(length: int, seed: int, vocab_size: int) -> np.ndarray:
    """`length` token ids in [0, vocab_size), int32, a pure function of (length, seed, vocab_size).

    id_i = (high32(raw_i) * vocab_size) >> 32, raw_i the i-th uint64 of PCG64(SeedSequence(seed)).
    The multiply-shift maps 32 random bits onto the vocabulary with a bias below
    vocab_size / 2**32, and a shorter expansion is always a prefix of a longer one.
    """
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    if not 0 <= seed <= MAX_TOKEN_SEED:
        raise ValueError(f"seed must be in [0, 2**63 - 1], got {seed}")
    check_vocab_size(vocab_size)
    raw = np.random.PCG64(seed).random_raw(length)
    ids = ((raw >> _HIGH_WORD) * np.uint64(vocab_size)) >> _HIGH_WORD
    return ids.astype(np.int32)


def derive_seed(*parts: int | str) -> int:
    """A token seed in [0, 2**63) derived from labelled parts (e.g. trace seed, agent, turn).

    BLAKE2b of the parts' text joined by '/', so it is stable everywhere and independent of
    any random stream.
    """
    text = "/".join(str(part) for part in parts).encode()
    digest = hashlib.blake2b(text, digest_size=8).digest()
    return int.from_bytes(digest, "little") & MAX_TOKEN_SEED
