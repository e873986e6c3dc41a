"""A partial-block hit on the native engine (scheduler.partial_block_hits): a prompt of whole
blocks, every one stored, reads them all and computes only its last token. Its greedy tokens equal
the ones computed with no store, the decode side's KV equals the stored bytes bit for bit
(runtime.verify_kv), and nothing stored is persisted again (tests/engine_harness.py: the real
model on the CPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dualpath_ray.config import DualPathConfig, parse_config
from dualpath_ray.kv.index import block_keys
from tests.engine_harness import EngineHarness, Request

BLOCK = 16
PROMPT = [int(t) for t in np.random.default_rng(5).integers(0, 512, 4 * BLOCK)]  # exactly 4 blocks


def config(partial: str = "auto") -> DualPathConfig:
    return parse_config(
        {
            "model": {"n_layer": 2, "max_context": 256},
            "cluster": {"hbm_tokens_per_engine": 2048, "buffer_blocks_per_node": 128, "prefill_hbm_tokens": 1024},
            "store": {"block_size": BLOCK},
            "emulation": {"enabled": False, "compute": "model"},
            "runtime": {"verify_kv": True, "kv_digests": True},
            "scheduler": {"partial_block_hits": partial},
        }
    )


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory):
    h = EngineHarness(config(), Path(tmp_path_factory.mktemp("partial")))
    (first,) = h.serve([Request("first", PROMPT, max_new_tokens=6)])  # no store yet: every token computed
    assert first.error is None and first.hit_tokens == 0, "the first computes the whole prompt"
    yield h, first
    h.close()


@pytest.mark.parametrize("path", ["pe", "de", "split"])
def test_a_partial_hit_computes_one_token_and_its_tokens_equal_the_recompute(harness, path: str) -> None:
    h, first = harness
    computed_before = h.prefill.stats.tokens_computed
    (again,) = h.serve([Request(f"again-{path}", PROMPT, path, max_new_tokens=6, pe_hit_blocks=2)])
    assert again.error is None, f"served on {path}: {again.error}"
    assert again.hit_tokens == len(PROMPT) - 1, "all 4 blocks are read, the hit is all but the last token"
    assert h.prefill.stats.tokens_computed - computed_before == 1, "the prefill engine computes exactly one token"
    assert again.output_tokens == first.output_tokens, "greedy tokens equal the ones computed with no store"
    assert again.kv_bytes_verified > 0 and again.kv_mismatches == 0, (
        "the decode side's prompt KV equals the store bit for bit, the last token's too (the loaded bytes win)"
    )
    prompt_keys = set(block_keys(np.asarray(PROMPT), BLOCK, h.namespace))
    assert not prompt_keys & {block.key for block in again.persisted}, "no stored prompt block is persisted again"
    h.assert_idle()


def test_an_oracle_partial_hit_keeps_the_stored_bytes(harness) -> None:
    h, first = harness
    (again,) = h.serve([Request("again-oracle", PROMPT, max_new_tokens=6)], oracle=True)
    assert again.error is None and again.hit_tokens == len(PROMPT) - 1, "the oracle reads all 4 blocks too"
    assert again.output_tokens == first.output_tokens, "and its greedy tokens equal the recompute's"
    assert again.kv_mismatches == 0, "its pages hold the stored bytes"
    h.assert_idle()


def test_with_partial_hits_off_the_last_block_is_computed(tmp_path: Path) -> None:
    h = EngineHarness(config("off"), tmp_path)
    try:
        (first,) = h.serve([Request("first", PROMPT, max_new_tokens=6)])
        (again,) = h.serve([Request("again", PROMPT, max_new_tokens=6)])
        assert again.hit_tokens == 3 * BLOCK, "whole-block hits: the block holding the last token is computed"
        assert again.output_tokens == first.output_tokens and again.kv_mismatches == 0, "same tokens, exact KV"
        h.assert_idle()
    finally:
        h.close()
