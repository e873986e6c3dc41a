"""KV persisted as Full Blocks and read back layer by layer, and the single-process demo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dualpath_ray import cli
from dualpath_ray.config import DualPathConfig
from dualpath_ray.kv.index import PrefixIndex, block_keys, namespace_for
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.store import LocalDirStore, MemoryStore
from dualpath_ray.demos.local import LOGIT_RTOL, persist_blocks, read_hit_kv, run_local_demo
from dualpath_ray.model.llama import DecoderModel
from tests.model_factories import random_tokens, tiny_model_config

BLOCK = 16
NAMESPACE = namespace_for("test-model", 0)


@pytest.fixture(scope="module")
def model() -> DecoderModel:
    return DecoderModel(tiny_model_config())


@pytest.fixture(scope="module")
def layout(model: DecoderModel) -> KVLayout:
    return KVLayout.from_model(model.cfg, BLOCK)


@pytest.fixture(params=["local_dir", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path, layout: KVLayout) -> LocalDirStore | MemoryStore:
    return LocalDirStore(tmp_path / "store", layout) if request.param == "local_dir" else MemoryStore(layout)


def test_kv_read_back_and_sliced_into_layer_blocks_is_byte_identical(
    model: DecoderModel, layout: KVLayout, store: LocalDirStore | MemoryStore
) -> None:
    tokens = random_tokens(3 * BLOCK + 5, model.cfg.vocab_size)
    produced = model.prefill(tokens).kv
    keys = block_keys(tokens.tolist(), BLOCK, NAMESPACE)
    assert persist_blocks(store, PrefixIndex(BLOCK), layout, keys, produced) == 3, "only the 3 full blocks are written"
    for block, key in enumerate(keys):
        full = layout.empty_full_block()
        store.get_into(key, full)
        span = slice(block * BLOCK, (block + 1) * BLOCK)
        for layer in range(layout.n_layer):
            layer_block = layout.layer_block(full, layer)
            assert torch.equal(layer_block[0], layout.kv_as_bytes(produced[layer][span])), (
                f"block {block} layer {layer}: the Layer Block read back must be the model's KV bytes"
            )
    read = read_hit_kv(store, layout, keys)
    for layer in range(model.n_layer):
        assert torch.equal(
            layout.kv_as_bytes(read[layer]), layout.kv_as_bytes(produced[layer][: 3 * BLOCK])
        ), f"layer {layer}: hit KV assembled from Layer Blocks must be byte-identical to the model's"


@pytest.mark.parametrize("prompt_len", [3 * BLOCK + 1, 3 * BLOCK + 11], ids=["block-aligned-hit", "unaligned"])
def test_prefill_over_hit_kv_from_the_store_matches_prefill_from_scratch(
    model: DecoderModel, layout: KVLayout, store: LocalDirStore | MemoryStore, prompt_len: int
) -> None:
    earlier = random_tokens(2 * BLOCK + 7, model.cfg.vocab_size, seed=1)
    index = PrefixIndex(BLOCK)
    persist_blocks(store, index, layout, block_keys(earlier.tolist(), BLOCK, NAMESPACE), model.prefill(earlier).kv)
    prompt = torch.cat((earlier, random_tokens(prompt_len - earlier.shape[0], model.cfg.vocab_size, seed=2)))
    hit = index.match(prompt.tolist(), NAMESPACE)
    assert hit.hit_tokens == 2 * BLOCK, "the stored full blocks of the earlier turn are the hit; its partial block is not"
    reused = model.prefill(prompt[hit.hit_tokens :], read_hit_kv(store, layout, hit.keys))
    scratch = model.prefill(prompt).logits[hit.hit_tokens :]
    err = float((reused.logits - scratch).abs().max() / scratch.abs().max())
    assert err <= 1e-5, f"logits over KV read from the store must match a full prefill within 1e-5 relative ({err:.2e})"


def test_demo_reuses_stored_blocks_and_matches_recomputation(tmp_path: Path) -> None:
    cfg = DualPathConfig().with_overrides(store={"block_size": 32}, runtime={"max_new_tokens": 6})
    layout = KVLayout.from_model(cfg.model, 32)
    result = run_local_demo(cfg, tmp_path, user_tokens=(70, 30, 25))
    first, second, third = result.turns
    assert first.hit_tokens == 0 and first.blocks_written == (70 + 5) // 32, "turn 1 computes everything and persists its full blocks"
    assert second.hit_tokens == 64 and second.computed_tokens == 70 + 6 + 30 - 64, "turn 2 hits turn 1's full blocks"
    assert third.hit_tokens == 96, "turn 3 hits the blocks of turns 1 and 2"
    assert result.bytes_read == result.hit_tokens * layout.bytes_per_token, "every hit token is read once, all layers"
    assert result.tokens_match, "greedy tokens must be the same with and without reuse"
    assert result.within_tolerance, f"logit diff {result.max_abs_logit_diff} over the tolerance"
    again = run_local_demo(cfg, tmp_path, user_tokens=(70, 30, 25))
    assert again.turns[0].hit_tokens == 64 and again.turns[0].blocks_written == 0, (
        "a second run on the same store hits the first run's blocks (the index is rebuilt from the store)"
    )


def test_demo_command_prints_the_json_result(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--local", "--json"]) == 0, "the demo must pass its own check"
    report = json.loads(capsys.readouterr().out)
    assert {"turns", "hit_tokens", "bytes_read", "max_abs_logit_diff"} <= set(report), "the JSON has the documented keys"
    assert isinstance(report["turns"], list) and len(report["turns"]) == 3, "turns is a list of the 3 turns"
    assert report["hit_tokens"] > 0 and report["bytes_read"] > 0, "later turns hit and read stored KV"
    assert report["max_abs_logit_diff"] <= LOGIT_RTOL * report["max_abs_logit"], "logits match recomputation"


def test_demo_command_text_output_names_each_turn(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--local"]) == 0, "`dualpath demo --local` runs the single-process demo"
    out = capsys.readouterr().out
    assert all(f"turn {n}:" in out for n in (1, 2, 3)) and "OK" in out, f"text output names each turn: {out}"


def test_demo_that_does_not_fit_the_context_names_the_field(tmp_path: Path) -> None:
    cfg = DualPathConfig().with_overrides(model={"max_context": 100})
    with pytest.raises(ValueError, match="model.max_context"):
        run_local_demo(cfg, tmp_path)
